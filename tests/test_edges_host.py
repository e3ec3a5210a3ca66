"""The edges of the host code (issue 43): second derivatives are refused on every path,
inference mode and no_grad work at every entry point, and a host copy of cu_seqlens that
disagrees with the device one is refused (or, where it cannot be compared, bounded in the
kernels). Every numeric result against the float64 oracle."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

import lrdsl.ops as ops
from lrdsl import reference
from lrdsl.verification.workloads import TOLERANCE, Shape, make_inputs, relative_error

from conftest import ROOT, INTERPRETED
from helpers import module, recurrence

TOL = TOLERANCE[torch.float32]
SHAPE = Shape(1, 20, 1, 2, 16, 16)  # GVA 2
BOUNDS = [0, 7, 7, 20]  # an empty sequence between two others


def gdn_inputs(generator, shape=SHAPE):
    rec = recurrence("gdn")
    return rec, make_inputs(rec, shape, dtype=torch.float32, generator=generator)


def check_against_oracle(rec, tensors, out, **kwargs):
    """o and the final state of a call against the float64 oracle on the same arguments."""
    ref_o, ref_ht = reference.run(rec, *tensors, output_final_state=True, **kwargs)
    o, ht = out
    assert relative_error(o, ref_o) <= TOL, f"o: {relative_error(o, ref_o):.2e}"
    if ht is not None:
        assert relative_error(ht, ref_ht) <= TOL, f"final state: {relative_error(ht, ref_ht):.2e}"


# -- item 2: a second derivative is refused, with constant cotangents -----------------------------

def _module_path(kernel):
    def run(tensors, cu_seqlens):
        return getattr(module("gdn"), kernel)(*tensors, cu_seqlens=cu_seqlens, output_final_state=True)
    return run


def _op_path(kernel):
    """The torch.library custom op (what torch.compile calls), called directly: its own autograd."""
    def run(tensors, cu_seqlens):
        mod = module("gdn")
        q, k, v, *extras = tensors
        if kernel == "recurrent":
            return mod._OPS.recurrent(q, k, v, extras, None, cu_seqlens, 16 ** -0.5, True, False, False)
        return mod._OPS.chunk(q, k, v, extras, None, cu_seqlens, None, None, 16 ** -0.5, True, False, 16, 16,
                              mod.DEFAULT_CHUNK_PLAN, "recompute", "input", False)
    return run


def _fla_path(kernel):
    def run(tensors, cu_seqlens):
        q, k, v, g, beta = tensors
        fn = ops.chunk_gated_delta_rule if kernel == "chunk" else ops.fused_recurrent_gated_delta_rule
        return fn(q=q, k=k, v=v, g=g, beta=beta, cu_seqlens=cu_seqlens, output_final_state=True)
    return run


SECOND_DERIVATIVE_PATHS = {
    "module.chunk": _module_path("chunk"),
    "module.recurrent": _module_path("recurrent"),
    "op.chunk": _op_path("chunk"),
    "op.recurrent": _op_path("recurrent"),
    "ops.chunk_gated_delta_rule": _fla_path("chunk"),
    "ops.fused_recurrent_gated_delta_rule": _fla_path("recurrent"),
}


@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("path", SECOND_DERIVATIVE_PATHS)
def test_second_derivative_refused(path, varlen, generator):
    """A gradient penalty ||dL/dq||^2 with a constant cotangent: the create_graph=True backward
    raises one line (before: it returned a gradient without a graph, and the penalty's gradient
    silently lost its second-order terms). A first derivative still matches the oracle."""
    rec, tensors = gdn_inputs(generator)
    cu_seqlens = torch.tensor(BOUNDS, dtype=torch.int32) if varlen else None
    d_o = torch.randn(SHAPE.B, SHAPE.T, SHAPE.HV, SHAPE.V, generator=generator)  # constant: no grad
    run = SECOND_DERIVATIVE_PATHS[path]

    leaves = [t.clone().requires_grad_() for t in tensors]
    o, _ = run(leaves, cu_seqlens)
    with pytest.raises(RuntimeError, match=r"second derivatives are not supported") as refusal:
        (d_q,) = torch.autograd.grad(o, leaves[0], d_o, create_graph=True)
        ((o * d_o).sum() + (d_q ** 2).sum()).backward()  # the loss plus its gradient penalty
    assert "\n" not in str(refusal.value)

    leaves = [t.clone().requires_grad_() for t in tensors]
    o, _ = run(leaves, cu_seqlens)
    (d_q,) = torch.autograd.grad(o, leaves[0], d_o)
    ref_leaves = [t.double().requires_grad_() for t in tensors]
    ref_o, _ = reference.run(rec, *ref_leaves, cu_seqlens=cu_seqlens)
    (ref_d_q,) = torch.autograd.grad(ref_o, ref_leaves[0], d_o.double())
    assert relative_error(d_q, ref_d_q) <= TOL


def test_second_derivative_refused_through_layer(generator):
    """The layer: its short convolution, gated norm and recurrence each refuse create_graph=True."""
    pytest.importorskip("transformers", minversion="5.24")
    from lrdsl.layers import GatedDeltaNet
    from test_layer import tiny_config

    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=generator)))
    layer = GatedDeltaNet(tiny_config(), layer_idx=0)
    x = torch.randn(1, 9, 32, generator=generator, requires_grad=True)
    out = layer(x)
    with pytest.raises(RuntimeError, match=r"second derivatives are not supported"):
        (d_x,) = torch.autograd.grad(out.sum(), x, create_graph=True)
        (out.sum() + (d_x ** 2).sum()).backward()
    kernels = pytest.importorskip("lrdsl.layers.kernels").layer_kernels()
    rows = torch.randn(5, 24, generator=generator, requires_grad=True)
    normed = kernels.gated_rms_norm(rows, torch.randn(5, 24, generator=generator), torch.ones(24))
    with pytest.raises(RuntimeError, match=r"gated_rms_norm: second derivatives are not supported"):
        torch.autograd.grad(normed, rows, torch.randn(5, 24, generator=generator), create_graph=True)
    conv_in = torch.randn(1, 9, 8, generator=generator, requires_grad=True)
    conv_out, _ = kernels.short_conv(conv_in, torch.randn(8, 4, generator=generator))
    with pytest.raises(RuntimeError, match=r"short_conv: second derivatives are not supported"):
        torch.autograd.grad(conv_out, conv_in, torch.randn(1, 9, 8, generator=generator), create_graph=True)


# -- item 3: inference mode and no_grad at every entry point ----------------------------------------

GRAD_MODES = {"inference_mode": torch.inference_mode, "no_grad": torch.no_grad}


def _varlen(mod, q, cu, how):
    """chunk()'s varlen arguments: cu_seqlens alone, with prepare_varlen, or counted on a host copy
    at chunk()'s own chunk size (which it may then count again at a smaller one for its scan)."""
    if how == "cu_seqlens":
        return dict(cu_seqlens=cu)
    if how == "prepare_varlen":
        return dict(cu_seqlens=cu, chunk_size=16, chunk_indices=mod.prepare_varlen(cu, 16))
    size = mod._default_chunk_size("chunk", q, SHAPE.K, "input", mod.DEFAULT_CHUNK_PLAN, SHAPE.V)
    return dict(cu_seqlens=cu, chunk_indices=mod.prepare_varlen(cu, size, cu_seqlens_cpu=cu.cpu().clone()))


