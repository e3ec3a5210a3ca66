"""IR passes: golden dumps, the verifier after every pass, and the verifier catching broken IR."""
from __future__ import annotations

import dataclasses

import pytest
import sympy

from lrdsl.errors import IRError
from lrdsl.ir.recurrence import GateKind
from lrdsl.ir.step import DecayState, Formula, ReadOutput, WriteState
from lrdsl.passes.derive_step import derive_step
from lrdsl.passes.pipeline import PASSES, STAGES, run_pipeline
from lrdsl.passes.verify import verify
from lrdsl.spec import load_spec

from helpers import ALL_SPECS, recurrence, spec_path


@pytest.mark.parametrize("name", ALL_SPECS)
def test_every_pass_verifies(name):
    stages = run_pipeline(load_spec(spec_path(name)), check=True)
    assert set(stages) == set(STAGES)


def test_pipeline_lists_each_pass_with_a_reason():
    assert all(p.why for p in PASSES)
    assert [p.name for p in PASSES] == list(STAGES[1:])


def test_qwen35_step_hoists_head_inputs(golden):
    step = run_pipeline(load_spec(spec_path("gdn_qwen35")), until="step")["step"]
    golden("gdn_qwen35.step.txt", step.describe() + "\n")
    assert [op.name for op in step.prologue] == ["A_log", "dt_bias"]


def test_constant_gate_formula_is_loop_invariant():
    step = derive_step(recurrence("retnet"))
    assert any(isinstance(op, Formula) and op.target == "g_t" for op in step.prologue)
    assert not any(isinstance(op, Formula) for op in step.body)


def test_pipeline_stops_at_requested_stage():
    stages = run_pipeline(load_spec(spec_path("gdn")), until="recurrence")
    assert set(stages) == {"spec", "recurrence"}


def test_a_stage_without_chunk_form_passes_through_every_later_pass(monkeypatch):
    """The pipeline, not each pass, carries a NoChunkForm: every stage after `chunk` holds it
    (factor_scalars, which had no pass-through of its own, raised AttributeError on one)."""
    from lrdsl.ir.chunk import NoChunkForm
    from lrdsl.passes import pipeline

    unchunked = lambda rec: NoChunkForm(rec, "an update the passes do not chunk")
    passes = tuple(dataclasses.replace(p, run=unchunked) if p.name == "chunk" else p for p in PASSES)
    monkeypatch.setattr(pipeline, "PASSES", passes)
    stages = run_pipeline(load_spec(spec_path("gdn")), check=True)
    later = STAGES[STAGES.index("chunk"):]
    assert all(stages[s] is stages["chunk"] for s in later)
    assert isinstance(stages["chunk"], NoChunkForm) and not isinstance(stages["step"], NoChunkForm)


