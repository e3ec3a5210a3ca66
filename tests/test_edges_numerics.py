"""Numerics at the edges of the contract (issue 43): hard-reset gates and non-finite inputs.

Hard resets. The contract allows any log-decay g <= 0, -inf included: a token at g = -1e9 forgets
the state before it. The chunk form sums g over a chunk in fp32, so such a token left every later
G_i - G_j of the chunk without a digit (-inf - -inf is NaN) while `recurrent` stayed exact. The
chunk programs now floor each token's log-decay (docs/design.md §2, "Hard resets"); every spec
kind (scalar, key-channel, dplr, a gate formula) is compared with the float64 oracle here at
single tokens, runs of tokens and 30 % of the tokens at -1e4 .. -inf, forward and gradients.

Non-finite inputs. A NaN or inf at token t reaches, in the recurrence, the outputs from t on and
the state (q's only its own output row). The chunk kernels multiplied a masked-out 0 by it inside
their products (0 * NaN = NaN), so one bad value made every output row of its chunk NaN: padding
garbage at the end of a dense batch erased the real tokens before it. The output rows and final
states that are not finite must now be exactly the oracle's, and the others must match it.
"""
from __future__ import annotations

import math

import pytest
import torch

from lrdsl.verification.workloads import TOLERANCE, Shape, make_inputs

from helpers import module, recurrence
from oracle_checks import Call, assert_errors, causality_errors, oracle_errors

LIMIT = TOLERANCE[torch.float32]
RESET_SPECS = ("gdn", "kda", "simple_gla", "rwkv7", "gdn_qwen35", "gated_deltaproduct")
SHAPE = Shape(1, 70, 1, 2, 16, 16)  # a chunk of 64 and a short one (rwkv7: 32, 32, 6)
# where the resets go: one token inside the first chunk, a run of tokens, or 30 % of all tokens
PATTERNS = {"one": lambda T, gen: torch.arange(T) == 37,
            "run": lambda T, gen: (torch.arange(T) >= 20) & (torch.arange(T) < 28),
            "30%": lambda T, gen: torch.rand(T, generator=gen) < 0.3,
            "all": lambda T, gen: torch.ones(T, dtype=torch.bool)}
RESETS = [("one", -1e4), ("one", -1e5), ("one", -1e9), ("one", -math.inf), ("run", -1e9), ("run", -math.inf),
          ("30%", -1e4), ("all", -20.0)]


def with_resets(rec, tensors, tokens, g, generator):
    """`tensors` with the log-decay at `g` on the `tokens` (a [T] mask), in every value head, and
    for a per-key-channel gate on a random half of the key channels. The gate is the spec's input
    itself (g, w), or Qwen3.5's -exp(A_log) softplus(a + dt_bias), driven through a = -g with
    A_log = dt_bias = 0, so that the formula's own value is -softplus(-g) = g (to 2e-9 at
    g = -20; with a random A_log it could fall below the floor where g was meant above it)."""
    names = ["q", "k", "v"] + [i.name for i in rec.inputs]
    tensors = list(tensors)
    if rec.name == "gdn_qwen35":
        index, value = names.index("a"), -g
        for head_input in ("A_log", "dt_bias"):
            tensors[names.index(head_input)] = torch.zeros_like(tensors[names.index(head_input)])
    else:
        index, value = names.index(str(rec.log_decay)), g
    x = tensors[index].clone()
    where = tokens.view(1, -1, 1)
    if x.dim() == 4:  # [B, T, HV, K]
        where = where[..., None] & (torch.rand(x.shape, generator=generator) < 0.5)
    tensors[index] = torch.where(where, torch.full_like(x, value), x)
    return tensors


def reset_case(name, pattern, g, generator, dtype=torch.float32, device="cpu", gradients=False, **options):
    rec, mod = recurrence(name), module(name)
    if name == "gdn_qwen35" and g == -math.inf:
        pytest.skip("a = +inf is a non-finite input, not a reset")
    tensors = make_inputs(rec, SHAPE, dtype=dtype, generator=generator)
    tensors = with_resets(rec, tensors, PATTERNS[pattern](SHAPE.T, generator), g, generator)
    # the largest chunk the call may take: on a GPU 16-bit inputs at K or V <= 16 take at most 32
    largest = mod.largest_chunk_size(SHAPE.K, dtype=None if device == "cpu" else dtype, V=SHAPE.V)
    options.setdefault("chunk_size", min(32 if rec.has_low_rank else 64, largest))
    call = Call(SHAPE, h0=True, dht=gradients)
    return oracle_errors(rec, mod, call, generator, "chunk", gradients=gradients, tensors=tensors, device=device,
                         **options)


@pytest.mark.parametrize("pattern, g", RESETS, ids=[f"{p}@{g:g}" for p, g in RESETS])
@pytest.mark.parametrize("name", RESET_SPECS)
def test_chunk_follows_the_recurrence_through_hard_resets(name, pattern, g, generator):
    errors = reset_case(name, pattern, g, generator)
    assert_errors(errors, LIMIT, f"{name} chunk, log-decay {g:g} at {pattern}")


