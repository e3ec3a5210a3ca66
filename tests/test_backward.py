"""Gradients: the autodiff pass (IR level, float64), its symbolic proof, and the generated
backward kernels against autograd through the float64 oracle (CPU interpreter)."""
from __future__ import annotations

import dataclasses
import gc
import weakref

import pytest
import torch
import torch.utils._python_dispatch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import lrdsl
from lrdsl import reference
from lrdsl.errors import IRError
import sympy

from lrdsl.ir.chunk import Broadcast, Formula as ChunkFormula, Load, NoChunkForm, StateIn
from lrdsl.ir.evaluate import evaluate_torch
from lrdsl.passes.pipeline import run_pipeline
from lrdsl.passes.plan import plan_kernels
from lrdsl.passes.save_policy import choose_saved, sub_chunk_values
from lrdsl.passes.stage_graph import build_stage_graph
from lrdsl.passes.verify import verify
from lrdsl.verification.prove import prove_backward
from lrdsl.spec import load_spec
from lrdsl.verification.workloads import TOLERANCE, Shape, relative_error

from oracle_checks import Call, assert_errors, oracle_errors
from helpers import ALL_SPECS, CORE_SPECS, SHAPE_STRATEGIES, direct_input, module, recurrence, sample, spec_path

GRAD_LIMIT = 3e-3
CHUNKED = [n for n in ALL_SPECS if not isinstance(run_pipeline(load_spec(spec_path(n)), until="chunk")["chunk"], NoChunkForm)]


def stages(name):
    return run_pipeline(load_spec(spec_path(name)))


# -- the autodiff pass ---------------------------------------------------------------------------

@pytest.mark.parametrize("stage", ["backward", "backward_factored"])
@pytest.mark.parametrize("name", CHUNKED)
def test_backward_program_is_the_vjp_of_the_chunk_program(name, stage, generator):
    """IR level, float64: the backward program (as derived, and with its scalar factors moved
    onto sums) equals torch.autograd through the forward program."""
    st = stages(name)
    forward, backward = st["chunk"], st[stage]
    verify(backward)
    sizes, valid = {"C": 8, "K": 5, "V": 4}, 6
    env = {}
    for op in forward.ops:
        if isinstance(op, (Load, StateIn)):
            dims = tuple(sizes[a] for a in op.shape)
            if op.source in ("scale", "h") if isinstance(op, Load) else False:
                env[op.out] = torch.tensor(0.7 if op.source == "scale" else 2.0, dtype=torch.float64)
                continue
            x = torch.randn(dims, generator=generator, dtype=torch.float64)
            if isinstance(op, Load) and op.shape[:1] == ("C",):
                x[valid:] = 0  # rows past the sequence end are loaded as 0
            if isinstance(op, Load) and op.source == direct_input(forward.recurrence, forward.recurrence.log_decay):
                x = -x.abs()
            env[op.out] = x.requires_grad_()
    out = evaluate_torch(forward, env, sizes, valid, l2norm=True)
    d_o = torch.randn(8, 4, generator=generator, dtype=torch.float64)
    d_o[valid:] = 0
    d_state = torch.randn(5, 4, generator=generator, dtype=torch.float64)
    loss = (out[forward.output("o")] * d_o).sum() + (out[forward.output("state")] * d_state).sum()
    leaves = {name: x for name, x in env.items() if x.requires_grad}
    # a value that only selects (lower_steps' step mask in selected(s, x)) reaches no output's
    # value: autograd leaves it out, its gradient is 0
    grads = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
    expected = {name: torch.zeros_like(x) if g is None else g for (name, x), g in zip(leaves.items(), grads)}

    benv = {backward.state_in: d_state}
    for op in backward.ops:
        if isinstance(op, Load):
            if op.source.startswith("saved:"):
                benv[op.out] = out[op.source[len("saved:"):]].detach()
            elif op.source == "dO":
                benv[op.out] = d_o
            else:
                benv[op.out] = next(env[o.out] for o in forward.ops if isinstance(o, Load) and o.source == op.source).detach()
    got = evaluate_torch(backward, benv, sizes, valid, l2norm=True)
    for role, value in backward.outputs:
        if role == "state":
            want = expected[forward.state_in]
        else:
            source = role[len("grad:"):]
            want = expected[next(o.out for o in forward.ops if isinstance(o, Load) and o.source == source)]
        torch.testing.assert_close(got[value], want, rtol=1e-10, atol=1e-12, msg=f"{name} {role}")


@pytest.mark.parametrize("stage", ["backward", "backward_factored"])
@pytest.mark.parametrize("name", CHUNKED)
def test_backward_symbolic_proof(name, stage):
    st = stages(name)
    for result in prove_backward(st["chunk"], st[stage]):
        assert result.ok, f"{name}: C={result.C} rows={result.rows}: {result.failures}"
        assert result.entries > 0


@pytest.mark.parametrize("name", CHUNKED)
def test_save_states_keeps_the_entry_states_of_the_rerun_scan(name):
    """save_states keeps what save_solve keeps, re-runs what it re-runs, and names the scan's
    entry state (the program's StateIn) as the state its re-run starts from; no other policy
    resumes; the verifier refuses a resumed value that is not that state."""
    item = stages(name)["save"]
    states, solve = item.policy("save_states"), item.policy("save_solve")
    state_in = item.forward.graph.program.state_in
    for plan in item.forward.plans:
        assert states.kept_by(plan.name) == solve.kept_by(plan.name)
        assert states.rerun_by(plan.name) == solve.rerun_by(plan.name)
        assert states.resumed_by(plan.name) == (state_in,)
        assert all(p.resumed_by(plan.name) == () for p in item.policies if p.name != "save_states")
    broken = dataclasses.replace(states, resumed=tuple((p.name, ("T",)) for p in item.forward.plans))
    with pytest.raises(IRError, match="is not the entry state"):
        verify(dataclasses.replace(item, policies=(broken,)))


