"""Chunk-form passes: derive_chunk, the symbolic proof, the stage graph and the kernel plans."""
from __future__ import annotations

import dataclasses

import pytest
import sympy
import torch

from lrdsl import reference
from lrdsl.verification.chunk_reference import run_chunked
from lrdsl.errors import IRError
from lrdsl.ir.chunk import DecayedGram, DecayMatrix, Formula, MatMul, NoChunkForm, UnitLowerInverse
from lrdsl.passes.derive_chunk import derive_chunk
from lrdsl.passes.lower_steps import STEP_GATE, lower_steps
from lrdsl.passes.plan import plan_kernels
from lrdsl.passes.stage_graph import build_stage_graph
from lrdsl.passes.verify import verify
from lrdsl.verification.prove import prove, prove_case
from lrdsl.verification.workloads import Shape

from helpers import ALL_SPECS, CORE_SPECS, recurrence, sample

def program(name):
    """The chunk program of a shipped spec, derived as the pipeline does (after lower_steps)."""
    return derive_chunk(lower_steps(recurrence(name)))


CHUNKED_SPECS = [n for n in ALL_SPECS if not isinstance(program(n), NoChunkForm)]


def test_dplr_update_solves_for_its_two_vector_sets():
    """rwkv7: the low-rank term's system T = (I - A_ab)^-1 over a and b, products of an exclusive
    row decay with the inclusive column decay (the term reads the state before the step's
    decay), the output's and exit state's products over both writes (k v^T and b u^T)."""
    prog = program("rwkv7")
    grams = {op.out: op for op in prog.ops if isinstance(op, DecayedGram)}
    assert {(g.a, g.b, g.x, g.column_decay, g.inclusive) for g in grams.values()} == {
        ("a_finite", "b_finite", "G_excl", "G", False), ("a_finite", "k", "G_excl", "G", False),
        ("q", "k", "G", "G", True), ("q", "b_finite", "G", "G", True)}
    assert sum(isinstance(op, UnitLowerInverse) for op in prog.ops) == 1
    assert prog.shape("U") == ("C", "V") and prog.shape("W") == ("C", "K")


def test_verify_catches_two_decays_of_different_gates():
    prog = program("rwkv7")
    with pytest.raises(IRError, match="two decays must be the exclusive and inclusive cumulative sums"):
        verify(_replace_op(prog, "ABt_decayed", x="G", y="G"))


def test_stages_follow_the_spec_not_its_name():
    ops = {name: {type(op) for op in program(name).ops} for name in CHUNKED_SPECS}
    assert UnitLowerInverse in ops["gdn"] and UnitLowerInverse in ops["deltanet"]
    assert UnitLowerInverse not in ops["simple_gla"] and UnitLowerInverse not in ops["linear_attn"]
    assert DecayMatrix in ops["gdn"] and DecayMatrix in ops["simple_gla"] and DecayMatrix in ops["retnet"]
    assert DecayMatrix not in ops["deltanet"] and DecayMatrix not in ops["linear_attn"]
    # a constant gate is its formula of the head index, spread over the rows
    retnet = program("retnet")
    gate = next(op for op in retnet.ops if isinstance(op, Formula) and op.out == "g_t")
    assert gate.shape == () and sympy.Symbol("h") in gate.expr.free_symbols


def test_key_channel_gate_decays_per_channel():
    """kda/gla: G is C x K, the decayed products are per channel (DecayedGram), never a C x C
    DecayMatrix; the exit state decays row by row by the channel totals."""
    for name, grams in (("kda", [False, True]), ("gla", [True])):
        prog = program(name)
        kinds = {type(op) for op in prog.ops}
        assert DecayMatrix not in kinds and (UnitLowerInverse in kinds) == (name == "kda")
        assert [op.inclusive for op in prog.ops if isinstance(op, DecayedGram)] == grams
        assert prog.shape("G") == ("C", "K") and prog.shape("G_last") == ("K",)
        suffix = prog.op("g_to_end")
        assert suffix.shape == ("C", "K") and suffix.reverse and suffix.exclusive


