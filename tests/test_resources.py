"""Every kernel a spec emits compiles for sm_90 (the H200) and fits its limits, checked on the
CPU: Triton compiles for a GPU target without one (lrdsl.measure.resources). Each check compiles chunk
(forward and backward, every plan) and recurrent."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

from conftest import ROOT
from helpers import ALL_SPECS, module, spec_path


def compile_for_sm90(specs, shapes, *options):
    """Runs lrdsl.measure.resources in a fresh process (it compiles for the target, so Triton must not be
    in interpreter mode); returns its report's rows per spec header line."""
    command = [sys.executable, "-m", "lrdsl.measure.resources", *map(spec_path, specs), *options]
    for shape in shapes:
        command += ["--shape", shape]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    sections, rows = {}, None
    for line in result.stdout.splitlines():
        if "shared" not in line:
            sections[line] = rows = []
        else:
            rows.append(line)
    assert not any("OVER" in row for rows in sections.values() for row in rows), output
    return sections


@pytest.mark.parametrize("precision", ["input", "tf32"])
def test_gdn_kernels_fit_sm90_shared_memory(precision):
    """The default shape and the largest head dims, K = V = 256 (precision="tf32": fp32 tiles at
    its default chunk size 32)."""
    sections = compile_for_sm90(["gdn"], ["1,256,2,4,128,128", "1,64,1,1,256,256"], "--precision", precision)
    assert len(sections) == 2
    for header, rows in sections.items():
        assert any("bwd_output_kernel" in r for r in rows) and any("recurrent" in r for r in rows), (header, rows)


def test_head_dims_under_16_compile_for_sm90():
    """K < 16 and V < 16: tl.dot needs every dimension >= 16 on NVIDIA GPUs (the interpreter
    takes any), so the key and value tiles are padded to 16 and masked. Every spec."""
    sections = compile_for_sm90(ALL_SPECS, ["1,20,1,2,8,4", "1,20,2,2,1,1"])
    assert len(sections) == 2 * len(ALL_SPECS)
    for header, rows in sections.items():
        name = header.split()[0]
        assert any(r.startswith(f"{name}_recurrent_fwd_kernel") for r in rows), (header, rows)
        if hasattr(module(name), "chunk"):
            assert any(r.startswith(f"{name}_chunk_bwd_output_kernel") for r in rows), (header, rows)


def test_key_channel_delta_backward_fits_sm90_at_its_default_chunk_size():
    """The kernel that sets the largest chunk size (the backward's output kernel) of a spec with
    a triangular system and per-key-channel decayed products (kda), at K = 256 where that rule
    gives C = 32 (64 needs 303,104 bytes). One kernel, to stay cheap."""
    sections = compile_for_sm90(["kda"], ["1,64,1,1,256,256"], "--kernels", "bwd_output")
    [(header, rows)] = sections.items()
    assert "chunk_size=32" in header, header
    # two specialisations: under the default save policy (save_states) the split plan keeps its
    # solved systems in bf16 while the fused plan's backward re-solves its own in fp32
    assert all(row.startswith("kda_chunk_bwd_output_kernel") for row in rows), rows
    assert sorted(re.search(r"chunk\[(\w+)\]", row).group(1) for row in rows) == ["fused", "split"], rows


def test_report_compiles_what_a_launch_compiles():
    """Each launch is compiled with the specialisation Triton gives a real one (16-byte aligned
    pointers, divisible integers): gdn's forward scan then pipelines its loads and spills nothing.
    Compiled without it (every load unaligned and unpipelined) the same kernel reported 255
    registers and 312 bytes of spills per thread, which the GPU never sees. (The backward's re-run
    of the scan, which also writes entry states at segment starts, is another compilation.)"""
    sections = compile_for_sm90(["gdn"], ["1,256,2,4,128,128"], "--kernels", "gdn_chunk_scan")
    [(header, rows)] = sections.items()
    forward = [row for row in rows if "writes=segment_states" not in row]
    assert forward and len(forward) < len(rows), rows
    for row in forward:
        registers = int(re.search(r"regs +(\d+)", row).group(1))
        spills = int(re.search(r"spills +(\d+) B", row).group(1))
        assert spills == 0 and registers < 255, row


