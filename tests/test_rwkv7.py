"""rwkv7, the diagonal-plus-low-rank update, through its generated kernels against the float64
oracle (CPU interpreter): the chunk kernels forward and backward, the differentiable recurrent
kernel, at strong (w = -30 per step) and zero decay, with initial states, varlen with empty
sequences, GVA; a and b are never L2-normalised; the delta rule written as a dplr spec runs
through the same kernels to kda's numbers.

Its kernels are the slowest of the shipped specs on the interpreter, so rwkv7 is not among the
core specs every shape case runs on: these few cases cover what its own passes add (the two-decay
products, the low-rank system, its backward) at tiny shapes, each case one forward and one backward.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import lrdsl
from lrdsl import reference
from lrdsl.passes.pipeline import run_pipeline
from lrdsl.spec import load_spec
from lrdsl.verification.workloads import TOLERANCE, Shape, relative_error

from helpers import assert_close, module, recurrence, sample
from test_reference import KDA_AS_DPLR  # the gated delta rule written as a dplr spec

GRAD_LIMIT = 3e-3
NAME = "rwkv7"


def strong_and_zero_steps(w: torch.Tensor) -> torch.Tensor:
    """w with whole steps forced: every third token's decay -30 per key channel (the state is
    forgotten at once), every fourth's 0 (nothing decays); the others keep their draw."""
    w = w.clone()
    w[:, 1::3] = -30.0
    w[:, 2::4] = 0.0
    return w


def errors_against_oracle(what, kernel, tensors, generator, device, bounds=None, scale=None, l2norm=False, spec=None,
                          **options):
    """Relative errors of o, the final state and every gradient, the initial state's included
    (loss <o, dO> + <ht, dht>), of `mod.<kernel>` against autograd through the float64 oracle.
    spec: (recurrence, module) of another dplr spec with inputs w, a, b (default rwkv7's)."""
    rec, mod = spec or (recurrence(NAME), module(NAME))
    B, T, HV, V = tensors[2].shape
    K = tensors[0].shape[-1]
    N = len(bounds) - 1 if bounds else B
    cu = torch.tensor(bounds, dtype=torch.int32) if bounds else None
    state0 = torch.randn(N, HV, K, V, generator=generator)
    d_o = torch.randn(B, T, HV, V, generator=generator)
    d_final = torch.randn(N, HV, K, V, generator=generator)
    shared = dict(scale=scale, output_final_state=True, use_qk_l2norm_in_kernel=l2norm)

    leaves = [t.detach().clone().to(device).requires_grad_() for t in tensors]
    h0_leaf = state0.clone().to(device).requires_grad_()
    o, ht = getattr(mod, kernel)(*leaves, initial_state=h0_leaf, cu_seqlens=cu.to(device) if cu is not None else None,
                                 **shared, **options)
    ((o * d_o.to(device)).sum() + (ht * d_final.to(device)).sum()).backward()

    refs = [t.detach().double().requires_grad_() for t in tensors]
    h0_ref = state0.double().requires_grad_()
    ref_o, ref_ht = reference.run(rec, *refs, initial_state=h0_ref, cu_seqlens=cu, **shared)
    ((ref_o * d_o.double()).sum() + (ref_ht * d_final.double()).sum()).backward()

    errors = {"o": relative_error(o, ref_o), "ht": relative_error(ht, ref_ht)}
    for name, leaf, ref in zip(["q", "k", "v", "w", "a", "b"], leaves, refs):
        assert leaf.grad.shape == leaf.shape and leaf.grad.dtype == leaf.dtype, name
        errors[f"d{name}"] = relative_error(leaf.grad, ref.grad)
    errors["dh0"] = relative_error(h0_leaf.grad, h0_ref.grad)
    print(f"{what}: " + ", ".join(f"{k} {e:.2e}" for k, e in errors.items()))
    return errors


def assert_within(errors: dict, what: str):
    limits = {name: TOLERANCE[torch.float32] if name in ("o", "ht") else GRAD_LIMIT for name in errors}
    bad = {name: e for name, e in errors.items() if not e <= limits[name]}
    assert not bad, f"{what}: errors above the limits (fp32 {TOLERANCE[torch.float32]}, gradients {GRAD_LIMIT}): {bad}"


