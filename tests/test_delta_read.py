"""The delta rule's read vector and written value (formulas.delta_read, formulas.write_value):
the two shipped specs that use them, against the float64 oracle, and the oracle against the
recurrences' equations written out here token by token, without lrdsl.

    comba  S' = exp(g_t) S_{t-1}         u_t = beta_t (v_t - S'^T p_t)        S_t = S' + k_t u_t^T
    gdn2   S' = Diag(exp(g_t)) S_{t-1}   u_t = w_t * v_t - S'^T (b_t * k_t)   S_t = S' + k_t u_t^T
    both   o_t = scale * S_t^T q_t

The shipped-spec lists elsewhere take them too (recurrent shapes and extremes, serving, segmented
scans, the proofs); here: the chunk kernels in every plan, chunk size and save policy (outputs,
final states and every gradient), the recurrent kernel's gradients, gate extremes, fp16, and
non-finite values in the inputs only the new formulas read.
"""
from __future__ import annotations

import math

import pytest
import torch

from lrdsl import reference
from lrdsl.verification.workloads import TOLERANCE, Shape, make_inputs, relative_error

from helpers import SHAPE_CASES, module, recurrence, run_case
from oracle_checks import Call, assert_errors, causality_errors, oracle_errors

NEW_SPECS = ("comba", "gdn2")
LIMIT = TOLERANCE[torch.float32]
GRAD_LIMIT = 3e-3  # tests/test_backward.py's


# -- the equations, token by token ----------------------------------------------------------------