@pytest.mark.parametrize("name", CHUNKED_SPECS)
def test_chunk_program_verifies(name):
    verify(program(name))


@pytest.mark.parametrize("name", CHUNKED_SPECS)
def test_symbolic_proof(name):
    results = prove(program(name))
    assert [(r.C, r.rows) for r in results] == [(2, 2), (3, 3), (3, 2)]
    for r in results:
        assert r.ok, f"{name}: C={r.C} rows={r.rows} differs at {r.failures}"
        assert r.entries == r.rows * 2 + 4


def _replace_op(prog, name, **changes):
    ops = tuple(dataclasses.replace(op, **changes) if op.out == name else op for op in prog.ops)
    return dataclasses.replace(prog, ops=ops)


def test_proof_catches_a_wrong_mask():
    prog = program("gdn")
    broken = _replace_op(prog, "D_incl", inclusive=False)  # the output forgets the diagonal
    result = prove_case(broken, 2, 2)
    assert not result.ok and any(f.startswith("O[") for f in result.failures)


def test_proof_catches_a_missing_decay():
    prog = program("simple_gla")
    state = next(op for op in prog.ops if op.out == "H_next")
    broken = _replace_op(prog, "H_next", expr=state.expr.subs(sympy.Symbol("H"), 0) + sympy.Symbol("H"))
    result = prove_case(broken, 3, 3)
    assert not result.ok and any(f.startswith("state[") for f in result.failures)


@pytest.mark.parametrize("name", CHUNKED_SPECS)
@pytest.mark.parametrize("chunk_size", [4, 16])
def test_chunk_program_matches_oracle_in_float64(name, chunk_size, generator):
    """The derived form itself, evaluated in float64 chunk by chunk: equal to the oracle to rounding
    (the oracle of the recurrence it is derived from: with several steps per token, the sub-step
    rows of passes/lower_steps.py, on any values of its step gate)."""
    rec = program(name).recurrence
    shape = Shape(1, 37, 2, 4, 8, 6)
    tensors = sample(rec, shape, torch.float32, generator)
    names = [i.name for i in rec.inputs]
    if STEP_GATE in names:  # a factor of the log-decay: in [0, 1], as the module's 0 and 1
        index = 3 + names.index(STEP_GATE)
        tensors[index] = torch.rand(tensors[index].shape, generator=generator)
    h0 = torch.randn(4, 4, 8, 6, generator=generator)
    kwargs = dict(initial_state=h0, output_final_state=True, cu_seqlens=torch.tensor([0, 0, 1, 20, 37]),
                  use_qk_l2norm_in_kernel=True, scale=0.4)
    o, ht = run_chunked(program(name), *tensors, chunk_size=chunk_size, **kwargs)
    ref_o, ref_ht = reference.run(rec, *tensors, **kwargs)
    torch.testing.assert_close(o, ref_o, rtol=1e-9, atol=1e-11)
    torch.testing.assert_close(ht, ref_ht, rtol=1e-9, atol=1e-11)


# -- verifier on broken chunk programs ---------------------------------------------------------

def test_verify_catches_shape_mismatch():
    prog = program("gdn")
    with pytest.raises(IRError, match="shape"):
        verify(_replace_op(prog, "W", shape=("C", "V")))


def test_verify_catches_non_contracting_matmul():
    prog = program("gdn")
    with pytest.raises(IRError, match="do not contract"):
        verify(_replace_op(prog, "KKt", transpose_b=False))


def test_verify_catches_use_before_definition():
    prog = program("deltanet")
    ops = list(prog.ops)
    inverse = next(i for i, op in enumerate(ops) if isinstance(op, UnitLowerInverse))
    ops.insert(0, ops.pop(inverse))
    with pytest.raises(IRError, match="before any definition"):
        verify(dataclasses.replace(prog, ops=tuple(ops)))


