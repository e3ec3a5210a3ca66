"""Segmented scans: the check on the chunk IR that a scan is an affine map of its state
(lrdsl/codegen/segments.py), and the scans run in segments (the chunk section's _scan) against
the float64 oracle, forward and backward, on the interpreter at small sizes."""
from __future__ import annotations

import dataclasses

import pytest
import sympy
import torch

from lrdsl.codegen.chunk import _calls, _launcher
from lrdsl.codegen.segments import segment_refusal
from lrdsl.ir.chunk import Formula, MatMul
from lrdsl.passes.pipeline import run_pipeline
from lrdsl.spec import load_spec
from lrdsl.verification.workloads import Shape

from lrdsl import reference
from lrdsl.verification.workloads import relative_error

from helpers import (ALL_SPECS, CORE_SPECS, TOLERANCE, direct_input, force_segments, module, recurrence, run_case, sample,
                     spec_path)
from test_backward import CHUNKED, assert_gradients, gradient_errors


def scans(name):
    """(program, scan kernel) of the forward's and the backward's plans."""
    stages = run_pipeline(load_spec(spec_path(name)))
    for stage in ("plan", "backward_plan"):
        item = stages[stage]
        for plan in item.plans:
            for kernel in plan.kernels:
                if kernel.kind == "scan":
                    yield item.graph.program, kernel


@pytest.mark.parametrize("name", CHUNKED)
def test_every_shipped_scan_is_segmentable(name):
    found = list(scans(name))
    assert len(found) >= 2  # the forward's (one per plan) and the backward's
    for prog, kernel in found:
        assert segment_refusal(prog, kernel) is None, (prog.direction, kernel.name)


def with_op(prog, value, op):
    """`prog` with the op computing `value` replaced."""
    return dataclasses.replace(prog, ops=tuple(op if o.out == value else o for o in prog.ops))


H, KtVn, G_LAST = sympy.symbols("H KtVn G_last")


def squared_state(prog):
    """gdn's forward program with a state update quadratic in the state."""
    return with_op(prog, "H_next", Formula("H_next", ("K", "V"), 2**G_LAST * H * H + KtVn))


def test_a_scan_that_is_not_affine_in_its_state_is_refused():
    prog, kernel = next(scans("gdn"))
    assert "not linear in H" in segment_refusal(squared_state(prog), kernel)
    shifted = with_op(prog, "H_next", Formula("H_next", ("K", "V"), 2**G_LAST * H + KtVn + G_LAST))
    assert "depends on neither the state nor a V-axis input" in segment_refusal(shifted, kernel)
    product = with_op(prog, "KtVn", MatMul("KtVn", ("K", "V"), "WH", "Vn", transpose_a=True))
    assert "multiplies two tiles that depend on the state" in segment_refusal(product, kernel)
    assert segment_refusal(prog, kernel) is None


def test_a_refused_scan_runs_whole_sequences_and_says_why():
    """The launcher of a scan that is not affine passes segmentable=False and a comment names the
    op that breaks it."""
    stages = run_pipeline(load_spec(spec_path("gdn")))
    plan = stages["plan"].plans[0]
    prog = stages["plan"].graph.program
    squared = squared_state(prog)
    scan = next(call for call in _calls(squared, plan) if call["kind"] == "scan")
    assert scan["segmentable"] is False and "not linear in H" in scan["segment_refusal"]
    assert "segmentable=False" in _launcher(squared, plan)
    assert "# never segmented: H_next = " in _launcher(squared, plan)
    scan = next(call for call in _calls(prog, plan) if call["kind"] == "scan")
    assert scan["segmentable"] is True and scan["segment_refusal"] is None


# K, V not powers of two: the map's K identity columns share a value block with the last values
SEGMENTED = dict(shape=Shape(2, 150, 1, 2, 20, 24), dtype=torch.float32, h0=True, l2norm=True)


def slow_gate(name):
    """A log-decay close to 0 where the spec reads one as an input: with the usual gates (down to
    -0.5 a token) a segment's map M decays to nothing within a few dozen tokens, and a wrong M
    would go unseen."""
    rec = recurrence(name)
    return -0.01 if direct_input(rec, rec.log_decay) else None


@pytest.mark.parametrize("name", ALL_SPECS)
def test_segmented_scans_forward(name, generator, device, monkeypatch):
    mod = module(name)
    chosen = force_segments(monkeypatch, mod)
    run_case(mod, recurrence(name), "chunk", SEGMENTED, generator, device, gate=slow_gate(name), chunk_size=16)
    assert chosen and all(chosen), chosen