def _by_hand(name, q, k, v, extras, scale, h0, bounds):
    """float64, one value head and token at a time: value head h reads key head h // (HV / H)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    group = HV // H
    o = torch.zeros(B, T, HV, V, dtype=torch.float64)
    sequences = [(b, 0, T) for b in range(B)] if bounds is None else [
        (0, bounds[n], bounds[n + 1]) for n in range(len(bounds) - 1)]
    finals = []
    for n, (b, bos, eos) in enumerate(sequences):
        heads = []
        for hv in range(HV):
            S = h0[n, hv].double().clone()
            for t in range(bos, eos):
                q_t, k_t, v_t = q[b, t, hv // group].double(), k[b, t, hv // group].double(), v[b, t, hv].double()
                if name == "comba":
                    p, beta, g = (x[b, t, hv].double() for x in extras)
                    S = math.exp(g) * S
                    u = beta * (v_t - S.T @ p)
                else:  # gdn2
                    g, erase, write = (x[b, t, hv].double() for x in extras)
                    S = torch.exp(g)[:, None] * S
                    u = write * v_t - S.T @ (erase * k_t)
                S = S + torch.outer(k_t, u)
                o[b, t, hv] = scale * (S.T @ q_t)
            heads.append(S)
        finals.append(torch.stack(heads))
    return o, torch.stack(finals)


@pytest.mark.parametrize("name", NEW_SPECS)
def test_the_oracle_is_the_equations(name, generator):
    """lrdsl's oracle (from the spec) equals the equations above: GVA, packed sequences with an
    empty one, initial states, a scale."""
    rec = recurrence(name)
    shape, bounds, scale = Shape(1, 23, 2, 4, 12, 10), [0, 0, 5, 23], 0.7
    tensors = make_inputs(rec, shape, dtype=torch.float64, generator=generator)
    h0 = torch.randn(3, shape.HV, shape.K, shape.V, generator=generator, dtype=torch.float64)
    o, ht = reference.run(rec, *tensors, scale=scale, initial_state=h0, output_final_state=True,
                          cu_seqlens=torch.tensor(bounds))
    want_o, want_ht = _by_hand(name, *tensors[:3], tensors[3:], scale, h0, bounds)
    assert relative_error(o, want_o) < 1e-12 and relative_error(ht, want_ht) < 1e-12


# -- the kernels against the oracle ---------------------------------------------------------------

# every plan at every chunk size, and every save policy
GRADIENT_OPTIONS = [("fused", "recompute", 16), ("split", "save_solve", 32), ("fused", "save_prepare", 64),
                    ("split", "save", 64), ("fused", "save_states", 32), ("split", "recompute", 16)]


@pytest.mark.parametrize("plan, save_policy, chunk_size", GRADIENT_OPTIONS)
@pytest.mark.parametrize("name", NEW_SPECS)
def test_chunk_every_plan_size_and_policy(name, plan, save_policy, chunk_size, generator, device):
    """The outputs, the final states and every gradient (q, k, v, each input, the initial state),
    a gradient into the final state too: packed sequences (an empty one, one of one token), GVA 2."""
    rec, mod = recurrence(name), module(name)
    call = Call(Shape(1, 36, 1, 2, 16, 16), bounds=(0, 0, 1, 20, 20, 36), h0=True, dht=True)
    errors = oracle_errors(rec, mod, call, generator, "chunk", device=device, plan=plan, save_policy=save_policy,
                           chunk_size=chunk_size)
    assert set(errors) == {"o", "ht", "d_q", "d_k", "d_v", "d_h0"} | {f"d_{i.name}" for i in rec.inputs}
    assert_errors(errors, GRAD_LIMIT, f"{name} {plan}/{save_policy}/{chunk_size}")


@pytest.mark.parametrize("name", NEW_SPECS)
def test_recurrent_gradients(name, generator, device):
    """The recurrent kernel's outputs and gradients (its backward is the chunked one): GVA 3, two
    sequences, the in-kernel L2 norm of q and k (the read vector b * k reads the normalised k)."""
    rec, mod = recurrence(name), module(name)
    call = Call(Shape(2, 11, 1, 3, 12, 16), h0=True, dht=True, l2norm=True, scale=0.3)
    assert_errors(oracle_errors(rec, mod, call, generator, "recurrent", device=device), GRAD_LIMIT, f"{name} recurrent")


@pytest.mark.parametrize("gate", [-30.0, "half"])
@pytest.mark.parametrize("name", NEW_SPECS)
def test_chunk_gate_extremes(name, gate, generator, device):
    """g = -30 (everything forgotten at once) and half -30 / half 0, in 64-row chunks and a tail."""
    case = dict(shape=Shape(1, 70, 1, 2, 16, 16), dtype=torch.float32, h0=True)
    run_case(module(name), recurrence(name), "chunk", case, generator, device, gate=gate, chunk_size=64)


@pytest.mark.parametrize("name", NEW_SPECS)
def test_chunk_fp16(name, generator, device):
    run_case(module(name), recurrence(name), "chunk", SHAPE_CASES["odd_T_gva3_fp16"], generator, device, chunk_size=16)


@pytest.mark.parametrize("name, which", [("comba", "p"), ("gdn2", "w")])
def test_a_nonfinite_read_vector_or_written_value_reaches_only_later_rows(name, which, generator):
    """A NaN at token 35 in an input only the read vector or the written value reads: the kernels'
    non-finite output rows and states are the oracle's, the others match it (V = 40: three value
    blocks)."""
    rec, mod = recurrence(name), module(name)
    shape = Shape(2, 40, 1, 1, 16, 40)
    tensors = make_inputs(rec, shape, generator=generator)
    names = ["q", "k", "v"] + [i.name for i in rec.inputs]
    x = tensors[names.index(which)].clone()
    x[(0, 35) + tuple(int(torch.randint(0, n, (1,), generator=generator)) for n in x.shape[2:])] = math.nan
    tensors[names.index(which)] = x
    h0 = torch.randn(2, shape.HV, shape.K, shape.V, generator=generator)
    call = Call(shape)
    assert_errors(causality_errors(rec, mod, call, tensors, "recurrent", h0=h0), LIMIT, f"{name} recurrent")
    for size in (16, 64):
        errors = causality_errors(rec, mod, call, tensors, "chunk", h0=h0, chunk_size=size)
        assert_errors(errors, LIMIT, f"{name} chunk[{size}] with {which} = NaN at token 35")