@pytest.mark.parametrize("mode", GRAD_MODES)
@pytest.mark.parametrize("call", ["chunk", "chunk:cu_seqlens", "chunk:prepare_varlen", "chunk:host_copy",
                                  "recurrent", "recurrent:cu_seqlens"])
def test_module_calls_without_gradients(call, mode, generator):
    """chunk() and recurrent(), dense and packed, on tensors made inside the mode (inference
    tensors have no version counter: before, every varlen chunk() raised on cu_seqlens._version)."""
    kernel, _, how = call.partition(":")
    rec, tensors = gdn_inputs(generator)
    mod = module("gdn")
    h0 = torch.randn(len(BOUNDS) - 1 if how else SHAPE.B, SHAPE.HV, SHAPE.K, SHAPE.V, generator=generator)
    with GRAD_MODES[mode]():
        inside = [t.clone() for t in tensors]
        cu = torch.tensor(BOUNDS, dtype=torch.int32) if how else None
        varlen = _varlen(mod, inside[0], cu, how) if kernel == "chunk" and how else dict(cu_seqlens=cu)
        out = getattr(mod, kernel)(*inside, initial_state=h0.clone(), output_final_state=True, **varlen)
    check_against_oracle(rec, tensors, out, initial_state=h0, cu_seqlens=torch.tensor(BOUNDS) if how else None)