def test_default_chunk_sizes_report_the_backward_at_its_own():
    """--chunk-size default compiles what a call without chunk_size runs: gdn's forward at 64 and
    its backward at its own BACKWARD_CHUNK_SIZE (32 at K = 128), not at the forward's; under the
    default save policy a training forward runs at 32 too, so the backward reads what it keeps
    (the solved systems among them) at their own width."""
    sections = compile_for_sm90(["gdn"], ["1,128,1,2,128,128"], "--chunk-size", "default", "--kernels", "bwd_output")
    [(header, rows)] = sections.items()
    assert "chunk_size=default (forward 64, backward 32)" in header, header
    # 128 value columns in 1 stage: the backward output kernel's settings below the largest chunk
    # size, one row per plan: the split plan's backward reads the solved systems its forward kept
    # at C = 64 by their diagonal blocks, the fused plan's re-solves them at 32
    assert len(rows) == 2 and all("num_stages=1" in row and "BV=128" in row for row in rows), rows
    assert [("CC_BT=64" in row) for row in rows] == [True, False] and "chunk[split]" in rows[0], rows
    # apply: the forwards at C = 64 (2 stages, all 128 columns; the training one also writes the
    # kept solved systems in bf16) and the backward's re-run at C = 32 (3 stages, 64 columns)
    [(_, rows)] = compile_for_sm90(["gdn"], ["1,128,1,2,128,128"], "--chunk-size", "default", "--kernels", "apply").items()
    assert any("num_stages=3 BV=64 BT=32" in row for row in rows), rows
    assert any("num_stages=2 BV=128 BT=64 writes=narrowed_T" in row for row in rows), rows
    assert any("num_stages=2 BV=128 BT=64  " in row for row in rows), rows


def test_launch_settings_replace_the_modules_one_report_each():
    """--launch compiles a role at the settings given, once per setting, so a kernel's spills can
    be read per launch setting without a GPU; the other roles keep the module's settings."""
    sections = compile_for_sm90(["gdn"], ["1,128,1,2,128,128"], "--chunk-size", "default", "--kernels", "bwd_",
                                "--launch", "bwd_output=64,8,1", "--launch", "bwd_output=32,4,2;bwd_scan=32,4,2")
    assert len(sections) == 2, sections
    (first_header, first), (second_header, second) = sections.items()
    assert first_header.endswith("launch bwd_output=64,8,1"), first_header
    assert second_header.endswith("launch bwd_output=32,4,2;bwd_scan=32,4,2"), second_header
    rows = {header: [row for row in rows if "bwd_output" in row] for header, rows in sections.items()}
    assert rows[first_header] and all("num_warps=8 num_stages=1 BV=64" in row for row in rows[first_header]), first
    assert rows[second_header] and all("num_warps=4 num_stages=2 BV=32" in row for row in rows[second_header]), second
    # the backward scan: the module's 3 stages in the first setting, the given 2 in the second
    assert all("num_stages=3" in row for row in first if "bwd_scan" in row), first
    assert all("num_warps=4 num_stages=2 BV=32" in row for row in second if "bwd_scan" in row), second


