"""Every kernel a spec emits compiles for sm_90 (the H200) and fits its limits, checked on the
CPU: Triton compiles for a GPU target without one (lrdsl.resources)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import ROOT
from helpers import spec_path


@pytest.mark.parametrize("precision", ["input", "tf32"])
def test_gdn_kernels_fit_sm90_shared_memory(precision):
    # a fresh process: resources compiles for the target, so Triton must not be in interpreter mode
    result = subprocess.run(
        [sys.executable, "-m", "lrdsl.resources", spec_path("gdn"), "--precision", precision],
        cwd=ROOT, capture_output=True, text=True, timeout=1200,
    )
    rows = [line for line in result.stdout.splitlines() if "shared" in line]
    assert any("bwd_output_kernel" in r for r in rows) and any("recurrent" in r for r in rows), result.stdout + result.stderr
    assert result.returncode == 0, result.stdout + result.stderr
    assert not any("OVER" in r for r in rows), result.stdout