@pytest.mark.parametrize("mode", GRAD_MODES)
@pytest.mark.parametrize("kernel", ["chunk", "recurrent", "verify"])
def test_pool_calls_without_gradients(kernel, mode, generator):
    """The serving functions (prefill into a pool, decode, verify then commit) on inference tensors:
    o and the pool rows they wrote against the oracle."""
    rec, tensors = gdn_inputs(generator)
    mod = module("gdn")
    bounds, slots = [0, 7, 10, 20], [4, -1, 1]  # the padding slot has 3 tokens, which reach no row
    pool = torch.randn(6, SHAPE.HV, SHAPE.K, SHAPE.V, generator=generator)
    with GRAD_MODES[mode]():
        inside = [t.clone() for t in tensors]
        cu, state_pool, indices = torch.tensor(bounds, dtype=torch.int32), pool.clone(), torch.tensor(slots)
        if kernel == "verify":
            o, draft = mod.verify(*inside, state_pool=state_pool, state_indices=indices, cu_seqlens=cu)
            mod.commit(draft, torch.tensor([7, 3, 10]))  # every draft token accepted
        else:
            options = dict(chunk_size=16, chunk_indices=mod.prepare_varlen(cu, 16)) if kernel == "chunk" else {}
            o, _ = getattr(mod, kernel)(*inside, state_pool=state_pool, state_indices=indices, cu_seqlens=cu, **options)
    h0 = pool[[4, 0, 1]]  # the padding slot's row 0 is a placeholder
    ref_o, ref_ht = reference.run(rec, *tensors, initial_state=h0, output_final_state=True,
                                  cu_seqlens=torch.tensor(bounds))
    live = torch.tensor([t < 7 or t >= 10 for t in range(SHAPE.T)])
    assert relative_error(o[0, live], ref_o[0, live]) <= TOL
    assert torch.equal(o[0, 7:10], torch.zeros_like(o[0, 7:10])), "the padding slot's outputs are zeros"
    assert relative_error(state_pool[[4, 1]], ref_ht[[0, 2]]) <= TOL
    assert torch.equal(state_pool[[0, 2, 3, 5]], pool[[0, 2, 3, 5]]), "rows of no sequence are untouched"


@pytest.mark.parametrize("mode", GRAD_MODES)
@pytest.mark.parametrize("fn", ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "chunk_kda"])
def test_fla_functions_without_gradients(fn, mode, generator):
    """lrdsl.ops on inference tensors, packed, with FLA's host copy cu_seqlens_cpu where it takes one."""
    name = "kda" if fn == "chunk_kda" else "gdn"
    rec = recurrence(name)
    tensors = make_inputs(rec, SHAPE, dtype=torch.float32, generator=generator)
    with GRAD_MODES[mode]():
        q, k, v, g, beta = (t.clone() for t in tensors)
        cu = torch.tensor(BOUNDS, dtype=torch.int64)
        host = dict(cu_seqlens_cpu=cu.clone()) if fn != "fused_recurrent_gated_delta_rule" else {}
        out = getattr(ops, fn)(q=q, k=k, v=v, g=g, beta=beta, cu_seqlens=cu, output_final_state=True, **host)
    check_against_oracle(rec, tensors, out, cu_seqlens=torch.tensor(BOUNDS))