@pytest.mark.parametrize("setting, message", [
    ("bwd_outpt=64,8,1", "unknown kernel role 'bwd_outpt'; roles: apply, bwd_output"),
    ("bwd_output=64,8", "bwd_output needs BV,WARPS,STAGES[,MAXNREG] (positive integers), got '64,8'"),
    ("apply=128,4,2,300", "apply's MAXNREG must be 24..255 registers, got 300"),
])
def test_bad_launch_setting_is_a_one_line_error(setting, message):
    result = subprocess.run([sys.executable, "-m", "lrdsl.measure.resources", spec_path("gdn"), "--launch", setting],
                            cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 2 and message in result.stderr.splitlines()[-1], result.stderr
    assert "Traceback" not in result.stderr, result.stderr


def test_starved_compiles_are_flagged():
    """ptxas compiles some kernels too large for it with 32 registers and tens of KB of spills per
    thread (gdn's backward output kernel at K = 256 with 32 value columns): the report marks such a
    launch STARVED, and not the same kernel at 64 columns (255 registers, about 2 KB)."""
    sections = compile_for_sm90(["gdn"], ["1,128,1,2,256,256"], "--chunk-size", "default", "--kernels", "bwd_output",
                                "--launch", "bwd_output=32,8,1", "--launch", "bwd_output=64,8,1")
    (_, narrow), (_, wide) = sections.items()
    assert narrow and all("STARVED: 32 of 255 registers" in row for row in narrow), narrow
    assert wide and not any("STARVED" in row for row in wide), wide


# Backward output kernels still starved at K = V = 256: rwkv7's (no launch setting tried keeps its
# registers there, and its forward kernels starve too; BENCHMARKS.md round 17).
STARVED_AT_K256 = {"rwkv7"}


@pytest.mark.parametrize("shape, names", [
    ("1,128,16,16,128,128", sorted(ALL_SPECS)),
    ("1,128,16,32,128,128", sorted(ALL_SPECS)),
    ("1,128,16,16,256,256", sorted(set(ALL_SPECS) - STARVED_AT_K256)),
])
def test_no_backward_output_kernel_starves_at_the_default_settings(shape, names):
    """The largest kernel of every spec, compiled as a call without chunk_size launches it (16 key
    heads; 16 or 32 value heads; K = V = 128, and 256), gets its registers: a launch-table change
    that made ptxas fall back to 32 registers and kilobytes of spills per thread (ten times a
    neighbouring setting's, and ten times the time on the H200) fails here, before any GPU time."""
    sections = compile_for_sm90(names, [shape], "--chunk-size", "default", "--kernels", "bwd_output")
    rows = [row for section in sections.values() for row in section]
    assert len(rows) >= len(names), sections
    assert not [row for row in rows if "STARVED" in row], f"{shape}: {[row for row in rows if 'STARVED' in row]}"


def test_starved_means_under_half_the_registers_while_spilling():
    from lrdsl.measure.resources import KernelResources

    def row(registers, spills, warps):
        return KernelResources("k", "", registers, spills, 0, warps)

    assert row(32, 8000, 8).starved and row(32, 8000, 4).starved
    assert not row(255, 2000, 8).starved and not row(32, 0, 8).starved
    assert not row(64, 3000, 16).starved  # 16 warps: 128 registers a thread at most
    assert row(32, 3000, 16).starved and row(64, 3000, 16).register_cap == 128
    # a launch's own register cap: half of it is the line
    capped = KernelResources("k", "", 64, 3000, 0, 4, maxnreg=96)
    assert capped.register_cap == 96 and not capped.starved
    assert KernelResources("k", "", 40, 3000, 0, 4, maxnreg=96).starved


def test_a_register_cap_in_the_launch_setting_reaches_ptxas():
    """--launch ROLE=BV,WARPS,STAGES,MAXNREG compiles the role under that register cap (what
    a launch with maxnreg= does): ptxas keeps every thread to it, spilling what does not fit."""
    sections = compile_for_sm90(["gdn"], ["1,128,1,2,128,128"], "--chunk-size", "64", "--kernels", "apply",
                                "--launch", "apply=128,4,2,128")
    [(header, rows)] = sections.items()
    assert header.endswith("launch apply=128,4,2,128"), header
    registers = [int(row.split("regs")[1].split()[0]) for row in rows]
    assert rows and all("maxnreg=128" in row for row in rows) and max(registers) <= 128, rows


def test_the_verdict_is_ok_only_without_a_problem():
    """Before: a starved row read "ok  STARVED: ..." (and an over-limit one could too)."""
    from lrdsl.measure.resources import KernelResources

    starved = KernelResources("k", "", 32, 8000, 0, 4)
    assert starved.verdict == "STARVED: 32 of 255 registers, spilling" and " ok" not in starved.describe()
    over = KernelResources("k", "", 255, 8000, 300_000, 4)
    assert over.verdict.startswith("OVER the 232448 B") and "STARVED" not in over.verdict
    assert KernelResources("k", "", 128, 0, 1024, 4).verdict == "ok"


def test_rows_name_their_calls_and_chunk_size():
    """Before: the same kernel appeared twice (a training forward at the backward's chunk size, a
    forward without gradients at its own) with nothing telling the rows apart, and no row said
    which plan launches it. Now each row names its calls and chunk size, and no two rows read alike."""
    [(header, rows)] = compile_for_sm90(["gdn"], ["1,64,1,2,32,32"], "--chunk-size", "default",
                                        "--kernels", "prepare").items()
    fused = [row for row in rows if row.startswith("gdn_chunk_prepare_kernel ")]
    assert len(fused) == 2 and all(" chunk[fused] " in row for row in fused), rows
    assert sorted(re.search(r" BT=(\d+) ", row).group(1) for row in fused) == ["32", "64"], fused
    shared = [row for row in rows if row.startswith("gdn_chunk_bwd_prepare_kernel ")]
    assert shared and all(" chunk[split,fused] " in row for row in shared), rows
    assert len(set(rows)) == len(rows), rows
