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


# The kernel that sets the largest chunk size (the backward's output kernel) of a spec with a
# triangular system and per-key-channel decayed products (kda), where its chunk size comes from
# that rule: K = 256, C = 32 (64 needs 303,104 bytes). One kernel, to stay cheap; `python -m
# lrdsl.resources SPEC [--shape ...] [--precision tf32]` checks every kernel of any spec.
def test_key_channel_delta_backward_fits_sm90_at_its_default_chunk_size():
    result = subprocess.run(
        [sys.executable, "-m", "lrdsl.resources", spec_path("kda"), "--shape", "1,64,1,1,256,256", "--kernels",
         "bwd_output"],
        cwd=ROOT, capture_output=True, text=True, timeout=1200,
    )
    assert "precision=input, chunk_size=32, sm_90" in result.stdout, result.stdout + result.stderr
    rows = [line for line in result.stdout.splitlines() if "shared" in line]
    assert len(rows) == 1 and "kda_chunk_bwd_output_kernel" in rows[0], result.stdout + result.stderr
    assert result.returncode == 0 and "OVER" not in rows[0], result.stdout