def test_backward_reads_the_forward_buffers_instead_of_solving():
    st = stages("gdn")
    reads = st["save"].reads
    # the entry states, the solved system, W, the residuals; and the decayed keys and chunk decay
    # the forward stores for its scan
    assert set(reads) == {"H", "T", "W", "Vn", "k_decayed", "G_last"}
    backward = st["backward"]
    assert backward.direction == "backward" and backward.state_in == "d_H_next"
    assert [role for role, _ in backward.outputs] == ["state", "grad:q", "grad:k", "grad:v", "grad:g", "grad:beta"]


def test_save_policies():
    save = stages("gdn")["save"]
    assert save.default_policy == "save_states"  # what a deep model should hold per layer (save_policy.py)
    recompute, solve, prepare, keep = (save.policy(n) for n in ("recompute", "save_solve", "save_prepare", "save"))
    assert recompute.kept_by("fused") == () and recompute.rerun_by("fused") == ("prepare", "scan")
    assert recompute.rerun_by("split") == ("system", "solve", "apply", "scan")
    assert solve.kept_by("split") == ("T",) and solve.rerun_by("split") == ("apply", "scan")
    assert solve.kept_by("fused") == () and solve.rerun_by("fused") == ("prepare", "scan")  # its solve also makes W, U
    # only matmuls read T after the forward: kept in the operand dtype; G_last feeds exp2, stays fp32
    assert solve.narrowed_by("split") == ("T",) and prepare.narrowed_by("split") == ("T",)
    assert set(prepare.kept_by("fused")) == {"T", "W", "U", "k_decayed", "G_last"} and prepare.rerun_by("fused") == ("scan",)
    assert set(keep.kept_by("split")) == {"H", "T", "W", "Vn", "k_decayed", "G_last"} and keep.rerun_by("split") == ()
    # nothing kept, or solved systems only: valid at a chunk size dividing the forward's
    assert [p.any_chunk_size_by("split") for p in (recompute, solve, prepare, keep)] == [True, True, False, False]


@pytest.mark.parametrize("name", ["gdn", "deltanet", "kda", "rwkv7"])
def test_solved_systems_are_valid_at_a_smaller_chunk_size(name):
    """The systems and their solutions depend on rows i..j only, not on where the chunk starts;
    values built on a decay from the chunk start or to its end do not."""
    prog = stages(name)["chunk"]
    valid = sub_chunk_values(prog)
    assert "T" in valid
    assert not valid & {"gamma", "decay_to_end", "q_decayed", "k_decayed", "W", "U", "G", "H"}
    assert stages(name)["save"].policy("save_solve").any_chunk_size_by("split")


def _evaluate_rows(prog, loads, rows, sizes):
    """The chunk program on the given rows of the row-wise loads (float64, every row valid)."""
    env = {name: (x[rows] if prog.op(name).shape[:1] == ("C",) else x) for name, x in loads.items()}
    count = rows.stop - rows.start
    return evaluate_torch(prog, env, dict(sizes, C=count), count, l2norm=True)


@pytest.mark.parametrize("name", CHUNKED)
def test_sub_chunk_values_are_the_diagonal_blocks(name, generator):
    """Numerically, float64: every value sub_chunk_values names, evaluated on an 8-row chunk, has
    on its diagonal the same value evaluated on each 4-row half alone."""
    prog = stages(name)["chunk"]
    sizes = {"C": 8, "K": 5, "V": 4}
    loads = {}
    for op in prog.ops:
        if isinstance(op, (Load, StateIn)):
            if isinstance(op, Load) and op.source in ("scale", "h"):
                loads[op.out] = torch.tensor(0.7 if op.source == "scale" else 2.0, dtype=torch.float64)
                continue
            x = torch.randn(tuple(sizes[a] for a in op.shape), generator=generator, dtype=torch.float64)
            if isinstance(op, Load) and op.source == direct_input(prog.recurrence, prog.recurrence.log_decay):
                x = -x.abs()
            loads[op.out] = x
    whole = _evaluate_rows(prog, loads, slice(0, 8), sizes)
    halves = [(rows, _evaluate_rows(prog, loads, rows, sizes)) for rows in (slice(0, 4), slice(4, 8))]
    checked = sub_chunk_values(prog)
    assert checked, name
    for value in checked:
        for rows, half in halves:
            torch.testing.assert_close(whole[value][rows, rows], half[value], rtol=1e-10, atol=1e-12, msg=f"{name} {value}")


def test_a_system_scaled_by_a_decay_from_the_chunk_start_is_not_reused():
    """A system whose rows carry exp2(G_i) (G from the chunk start) changes with the chunk size:
    save_solve then keeps the backward at the forward's chunk size."""
    st = stages("gdn")
    prog = st["chunk"]
    ops = []
    for op in prog.ops:
        if op.out == "A":
            ops.append(Broadcast("gamma_rows", ("C", "C"), "gamma"))
            op = ChunkFormula("A", ("C", "C"), sympy.Symbol("A_rows") * sympy.Symbol("KKt_decayed") * sympy.Symbol("gamma_rows"))
        ops.append(op)
    scaled = dataclasses.replace(prog, ops=tuple(ops))
    assert {"KKt_decayed", "A_rows"} <= sub_chunk_values(scaled) and not {"A", "T"} & sub_chunk_values(scaled)
    save = choose_saved(plan_kernels(build_stage_graph(scaled)), st["backward_plan"])
    assert save.policy("save_solve").kept_by("split") == ("T",)
    assert not save.policy("save_solve").any_chunk_size_by("split")


def test_verify_catches_a_gradient_of_the_wrong_shape():
    backward = stages("gdn")["backward"]
    outputs = tuple((role, "d_k" if role == "grad:g" else value) for role, value in backward.outputs)
    with pytest.raises(IRError, match="dg has shape"):
        verify(dataclasses.replace(backward, outputs=outputs))