@pytest.mark.parametrize("switch, verified", [(None, True), ("1", True), ("0", False)])
def test_load_and_compile_verify_every_stage_unless_switched_off(switch, verified, monkeypatch, tmp_path):
    """lrdsl.load (on a cache miss) and lrdsl compile (through loader.generate) run the IR
    verifier on every stage by default; LRDSL_VERIFY=0 turns it off."""
    from lrdsl.passes import pipeline
    from lrdsl.runtime import loader

    if switch is None:
        monkeypatch.delenv("LRDSL_VERIFY", raising=False)
    else:
        monkeypatch.setenv("LRDSL_VERIFY", switch)
    checked = []
    monkeypatch.setattr(pipeline, "verify", checked.append)
    loader.generate(spec_path("linear_attn"))
    assert len(checked) == (len(PASSES) if verified else 0)

    checked.clear()
    monkeypatch.setenv("LRDSL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(loader, "_loaded", {})
    loader.load(spec_path("linear_attn"))
    assert len(checked) == (len(PASSES) if verified else 0)


def test_compile_refuses_ir_a_pass_broke(monkeypatch, tmp_path):
    """A pass's slip reaches the user of `lrdsl compile` as the verifier's one line, not as a
    module built from broken IR."""
    from lrdsl.passes import pipeline
    from lrdsl.passes.derive_chunk import derive_chunk
    from lrdsl.runtime import loader

    def drop_a_load(rec):
        prog = derive_chunk(rec)
        return dataclasses.replace(prog, ops=tuple(op for op in prog.ops if op.out != "scale"))

    passes = tuple(dataclasses.replace(p, run=drop_a_load) if p.name == "chunk" else p for p in PASSES)
    monkeypatch.setattr(pipeline, "PASSES", passes)
    monkeypatch.delenv("LRDSL_VERIFY", raising=False)
    with pytest.raises(IRError, match="scale"):
        loader.generate(spec_path("gdn"))


def test_unknown_stage():
    with pytest.raises(ValueError, match="unknown stage 'chunky'"):
        run_pipeline(load_spec(spec_path("gdn")), until="chunky")


# -- the verifier catches broken IR -----------------------------------------------------------

def test_verify_catches_missing_state_write():
    step = derive_step(recurrence("gdn"))
    broken = dataclasses.replace(step, body=tuple(op for op in step.body if not isinstance(op, WriteState)))
    with pytest.raises(IRError, match="write the state exactly once"):
        verify(broken)


def test_verify_catches_read_before_write():
    step = derive_step(recurrence("gdn"))
    body = list(step.body)
    read = next(op for op in body if isinstance(op, ReadOutput))
    body.remove(read)
    body.insert(body.index(next(op for op in body if isinstance(op, WriteState))), read)
    with pytest.raises(IRError, match="reads the state after the write"):
        verify(dataclasses.replace(step, body=tuple(body)))


def test_verify_catches_use_before_definition():
    step = derive_step(recurrence("gdn"))
    body = [op for op in step.body if not (isinstance(op, Formula) and op.target == "g_t")]
    with pytest.raises(IRError, match=r"DecayState reads \['g_t'\] before any definition"):
        verify(dataclasses.replace(step, body=tuple(body)))


def test_verify_catches_decay_without_gate():
    step = derive_step(recurrence("deltanet"))
    body = (Formula("g_t", sympy.Integer(0), per_key=False), DecayState(per_key=False)) + step.body
    with pytest.raises(IRError, match="decay op belongs in the body exactly when gated"):
        verify(dataclasses.replace(step, body=body))


def test_verify_catches_gate_without_formula():
    rec = recurrence("gdn")
    with pytest.raises(IRError, match="log_decay must be set exactly when gated"):
        verify(dataclasses.replace(rec, log_decay=None))


def test_verify_catches_undeclared_symbol():
    rec = recurrence("gdn")
    with pytest.raises(IRError, match="reads undeclared"):
        verify(dataclasses.replace(rec, beta=sympy.Symbol("mystery")))


def test_verify_catches_constant_gate_reading_tokens():
    rec = recurrence("gdn")
    with pytest.raises(IRError, match="constant gate may not read per-token inputs"):
        verify(dataclasses.replace(rec, gate=GateKind.CONSTANT))


def test_verify_catches_misplaced_delta_vectors():
    """The read vector and the written value: delta rule only, k only in r_t, v only in x_t."""
    from lrdsl.ir.recurrence import UpdateRule

    gdn2, gdn = recurrence("gdn2"), recurrence("gdn")
    k, v, w = sympy.Symbol("k"), sympy.Symbol("v"), sympy.Symbol("w")
    with pytest.raises(IRError, match="belong to the delta rule only"):
        verify(dataclasses.replace(gdn2, update=UpdateRule.PLAIN))
    with pytest.raises(IRError, match=r"write_value reads undeclared \['k'\]"):
        verify(dataclasses.replace(gdn2, write_value=v * k))
    with pytest.raises(IRError, match="written value x_t is per value channel and reads v"):
        verify(dataclasses.replace(gdn2, write_value=w))
    with pytest.raises(IRError, match="read vector r_t is per key channel"):
        verify(dataclasses.replace(gdn, delta_read=sympy.Symbol("beta")))
    with pytest.raises(IRError, match="beta may not read per-value-channel inputs"):
        verify(dataclasses.replace(gdn2, beta=w))


def test_ir_nodes_are_frozen_and_hashable():
    rec = recurrence("gdn_qwen35")
    step = derive_step(rec)
    assert hash(rec) == hash(recurrence("gdn_qwen35"))
    assert hash(step) == hash(derive_step(rec))
    with pytest.raises(dataclasses.FrozenInstanceError):
        rec.name = "other"


def test_type_registries_name_what_is_missing():
    """IR lookups by type (emitters, adjoint rules, verifiers) fail with one named lrdsl error."""
    from lrdsl.codegen.emitters import CHUNK_EMITTERS
    from lrdsl.errors import CompileError, IRError
    from lrdsl.passes.autodiff import ADJOINTS
    from lrdsl.passes.verify import verify

    class UnknownOp:
        pass

    with pytest.raises(CompileError, match="no chunk kernel emitter for UnknownOp"):
        CHUNK_EMITTERS.lookup(UnknownOp())
    with pytest.raises(IRError, match="no adjoint rule for UnknownOp"):
        ADJOINTS.lookup(UnknownOp())
    with pytest.raises(IRError, match="no verifier for UnknownOp"):
        verify(UnknownOp())
    from lrdsl.ir.chunk import MatMul

    with pytest.raises(ValueError, match="a second adjoint rule for MatMul"):
        ADJOINTS.register(MatMul)(lambda *args: None)
