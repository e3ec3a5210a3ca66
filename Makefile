# Two commands do all set-up on a fresh machine:
#   make demo   compile specs/gdn.toml, run its kernels against the float64 oracle, print errors and times
#   make test   run the test suite
# Both create .venv and install lrdsl with its dependencies first (CPU machines get torch 2.13.0 and
# triton 3.6.0, and numpy below 2.4, which Triton 3.6's interpreter needs; without a GPU the kernels run
# on Triton's CPU interpreter).
# The oldest Python pyproject.toml declares (requires-python), where installed: what CI must prove works.
OLDEST_PYTHON := python$(shell sed -n 's/^requires-python = ">=\([0-9.]*\)"/\1/p' pyproject.toml)
PYTHON ?= $(shell command -v $(OLDEST_PYTHON) >/dev/null 2>&1 && echo $(OLDEST_PYTHON) || echo python3)
VENV ?= .venv
BIN := $(VENV)/bin
# Test processes (pytest-xdist): the interpreter runs one Python thread per test, so a CPU machine's
# cores each take a share of the suite. GPU tests are run on their own (`pytest -m gpu`), not here.
TEST_WORKERS ?= 2
STAMP := $(VENV)/.installed

.PHONY: demo test setup clean python-version

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "torch==2.13.0"
	$(BIN)/python -c "import triton" 2>/dev/null || $(BIN)/python -m pip install -q "triton==3.6.0"
	$(BIN)/python -m pip install -q -e ".[test]" "numpy<2.4"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/lrdsl demo specs/gdn.toml

python-version:  # the interpreter `make setup` builds .venv from
	@echo $(PYTHON)

test: $(STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS)

clean:
	rm -rf $(VENV) out .pytest_cache .hypothesis