def test_a_gradient_of_an_input_the_backward_reads_only_through_a_saved_value(tmp_path, generator):
    """A plain update with a constant beta: the backward reads the forward's Vn = beta v back and
    never loads v, yet writes v's gradient. The verifier (on in lrdsl.load) refused that module
    ("gradient of v, which the program does not load"; the spec fuzzer's fixed-seed draws hit it);
    its gradients are the oracle's."""
    path = tmp_path / "constant_beta.toml"
    path.write_text('name = "constant_beta"\n[recurrence]\nupdate = "plain"\ngate = "none"\n[inputs]\n'
                    '[formulas]\nbeta = "sigmoid(0.75)"\n')
    rec = run_pipeline(load_spec(path), until="recurrence")["recurrence"]
    verify(run_pipeline(load_spec(path))["backward"])
    errors = oracle_errors(rec, lrdsl.load(path), Call(Shape(1, 40, 1, 2, 20, 24), h0=True, dht=True), generator)
    assert_errors(errors, TOLERANCE[torch.float32], "constant beta")


# -- generated backward kernels vs autograd through the oracle -----------------------------------

GRAD_CASES = {
    "gva1_h0_dht": dict(shape=Shape(2, 21, 2, 2, 16, 24), h0=True, dht=True),
    "gva2_varlen_empty_len1": dict(shape=Shape(1, 40, 2, 4, 24, 16), h0=True, dht=True, bounds=[0, 0, 1, 22, 22, 40]),
    "gva3_l2norm_no_h0": dict(shape=Shape(1, 19, 1, 3, 32, 20), l2norm=True),
    "odd_T_scale": dict(shape=Shape(1, 35, 1, 1, 24, 24), h0=True, scale=0.3),
}


def gradient_errors(name, case, generator, device, gate=None, kernel="chunk", **options):
    """Relative errors of every gradient, kernel vs autograd through the float64 oracle."""
    rec, mod = recurrence(name), module(name)
    shape = case["shape"]
    bounds = case.get("bounds")
    N = len(bounds) - 1 if bounds else shape.B
    tensors = sample(rec, shape, torch.float32, generator, gate=gate)
    h0 = torch.randn(N, shape.HV, shape.K, shape.V, generator=generator) if case.get("h0") else None
    d_o = torch.randn(shape.B, shape.T, shape.HV, shape.V, generator=generator)
    d_final = torch.randn(N, shape.HV, shape.K, shape.V, generator=generator) if case.get("dht") else None
    cu = torch.tensor(bounds, dtype=torch.int32) if bounds else None
    kwargs = dict(scale=case.get("scale"), output_final_state=d_final is not None, use_qk_l2norm_in_kernel=case.get("l2norm", False))

    leaves = [t.detach().clone().to(device).requires_grad_() for t in tensors]
    h0_leaf = h0.detach().clone().to(device).requires_grad_() if h0 is not None else None
    o, ht = getattr(mod, kernel)(*leaves, initial_state=h0_leaf, cu_seqlens=cu.to(device) if cu is not None else None,
                                 **kwargs, **options)
    loss = (o * d_o.to(device)).sum() + ((ht * d_final.to(device)).sum() if d_final is not None else 0)
    loss.backward()

    refs = [t.detach().double().requires_grad_() for t in tensors]
    h0_ref = h0.double().requires_grad_() if h0 is not None else None
    ref_o, ref_ht = reference.run(rec, *refs, initial_state=h0_ref, cu_seqlens=cu, **kwargs)
    ref_loss = (ref_o * d_o.double()).sum() + ((ref_ht * d_final.double()).sum() if d_final is not None else 0)
    ref_loss.backward()

    names = ["q", "k", "v"] + [i.name for i in rec.inputs]
    errors = {n: relative_error(a.grad, b.grad) for n, a, b in zip(names, leaves, refs)}
    if h0 is not None:
        errors["h0"] = relative_error(h0_leaf.grad, h0_ref.grad)
    for n, a in zip(names, leaves):
        assert a.grad.dtype == a.dtype and a.grad.shape == a.shape, n
    return errors


def assert_gradients(errors: dict, what: str):
    bad = {n: e for n, e in errors.items() if not e <= GRAD_LIMIT}
    assert not bad, f"{what}: gradient errors above {GRAD_LIMIT}: {bad} (all: {errors})"


@pytest.mark.parametrize("case", sorted(GRAD_CASES))
@pytest.mark.parametrize("name", CORE_SPECS)
def test_chunk_gradients(name, case, generator, device):
    chunk_size = {"gva1_h0_dht": 16, "gva2_varlen_empty_len1": 16, "gva3_l2norm_no_h0": 32, "odd_T_scale": 64}[case]
    assert_gradients(gradient_errors(name, GRAD_CASES[case], generator, device, chunk_size=chunk_size), f"{name} {case}")


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(**SHAPE_STRATEGIES, h0=st.booleans(), dht=st.booleans())
def test_chunk_gradients_property_shapes(B, T, H, group, K, V, chunk_size, h0, dht, name, generator, device):
    case = dict(shape=Shape(B, T, H, H * group, K, V), h0=h0, dht=dht)
    errors = gradient_errors(name, case, generator, device, chunk_size=chunk_size)
    assert_gradients(errors, f"{name} {case} C={chunk_size}")


@pytest.mark.parametrize("name", ["gdn_qwen35", "retnet", "kda_fused_gate", "kda_neg_eigval"])
def test_chunk_gradients_of_in_kernel_formulas(name, generator, device):
    """The Qwen3.5 gate's A_log and dt_bias, the raw b under sigmoid; a constant gate; KDA's
    per-key-channel gate (dt_bias [HV, K]) and beta = 2 sigmoid(b) in (0, 2)."""
    errors = gradient_errors(name, GRAD_CASES["gva2_varlen_empty_len1"], generator, device, chunk_size=16)
    assert_gradients(errors, name)
    names = ["q", "k", "v"] + [i.name for i in recurrence(name).inputs]
    assert set(names) <= set(errors)