@pytest.mark.parametrize("mode", GRAD_MODES)
def test_layer_without_gradients(mode, generator):
    """The layer on a padded batch (packed into cu_seqlens inside) and a decode step with a cache,
    inside the mode, against its float64 oracle."""
    pytest.importorskip("transformers", minversion="5.24")
    from lrdsl.layers import GatedDeltaNet, GatedDeltaNetCache
    from test_layer import double_copy, oracle, tiny_config

    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=generator)))
    layer = GatedDeltaNet(tiny_config(), layer_idx=0)
    x = torch.randn(2, 9, 32, generator=generator)
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1, :3] = False  # left padding
    with GRAD_MODES[mode]():
        padded = layer(x.clone(), attention_mask=mask.clone())
        cache = GatedDeltaNetCache()
        prefill = layer(x[:1, :8].clone(), cache=cache)
        step = layer(x[:1, 8:].clone(), cache=cache)
    reference_layer = double_copy(layer)
    with torch.no_grad():
        whole, _, _ = oracle(reference_layer, x[:1].double())
        second, _, _ = oracle(reference_layer, x[1:, 3:].double())
    assert relative_error(torch.cat([prefill, step], 1), whole) <= TOL
    assert relative_error(padded[1, 3:], second[0]) <= TOL
    assert relative_error(padded[:1], whole) <= TOL


# -- item 4: a host copy of cu_seqlens that disagrees with the device one --------------------------

STALE_BOUNDS = [0, 30, 40]  # the device's are [0, 7, 40]: its second sequence has 3 chunks of 16, the copy 1


def test_stale_host_copy_refused(generator):
    """Both on the host: prepare_varlen (and lrdsl.ops through it) compares them and refuses in one
    line (before: chunk() corrupted the process's memory, `double free or corruption`)."""
    rec, (q, k, v, g, beta) = gdn_inputs(generator, Shape(1, 40, 1, 1, 16, 16))
    mod = module("gdn")
    cu, stale = torch.tensor([0, 7, 40], dtype=torch.int32), torch.tensor(STALE_BOUNDS, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"cu_seqlens_cpu is not a copy of cu_seqlens: cu_seqlens_cpu\[1\] = 30 "
                                         r"but cu_seqlens\[1\] = 7$"):
        mod.prepare_varlen(cu, 16, cu_seqlens_cpu=stale)
    with pytest.raises(ValueError, match=r"cu_seqlens_cpu is not a copy of cu_seqlens"):
        ops.chunk_gated_delta_rule(q=q, k=k, v=v, g=g, beta=beta, cu_seqlens=cu.long(), cu_seqlens_cpu=stale.long())
    chunks = mod.prepare_varlen(cu, 16, cu_seqlens_cpu=cu.clone())  # an equal copy is taken
    out = mod.chunk(q, k, v, g, beta, cu_seqlens=cu, chunk_size=16, chunk_indices=chunks, output_final_state=True)
    check_against_oracle(rec, (q, k, v, g, beta), out, cu_seqlens=cu)


