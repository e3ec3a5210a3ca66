"""pytest --shard I/N (tests/conftest.py): the N shards of a selection run each of its tests once."""
from __future__ import annotations

import subprocess
import sys

from conftest import ROOT


def _collected(*args) -> tuple[list[str], str]:
    result = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                             "tests/test_memory.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    return [line for line in result.stdout.splitlines() if "::" in line], result.stderr


def test_the_shards_split_the_selection():
    everything, _ = _collected()
    shards = [_collected("--shard", f"{i}/3")[0] for i in (1, 2, 3)]
    assert sorted(sum(shards, [])) == sorted(everything) and all(shards)
    assert len(set(sum(shards, []))) == len(everything)  # no test in two shards


def test_a_bad_shard_is_one_line():
    _, stderr = _collected("--shard", "4/3")
    assert "--shard takes I/N with 1 <= I <= N, got '4/3'" in stderr