@pytest.mark.parametrize("kernel", ["chunk", "recurrent"])
def test_an_output_the_loss_does_not_read_gets_no_gradient_tensor(kernel, generator, device, monkeypatch):
    """output_final_state=True with a loss reading o only, then the final state only: the unread
    output's gradient reaches the backward as None (not a state-sized tensor of zeros for the
    reverse scan to load), and every gradient matches the float64 oracle's."""
    rec, mod = recurrence("gdn"), module("gdn")
    shape, bounds = Shape(1, 40, 1, 2, 16, 16), [0, 1, 25, 40]
    tensors = sample(rec, shape, torch.float32, generator)
    h0 = torch.randn(3, shape.HV, shape.K, shape.V, generator=generator)
    d_o = torch.randn(1, 40, shape.HV, shape.V, generator=generator)
    d_ht = torch.randn(h0.shape, generator=generator)
    cu = torch.tensor(bounds, dtype=torch.int32)
    finals = []
    backward = mod._chunk_backward
    # _chunk_backward(c, plan, policy, kept, d_o, d_final, want, ...): record d_final
    monkeypatch.setattr(mod, "_chunk_backward", lambda *a, **kw: finals.append(a[5]) or backward(*a, **kw))
    for reads_o in (True, False):
        leaves = [t.to(device).requires_grad_() for t in (*tensors, h0)]
        o, ht = getattr(mod, kernel)(*leaves[:-1], initial_state=leaves[-1], output_final_state=True, cu_seqlens=cu.to(device))
        got = torch.autograd.grad(o if reads_o else ht, leaves, (d_o if reads_o else d_ht).to(device), allow_unused=True)
        refs = [t.double().requires_grad_() for t in (*tensors, h0)]
        ref_o, ref_ht = reference.run(rec, *refs[:-1], initial_state=refs[-1], output_final_state=True, cu_seqlens=cu)
        # the final state does not depend on q: its gradient is zero (None from the oracle)
        expected = torch.autograd.grad(ref_o if reads_o else ref_ht, refs, (d_o if reads_o else d_ht).double(),
                                       materialize_grads=True)
        errors = [relative_error(torch.zeros_like(b) if a is None else a, b) for a, b in zip(got, expected)]
        assert max(errors) <= GRAD_LIMIT, (reads_o, errors)
    assert finals[0] is None and finals[1] is not None


@pytest.mark.parametrize("name", ["gdn", "kda", "simple_gla"])
def test_boundary_states_reach_the_gate_gradient_at_full_precision(name, generator, device):
    """bf16 inputs (fp32 gates): one-token sequences with an initial state and a final-state
    gradient, where nothing is written (beta = 0; v = 0 without a delta rule) and o gets no
    gradient. Each token's gate gradient is then exactly its decay times <h0, d_ht>, summed over
    the state (over V, per key channel, for key-channel gates). The backward's entry-state and
    d_H_next buffers hold bf16, which would round both tiles of that sum (about 3e-3 relative
    error, more where the gradient cancels); the kernels read h0 and d_ht themselves at a
    sequence's first and last chunk, so only fp32 accumulation remains."""
    rec, mod = recurrence(name), module(name)
    shape, bounds = Shape(1, 4, 1, 2, 64, 64), [0, 1, 2, 3, 4]
    tensors = sample(rec, shape, torch.bfloat16, generator, beta=0.0 if rec.beta is not None else None)
    if rec.beta is None:
        tensors[2] = torch.zeros_like(tensors[2])
    h0 = torch.randn(4, shape.HV, shape.K, shape.V, generator=generator)
    d_ht = torch.randn(4, shape.HV, shape.K, shape.V, generator=generator)
    d_o = torch.zeros(1, 4, shape.HV, shape.V)
    cu = torch.tensor(bounds, dtype=torch.int32)
    gate = ["q", "k", "v", *(i.name for i in rec.inputs)].index(direct_input(rec, rec.log_decay))

    leaves = [t.to(device).requires_grad_() for t in tensors]
    o, ht = mod.chunk(*leaves, initial_state=h0.to(device), output_final_state=True, cu_seqlens=cu.to(device), chunk_size=16)
    (d_gate,) = torch.autograd.grad((o, ht), leaves[gate], (d_o.to(device, o.dtype), d_ht.to(device)))
    refs = [t.double().requires_grad_() for t in tensors]
    ref_o, ref_ht = reference.run(rec, *refs, initial_state=h0.double(), output_final_state=True, cu_seqlens=cu)
    (ref_d_gate,) = torch.autograd.grad((ref_o, ref_ht), refs[gate], (d_o.double(), d_ht.double()))
    assert relative_error(d_gate, ref_d_gate) <= 1e-4, relative_error(d_gate, ref_d_gate)


@pytest.mark.parametrize("gate", [0.0, -30.0, "half"])
@pytest.mark.parametrize("name, chunk_size", [("gdn", 16), ("simple_gla", 16), ("kda", 16), ("gla", 16), ("kda", 64), ("gla", 64)])
def test_gradients_at_gate_extremes(name, chunk_size, gate, generator, device):
    """Key-channel gates also in 64-row chunks, where the decay split's widest levels run."""
    case = dict(shape=Shape(1, 33 if chunk_size == 16 else 70, 1, 2, 16, 16), h0=True, dht=True)
    errors = gradient_errors(name, case, generator, device, gate=gate, chunk_size=chunk_size)
    assert_gradients(errors, f"{name} C={chunk_size} g={gate}")


@pytest.mark.parametrize("plan", ["fused", "split"])
@pytest.mark.parametrize("save_policy", ["recompute", "save_solve", "save_prepare", "save", "save_states"])
def test_gradients_every_plan_and_policy(plan, save_policy, generator, device):
    errors = gradient_errors("gdn", GRAD_CASES["gva1_h0_dht"], generator, device, chunk_size=16, plan=plan,
                             save_policy=save_policy)
    assert_gradients(errors, f"{plan}/{save_policy}")