# What a GPU call with a stale host copy runs (there the copies cannot be compared without a
# synchronisation): chunk tables counted on the copy, the sequences read from the device tensor.
# Run in a child process: before, this corrupted the memory of the process that ran it.
STALE_TABLE_SCRIPT = """
import sys, torch
from lrdsl import config
config.use_interpreter_without_gpu()
import lrdsl
mod = lrdsl.load(sys.argv[1])
device = sys.argv[2]
torch.manual_seed(int(sys.argv[3]))
T, H, K = 40, 1, 16
q, k, v = (torch.randn(1, T, H, K, device=device) for _ in range(3))
g = -torch.rand(1, T, H, device=device)
beta = torch.rand(1, T, H, device=device)
cu = torch.tensor([0, 7, 40], dtype=torch.int32, device=device)


def prepare_without_comparing(cu_seqlens, chunk_size=64, cu_seqlens_cpu=None):
    # prepare_varlen as on a GPU, where comparing the copies would cost a synchronisation
    indices, offsets, tokens = mod._count_chunks(cu_seqlens_cpu, chunk_size)
    return mod.VarlenChunks(indices.to(device), offsets.to(device), chunk_size, tokens, cu_seqlens, cu_seqlens_cpu)


mod.prepare_varlen = prepare_without_comparing  # chunk() counts its other chunk sizes through it
for stale in ([0, 30, 40], [0, 1, 40], [0, 39, 40], [0, 0, 40]):
    stale = torch.tensor(stale, dtype=torch.int32)
    # at a given chunk size, and at chunk()'s own (which it may count again at other sizes)
    for size in (16, 32, None):
        chunk_size = size or mod._default_chunk_size("chunk", q, K, "input", mod.DEFAULT_CHUNK_PLAN, v.shape[-1])
        chunks = prepare_without_comparing(cu, chunk_size, stale)
        leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta)]
        o, ht = mod.chunk(*leaves, cu_seqlens=cu, chunk_size=size, chunk_indices=chunks, output_final_state=True)
        (o.sum() + ht.sum()).backward()
        with torch.no_grad():
            mod.chunk(q, k, v, g, beta, cu_seqlens=cu, chunk_size=size, chunk_indices=chunks, output_final_state=True)
if device == "cuda":
    torch.cuda.synchronize()
print("no corruption")
"""