@pytest.mark.parametrize("name", CORE_SPECS + ("rwkv7",))
def test_segmented_scans_gradients(name, generator, device, monkeypatch):
    chosen = force_segments(monkeypatch, module(name))
    case = dict(shape=SEGMENTED["shape"], h0=True, dht=True, l2norm=True)
    # save_solve: the re-run scan walks the sequences (save_states would resume it from kept states, save keeps its results)
    errors = gradient_errors(name, case, generator, device, gate=slow_gate(name), chunk_size=16, save_policy="save_solve")
    assert_gradients(errors, f"{name} segmented")
    assert len(chosen) == 3 and all(chosen), chosen  # the forward's scan, its re-run and the backward's


def test_segmented_scans_keep_the_state_layout(generator, device, monkeypatch):
    """state_v_first: the initial and final states [N, HV, V, K] go through the segments' combine."""
    mod, rec = module("gdn"), recurrence("gdn")
    chosen = force_segments(monkeypatch, mod)
    shape = Shape(2, 100, 2, 2, 16, 32)
    tensors = sample(rec, shape, torch.float32, generator, gate=slow_gate("gdn"))
    h0 = torch.randn(2, 2, 16, 32, generator=generator)
    o, ht = mod.chunk(*[t.to(device) for t in tensors], initial_state=h0.transpose(-1, -2).contiguous().to(device),
                      output_final_state=True, state_v_first=True, chunk_size=16)
    ref_o, ref_ht = reference.run(rec, *tensors, initial_state=h0, output_final_state=True)
    assert all(chosen), chosen
    assert relative_error(o.cpu(), ref_o) <= TOLERANCE[torch.float32]
    assert relative_error(ht.transpose(-1, -2).cpu(), ref_ht) <= TOLERANCE[torch.float32]


# packed sequences: an empty one (its final state is its initial state), one token, a long one
# cut into segments whose last is short, one a single segment long
PACKED = dict(shape=Shape(1, 300, 1, 2, 20, 24), dtype=torch.float32, h0=True, l2norm=True,
              bounds=[0, 0, 1, 230, 230, 300])


@pytest.mark.parametrize("name", ["gdn", "kda", "simple_gla", "rwkv7"])
def test_segmented_scans_of_packed_sequences(name, generator, device, monkeypatch):
    mod = module(name)
    chosen = force_segments(monkeypatch, mod)
    run_case(mod, recurrence(name), "chunk", PACKED, generator, device, gate=slow_gate(name), chunk_size=16)
    assert chosen and all(chosen), chosen
    chosen.clear()
    case = dict(PACKED, dht=True)
    errors = gradient_errors(name, case, generator, device, gate=slow_gate(name), chunk_size=16, save_policy="save_solve")
    assert_gradients(errors, f"{name} packed, segmented")
    assert len(chosen) == 3 and all(chosen), chosen


def test_short_sequences_and_wide_keys_are_not_segmented(generator, device, monkeypatch):
    mod = module("gdn")
    chosen = force_segments(monkeypatch, mod)
    case = dict(shape=Shape(1, 40, 1, 1, 16, 16), dtype=torch.float32, h0=True)
    run_case(mod, recurrence("gdn"), "chunk", case, generator, device, chunk_size=16)
    assert chosen == [0]  # 3 chunks: fewer than two segments of 2 chunks
    chosen.clear()
    wide = dict(shape=Shape(1, 100, 1, 1, 160, 16), dtype=torch.float32)
    run_case(mod, recurrence("gdn"), "chunk", wide, generator, device, chunk_size=16)
    assert chosen == [0]  # K > 128: the combine's K x K maps would not fit its registers


def test_segmented_scans_prefill_a_state_pool(generator, device, monkeypatch):
    """A prefill into a pool: rows 2 and 0 read and written through the segments' combine, row 1
    untouched, a padding slot (-1) touching no row and giving zeros."""
    mod, rec = module("gdn"), recurrence("gdn")
    chosen = force_segments(monkeypatch, mod)
    shape = Shape(3, 70, 1, 2, 16, 16)
    tensors = sample(rec, shape, torch.float32, generator, gate=slow_gate("gdn"))
    pool = torch.randn(3, 2, 16, 16, generator=generator)
    indices = torch.tensor([2, -1, 0], dtype=torch.int32)
    out_pool = pool.clone().to(device)
    o, _ = mod.chunk(*[t.to(device) for t in tensors], state_pool=out_pool, state_indices=indices.to(device), chunk_size=16)
    assert all(chosen), chosen
    live = [0, 2]
    ref_o, ref_ht = reference.run(rec, *[t[live] for t in tensors], initial_state=pool[[2, 0]], output_final_state=True)
    assert relative_error(o[live].cpu(), ref_o) <= TOLERANCE[torch.float32]
    assert torch.all(o[1] == 0)
    assert relative_error(out_pool[[2, 0]].cpu(), ref_ht) <= TOLERANCE[torch.float32]
    assert torch.equal(out_pool[1].cpu(), pool[1])