RESUMED_CASES = {
    # the forward at C = 64, the backward at 32: runs of two chunks, the last of a sequence shorter
    "dense_h0_dht": dict(shape=Shape(2, 150, 1, 2, 16, 24), h0=True, dht=True),
    "packed_empty_len1": dict(shape=Shape(1, 200, 1, 2, 16, 16), h0=True, dht=True, bounds=[0, 0, 1, 130, 130, 200]),
}


@pytest.mark.parametrize("every", [1, 2])
@pytest.mark.parametrize("case", sorted(RESUMED_CASES))
@pytest.mark.parametrize("name", ["gdn", "deltanet", "simple_gla", "rwkv7"])
def test_save_states_resumes_the_rerun_scan_from_the_forward_states(name, case, every, generator, device, monkeypatch):
    """save_states: the backward (here at half the forward's chunk size) re-runs the forward scan
    from the entry states the forward call kept (every forward chunk's, or every other one's),
    runs of chunks side by side, and its gradients match the oracle's (packed sequences, empty
    and one-token ones, initial states included). The re-run has few programs here (as many
    multiprocessors as an H200 stand in for the interpreter's none)."""
    mod = module(name)
    monkeypatch.setattr(mod, "_multiprocessors", lambda q: 132)
    monkeypatch.setattr(mod, "RESUME_EVERY", every)
    resumed, states, alive_in_backward_scan = [], [], []
    real_resumed, real_scan = mod._scan_resumed, mod._scan
    monkeypatch.setattr(mod, "_scan_resumed",
                        lambda *args: resumed.append(args[-1]) or states.append(weakref.ref(args[-2])) or real_resumed(*args))

    def scan(*args, reverse=False, **options):
        if reverse:  # the backward's own scan, after the re-run: the kept states are released by then
            gc.collect()
            alive_in_backward_scan.append([ref() is not None for ref in states])
        return real_scan(*args, reverse=reverse, **options)

    monkeypatch.setattr(mod, "_scan", scan)
    errors = gradient_errors(name, RESUMED_CASES[case], generator, device, save_policy="save_states")
    assert_gradients(errors, f"{name} {case} save_states")
    forward, backward = mod.FORWARD_CHUNK_SIZE[mod.DEFAULT_CHUNK_PLAN, "input"], mod.BACKWARD_CHUNK_SIZE["input"]
    assert resumed == [every * forward // backward]
    assert alive_in_backward_scan == [[False]]


def test_save_states_keeps_no_state_where_the_rerun_scan_has_programs_enough(generator, device, monkeypatch):
    """Where the re-run walking whole sequences has at least RESUME_FEW_PROGRAMS programs per
    multiprocessor, the forward keeps no entry state and the backward re-runs as save_solve does."""
    mod = module("gdn")
    monkeypatch.setattr(mod, "_multiprocessors", lambda q: 1)
    decided, real = [], mod._resumes
    monkeypatch.setattr(mod, "_resumes", lambda *args: decided.append(real(*args)) or decided[-1])
    monkeypatch.setattr(mod, "_resume_states", lambda *args: pytest.fail("the forward kept entry states"))
    monkeypatch.setattr(mod, "_scan_resumed", lambda *args: pytest.fail("the re-run resumed"))
    errors = gradient_errors("gdn", RESUMED_CASES["dense_h0_dht"], generator, device, save_policy="save_states")
    assert_gradients(errors, "gdn save_states, programs enough")
    assert decided == [False]


@pytest.mark.parametrize("name", ["gdn", "linear_attn", "kda", "gla"])
def test_recurrent_gradients_route_through_the_chunk_backward(name, generator, device):
    assert_gradients(gradient_errors(name, GRAD_CASES["gva1_h0_dht"], generator, device, kernel="recurrent"), name)


def test_gradients_are_bitwise_reproducible(generator, device):
    rec, mod = recurrence("gdn"), module("gdn")
    tensors = sample(rec, Shape(1, 40, 2, 4, 16, 16), torch.float32, generator)
    d_o = torch.randn(1, 40, 4, 16, generator=generator)
    runs = []
    for _ in range(2):
        leaves = [t.detach().clone().to(device).requires_grad_() for t in tensors]
        o, _ = mod.chunk(*leaves, chunk_size=16, cu_seqlens=torch.tensor([0, 13, 40], dtype=torch.int32, device=device))
        (o * d_o.to(device)).sum().backward()
        runs.append([x.grad.clone() for x in leaves])
    for a, b in zip(*runs):
        assert torch.equal(a, b)


class _RecordAllocations(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the shape of every new tensor (empty, zeros, ...) torch allocates while active;
    views (the interpreter makes some of kernel arguments) are not allocations."""

    FACTORIES = ("empty", "empty_strided", "empty_like", "zeros", "zeros_like", "new_empty", "new_zeros", "full")

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ in self.FACTORIES:
            self.shapes.append(tuple(out.shape))
        return out


def test_gva_q_k_gradients_sum_in_the_kernel(generator, device):
    """HV = 3 H: the q/k gradients are summed per group in the kernel: the only [B, T, HV, K]
    tensors the backward allocates are the planned buffers of that shape (q decayed, which its
    scan loads), no per-value-head gradient."""
    rec, mod = recurrence("gdn"), module("gdn")
    B, T, H, HV, K, V = 1, 20, 2, 6, 32, 24  # K differs from the chunk size: [B, T, HV, C] buffers are expected
    tensors = [t.to(device).requires_grad_() for t in sample(rec, Shape(B, T, H, HV, K, V), torch.float32, generator)]
    o, _ = mod.chunk(*tensors, chunk_size=16, save_policy="save")  # no forward kernel re-runs in the backward
    with _RecordAllocations() as recorded:
        o.backward(torch.randn(B, T, HV, V, generator=generator).to(device))
    planned = [b for b in stages("gdn")["backward_plan"].plans[0].buffers if b.shape == ("C", "K")]
    assert recorded.shapes.count((B, T, HV, K)) == len(planned) == 1, planned
    assert tensors[0].grad.shape == tensors[1].grad.shape == (B, T, H, K)


def test_policies_give_identical_gradients(generator, device):
    rec, mod = recurrence("deltanet"), module("deltanet")
    tensors = sample(rec, Shape(1, 30, 1, 2, 16, 16), torch.float32, generator)
    grads = {}
    for policy in mod.SAVE_POLICIES:
        leaves = [t.detach().clone().to(device).requires_grad_() for t in tensors]
        o, _ = mod.chunk(*leaves, chunk_size=16, save_policy=policy)
        o.sum().backward()
        grads[policy] = [x.grad for x in leaves]
    for policy, g in grads.items():
        assert all(torch.equal(a, b) for a, b in zip(g, grads["recompute"])), policy


def test_no_gradient_needed_runs_no_backward_machinery(generator, device):
    rec, mod = recurrence("gdn"), module("gdn")
    tensors = [t.to(device) for t in sample(rec, Shape(1, 8, 1, 1, 16, 16), torch.float32, generator)]
    o, _ = mod.chunk(*tensors)
    assert o.grad_fn is None


def test_bad_save_policy(generator):
    rec, mod = recurrence("gdn"), module("gdn")
    tensors = sample(rec, Shape(1, 8, 1, 1, 16, 16), torch.float32, generator)
    with pytest.raises(mod.InputError, match="save_policy must be one of"):
        mod.chunk(*tensors, save_policy="everything")


def test_gradcheck_float64(device):
    """torch.autograd.gradcheck on a tiny float64 problem (kernels compute in fp64 for fp64 inputs)."""
    rec, mod = recurrence("gdn"), module("gdn")
    generator = torch.Generator().manual_seed(7)
    tensors = [t.double().to(device).requires_grad_() for t in sample(rec, Shape(1, 5, 1, 2, 16, 16), torch.float32, generator)]
    h0 = torch.randn(1, 2, 16, 16, generator=generator, dtype=torch.float64).to(device).requires_grad_()
    # fast mode: random projections of the Jacobian (the full one needs ~1000 interpreted calls)

    def fn(q, k, v, g, beta, h0):
        o, ht = mod.chunk(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=16, scale=0.25,
                          use_qk_l2norm_in_kernel=True)
        return o, ht

    assert torch.autograd.gradcheck(fn, (*tensors, h0), eps=1e-6, atol=1e-7, rtol=1e-5, fast_mode=True)


def test_check_reports_a_gradient_error_the_forward_hides(generator, device):
    """`lrdsl check` compares gradients too: right outputs with wrong gradients fail."""
    from types import SimpleNamespace

    from lrdsl.verification.check import check_module

    rec, mod = recurrence("deltanet"), module("deltanet")

    def chunk_with_wrong_gradient(*args, **kwargs):
        o, ht = mod.chunk(*args, **kwargs)
        return o + 0.5 * (o - o.detach()), ht  # the same values; gradients through o 1.5x too large

    shim = SimpleNamespace(chunk=chunk_with_wrong_gradient, recurrent=mod.recurrent, CHUNK_PLANS=mod.CHUNK_PLANS,
                           CHUNK_SIZES=mod.CHUNK_SIZES, largest_chunk_size=mod.largest_chunk_size)
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=generator))
    rows = check_module(shim, rec, Shape(1, 12, 1, 2, 8, 8), device=device, seed=seed, timed=False, plans=["split"], chunk_sizes=[64])
    by_kernel = {(row.kernel, row.case): row for row in rows}
    for case in ("dense+h0+l2norm", "varlen+h0"):
        assert by_kernel["recurrent", case].ok
        wrong = by_kernel["chunk[split,64]", case]
        assert wrong.out_error <= wrong.limit and wrong.state_error <= wrong.limit
        assert wrong.grad_error > 0.1 and not wrong.ok


@pytest.mark.parametrize("bounds", [None, [0, 3, 70, 100]], ids=["dense", "varlen"])
def test_backward_recomputes_at_its_own_chunk_size(bounds, generator, device, monkeypatch):
    """chunk_size left to lrdsl: the forward runs at FORWARD_CHUNK_SIZE, the backward (which
    recomputes every forward buffer it reads) at BACKWARD_CHUNK_SIZE; gradients still match."""
    mod = module("gdn")
    assert mod.BACKWARD_CHUNK_SIZE["input"] < mod.largest_chunk_size(16)
    sizes, backward = [], mod._chunk_backward
    monkeypatch.setattr(mod, "_chunk_backward", lambda c, *rest: sizes.append(c["BT"]) or backward(c, *rest))
    case = dict(shape=Shape(1, 100, 1, 2, 16, 16), h0=True, dht=True, bounds=bounds)
    assert_gradients(gradient_errors("gdn", case, generator, device), f"bounds={bounds}")
    assert sizes == [mod.BACKWARD_CHUNK_SIZE["input"]]


def test_kept_systems_are_narrowed_to_the_operand_dtype_after_the_forward_reads_them(generator, device, monkeypatch):
    """Where matmul operands are 16-bit (a GPU at precision="input"; here pretended, fp16), the
    kept T is converted after the forward's last reader (apply, which read the fp32 one): the
    backward receives it in that dtype and its gradients still match the oracle."""
    mod = module("gdn")
    monkeypatch.setattr(mod, "_operand_dtype", lambda c: torch.float16)
    kept_dtypes, backward = [], mod._chunk_backward
    record = lambda c, plan, policy, kept, *rest: kept_dtypes.append({n: t.dtype for n, t in kept.items()})
    monkeypatch.setattr(mod, "_chunk_backward", lambda *args: record(*args) or backward(*args))
    case = dict(shape=Shape(1, 70, 1, 2, 16, 16), h0=True, dht=True)
    assert_gradients(gradient_errors("gdn", case, generator, device, save_policy="save_solve"), "narrowed T")
    assert kept_dtypes == [{"T": torch.float16}]


class _RecordConversions(torch.utils._python_dispatch.TorchDispatchMode):
    """The dtypes every tensor conversion (`.to(dtype)`) made while active converted to."""

    def __init__(self):
        super().__init__()
        self.dtypes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ == "_to_copy":
            self.dtypes.append(out.dtype)
        return out


def test_the_narrowed_copy_is_written_by_its_last_reader_as_the_conversion_would_round_it(generator, device, monkeypatch):
    """apply, the kept T's last reader in the forward call, stores the narrowed copy as it loads
    each tile (no conversion of the whole buffer after it): the copy the backward receives is the
    fp32 T the forward solved, rounded to the operand dtype, element for element."""
    mod = module("gdn")
    kept, backward = [], mod._chunk_backward

    def record(c, plan, policy, saved, *rest):
        kept.append(saved["T"].clone())
        return backward(c, plan, policy, saved, *rest)

    monkeypatch.setattr(mod, "_chunk_backward", record)
    draw = lambda *size, sign=1: (sign * torch.rand(*size, generator=generator, dtype=torch.float64)).to(device, torch.float32)
    q, k = torch.randn(2, 1, 70, 1, 16, generator=generator, dtype=torch.float64).to(device, torch.float32)
    v = torch.randn(1, 70, 2, 16, generator=generator, dtype=torch.float64).to(device, torch.float32)
    g, beta = draw(1, 70, 2, sign=-1), draw(1, 70, 2)
    conversions = _RecordConversions()
    for operand in (None, torch.float16):  # the fp32 T, then its narrowed copy
        monkeypatch.setattr(mod, "_operand_dtype", lambda c, operand=operand: operand)
        leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta)]
        with conversions:
            o, _ = mod.chunk(*leaves, save_policy="save_solve", use_qk_l2norm_in_kernel=True)
        o.sum().backward()
    assert [t.dtype for t in kept] == [torch.float32, torch.float16]
    assert torch.float16 not in conversions.dtypes, "the forward converted a buffer to the operand dtype itself"
    assert torch.equal(kept[1], kept[0].to(torch.float16))


@pytest.mark.parametrize("name, bounds", [("gdn", None), ("gdn", [0, 3, 70, 100]), ("kda", [0, 45, 100]),
                                          ("rwkv7", None), ("deltanet", [0, 100])])
def test_backward_reads_the_forward_systems_at_its_own_chunk_size(name, bounds, generator, device, monkeypatch):
    """save_solve: the forward keeps its solved systems at its chunk size, the backward runs at a
    smaller one and reads each sub-chunk's diagonal block; gradients match the float64 oracle
    (sequences that end inside a forward chunk's first or second half, dense and packed)."""
    mod = module(name)
    calls, backward = [], mod._chunk_backward
    record = lambda c, plan, policy, kept, *rest: calls.append((c["BT"], {n: t.shape[-1] for n, t in kept.items()}))
    monkeypatch.setattr(mod, "_chunk_backward", lambda *args: record(*args) or backward(*args))
    forward_size = mod.FORWARD_CHUNK_SIZE["split", "input"]
    backward_size = mod.BACKWARD_CHUNK_SIZE["input"]
    if backward_size >= forward_size:
        backward_size = forward_size // 2  # the spec's backward already runs at the forward's size: pin a smaller one
        monkeypatch.setitem(mod.BACKWARD_CHUNK_SIZE, "input", backward_size)
    case = dict(shape=Shape(1, 100, 1, 2, 16, 16), h0=True, dht=True, bounds=bounds)
    assert_gradients(gradient_errors(name, case, generator, device, save_policy="save_solve"), f"{name} bounds={bounds}")
    assert calls == [(backward_size, {"T": forward_size})]


@pytest.mark.parametrize("policy", [None, "save", "save_prepare", "save_states"])
def test_backward_keeps_a_chunk_size_the_caller_gives(policy, generator, device, monkeypatch):
    """A chunk size the caller gives fixes the backward's, whatever the policy keeps."""
    mod = module("gdn")
    sizes, backward = [], mod._chunk_backward
    monkeypatch.setattr(mod, "_chunk_backward", lambda c, *rest: sizes.append(c["BT"]) or backward(c, *rest))
    case = dict(shape=Shape(1, 70, 1, 1, 16, 16), h0=True, dht=True)
    assert_gradients(gradient_errors("gdn", case, generator, device, chunk_size=64, save_policy=policy), str(policy))
    assert sizes == [64]


def _record_chunk_sizes(mod, monkeypatch):
    """[(who, chunk size)] of every forward launch (the backward's re-runs included; the output
    kernel's chunk size, where the kernels before it ran at a smaller one: plan rule 6) and
    backward call."""
    sizes, backward, launcher = [], mod._chunk_backward, mod._CHUNK_LAUNCHERS["split"]
    monkeypatch.setattr(mod, "_chunk_backward", lambda c, *rest: sizes.append(("backward", c["BT"])) or backward(c, *rest))
    monkeypatch.setitem(mod._CHUNK_LAUNCHERS, "split", lambda c, *a, **kw: sizes.append(
        ("forward", (kw.get("output_c") or c)["BT"])) or launcher(c, *a, **kw))
    return sizes


@pytest.mark.parametrize("name, policy", [("gdn", "save"), ("gdn", "save_prepare"), ("deltanet", "save"), ("simple_gla", "save")])
def test_training_forward_runs_at_the_backward_chunk_size(name, policy, generator, device, monkeypatch):
    """Under a policy whose kept buffers hold only at the chunk size they were made at (save and
    save_prepare), a call that needs gradients and gives no chunk_size runs its
    forward at BACKWARD_CHUNK_SIZE, so that the backward runs there too; gradients against the
    float64 oracle. A call without gradients keeps FORWARD_CHUNK_SIZE."""
    mod = module(name)
    forward_size, backward_size = mod.FORWARD_CHUNK_SIZE["split", "input"], mod.BACKWARD_CHUNK_SIZE["input"]
    if backward_size >= forward_size:
        backward_size = forward_size // 2  # pin a smaller backward size where the spec has none
        monkeypatch.setitem(mod.BACKWARD_CHUNK_SIZE, "input", backward_size)
    sizes = _record_chunk_sizes(mod, monkeypatch)
    case = dict(shape=Shape(1, 100, 1, 2, 16, 16), h0=True, dht=True)
    assert_gradients(gradient_errors(name, case, generator, device, save_policy=policy), f"{name} {policy}")
    assert sizes == [("forward", backward_size), ("backward", backward_size), ("forward", backward_size)]
    sizes.clear()
    tensors = [t.to(device) for t in sample(recurrence(name), case["shape"], torch.float32, generator)]
    with torch.no_grad():
        mod.chunk(*tensors, save_policy=policy)
    assert sizes == [("forward", forward_size)]


@pytest.mark.parametrize("on_host", [True, False], ids=["host-counted", "device-counted"])
def test_training_forward_counts_varlen_chunks_again_at_the_backward_size(on_host, generator, device, monkeypatch):
    """Packed sequences under save: chunk_indices counted on the host at the forward's
    default size are counted again, on the host, at the backward's (forward and backward run
    there); counted on the device they fix both to their size. Gradients against the oracle."""
    mod, rec = module("gdn"), recurrence("gdn")
    forward_size, backward_size = mod.FORWARD_CHUNK_SIZE["split", "input"], mod.BACKWARD_CHUNK_SIZE["input"]
    bounds = [0, 3, 70, 100]
    cu_cpu = torch.tensor(bounds, dtype=torch.int32)
    cu = cu_cpu.to(device)
    chunks = mod.prepare_varlen(cu, forward_size, cu_cpu if on_host else None)
    sizes = _record_chunk_sizes(mod, monkeypatch)
    tensors = sample(rec, Shape(1, 100, 1, 2, 16, 16), torch.float32, generator)
    d_o = torch.randn(1, 100, 2, 16, generator=generator, dtype=torch.float64)
    leaves = [t.clone().to(device).requires_grad_() for t in tensors]
    o, _ = mod.chunk(*leaves, cu_seqlens=cu, chunk_indices=chunks, use_qk_l2norm_in_kernel=True, save_policy="save")
    (o * d_o.to(device, o.dtype)).sum().backward()
    refs = [t.double().requires_grad_() for t in tensors]
    ref_o, _ = reference.run(rec, *refs, cu_seqlens=cu_cpu, use_qk_l2norm_in_kernel=True)
    (ref_o * d_o).sum().backward()
    assert relative_error(o, ref_o) <= GRAD_LIMIT
    assert_gradients({i: relative_error(a.grad, b.grad) for i, (a, b) in enumerate(zip(leaves, refs))}, f"on_host={on_host}")
    size = backward_size if on_host else forward_size
    assert sizes == [("forward", size), ("backward", size), ("forward", size)]


def _assert_saturated_input_keeps_its_gradient(rec, mod, kernel, shift, generator, device):
    """The gradient of input b (the fifth), shifted by `shift` into its formula's saturation,
    against the float64 oracle."""
    tensors = sample(rec, Shape(1, 20, 1, 2, 16, 16), torch.float32, generator)
    tensors[4] = tensors[4] + shift  # b
    leaves = [t.clone().to(device).requires_grad_() for t in tensors]
    options = {"chunk_size": 16} if kernel == "chunk" else {}
    o, _ = getattr(mod, kernel)(*leaves, use_qk_l2norm_in_kernel=True, **options)
    d_o = torch.randn(o.shape, generator=generator)
    got = torch.autograd.grad(o, leaves[4], d_o.to(device))[0]
    refs = [t.double().requires_grad_() for t in tensors]
    ref_o, _ = reference.run(rec, *refs, use_qk_l2norm_in_kernel=True)
    expected = torch.autograd.grad(ref_o, refs[4], d_o.double())[0]
    assert expected.abs().max() > 0 and relative_error(got, expected) <= 2e-3


@pytest.mark.parametrize("kernel", ["chunk", "recurrent"])
def test_saturated_sigmoid_keeps_its_gradient(kernel, generator, device):
    """beta = sigmoid(b) at b ~ 25: d beta / d b = exp(-25) ~ 1e-11. Written s (1 - s), the
    derivative cancelled to exactly 0 in float32 (d_b off by 100%); sigmoid(x) sigmoid(-x) keeps it."""
    rec, mod = recurrence("gdn_qwen35"), module("gdn_qwen35")
    _assert_saturated_input_keeps_its_gradient(rec, mod, kernel, 25.0, generator, device)


TANH_BETA_SPEC = """\
name = "tanh_beta"
[recurrence]
update = "delta"
gate = "scalar"
[inputs]
g = "token"
b = "token"
[formulas]
log_decay = "g"
beta = "0.5 + 0.5 * tanh(b)"
"""


@pytest.mark.parametrize("kernel", ["chunk", "recurrent"])
def test_saturated_tanh_keeps_its_gradient(kernel, tmp_path, generator, device):
    """beta = (1 + tanh(b)) / 2 at b ~ 10: d beta / d b = 2 exp(-2b) ~ 4e-9. Written 1 - tanh^2
    (sympy's derivative), it cancelled to 0 in float32 from b ~ 9 on (the oracle fuzzer found a
    low-rank vector 0.1 tanh(x + 8) whose gradient was 4 % off); 4 sigmoid(2b) sigmoid(-2b) keeps it."""
    import lrdsl

    path = tmp_path / "tanh_beta.toml"
    path.write_text(TANH_BETA_SPEC)
    rec = run_pipeline(load_spec(path), until="recurrence")["recurrence"]
    mod = lrdsl.load(path)
    _assert_saturated_input_keeps_its_gradient(rec, mod, kernel, 10.0, generator, device)