GRADIENT_CASES = [(name, "recompute") for name in RESET_SPECS] + [("gdn", "save_states"), ("gdn", "save")]


@pytest.mark.parametrize("name, policy", GRADIENT_CASES)
@pytest.mark.parametrize("pattern, g", [("run", -math.inf), ("30%", -1e4)], ids=["run@-inf", "30%@-1e4"])
def test_gradients_through_hard_resets(name, policy, pattern, g, generator):
    """The gradient through a floored token is 0; the oracle's, exp(g) (...), is 0 too at g <= -1e4."""
    errors = reset_case(name, pattern, g, generator, gradients=True, save_policy=policy)
    assert_errors(errors, LIMIT, f"{name} gradients ({policy}), log-decay {g:g} at {pattern}")


@pytest.mark.parametrize("name", RESET_SPECS)
def test_gate_gradients_when_every_token_decays_strongly(name, generator):
    """g = -20 on every token, above the floor: every gradient of the gate is then of the order
    exp(-20) = 2e-9, while the pairs of rows inside one token's update steps (no decay between
    them) are of order 1. The backward summed the gate's gradient as a suffix sum of row sums
    minus column sums, where those pairs cancel: Gated DeltaProduct's d_g came out 0.8-5.2 off
    the oracle (about 1e-5 now); it sums the pairs spanning each token directly."""
    for chunk_size in (16, 32):
        errors = reset_case(name, "all", -20.0, generator, gradients=True, chunk_size=chunk_size)
        assert_errors(errors, LIMIT, f"{name} gradients at chunk size {chunk_size}, log-decay -20 on every token")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("pattern, g", RESETS, ids=[f"{p}@{g:g}" for p, g in RESETS])
@pytest.mark.parametrize("name", RESET_SPECS)
def test_gpu_hard_resets(name, pattern, g, dtype, generator):
    """The same on a GPU, in bf16 and fp32: outputs, final states and the gradients of q, k, v
    and the initial state (in bf16 a gate's and beta's gradients are sums that 16-bit operands do
    not resolve at the last token: tests/test_gpu.py asserts them on their own)."""
    errors = reset_case(name, pattern, g, generator, dtype=dtype, device="cuda", gradients=True)
    print(f"{name} {pattern}@{g:g} {dtype}: " + ", ".join(f"{k} {e:.2e}" for k, e in errors.items()))
    asserted = ("o", "ht", "d_q", "d_k", "d_v", "d_h0") if dtype == torch.bfloat16 else tuple(errors)
    assert_errors({k: errors[k] for k in asserted}, TOLERANCE[dtype], f"{name} {dtype} log-decay {g:g} at {pattern}")


# -- non-finite inputs ---------------------------------------------------------------------------

NONFINITE_SPECS = ("gdn", "kda", "simple_gla", "rwkv7", "gdn_qwen35", "deltanet", "linear_attn")
# (input, value): q, k, v by name; "gate", "beta": the spec's per-token input the formula reads
NONFINITE = [("v", math.nan), ("v", math.inf), ("k", math.nan), ("k", -math.inf), ("q", math.nan),
             ("gate", math.nan), ("beta", math.nan)]
NONFINITE_SHAPE = Shape(2, 56, 1, 1, 16, 40)  # V = 40: three value blocks of 16 in the kernels' V loops


def _per_token_input(rec, formula):
    """The per-token input `formula` reads (the gate's or beta's), or None."""
    if formula is None:
        return None
    inputs = [i.name for i in rec.formula_inputs(formula) if i.role.per_token]
    return inputs[0] if inputs else None


def with_nonfinite(rec, tensors, which, value, token, generator):
    """`tensors` with one entry of `which` at `token` of the first batch row set to `value` (a
    random head and, where the tensor has one, a random channel)."""
    names = ["q", "k", "v"] + [i.name for i in rec.inputs]
    name = {"gate": _per_token_input(rec, rec.log_decay), "beta": _per_token_input(rec, rec.beta)}.get(which, which)
    if name is None:
        pytest.skip(f"{rec.name} has no per-token {which} input")
    x = tensors[names.index(name)].clone()
    index = (0, token) + tuple(int(torch.randint(0, n, (1,), generator=generator)) for n in x.shape[2:])
    x[index] = value
    tensors = list(tensors)
    tensors[names.index(name)] = x
    return tensors