def run_stale_tables(device, generator):
    seed = int(torch.randint(0, 2**31, (1,), generator=generator))
    result = subprocess.run([sys.executable, "-c", STALE_TABLE_SCRIPT, str(ROOT / "specs" / "gdn.toml"), device, str(seed)],
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0 and "no corruption" in result.stdout, \
        f"exit {result.returncode}: {result.stderr.strip().splitlines()[-1:] if result.stderr.strip() else ''}"


@pytest.mark.skipif(not INTERPRETED, reason="the interpreter's run of the kernels")
def test_stale_chunk_table_stays_in_bounds(generator):
    """Chunk tables that disagree with cu_seqlens (more chunks on the device than in the table, or
    fewer), forward and backward: the kernels stay inside their tensors."""
    run_stale_tables("cpu", generator)


@pytest.mark.gpu
def test_stale_chunk_table_stays_in_bounds_gpu(generator):
    run_stale_tables("cuda", generator)


# -- item 6: input names that are sympy's own, and non-ASCII names ---------------------------------

SHADOWING_SPEC = """
name = "gdn_shadowing"

[recurrence]
update = "delta"
gate = "scalar"

[inputs]
Float = "token"
Integer = "token"
Rational = "head"
Symbol = "head"

[formulas]
log_decay = "-exp(Rational) * softplus(Float + Symbol + 0.5) - 1e-3"
beta = "2 * sigmoid(Integer) / 3"
"""


def test_inputs_named_like_sympy_internals(tmp_path, generator):
    """Inputs named Float, Integer, Rational, Symbol in formulas with literals compile, and chunk()
    matches the oracle (before: every formula with a literal failed, `cannot parse formula ...:
    TypeError`)."""
    from lrdsl.passes.pipeline import run_pipeline
    from lrdsl.spec import load_spec
    import lrdsl

    path = tmp_path / "gdn_shadowing.toml"
    path.write_text(SHADOWING_SPEC)
    rec = run_pipeline(load_spec(path), until="recurrence")["recurrence"]
    tensors = make_inputs(rec, SHAPE, dtype=torch.float32, generator=generator)
    out = lrdsl.load(path).chunk(*tensors, output_final_state=True)
    check_against_oracle(rec, tensors, out)


def test_undeclared_sympy_name_in_formula(tmp_path):
    from lrdsl.errors import SpecError
    from lrdsl.spec import load_spec

    path = tmp_path / "s.toml"
    path.write_text(SHADOWING_SPEC.replace('beta = "2 * sigmoid(Integer) / 3"', 'beta = "sigmoid(Function) + 1"'))
    with pytest.raises(SpecError, match=r"s.toml:\d+: formulas.beta: .*undeclared name 'Function'"):
        load_spec(path)


def test_non_ascii_input_name_says_what_is_allowed(tmp_path):
    """λ is a Python identifier, refused as one before; now the line says what a name may hold."""
    from lrdsl.errors import SpecError
    from lrdsl.spec import load_spec

    path = tmp_path / "s.toml"
    path.write_text(SHADOWING_SPEC.replace('Symbol = "head"', '"λ" = "head"').replace("Symbol", "λ"))
    with pytest.raises(SpecError) as error:
        load_spec(path)
    assert str(error.value) == (f"{path}:12: inputs.λ: an input name must be ASCII letters, digits and '_', "
                                "not starting with a digit, got 'λ'")


@pytest.mark.gpu
@pytest.mark.parametrize("mode", GRAD_MODES)
def test_calls_without_gradients_do_not_synchronise_gpu(mode, generator):
    """Inside inference_mode / no_grad, a packed chunk() with chunks counted on the host copy, a
    pool prefill writing prefix checkpoints and a pool decode, both without validation, and lrdsl.ops
    with cu_seqlens_cpu synchronise with nothing (the checkpoints' masked write used to count its
    rows on the host)."""
    rec, tensors = gdn_inputs(generator)
    mod = module("gdn")
    cu_cpu = torch.tensor(BOUNDS, dtype=torch.int32)
    pool = torch.randn(4, SHAPE.HV, SHAPE.K, SHAPE.V, generator=generator).cuda()
    with GRAD_MODES[mode]():
        inside = [t.cuda() for t in tensors]
        cu = cu_cpu.cuda()
        indices = torch.tensor([2, -1, 0], device="cuda")
        prefill_pool = torch.zeros(6, SHAPE.HV, SHAPE.K, SHAPE.V, device="cuda")
        rows, checkpoint_rows = torch.tensor([0, 1, 2], device="cuda"), torch.tensor([[3], [4], [5]], device="cuda")
        decode = [t[0, :3].unsqueeze(1).contiguous() for t in inside]  # 3 sequences of one token
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            chunks = mod.prepare_varlen(cu, 32, cu_seqlens_cpu=cu_cpu)
            out = mod.chunk(*inside, cu_seqlens=cu, chunk_indices=chunks, chunk_size=32, output_final_state=True)
            small = mod.prepare_varlen(cu, 16, cu_seqlens_cpu=cu_cpu)
            mod.chunk(*inside, cu_seqlens=cu, chunk_indices=small, chunk_size=16, state_pool=prefill_pool,
                      state_indices=rows, checkpoint_every=16, checkpoint_indices=checkpoint_rows, validate=False)
            mod.recurrent(*decode, state_pool=pool, state_indices=indices, validate=False)
            ops.chunk_gated_delta_rule(*inside, cu_seqlens=cu.long(), cu_seqlens_cpu=cu_cpu.long())
        finally:
            torch.cuda.set_sync_debug_mode("default")
    check_against_oracle(rec, tensors, [x.cpu() for x in out], cu_seqlens=cu_cpu)


# -- 16-bit inputs with K or V <= 16 on a GPU take chunks of at most 32 ---------------------------
# At K = V = 16, C = 64, bf16, Triton 3.6.0 miscompiled gdn's backward output kernel on an H100 (an
# out-of-range shared-memory access; d_q, d_k, d_g 0.5-0.7 off where it did not fault); at K = 20,
# V = 8, C = 64 the oracle fuzzer found packed-sequence forwards 0.05-0.63 off and one illegal
# memory access. The module caps the chunk size where either head dim is one 16-column tile, for
# every spec (NARROW_LARGEST_CHUNK_SIZE).

@pytest.mark.parametrize("name", ["gdn", "kda", "simple_gla", "gated_deltaproduct"])
def test_narrow_heads_in_16_bits_take_chunks_of_at_most_32(name):
    """Meta tensors stand for a GPU's (the module reads their dtype as a GPU call would): the
    default chunk size and the largest are 32 where K or V <= 16 in bf16 and fp16, unchanged at
    K = V = 32, for fp32 inputs and in the interpreter; under torch.compile a larger one is refused
    in one line."""
    mod = module(name)
    for K, V, dtype, expected in ((16, 32, torch.bfloat16, 32), (8, 8, torch.float16, 32), (32, 8, torch.bfloat16, 32),
                                  (32, 16, torch.float16, 32), (32, 32, torch.bfloat16, None),
                                  (32, 17, torch.bfloat16, None), (16, 16, torch.float32, None)):
        q = torch.empty(1, 4, 1, K, dtype=dtype, device="meta")
        v = torch.empty(1, 4, 1, V, dtype=dtype, device="meta")
        unchanged = mod.largest_chunk_size(K, "input", None, V)  # the interpreter's
        largest = mod._largest_chunk_size(q, K, "input", V)
        assert largest == mod.largest_chunk_size(K, "input", dtype, V)
        assert largest == (min(expected, unchanged) if expected else mod.largest_chunk_size(K, "input", dtype))
        assert mod._default_chunk_size("chunk", q, K, "input", mod.DEFAULT_CHUNK_PLAN, V) <= largest
        assert mod.intermediate_chunk_tokens(q, v=v) * getattr(mod, "STEPS_PER_TOKEN", 1) <= largest
        if expected and unchanged > expected:
            with pytest.raises(mod.InputError, match=r"chunk_size must be one of \(16, 32, 64\) and at most 32"):
                mod._fake_chunk_options(q, v, 64, mod.DEFAULT_CHUNK_PLAN, "input")
    cpu = torch.empty(1, 4, 1, 16, dtype=torch.bfloat16)
    assert mod._largest_chunk_size(cpu, 16, "input", 8) == mod.largest_chunk_size(16, "input", None)


@pytest.mark.gpu
def test_gpu_narrow_keys_in_bf16_default_to_32_and_refuse_64(generator):
    """gdn at K = V = 16 in bf16 on a GPU: chunk_size=64 refused in one line; the default call's
    outputs and gradients against the float64 oracle."""
    from oracle_checks import Call, assert_errors, oracle_errors
    rec, mod = recurrence("gdn"), module("gdn")
    shape = Shape(1, 70, 1, 2, 16, 16)
    tensors = make_inputs(rec, shape, dtype=torch.bfloat16, generator=generator)
    with pytest.raises(mod.InputError, match=r"^gdn.chunk: chunk_size=64 with K=16, V=16 and torch.bfloat16 inputs on a "
                                             r"GPU: Triton 3.6 miscompiles the kernels .* use chunk_size <= 32$"):
        mod.chunk(*[t.cuda() for t in tensors], chunk_size=64)
    errors = oracle_errors(rec, mod, Call(shape, h0=True, dht=True), generator, "chunk", tensors=tensors, device="cuda")
    assert_errors({k: errors[k] for k in ("o", "ht", "d_q", "d_k", "d_v", "d_h0")}, TOLERANCE[torch.bfloat16],
                  "gdn K = 16 bf16 at the default chunk size")


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["linear_attn", "deltanet"])
def test_gpu_narrow_values_with_packed_sequences_in_bf16(name, generator):
    """The oracle fuzzer's GPU finding: K = 20, V = 8, packed sequences shorter than a chunk, an
    initial state, bf16: chunk() at its default chunk size (32 here) against the float64 oracle,
    outputs and final states, and chunk_size=64 refused in one line."""
    from oracle_checks import Call, assert_errors, oracle_errors
    rec, mod = recurrence(name), module(name)
    shape = Shape(1, 23, 1, 1, 20, 8)
    tensors = make_inputs(rec, shape, dtype=torch.bfloat16, generator=generator)
    with pytest.raises(mod.InputError, match=r"chunk_size=64 with K=20, V=8 and torch.bfloat16 inputs on a GPU"):
        mod.chunk(*[t.cuda() for t in tensors], chunk_size=64)
    call = Call(shape, bounds=(0, 6, 23), h0=True)
    errors = oracle_errors(rec, mod, call, generator, "chunk", gradients=False, tensors=tensors, device="cuda")
    assert_errors(errors, TOLERANCE[torch.bfloat16], f"{name} K = 20, V = 8, packed, bf16 at the default chunk size")
