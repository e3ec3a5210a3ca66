"""examples/serving_decode.py as a user runs it (a fresh process; CPU: Triton's interpreter, GPU:
its CUDA-graph steps): it exits 0, and every error it prints against the float64 oracle is
within the tolerance of its dtypes."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

from conftest import HAS_GPU, ROOT
from test_cli import user_environment


@pytest.mark.parametrize("options", [[], ["--spec", "kda", "--state-dtype", "float16"]])
def test_serving_decode_example(options):
    result = subprocess.run([sys.executable, "examples/serving_decode.py", *options], cwd=ROOT, env=user_environment(),
                            capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[-1] == "ok", result.stdout
    for needed in ("prefill A (5 tokens)", "B leaves", "D joins slot 1", "verify 3 drafts each, accepted", "final pool rows"):
        assert needed in result.stdout, needed
    errors = [float(x) for x in re.findall(r"relative error vs the oracle (\S+)", result.stdout)]
    limit = 8e-3 if HAS_GPU or options else 2e-3  # bf16 inputs on a GPU, an fp16 pool
    assert len(errors) == 9 and max(errors) <= limit, result.stdout  # 2 prefills, 6 steps, the final rows