def test_verify_catches_missing_solve():
    prog = program("deltanet")
    ops = tuple(op for op in prog.ops if not isinstance(op, UnitLowerInverse))
    ops = tuple(dataclasses.replace(op, a="A") if isinstance(op, MatMul) and op.a == "T" else op for op in ops)
    with pytest.raises(IRError, match="triangular system belongs to the delta rule"):
        verify(dataclasses.replace(prog, ops=ops))


# -- stage graph and plans --------------------------------------------------------------------

def test_stage_graph_phases_gdn():
    stages = build_stage_graph(program("gdn"))
    phase = stages.phase
    assert phase("T") == "prepare" and phase("W") == "prepare" and phase("U") == "prepare"
    assert phase("H") == "scan" and phase("Vn") == "scan" and phase("H_next") == "scan"
    assert phase("O") == "output" and phase("QH") == "output"
    crossing = {(v, a, b) for v, a, b in stages.crossings()}
    assert ("W", "prepare", "scan") in crossing and ("Vn", "scan", "output") in crossing
    graph = stages.graph()
    assert graph.has_edge("T", "W") and graph.nodes["O"]["phase"] == "output"


@pytest.mark.parametrize("name", CHUNKED_SPECS)
def test_plans_are_complete(name):
    plans = plan_kernels(build_stage_graph(program(name)))
    verify(plans)
    assert [p.name for p in plans.plans] == ["split", "fused"]  # split is the default
    for plan in plans.plans:
        kinds = [k.kind for k in plan.kernels]
        assert kinds.count("scan") == 1 and plan.kernels[-1].name == "output"


def test_split_plan_separates_the_solve():
    plans = plan_kernels(build_stage_graph(program("gdn")))
    assert [k.name for k in plans.plan("fused").kernels] == ["prepare", "scan", "output"]
    assert [k.name for k in plans.plan("split").kernels] == ["system", "solve", "apply", "scan", "output"]
    solve = plans.plan("split").kernels[1]
    assert solve.loads == ("A",) and solve.stores == ("T",)
    fused = plans.plan("fused").kernels[0]
    assert {"A", "T", "W", "U"} <= set(fused.stores)


def test_plain_update_needs_no_solve():
    for name in ("simple_gla", "linear_attn"):
        plans = plan_kernels(build_stage_graph(program(name)))
        assert plans.plan("fused").kernels == plans.plan("split").kernels
        assert not any(b.shape == ("C", "C") for b in plans.plan("fused").buffers)


def test_verify_catches_a_plan_reading_an_unstored_buffer():
    plans = plan_kernels(build_stage_graph(program("gdn")))
    fused = plans.plan("fused")
    stores = tuple(v for v in fused.kernels[0].stores if v != "U")  # U no longer stored
    broken_kernel = dataclasses.replace(fused.kernels[0], stores=stores)
    broken = dataclasses.replace(fused, kernels=(broken_kernel,) + fused.kernels[1:])
    with pytest.raises(IRError, match="reads U"):
        verify(dataclasses.replace(plans, plans=tuple(broken if p.name == "fused" else p for p in plans.plans)))


@pytest.mark.parametrize("name", CHUNKED_SPECS)
def test_output_at_a_multiple_of_the_scan_chunk_size(name):
    """Plan rule 6: the output kernel may run at a multiple of the scan's chunk size where it reads
    only entry states and chunk-size-free rows from memory (the residual Vn, row functions of the
    inputs); rwkv7's output reads U, solved within each chunk, so it may not."""
    plans = plan_kernels(build_stage_graph(program(name)))
    prog = plans.graph.program
    # what the state update writes: Vn (delta rule, beta v), or v itself for a plain write without beta
    assert len(prog.chunk_size_free) == (0 if name == "rwkv7" else 1)
    for plan in plans.plans:
        reads = set(plan.kernels[-1].loads)
        assert plan.output_at_multiple == (name != "rwkv7"), (plan.name, reads)
        assert ("U" in reads) == (name == "rwkv7")


