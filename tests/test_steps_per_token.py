"""Several update steps per token (recurrence.steps_per_token; Gated DeltaProduct), against the
float64 oracle: chunk (every plan and chunk size forward, every save policy with gradients),
recurrent and its backward, varlen with empty and uneven sequences, GVA, initial and final states,
the state pool (prefill, decode, verify and commit of draft tokens); the oracle itself against the
equations written out here; the spec key's errors and the call's shape errors.

Two specs: the shipped gated_deltaproduct (2 steps, gate g, beta read as given) and THREE_STEPS,
written here, with 3 steps and gdn_qwen35's in-kernel activations (a gate formula over a per-token
and two per-head inputs, beta = sigmoid(b)).
"""
from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

import lrdsl
from lrdsl import reference
from lrdsl.errors import InputError, SpecError
from lrdsl.passes.pipeline import run_pipeline
from lrdsl.spec import load_spec, parse_spec
from lrdsl.verification.workloads import TOLERANCE, Shape, make_inputs, relative_error

from helpers import module, recurrence, rows_per_token
from oracle_checks import Call, assert_errors, oracle_errors

LIMIT = TOLERANCE[torch.float32]

THREE_STEPS = """\
name = "gdn_qwen35_three_steps"
[recurrence]
update = "delta"
gate = "scalar"
steps_per_token = 3
[inputs]
a = "token"
b = "token"
A_log = "head"
dt_bias = "head"
[formulas]
log_decay = "-exp(A_log) * softplus(a + dt_bias)"
beta = "sigmoid(b)"
"""


@pytest.fixture(scope="module")
def specs(tmp_path_factory):
    """name -> (recurrence, module) of both specs."""
    path = tmp_path_factory.mktemp("steps") / "three_steps.toml"
    path.write_text(THREE_STEPS)
    three = run_pipeline(load_spec(path), until="recurrence")["recurrence"]
    return {"gated_deltaproduct": (recurrence("gated_deltaproduct"), module("gated_deltaproduct")),
            "three_steps": (three, lrdsl.load(path))}


SPECS = ("gated_deltaproduct", "three_steps")
# GVA (2 value heads per key head), K and V not powers of two; packed sequences of 5, 0, 1 and 17
# tokens (10, 0, 2 and 34 rows with two steps, 51 with three: every chunk size's boundaries)
SHAPE = Shape(1, 23, 1, 2, 12, 10)
BOUNDS = (0, 5, 5, 6, 23)


def test_shipped_spec_declares_its_layout():
    rec = recurrence("gated_deltaproduct")
    assert rec.steps_per_token == 2
    assert "k[B,T*2,H,K], v[B,T*2,HV,V], g[B,T,HV], beta[B,T*2,HV]" in rec.describe()


# -- the oracle ---------------------------------------------------------------------------------------