# GVA and varlen with an empty and a one-token sequence at whole steps of -30 and of 0; the
# module's longest chunk (32, where the decay split's widest level runs) at -30 or 0 per key
# channel at random, with a scale, and at zero decay throughout with the in-kernel L2 norm of q, k
# (in the fused plan; the others in the default, split).
CHUNK_CASES = {
    "varlen_gva2_strong_zero_steps_C16": dict(shape=Shape(1, 45, 1, 2, 16, 16), gate="steps", chunk_size=16,
                                              bounds=[0, 0, 1, 20, 20, 45]),
    "gva1_per_channel_half_scale_C32": dict(shape=Shape(1, 40, 2, 2, 16, 24), gate="half", chunk_size=32, scale=0.3),
    "zero_decay_l2norm_fused_C32": dict(shape=Shape(2, 36, 1, 1, 16, 16), gate=0.0, chunk_size=32, l2norm=True,
                                        plan="fused"),
}


def case_inputs(shape: Shape, gate, generator):
    rec = recurrence(NAME)
    if gate == "steps":
        tensors = sample(rec, shape, torch.float32, generator)
        tensors[3] = strong_and_zero_steps(tensors[3])
        return tensors
    return sample(rec, shape, torch.float32, generator, gate=gate)


@pytest.mark.parametrize("case", sorted(CHUNK_CASES))
def test_chunk_forward_and_gradients(case, generator, device):
    options = dict(CHUNK_CASES[case])
    tensors = case_inputs(options.pop("shape"), options.pop("gate"), generator)
    errors = errors_against_oracle(f"rwkv7.chunk {case}", "chunk", tensors, generator, device, **options)
    assert_within(errors, f"rwkv7.chunk {case}")


def test_recurrent_forward_and_gradients(generator, device):
    """The recurrent kernel forward; its backward is the chunked one."""
    tensors = case_inputs(Shape(1, 30, 1, 2, 16, 16), "steps", generator)
    errors = errors_against_oracle("rwkv7.recurrent", "recurrent", tensors, generator, device,
                                   bounds=[0, 13, 13, 14, 30])
    assert_within(errors, "rwkv7.recurrent")


def test_split_prefill_and_decode_equal_one_prefill(generator, device):
    """chunk(T1), one recurrent step, then chunk of the rest, each from the state before: the
    same outputs and final state as one chunk over all T tokens."""
    mod = module(NAME)
    T1, T = 13, 30
    tensors = [t.to(device) for t in case_inputs(Shape(1, T, 1, 2, 16, 16), "steps", generator)]
    h0 = torch.randn(1, 2, 16, 16, generator=generator).to(device)
    o_all, h_all = mod.chunk(*tensors, initial_state=h0, output_final_state=True, chunk_size=16)
    parts, state = [], h0
    for kernel, span in (("chunk", slice(0, T1)), ("recurrent", slice(T1, T1 + 1)), ("chunk", slice(T1 + 1, T))):
        options = {"chunk_size": 16} if kernel == "chunk" else {}
        o, state = getattr(mod, kernel)(*[t[:, span] for t in tensors], initial_state=state, output_final_state=True,
                                        **options)
        parts.append(o)
    assert relative_error(torch.cat(parts, 1), o_all) < 1e-5 and relative_error(state, h_all) < 1e-5