def test_output_reading_a_chunk_relative_buffer_stays_at_the_scan_chunk_size():
    """gdn with Vn no longer declared chunk-size-free (it is U - W H: products within the chunk)."""
    prog = dataclasses.replace(program("gdn"), chunk_size_free=())
    plans = plan_kernels(build_stage_graph(prog))
    assert all("Vn" in p.kernels[-1].loads and not p.output_at_multiple for p in plans.plans)


def test_verify_catches_a_chunk_size_free_value_with_a_chunk_axis():
    with pytest.raises(IRError, match="chunk-size-free A must be a per-row value"):
        verify(dataclasses.replace(program("gdn"), chunk_size_free=("A",)))
    plans = plan_kernels(build_stage_graph(program("gdn")))
    split = plans.plan("split")
    # a second chunk kernel after the output: the one at the multiple no longer follows the scan
    second = dataclasses.replace(split.kernels[-1], name="output_again")
    late = dataclasses.replace(split, kernels=split.kernels + (second,))
    with pytest.raises(IRError, match="must follow the scan"):
        verify(dataclasses.replace(plans, plans=(late, plans.plan("fused"))))


@pytest.mark.parametrize("name", CORE_SPECS)
def test_every_pass_verifies_with_chunk_stages(name):
    from lrdsl.passes.pipeline import run_pipeline
    from lrdsl.spec import load_spec

    from helpers import spec_path

    stages = run_pipeline(load_spec(spec_path(name)), check=True)
    assert {"chunk", "stages", "plan"} <= set(stages)


@pytest.mark.parametrize("name", CORE_SPECS)
def test_scan_runs_only_what_depends_on_the_state(name):
    """The scan is sequential: it loads the prepare values it needs instead of recomputing them
    (no norms or cumsums of prepare values inside it), forward and backward. K x V values, as
    large as the state, are the exception: the scan recomputes them."""
    from lrdsl.ir.chunk import Formula, Load
    from lrdsl.passes.pipeline import run_pipeline
    from lrdsl.spec import load_spec

    from helpers import spec_path

    stages = run_pipeline(load_spec(spec_path(name)))
    for graph_stage, plan_stage in (("stages", "plan"), ("backward_stages", "backward_plan")):
        graph, plans = stages[graph_stage], stages[plan_stage]
        prog = graph.program
        for plan in plans.plans:
            scan = next(k for k in plan.kernels if k.kind == "scan")
            for value in scan.computes:
                op = prog.op(value)
                recomputed = isinstance(op, (Load, Formula)) or op.shape == ("K", "V")
                assert graph.phase(value) == "scan" or recomputed, (plan.name, value, op)


# -- every combination the spec language accepts lowers ------------------------------------------

GATES = {  # gate -> (inputs, log_decay): the in-kernel kda gate mixes token, head and head_key roles
    "none": ({}, None),
    "scalar": ({"g": "token"}, "g"),
    "key_channel": ({"a": "token_key", "A_log": "head", "dt_bias": "head_key"}, "-exp(A_log) * softplus(a + dt_bias)"),
    "constant": ({}, "log(1 - 2**(-5 - h))"),
}
BETAS = {  # beta -> (inputs, formula): absent, per token in (0, 2), one per head
    "none": ({}, None),
    "token": ({"b": "token"}, "2 * sigmoid(b)"),
    "head": ({"c": "head"}, "sigmoid(c)"),
}


# dplr's low-rank vectors: bounded formulas of their own inputs (|a| small enough that I + b a^T
# stays near a contraction over the test's tokens), of every role a K-vector can be formed from:
# per token and key channel, per token (spread over the channels), per head and key channel
LOW_RANK = ({"la": "token_key", "ls": "token", "lb": "head_key"},
            {"low_rank_read": "-0.2 * tanh(la) * sigmoid(ls)", "low_rank_write": "tanh(lb)"})
COMBINATIONS = [(u, g, b) for u in ("delta", "plain") for g in sorted(GATES) for b in sorted(BETAS)]
COMBINATIONS += [("dplr", "key_channel", b) for b in sorted(BETAS)]  # dplr decays per key channel