def token_by_token(q, k, v, g, beta, n, h0, bounds, scale):
    """The equations, written out: per token one decay, n delta-rule steps, one read-out (GVA: value
    head h reads key head h // (HV / H))."""
    HV = v.shape[2]
    group = HV // q.shape[2]
    outputs, finals = [], []
    for index, (bos, eos) in enumerate(zip(bounds, bounds[1:])):
        S = h0[index].clone()  # [HV, K, V]
        for t in range(bos, eos):
            for h in range(HV):
                S[h] = torch.exp(g[0, t, h]) * S[h]
                for j in range(n):
                    kj, vj = k[0, t * n + j, h // group], v[0, t * n + j, h]
                    S[h] = S[h] + beta[0, t * n + j, h] * torch.outer(kj, vj - S[h].T @ kj)
            outputs.append(torch.stack([scale * S[h].T @ q[0, t, h // group] for h in range(HV)]))
        finals.append(S)
    return torch.stack(outputs)[None], torch.stack(finals)


@pytest.mark.parametrize("n", [2, 3])
def test_oracle_is_the_token_by_token_recurrence(n, generator):
    text = f'name = "gdp"\n[recurrence]\nupdate = "delta"\ngate = "scalar"\nsteps_per_token = {n}\n' \
           '[inputs]\ng = "token"\nbeta = "token"\n[formulas]\nlog_decay = "g"\nbeta = "beta"\n'
    rec = run_pipeline(parse_spec(text), until="recurrence")["recurrence"]
    H, HV, K, V, T = 1, 2, 5, 4, 9
    bounds = [0, 4, 4, 9]
    q = torch.randn(1, T, H, K, generator=generator, dtype=torch.float64)
    k = F.normalize(torch.randn(1, T * n, H, K, generator=generator, dtype=torch.float64), dim=-1)
    v = torch.randn(1, T * n, HV, V, generator=generator, dtype=torch.float64)
    g = -torch.rand(1, T, HV, generator=generator, dtype=torch.float64)
    beta = torch.rand(1, T * n, HV, generator=generator, dtype=torch.float64)
    h0 = torch.randn(3, HV, K, V, generator=generator, dtype=torch.float64)
    o, ht = reference.run(rec, q, k, v, g, beta, initial_state=h0, output_final_state=True,
                          cu_seqlens=torch.tensor(bounds), scale=0.3)
    ref_o, ref_ht = token_by_token(q, k, v, g, beta, n, h0, bounds, 0.3)
    torch.testing.assert_close(o, ref_o, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ht, ref_ht, rtol=1e-12, atol=1e-12)


# -- the kernels against the oracle --------------------------------------------------------------------

@pytest.mark.parametrize("name", SPECS)
def test_chunk_forward_every_plan_and_chunk_size(name, specs, generator, device):
    rec, mod = specs[name]
    call = Call(SHAPE, bounds=BOUNDS, h0=True, l2norm=name == "three_steps", scale=0.4)
    tensors = make_inputs(rec, SHAPE, generator=generator)
    for plan in mod.CHUNK_PLANS:
        for size in mod.CHUNK_SIZES:
            errors = oracle_errors(rec, mod, call, generator, "chunk", gradients=False, tensors=tensors, device=device,
                                   plan=plan, chunk_size=size)
            assert_errors(errors, LIMIT, f"{name} chunk[{plan}, {size}]")
    errors = oracle_errors(rec, mod, call, generator, "recurrent", gradients=False, tensors=tensors, device=device)
    assert_errors(errors, LIMIT, f"{name} recurrent")


# each save policy once, over the plans and chunk sizes; dense batches and packed sequences
GRADIENT_CASES = [
    ("chunk", dict(plan="split", chunk_size=16, save_policy="save"), True),
    ("chunk", dict(plan="fused", chunk_size=32, save_policy="save_states"), False),
    ("chunk", dict(plan="split", chunk_size=64, save_policy="save_solve"), True),
    ("chunk", dict(plan="fused", chunk_size=16, save_policy="recompute"), False),
    ("chunk", dict(plan="split", chunk_size=32, save_policy="save_prepare"), True),
    ("chunk", dict(), True),  # lrdsl's chunk sizes: the forward at the backward's
    ("recurrent", dict(), True),
]


@pytest.mark.parametrize("name", SPECS)
def test_gradients(name, specs, generator, device):
    rec, mod = specs[name]
    found = {}
    for index, (kernel, options, packed) in enumerate(GRADIENT_CASES):
        shape = SHAPE if packed else Shape(2, 11, 2, 4, 8, 8)
        call = Call(shape, bounds=BOUNDS if packed else None, h0=True, dht=index % 2 == 0, l2norm=index % 3 == 0)
        errors = oracle_errors(rec, mod, call, generator, kernel, device=device, **options)
        assert_errors(errors, LIMIT, f"{name} {kernel} {options}")
        found[f"{kernel} {options}"] = max(errors.values())
    print(name, found)


# -- serving ---------------------------------------------------------------------------------------

def pool_oracle(rec, rows, tensors, slots, bounds=None, count=None):
    """The oracle over each live slot's tokens (the first `count[n]` of them, else all) from its
    float64 pool row, which it advances; returns o (zeros for padding slots and dropped tokens)."""
    T = tensors[0].shape[1]
    o = torch.zeros(tensors[0].shape[0], T, *tensors[2].shape[2:], dtype=torch.float64)
    for n, row in enumerate(slots):
        if row < 0:
            continue
        start, stop = (0, T) if bounds is None else (bounds[n], bounds[n + 1])
        stop = stop if count is None else start + count[n]
        batch = slice(None) if bounds is not None else slice(n, n + 1)
        picked = [x if not r else x[batch, start * r:stop * r] for x, r in zip(tensors, rows_per_token(rec))]
        o_n, final = reference.run(rec, *picked, initial_state=rows[row][None], output_final_state=True)
        o[0 if bounds is not None else n, start:stop] = o_n[0]
        rows[row] = final[0]
    return o


@pytest.mark.parametrize("name", SPECS)
def test_pool_prefill_decode_verify_commit(name, specs, generator, device):
    """A chunk prefill of packed sequences into pool rows (a padding slot among them), a decode
    token (one token: all its steps) into a caller's out= buffer, then 3 draft tokens verified and
    2, 0 and 3 of them committed (commit counts tokens)."""
    rec, mod = specs[name]
    H, HV, K, V = 1, 2, 12, 10
    P = 5
    pool = torch.randn(P, HV, K, V, generator=generator) * 0.5
    rows = pool.double().clone()
    slots = [3, -1, 0, 4]
    bounds = [0, 6, 8, 8, 13]

    def index(values):
        return torch.tensor(values, device=device)

    def on(tensors):
        return [t.to(device) for t in tensors]

    pool = pool.to(device)
    tensors = make_inputs(rec, Shape(1, bounds[-1], H, HV, K, V), generator=generator)
    with torch.no_grad():
        o, _ = mod.chunk(*on(tensors), cu_seqlens=index(bounds), state_pool=pool, state_indices=index(slots),
                         chunk_size=16)
    assert relative_error(o, pool_oracle(rec, rows, tensors, slots, bounds)) <= LIMIT
    assert relative_error(pool[[0, 3, 4]], rows[[0, 3, 4]]) <= LIMIT

    live = [4, 0, 3]
    tensors = make_inputs(rec, Shape(3, 1, H, HV, K, V), generator=generator)
    out = torch.empty(3, 1, HV, V, device=device)
    with torch.no_grad():
        o, _ = mod.recurrent(*on(tensors), state_pool=pool, state_indices=index(live), out=out)
    assert o is out and relative_error(o, pool_oracle(rec, rows, tensors, live)) <= LIMIT
    assert relative_error(pool[live], rows[live]) <= LIMIT

    tensors = make_inputs(rec, Shape(3, 3, H, HV, K, V), generator=generator)
    before = pool.clone()
    o, draft = mod.verify(*on(tensors), state_pool=pool, state_indices=index(live))
    assert torch.equal(pool, before), "verify only reads the pool"
    assert relative_error(o, pool_oracle(rec, rows.clone(), tensors, live)) <= LIMIT
    accepted = [2, 0, 3]
    mod.commit(draft, index(accepted))
    pool_oracle(rec, rows, tensors, live, count=accepted)
    assert relative_error(pool[live], rows[live]) <= LIMIT
    assert torch.equal(pool[0], before[0]), "no accepted token: the row keeps its state"
    with pytest.raises(InputError, match=r"num_accepted\[1\] = 4 is outside 0 \.\. 3, sequence 1's draft tokens"):
        mod.commit(draft, index([1, 4, 0]))


# -- the spec key -----------------------------------------------------------------------------------

def spec_text(steps="2", gate="scalar", log_decay="-softplus(a)", beta="sigmoid(b)"):
    return (f'name = "x"\n[recurrence]\nupdate = "delta"\ngate = "{gate}"\nsteps_per_token = {steps}\n'
            f'[inputs]\na = "{"head" if gate == "constant" else "token"}"\nb = "token"\n'
            f'[formulas]\nlog_decay = "{log_decay}"\nbeta = "{beta}"\n')


@pytest.mark.parametrize("text, where, message", [
    (spec_text(steps="2.5"), "5: recurrence.steps_per_token", "expected an integer >= 1, got a float"),
    (spec_text(steps='"2"'), "5: recurrence.steps_per_token", "expected an integer >= 1, got str"),
    (spec_text(steps="true"), "5: recurrence.steps_per_token", "expected an integer >= 1, got a boolean"),
    (spec_text(steps="0"), "5: recurrence.steps_per_token", "expected an integer >= 1, got 0"),
    (spec_text(steps="-2"), "5: recurrence.steps_per_token", "expected an integer >= 1, got -2"),
    (spec_text(beta="sigmoid(a + b)"), "7: inputs.a",
     "read by formulas.log_decay (one row per token) and formulas.beta (one row per step, steps_per_token = 2)"),
    (spec_text(gate="constant", log_decay="-softplus(a)"), "5: recurrence.steps_per_token",
     "a constant gate decays at every step"),
])
def test_spec_errors_are_one_line(text, where, message):
    with pytest.raises(SpecError) as info:
        run_pipeline(parse_spec(text, "s.toml"), until="recurrence")
    assert "\n" not in str(info.value)
    assert str(info.value).startswith(f"s.toml:{where}: ") and message in str(info.value), str(info.value)


def test_one_input_may_feed_gate_and_beta_with_one_step():
    rec = run_pipeline(parse_spec(spec_text(steps="1", beta="sigmoid(a + b)")), until="recurrence")["recurrence"]
    assert rec.steps_per_token == 1


def test_any_spec_takes_steps_without_a_gate(generator, device, tmp_path):
    """A DeltaNet with 2 steps per token (no gate: nothing confined to a token's first step)."""
    path = tmp_path / "deltaproduct.toml"
    path.write_text('name = "deltaproduct"\n[recurrence]\nupdate = "delta"\ngate = "none"\nsteps_per_token = 2\n'
                    '[inputs]\nbeta = "token"\n[formulas]\nbeta = "beta"\n')
    rec = run_pipeline(load_spec(path), until="recurrence")["recurrence"]
    call = Call(Shape(2, 9, 1, 2, 8, 8), h0=True, dht=True)
    assert_errors(oracle_errors(rec, lrdsl.load(path), call, generator, "chunk", device=device, chunk_size=16), LIMIT,
                  "deltaproduct chunk")


def test_steps_take_a_written_value_per_value_channel(generator, device, tmp_path):
    """Two steps per token with an input of one row of V per step (GDN-2's w, written value w * v):
    before, every call died in the host code (KeyError: 'V', the row layout knew no V); the
    spec fuzzer's GPU pass drew it. recurrent and chunk, with gradients, against the oracle."""
    path = tmp_path / "written.toml"
    path.write_text('name = "written"\n[recurrence]\nupdate = "delta"\ngate = "scalar"\nsteps_per_token = 2\n'
                    '[inputs]\nw = "token_value"\nbeta = "token"\ng = "token"\n'
                    '[formulas]\nlog_decay = "g"\nbeta = "beta"\nwrite_value = "w * v"\n')
    rec = run_pipeline(load_spec(path), until="recurrence")["recurrence"]
    mod = lrdsl.load(path)
    call = Call(Shape(2, 9, 1, 2, 8, 6), h0=True, dht=True)
    assert_errors(oracle_errors(rec, mod, call, generator, "recurrent", device=device), LIMIT, "written recurrent")
    assert_errors(oracle_errors(rec, mod, call, generator, "chunk", device=device, chunk_size=16), LIMIT,
                  "written chunk")


# -- the call's shapes -------------------------------------------------------------------------------

def test_call_shape_errors_name_the_tensor_and_its_shape(generator, device):
    rec, mod = recurrence("gated_deltaproduct"), module("gated_deltaproduct")
    q, k, v, g, beta = [t.to(device) for t in make_inputs(rec, Shape(2, 3, 1, 2, 8, 8), generator=generator)]
    cases = [
        ((q, k[:, :3], v, g, beta), {}, "k must be [B, T*2, H, K] = [2, 6, 1, 8] (2 steps per token of q's T=3), got [2, 3, 1, 8]"),
        ((q, k, v[:, :5], g, beta), {}, "v must be [B, T*2, HV, V] with B=2, T*2=6 (2 steps per token of q's T=3), got [2, 5, 2, 8]"),
        ((q, k, v, g, beta[:, :3]), {}, "beta must be [B, T*2, HV] = [2, 6, 2], got [2, 3, 2]"),
        ((q, k, v, g.repeat(1, 2, 1), beta), {}, "g must be [B, T, HV] = [2, 3, 2], got [2, 6, 2]"),
        ((q, k, v, g, beta), dict(out=torch.empty(2, 6, 2, 8, device=device)),
         "out must be a contiguous torch.float32 tensor [2, 3, 2, 8]"),
    ]
    for tensors, options, message in cases:
        for fn in ("chunk", "recurrent"):
            if "out" in options and fn == "chunk":
                continue
            with pytest.raises(InputError) as info:
                getattr(mod, fn)(*tensors, **options)
            text = str(info.value)
            assert "\n" not in text and text.startswith(f"gated_deltaproduct.{fn}: ") and message in text, text


@pytest.mark.parametrize("host_copy", [False, True])
def test_prepared_chunks_of_token_bounds(host_copy, generator, device):
    """prepare_varlen takes token bounds (and their host copy) and counts the chunks of the rows;
    chunks of another cu_seqlens are refused in one line."""
    rec, mod = recurrence("gated_deltaproduct"), module("gated_deltaproduct")
    bounds = (0, 7, 7, 19)
    cu = torch.tensor(bounds, dtype=torch.int32)
    chunks = mod.prepare_varlen(cu.to(device), 16, cu if host_copy else None)
    assert chunks.num_tokens == 2 * bounds[-1]
    call = Call(Shape(1, bounds[-1], 1, 2, 8, 8), bounds=bounds, h0=True, dht=True)

    def layout(t):  # the call's cu_seqlens must be the very tensor the chunks were prepared from
        return chunks.token_cu_seqlens if t.dtype == torch.int32 else t

    errors = oracle_errors(rec, mod, call, generator, "chunk", device=device, layout=layout, chunk_size=16,
                           chunk_indices=chunks)
    assert_errors(errors, LIMIT, f"chunk with chunk_indices (host copy: {host_copy})")
    tensors = [t.to(device) for t in make_inputs(rec, call.shape, generator=generator)]
    with pytest.raises(InputError, match=re.escape("chunk_indices were prepared from another cu_seqlens")):
        mod.chunk(*tensors, cu_seqlens=cu.clone().to(device), chunk_size=16, chunk_indices=chunks)