@pytest.mark.parametrize("which, value", NONFINITE, ids=[f"{w}={v}" for w, v in NONFINITE])
@pytest.mark.parametrize("name", NONFINITE_SPECS)
def test_a_nonfinite_input_reaches_only_later_rows(name, which, value, generator):
    """One bad entry at token 50 of the first sequence (the fourth chunk of 16, the only one of
    64), the initial state given, against the oracle: the recurrent kernel and the chunk kernels
    at chunk sizes 16 and 64 (gdn: in every plan)."""
    rec, mod = recurrence(name), module(name)
    tensors = make_inputs(rec, NONFINITE_SHAPE, generator=generator)
    tensors = with_nonfinite(rec, tensors, which, value, 50, generator)
    h0 = torch.randn(2, NONFINITE_SHAPE.HV, NONFINITE_SHAPE.K, NONFINITE_SHAPE.V, generator=generator)
    call = Call(NONFINITE_SHAPE)
    assert_errors(causality_errors(rec, mod, call, tensors, "recurrent", h0=h0), LIMIT, f"{name} recurrent")
    largest = mod.largest_chunk_size(NONFINITE_SHAPE.K, dtype=torch.float32, V=NONFINITE_SHAPE.V)
    for plan in mod.CHUNK_PLANS if name == "gdn" else mod.CHUNK_PLANS[:1]:
        for size in (s for s in (16, 64) if s <= largest):
            errors = causality_errors(rec, mod, call, tensors, "chunk", h0=h0, plan=plan, chunk_size=size)
            assert_errors(errors, LIMIT, f"{name} chunk[{plan}, {size}] with {which} = {value} at token 50")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("which, value", NONFINITE, ids=[f"{w}={v}" for w, v in NONFINITE])
@pytest.mark.parametrize("name", NONFINITE_SPECS)
def test_gpu_nonfinite_inputs(name, which, value, dtype, generator):
    """The same on a GPU, in bf16 and fp32, at K = 128 and V = 128, token 150 of 300, every plan."""
    rec, mod = recurrence(name), module(name)
    shape = Shape(2, 300, 2, 4, 128, 128)
    tensors = make_inputs(rec, shape, dtype=dtype, generator=generator)
    tensors = with_nonfinite(rec, tensors, which, value, 150, generator)
    h0 = torch.randn(2, shape.HV, shape.K, shape.V, generator=generator)
    for plan in mod.CHUNK_PLANS:
        errors = causality_errors(rec, mod, Call(shape, l2norm=True), tensors, "chunk", device="cuda", h0=h0, plan=plan)
        print(f"{name} {which}={value} {dtype} {plan}: " + ", ".join(f"{k} {e:.2e}" for k, e in errors.items()))
        assert_errors(errors, TOLERANCE[dtype], f"{name} chunk[{plan}] {dtype} with {which} = {value} at token 150")


@pytest.mark.parametrize("name", ["gdn", "kda"])
def test_right_padded_garbage_leaves_the_real_tokens_exact(name, generator):
    """A dense batch whose shorter sequences are right-padded with garbage (NaN, inf) in every
    input: the rows before the padding and the other sequences match the oracle, the padding's
    rows and those sequences' final states are NaN, as in the recurrence."""
    rec, mod = recurrence(name), module(name)
    shape = Shape(3, 45, 1, 2, 16, 16)
    tensors = make_inputs(rec, shape, generator=generator)
    lengths = (45, 12, 33)
    for index, tensor in enumerate(tensors):
        if tensor.dim() >= 3 and tensor.shape[1] == shape.T:  # per-token tensors
            for b, length in enumerate(lengths):
                garbage = torch.full_like(tensor[b, length:], math.nan if index % 2 else math.inf)
                tensor[b, length:] = garbage
    errors = causality_errors(rec, mod, Call(shape), tensors, "chunk")
    assert_errors(errors, LIMIT, f"{name} right-padded batch")
    with torch.no_grad():
        o, _ = mod.chunk(*tensors)
    for b, length in enumerate(lengths):
        assert torch.isfinite(o[b, :length]).all(), f"{name}: sequence {b}'s real rows are not finite"


def test_only_kernels_that_nan_reaches_causally_go_unguarded():
    """row_guards rule 4, for every shipped spec and plan: each forward scan leaves its buffer
    tiles unguarded (its stored tiles take row i from rows <= i: NaN alone does rule 3's work),
    every forward output kernel guards the buffers it loads (its masked product over the chunk's
    rows would carry a later row's NaN into earlier rows), and the call's inputs stay guarded
    wherever they are loaded."""
    from lrdsl.codegen.context import KernelContext
    from lrdsl.codegen.row_guards import GUARDED_SOURCES, ROW_SHAPES, nan_propagates
    from lrdsl.ir.chunk import Load
    from lrdsl.passes.pipeline import run_pipeline
    from lrdsl.spec import load_spec, shipped_spec_names
    from helpers import spec_path

    checked, plans = 0, 0
    for name in shipped_spec_names():
        forward = run_pipeline(load_spec(spec_path(name)))["save"].forward
        prog = forward.graph.program
        for plan in forward.plans:
            plans += 1
            for kernel in plan.kernels:
                ctx = KernelContext(prog, plan, kernel)
                buffers = [v for v in kernel.loads if ctx.shape(v) in ROW_SHAPES]
                inputs = [v for v in kernel.computes if isinstance(prog.op(v), Load) and prog.op(v).source in GUARDED_SOURCES]
                assert set(inputs) <= set(ctx.guarded), f"{name} {plan.name}/{kernel.name}: an input load unguarded"
                if kernel.kind == "scan":
                    assert nan_propagates(ctx) and not set(buffers) & set(ctx.guarded), f"{name} {plan.name} scan"
                    checked += 1
                elif kernel.name == "output" and buffers:
                    assert not nan_propagates(ctx) and set(buffers) <= set(ctx.guarded), f"{name} {plan.name} output"
    assert checked == plans  # one scan a plan