@pytest.mark.parametrize("kernel", ["chunk", "recurrent"])
def test_l2norm_normalises_q_and_k_only(kernel, generator, device):
    """use_qk_l2norm_in_kernel normalises q and k, never the low-rank vectors: with |b| = 3 and
    |a| = eta / 3 (the same contraction I + b a^T as unit vectors) the kernels agree with the
    oracle, which leaves a and b as given, and not with a and b normalised."""
    rec, mod = recurrence(NAME), module(NAME)
    q, k, v, w, a, b = sample(rec, Shape(1, 20, 1, 2, 16, 16), torch.float32, generator)
    a, b = a / 3, b * 3
    kwargs = dict(output_final_state=True, use_qk_l2norm_in_kernel=True)
    o, ht = getattr(mod, kernel)(*[t.to(device) for t in (q, k, v, w, a, b)], **kwargs,
                                 **({"chunk_size": 16} if kernel == "chunk" else {}))
    ref_o, ref_ht = reference.run(rec, q, k, v, w, a, b, **kwargs)
    assert_close(o, ref_o, torch.float32, f"rwkv7.{kernel} o")
    assert_close(ht, ref_ht, torch.float32, f"rwkv7.{kernel} final state")
    normalised_o, _ = reference.run(rec, q, k, v, w, F.normalize(a, dim=-1), F.normalize(b, dim=-1), **kwargs)
    assert relative_error(normalised_o, ref_o) > 10 * TOLERANCE[torch.float32]


def test_kda_through_the_dplr_kernels(tmp_path, generator, device):
    """kda written as a dplr spec runs through the dplr chunk kernels to kda's oracle, forward and
    every gradient (the key's gradient is the sum of its two inputs')."""
    path = tmp_path / "kda_as_dplr.toml"
    path.write_text(KDA_AS_DPLR)
    mod, kda = lrdsl.load(path), recurrence("kda")
    q, k, v, g, beta = sample(kda, Shape(1, 37, 1, 2, 16, 16), torch.float32, generator)
    h0 = torch.randn(1, 2, 16, 16, generator=generator)
    d_o = torch.randn(1, 37, 2, 16, generator=generator)

    leaves = [t.clone().to(device).requires_grad_() for t in (q, k, v, g, beta)]
    keys = leaves[1].repeat_interleave(2, dim=2)  # per value head, as a token_key input
    o, ht = mod.chunk(*leaves, keys, initial_state=h0.to(device), output_final_state=True, chunk_size=16)
    (o * d_o.to(device)).sum().backward()
    refs = [t.double().requires_grad_() for t in (q, k, v, g, beta)]
    ref_o, ref_ht = reference.run(kda, *refs, initial_state=h0, output_final_state=True)
    (ref_o * d_o.double()).sum().backward()

    assert_close(o, ref_o, torch.float32, "kda as dplr: o")
    assert_close(ht, ref_ht, torch.float32, "kda as dplr: final state")
    for name, leaf, ref in zip(["q", "k", "v", "g", "beta"], leaves, refs):
        assert_close(leaf.grad, ref.grad, torch.float32, f"kda as dplr: d{name}", limit=GRAD_LIMIT)


# a and b are formulas that are not 0 where their inputs are 0, at K = 20: the kernels pad the key
# axis to 32 lanes with zero inputs, and a low-rank vector of f(0) there once summed the padding
# into S^T a (4.6e-4 off the oracle in float64 before the lanes were masked).
PADDED_LANES_SPEC = """
name = "dplr_padded_lanes"
[recurrence]
update = "dplr"
gate = "key_channel"
[inputs]
w = "token_key"
a = "token_key"
b = "token_key"
[formulas]
log_decay = "-softplus(w) - 0.25"
low_rank_read = "-0.3 * sigmoid(a)"
low_rank_write = "0.3 * sigmoid(b)"
"""


@pytest.mark.parametrize("kernel", ["chunk", "recurrent"])
def test_formulas_nonzero_at_zero_with_padded_key_lanes(kernel, tmp_path, generator, device):
    path = tmp_path / "dplr_padded_lanes.toml"
    path.write_text(PADDED_LANES_SPEC)
    spec = (run_pipeline(load_spec(path), until="recurrence")["recurrence"], lrdsl.load(path))
    tensors = sample(spec[0], Shape(1, 37, 1, 2, 20, 12), torch.float32, generator)
    options = {"chunk_size": 16} if kernel == "chunk" else {}
    errors = errors_against_oracle(f"padded lanes {kernel}", kernel, tensors, generator, device, bounds=[0, 9, 37],
                                   spec=spec, **options)
    assert_within(errors, f"padded lanes {kernel}")