def combination_spec(update: str, gate: str, beta: str) -> str:
    low_rank = LOW_RANK if update == "dplr" else ({}, {})
    inputs = {**GATES[gate][0], **BETAS[beta][0], **low_rank[0]}
    formulas = {"log_decay": GATES[gate][1], "beta": BETAS[beta][1], **low_rank[1]}
    lines = ['name = "combo"', "[recurrence]", f'update = "{update}"', f'gate = "{gate}"', "[inputs]"]
    lines += [f'{name} = "{role}"' for name, role in inputs.items()]
    lines += ["[formulas]"] + [f'{key} = "{text}"' for key, text in formulas.items() if text is not None]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("update, gate, beta", COMBINATIONS)
def test_every_combination_lowers(update, gate, beta, tmp_path, generator):
    """Each update x gate x beta the spec language accepts: every pass verifies, the module is
    emitted (chunk and recurrent, both differentiable), and the derived chunk form equals the
    oracle in float64."""
    from lrdsl.codegen.module import emit_module
    from lrdsl.passes.pipeline import run_pipeline
    from lrdsl.spec import load_spec

    path = tmp_path / "combo.toml"
    path.write_text(combination_spec(update, gate, beta))
    stages = run_pipeline(load_spec(str(path)), check=True)
    source = emit_module(stages, spec_path=str(path))
    assert "def chunk(" in source and "_RecurrentFunction.apply" in source
    rec = stages["recurrence"]
    tensors = sample(rec, Shape(1, 19, 1, 2, 4, 3), torch.float32, generator)
    kwargs = dict(output_final_state=True, cu_seqlens=torch.tensor([0, 0, 1, 19]), use_qk_l2norm_in_kernel=True)
    o, ht = run_chunked(stages["chunk"], *tensors, chunk_size=8, **kwargs)
    ref_o, ref_ht = reference.run(rec, *tensors, **kwargs)
    torch.testing.assert_close(o, ref_o, rtol=1e-9, atol=1e-11)
    torch.testing.assert_close(ht, ref_ht, rtol=1e-9, atol=1e-11)


def test_a_recurrence_without_chunk_form_is_refused_at_compile_time():
    """A future recurrence the passes cannot chunk gets one line naming why, never a module
    without gradients or a wrong kernel."""
    from lrdsl.codegen.module import emit_module
    from lrdsl.errors import CompileError
    from lrdsl.passes.pipeline import run_pipeline
    from lrdsl.spec import load_spec

    from helpers import spec_path

    stages = run_pipeline(load_spec(spec_path("gla")))
    stages["save"] = NoChunkForm(stages["recurrence"], "an update the passes do not chunk")
    with pytest.raises(CompileError) as info:
        emit_module(stages, spec_path="specs/gla.toml")
    assert str(info.value) == "specs/gla.toml: cannot compile no chunk form for gla: an update the passes do not chunk"


def test_a_backward_larger_than_any_measured_chunk_size_is_refused_at_compile_time(monkeypatch):
    """The largest chunk size is read off the backward's output kernel (how many per-key-channel
    decayed products it holds); a program beyond every measured row gets one line, not a module
    whose kernels might not fit a GPU block. Here the table lacks rwkv7's row."""
    from lrdsl.codegen import launch
    from lrdsl.codegen.module import emit_module
    from lrdsl.errors import CompileError
    from lrdsl.passes.pipeline import run_pipeline
    from lrdsl.spec import load_spec

    from helpers import spec_path

    monkeypatch.setattr(launch, "LARGEST_CHUNK_SIZES", launch.LARGEST_CHUNK_SIZES[:-1])
    with pytest.raises(CompileError) as info:
        emit_module(run_pipeline(load_spec(spec_path("rwkv7"))), spec_path="specs/rwkv7.toml")
    assert str(info.value) == ("rwkv7: the backward's output kernel computes 10 per-key-channel decayed products, more "
                               "than any chunk size was measured to fit (lrdsl resources)")
