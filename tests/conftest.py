"""Test set-up: the Triton interpreter when there is no GPU, a private module cache, fresh seeds."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
import torch

# Modules must be loaded after this: Triton reads TRITON_INTERPRET when kernels are decorated.
from lrdsl import config

INTERPRETED = config.use_interpreter_without_gpu()
HAS_GPU = torch.cuda.is_available()
ROOT = Path(__file__).resolve().parent.parent
SPECS = ROOT / "specs"

os.environ.setdefault("LRDSL_CACHE_DIR", tempfile.mkdtemp(prefix="lrdsl-test-cache-"))


def pytest_collection_modifyitems(config, items):
    shard = config.getoption("--shard")
    if shard is not None:
        # every n-th test from the i-th: the GPU suite takes longer than one device call, so it runs
        # in shards, one call each (pytest -m gpu --shard 1/3, 2/3, 3/3 together run every test once)
        index, count = shard
        kept = [item for position, item in enumerate(items) if position % count == index - 1]
        config.hook.pytest_deselected(items=[item for item in items if item not in kept])
        items[:] = kept
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def generator(request):
    """A fresh random seed per test, printed so a failure can be replayed (pytest --seed N)."""
    seed = request.config.getoption("--seed")
    if seed is None:
        seed = int(torch.seed() % 2**31)
    print(f"[seed {seed}]")
    return torch.Generator().manual_seed(seed)


@pytest.fixture(scope="session")
def device():
    return "cuda" if HAS_GPU else "cpu"


def pytest_addoption(parser):
    parser.addoption("--update-golden", action="store_true", help="rewrite tests/golden/* from the current output")
    parser.addoption("--seed", type=int, default=None, help="replay: every test's generator starts from this seed")
    parser.addoption("--shard", type=_shard, default=None, metavar="I/N",
                     help="run the I-th of N interleaved shards of the selected tests (1 <= I <= N)")


def _shard(text: str) -> tuple[int, int]:
    import argparse

    index, _, count = text.partition("/")
    if not (index.isdigit() and count.isdigit() and 1 <= int(index) <= int(count)):
        raise argparse.ArgumentTypeError(f"--shard takes I/N with 1 <= I <= N, got {text!r}")
    return int(index), int(count)


@pytest.fixture
def golden(request):
    """golden(name, text): compare `text` with tests/golden/<name> (or rewrite it with --update-golden)."""
    update = request.config.getoption("--update-golden")

    def check(name: str, text: str):
        path = Path(__file__).parent / "golden" / name
        if update or not path.exists():
            if not update:
                pytest.fail(f"golden file {path} is missing: run pytest --update-golden and review it")
            path.write_text(text)
        assert text == path.read_text(), f"output differs from golden {path.name} (pytest --update-golden after review)"

    return check
