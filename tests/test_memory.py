"""lrdsl.measure.memory: the bytes a chunk call holds at each kernel launch, counted on meta tensors, are
what the same call holds when its kernels run (here on the CPU interpreter, with real tensors)."""
from __future__ import annotations

import math
import re
import subprocess
import sys

import pytest
import torch

from lrdsl import config
from lrdsl.measure.memory import MiB, HeldAtLaunch, LiveAllocations, call_memory, kept_for_backward, peak
from lrdsl.verification.workloads import Shape, make_inputs

from conftest import ROOT
from helpers import module, recurrence, spec_path


def _held_when_run(mod, rec, shape, dtype, save_policy, monkeypatch) -> list[HeldAtLaunch]:
    """call_memory's call, run through the interpreter on CPU tensors: what is held at each launch.
    16-bit inputs get the module's GPU rule for matmul operands (on the CPU it multiplies in fp32):
    it decides which kept buffers are stored narrowed, and so what is held. The values the
    interpreter then computes are meaningless (its dot takes bf16 tiles for integers); the buffers
    are the GPU's."""
    from triton.runtime.interpreter import InterpretedFunction

    tracker, held, launch = LiveAllocations("cpu"), [], InterpretedFunction.run

    def recorded(kernel, *args, **kwargs):
        held.append(HeldAtLaunch(kernel.fn.__name__, tracker.held()))
        return launch(kernel, *args, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", recorded)
    monkeypatch.setattr(mod, "_multiprocessors", lambda q: 132)  # as lrdsl.measure.memory's recorder shows the module
    monkeypatch.setattr(mod, "_exact_products", lambda q: q.dtype in (torch.float32, torch.float64))
    tensors = make_inputs(rec, shape, dtype=dtype, generator=torch.Generator().manual_seed(0), normalize_keys=False)
    leaves = [t.requires_grad_() for t in tensors]
    d_o = torch.randn(shape.B, shape.T, shape.HV, shape.V).to(dtype)
    with tracker:
        o, ht = mod.chunk(*leaves, use_qk_l2norm_in_kernel=True, output_final_state=True, save_policy=save_policy)
        gradients = torch.autograd.grad(o, leaves, d_o)
        held.append(HeldAtLaunch("returned", tracker.held()))
    return held


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name, save_policy", [("gdn", "save"), ("gdn", "save_states"), ("kda", "save"), ("rwkv7", "save")])
def test_meta_count_matches_the_run(name, save_policy, dtype, monkeypatch):
    if not config.interpreting():
        pytest.skip("runs the kernels through Triton's CPU interpreter")
    rec, mod = recurrence(name), module(name)
    shape = Shape(1, 100, 1, 2, 32, 32)
    counted = call_memory(mod, rec, shape, dtype, save_policy=save_policy)
    run = _held_when_run(mod, rec, shape, dtype, save_policy, monkeypatch)
    assert [h.kernel for h in counted] == [h.kernel for h in run]
    assert [h.buffers for h in counted] == [h.buffers for h in run]
    top = peak(counted)
    assert top.kernel != "returned" and top.held_bytes > counted[-1].held_bytes  # the call's buffers, then its results


@pytest.mark.parametrize("save_policy, fewest", [("save", False), ("save_states", False), ("recompute", True)])
def test_kept_for_the_backward_matches_the_run(save_policy, fewest, monkeypatch):
    """What a forward keeps for its backward (a model holds it once per layer), counted on meta
    tensors, is what the interpreter's run of the same forward keeps; recompute keeps nothing."""
    if not config.interpreting():
        pytest.skip("runs the kernels through Triton's CPU interpreter")
    rec, mod = recurrence("gdn"), module("gdn")
    shape, dtype = Shape(1, 100, 1, 2, 32, 32), torch.bfloat16
    counted = kept_for_backward(mod, rec, shape, dtype, save_policy=save_policy)
    monkeypatch.setattr(mod, "_multiprocessors", lambda q: 132)
    monkeypatch.setattr(mod, "_exact_products", lambda q: q.dtype in (torch.float32, torch.float64))
    tensors = make_inputs(rec, shape, dtype=dtype, generator=torch.Generator().manual_seed(0), normalize_keys=False)
    tracker = LiveAllocations("cpu")
    with tracker:
        o, ht = mod.chunk(*[t.requires_grad_() for t in tensors], use_qk_l2norm_in_kernel=True, output_final_state=True,
                          save_policy=save_policy)
        run = tracker.held(besides=(o, ht))
    assert counted.buffers == run
    assert (counted.held_bytes == 0) == fewest


def test_cli_reports_each_launch_and_the_peak():
    result = subprocess.run([sys.executable, "-m", "lrdsl.measure.memory", spec_path("gdn"), "--shape", "2,300,2,4,64,64"],
                            cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("gdn  B=2 T=300 H=2 HV=4 K=64 V=64  bf16  precision=input  save_policy=save_states  forward + backward")
    launches = [(m[1], float(m[2])) for line in lines[1:] if (m := re.match(r"  (\w+) +([\d.]+) MiB$", line))]
    assert launches[-1][0] == "returned" and len(launches) == len(lines) - 3
    held = max(size for _, size in launches)
    m = re.match(r"  peak ([\d.]+) MiB at (\w+): (.*)$", lines[-2])
    assert m and float(m[1]) == held and m[2] in {kernel for kernel, size in launches if size == held}
    # the peak's buffers, grouped by shape and dtype, add up to it
    groups = re.findall(r"(\d+) x \(([\d, ]+)\) (\w+) \(", m[3])
    element = {"bfloat16": 2, "float32": 4}
    total = sum(int(count) * element[dtype] * math.prod(map(int, dims.split(", "))) for count, dims, dtype in groups)
    assert abs(total / MiB - held) < 0.06
    kept = re.match(r"  kept from the forward for the backward ([\d.]+) MiB \(([\d.]+) KiB per token\): ", lines[-1])
    # both printed to 0.1: 0.05 MiB of rounding, and 0.05 KiB x 600 tokens
    assert kept and 0 < float(kept[1]) < held and abs(float(kept[2]) * 600 / 1024 - float(kept[1])) < 0.1
