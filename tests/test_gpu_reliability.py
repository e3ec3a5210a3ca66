"""On GPUs, in bf16 against the float64 oracle: launches on the inputs' own device (two GPUs),
grids for any number of sequences x value heads, tensors past 2**31 elements. Skipped without a
CUDA device; the two-GPU tests also without a second one.

    pytest -m gpu tests/test_gpu_reliability.py -s     # one GPU: grids and large tensors
    pytest -m gpu tests/test_gpu_reliability.py -s -k two_gpus   # on two GPUs (nvidia-h200-x2)

Each test prints its measured errors (and the large-tensor tests their peak GPU memory).
tests/test_launches.py checks the same launch structure on the CPU interpreter."""
from __future__ import annotations

import pytest
import torch

from lrdsl import reference
from lrdsl.layers.kernels import layer_kernels
from lrdsl.verification.workloads import TOLERANCE, Shape, relative_error

from helpers import ALL_SPECS, module, recurrence, sample

pytestmark = pytest.mark.gpu

LIMIT = TOLERANCE[torch.bfloat16]
FP32_LIMIT = TOLERANCE[torch.float32]
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")


def _names(rec):
    return ["q", "k", "v"] + [i.name for i in rec.inputs]


def _check(what, errors, limit=LIMIT, skip=()):
    print(f"  {what}: " + ", ".join(f"{n} {e:.2e}" for n, e in errors.items()))
    bad = {n: e for n, e in errors.items() if n not in skip and not e <= limit}
    assert not bad, f"{what}: errors above {limit}: {bad}"


def _per_head(rec):
    """Gradients of per-head parameters: sums over every token whose bf16 rounding partly cancels
    (printed, not asserted, in bf16; tests/test_gpu.py asserts them with precision="tf32")."""
    return {f"d{i.name}" for i in rec.head_inputs}


def _run(mod, kernel, tensors, h0, d_o, d_ht, **kwargs):
    """(o, ht, gradients of q, k, v, the spec's inputs and h0, or None without d_o)."""
    if d_o is None:
        with torch.no_grad():
            return (*getattr(mod, kernel)(*tensors, initial_state=h0, output_final_state=True, **kwargs), None)
    leaves = [t.detach().requires_grad_() for t in (*tensors, h0)]
    o, ht = getattr(mod, kernel)(*leaves[:-1], initial_state=leaves[-1], output_final_state=True, **kwargs)
    grads = torch.autograd.grad((o, ht), leaves, (d_o.to(o.dtype), d_ht))
    return o.detach(), ht.detach(), grads


def _oracle(rec, tensors, h0, d_o, d_ht, **kwargs):
    """The float64 oracle on the tensors' device: (o, ht, gradients or None)."""
    refs = [t.detach().double().requires_grad_(d_o is not None) for t in (*tensors, h0)]
    o, ht = reference.run(rec, *refs[:-1], initial_state=refs[-1], output_final_state=True, **kwargs)
    if d_o is None:
        return o, ht, None
    # d_o as the kernels get it (rounded to o's dtype, v's), so both differentiate the same loss
    return o, ht, torch.autograd.grad((o, ht), refs, (d_o.to(tensors[2].dtype).double(), d_ht.double()))


def _errors(rec, got, expected):
    o, ht, grads = got
    ref_o, ref_ht, ref_grads = expected
    errors = {"o": relative_error(o, ref_o), "ht": relative_error(ht, ref_ht)}
    if grads is not None:
        errors.update({f"d{n}": relative_error(a, b) for n, a, b in zip(_names(rec) + ["h0"], grads, ref_grads)})
    return errors


# -- two GPUs: every launch on its inputs' device ----------------------------------------------


@two_gpus
@pytest.mark.parametrize("name", ["gdn", "gdn_qwen35", "simple_gla", "kda"])
def test_two_gpus_tensors_on_the_second_while_the_first_is_current(name, generator):
    """Tensors on cuda:1 while cuda:0 is current: chunk (every plan, forward and backward) and
    recurrent run on cuda:1, leave cuda:0 current, and match the oracle."""
    rec, mod = recurrence(name), module(name)
    shape = Shape(2, 150, 2, 4, 128, 128)
    tensors = sample(rec, shape, torch.bfloat16, generator)
    h0 = torch.randn(shape.B, shape.HV, shape.K, shape.V, generator=generator)
    d_o = torch.randn(shape.B, shape.T, shape.HV, shape.V, generator=generator).bfloat16()  # as the kernels take it
    d_ht = torch.randn(h0.shape, generator=generator)  # seeded: --seed replays it
    chunked = hasattr(mod, "chunk")
    expected = _oracle(rec, tensors, h0, d_o if chunked else None, d_ht, use_qk_l2norm_in_kernel=True)
    second = [t.to("cuda:1") for t in (*tensors, h0, d_o, d_ht)]
    runs = [("recurrent", {})] + [("chunk", dict(plan=plan)) for plan in getattr(mod, "CHUNK_PLANS", ())]
    with torch.cuda.device(0):
        for kernel, options in runs:
            got = _run(mod, kernel, second[:-3], second[-3], second[-2] if chunked else None, second[-1],
                       use_qk_l2norm_in_kernel=True, **options)
            torch.cuda.synchronize(1)
            assert torch.cuda.current_device() == 0, f"{kernel} changed the current device"
            assert got[0].device == got[1].device == torch.device("cuda:1")
            assert got[2] is None or all(g.device == torch.device("cuda:1") for g in got[2])
            _check(f"{name} {kernel} {options} on cuda:1", _errors(rec, got, expected), skip=_per_head(rec))


@two_gpus
def test_two_gpus_layer_on_the_second_while_the_first_is_current(generator):
    """The Qwen3.5 layer (short convolution, gated RMSNorm, gdn_qwen35's kernels) on cuda:1 in
    fp32 while cuda:0 is current: prefill output and every gradient, then prefill + one-token
    steps through the cache (the convolution's update kernel, the recurrent kernel), vs the
    float64 oracle of the layer. The cache is lrdsl's own: the device guard is the point here, and
    the GPU machine's transformers need not have Qwen3.5's cache methods (one did not)."""
    from lrdsl.layers.gated_deltanet import GatedDeltaNetCache

    from test_layer import double_copy, grads, layer_pair, oracle

    ours, _ = layer_pair(generator, "cuda:1")
    x = torch.randn(2, 13, 32, generator=generator)
    exact = double_copy(ours)
    x_oracle = x.double().requires_grad_(True)
    out_oracle = oracle(exact, x_oracle)[0]
    seed = torch.randn(out_oracle.shape, generator=generator, dtype=torch.float64)
    expected = grads(exact, x_oracle, out_oracle, seed)
    with torch.cuda.device(0):
        x_ours = x.to("cuda:1").requires_grad_(True)
        out = ours(x_ours)
        got = grads(ours, x_ours, out, seed)
        cache = GatedDeltaNetCache()
        with torch.no_grad():
            stepped = torch.cat([ours(x_ours[:, :10].detach(), cache=cache)]
                                + [ours(x_ours[:, t : t + 1].detach(), cache=cache) for t in range(10, 13)], dim=1)
        torch.cuda.synchronize(1)
        assert torch.cuda.current_device() == 0
    errors = {"out": relative_error(out, out_oracle), "prefill + steps": relative_error(stepped, out_oracle)}
    errors.update({f"d{n}": relative_error(got[n], expected[n]) for n in got})
    _check("layer on cuda:1", errors, limit=FP32_LIMIT)


@two_gpus
def test_two_gpus_mixed_devices_are_one_clear_error(generator):
    rec, mod = recurrence("gdn"), module("gdn")
    q, k, v, g, beta = [t.to("cuda:0") for t in sample(rec, Shape(1, 8, 1, 2, 16, 16), torch.bfloat16, generator)]
    one_device = "; all tensors must share one device$"
    for kernel in ("chunk", "recurrent"):
        with pytest.raises(mod.InputError, match=rf"^gdn\.{kernel}: k is on cuda:1 but q is on cuda:0" + one_device):
            getattr(mod, kernel)(q, k.to("cuda:1"), v, g, beta)
        with pytest.raises(mod.InputError, match=rf"^gdn\.{kernel}: initial_state is on cuda:1 but q is on cuda:0$"):
            getattr(mod, kernel)(q, k, v, g, beta, initial_state=torch.zeros(1, 2, 16, 16, device="cuda:1"))
    kernels = layer_kernels()
    x = torch.zeros(1, 8, 16, device="cuda:0")  # only the device matters here
    with pytest.raises(kernels.InputError, match=r"^short_conv: weight is on cuda:1 but x is on cuda:0" + one_device):
        kernels.short_conv(x, torch.zeros(16, 4, device="cuda:1"))


# -- grids past 65,535 sequences x value heads -------------------------------------------------


def _normal(generator, *size):
    return torch.randn(*size, generator=generator, device="cuda", dtype=torch.bfloat16)


def _cuda_generator(generator):
    """A CUDA generator seeded from the test's (printed) seed: large inputs are drawn on the GPU."""
    return torch.Generator(device="cuda").manual_seed(int(torch.randint(2**31, (1,), generator=generator)))


def _sample_on_gpu(rec, shape, generator):
    """make_inputs's distributions (lrdsl.verification.workloads), drawn on the GPU: q, k, v normal; an input
    that is the log-decay uniform in [-0.5, 0], one that is beta uniform in (0, 1), others normal;
    gates and per-head inputs fp32, the rest bf16."""
    B, T, H, HV, K, V = shape.B, shape.T, shape.H, shape.HV, shape.K, shape.V
    sizes = {"B": B, "T": T, "HV": HV, "K": K}
    tensors = [_normal(generator, B, T, H, K), _normal(generator, B, T, H, K), _normal(generator, B, T, HV, V)]
    gate_inputs = {i.name for i in rec.formula_inputs(rec.log_decay)}
    for i in rec.inputs:
        size = [sizes[d] for d in i.role.shape]
        if str(rec.log_decay) == i.name:
            x = -0.5 * torch.rand(*size, generator=generator, device="cuda")
        elif str(rec.beta) == i.name:
            x = torch.rand(*size, generator=generator, device="cuda")
        else:
            x = torch.randn(*size, generator=generator, device="cuda")
        tensors.append(x if i.name in gate_inputs or not i.role.per_token else x.bfloat16())
    return tensors


def _batch_tail(tensors, count):
    """The last `count` batch elements of per-token tensors ([B, T, ...]); per-head ones whole."""
    return [t[-count:] if t.dim() >= 3 else t for t in tensors]


@pytest.mark.parametrize("name", ALL_SPECS)
def test_decode_2048_requests_32_value_heads(name, generator):
    """One token for each of 2,048 sequences with 32 value heads: 65,536 programs per block of
    value columns, one more than a grid's second axis holds. recurrent (and chunk, T = 1);
    the last 128 requests vs the oracle."""
    rec, mod = recurrence(name), module(name)
    shape = Shape(2048, 1, 16, 32, 128, 128)
    cuda = _cuda_generator(generator)
    tensors = _sample_on_gpu(rec, shape, cuda)
    h0 = torch.randn(shape.B, shape.HV, shape.K, shape.V, generator=cuda, device="cuda")
    expected = _oracle(rec, _batch_tail(tensors, 128), h0[-128:], None, None, use_qk_l2norm_in_kernel=True)
    for kernel in ["recurrent"] + (["chunk"] if hasattr(mod, "chunk") else []):
        o, ht, _ = _run(mod, kernel, tensors, h0, None, None, use_qk_l2norm_in_kernel=True)
        _check(f"{name} {kernel}: 2048 requests x 32 value heads, last 128",
               _errors(rec, (o[-128:], ht[-128:], None), expected))


def _sequence_slice(tensors, bounds, first):
    """The packed tokens of sequences first.. (and their bounds from 0): per-token tensors cut
    along T, per-head ones whole."""
    start = bounds[first]
    cut = [t[:, start:] if t.dim() >= 3 else t for t in tensors]
    return cut, torch.tensor([b - start for b in bounds[first:]], dtype=torch.int32)


@pytest.mark.parametrize("name", ["deltanet", "gdn", "gdn_qwen35", "linear_attn", "retnet", "simple_gla"])
def test_4096_short_varlen_sequences_16_value_heads(name, generator):
    """4,096 packed sequences of 0 to 12 tokens with 16 value heads: 65,536 scan programs per
    block of value columns. chunk (every plan, forward and backward) and recurrent; the last 64
    sequences vs the oracle."""
    rec, mod = recurrence(name), module(name)
    lengths = torch.randint(0, 13, (4096,), generator=generator)
    bounds = [0] + lengths.cumsum(0).tolist()
    shape = Shape(1, bounds[-1], 8, 16, 128, 128)
    cuda = _cuda_generator(generator)
    tensors = _sample_on_gpu(rec, shape, cuda)
    h0 = torch.randn(4096, shape.HV, shape.K, shape.V, generator=cuda, device="cuda")
    d_o = torch.randn(1, shape.T, shape.HV, shape.V, generator=cuda, device="cuda", dtype=torch.bfloat16)
    d_ht = torch.randn(h0.shape, generator=cuda, device="cuda")
    cu = torch.tensor(bounds, dtype=torch.int32, device="cuda")
    (*cut, cut_d_o), cut_cu = _sequence_slice([*tensors, d_o], bounds, 4096 - 64)
    expected = _oracle(rec, cut, h0[-64:], cut_d_o, d_ht[-64:], cu_seqlens=cut_cu, use_qk_l2norm_in_kernel=True)
    start = bounds[4096 - 64]
    runs = [("recurrent", {}, None)] + [("chunk", dict(plan=plan), d_o) for plan in mod.CHUNK_PLANS]
    runs += [("recurrent", {}, d_o)]  # its backward is the chunked one
    for kernel, options, seed in runs:
        o, ht, grads = _run(mod, kernel, tensors, h0, seed, d_ht, cu_seqlens=cu, use_qk_l2norm_in_kernel=True, **options)
        if grads is not None:
            grads = [g[:, start:] if g.dim() >= 3 else g for g in grads[:-1]] + [grads[-1][-64:]]
        got = (o[:, start:], ht[-64:], grads)
        reference_grads = expected if grads is not None else (*expected[:2], None)
        # per-head parameters' gradients sum over all 4,096 sequences: not comparable on a slice
        _check(f"{name} {kernel} {options} grads={seed is not None}: 4096 sequences x 16 value heads, last 64",
               _errors(rec, got, reference_grads), skip=_per_head(rec))


# -- fp32 and fp64 inputs: chunk sizes whose kernels fit -----------------------------------------


@pytest.mark.parametrize("dtype, K", [(torch.float32, 256), (torch.float64, 128), (torch.float64, 256)])
def test_wide_inputs_default_to_a_chunk_size_that_fits(dtype, K, generator):
    """fp32 and fp64 inputs multiply in their own width, in tiles too large for a block's shared
    memory at C = 64 (fp32 from K > 128 on, fp64 always): the default chunk size fits (chunk and
    the recurrent backward, the chunked one, vs the oracle) and chunk_size=64 is one clear error."""
    rec, mod = recurrence("gdn"), module("gdn")
    shape = Shape(1, 100, 1, 2, K, K)
    tensors = [t.cuda() for t in sample(rec, shape, dtype, generator)]
    h0 = torch.randn(1, 2, K, K, generator=generator, dtype=dtype).cuda()
    d_o = torch.randn(1, 100, 2, K, generator=generator, dtype=dtype).cuda()
    d_ht = torch.randn(h0.shape, generator=generator, dtype=dtype).cuda()  # seeded: --seed replays it
    expected = _oracle(rec, tensors, h0, d_o, d_ht, use_qk_l2norm_in_kernel=True)
    for kernel in ("chunk", "recurrent"):
        got = _run(mod, kernel, tensors, h0, d_o, d_ht, use_qk_l2norm_in_kernel=True)
        _check(f"gdn {kernel} {dtype} K=V={K}", _errors(rec, got, expected), limit=FP32_LIMIT)
    with pytest.raises(mod.InputError, match=rf"chunk_size=64 with precision='input' and K={K} \({dtype} inputs\) needs more shared memory"):
        mod.chunk(*tensors, chunk_size=64)


# -- tensors past 2**31 elements ---------------------------------------------------------------

# B·T·HV·V = B·T·H·K = 513 · 2**22 = 2**31 + 2**22 elements: the last batch element lies wholly
# past 2**31, where an int32 offset wraps. bf16: 4.3 GB per such tensor; the backward's peak,
# with its fp32 gradients and the buffers its forward re-runs, is about 100 GB.
LARGE = Shape(513, 2048, 32, 32, 64, 64)


@pytest.fixture
def large_inputs(generator):
    rec = recurrence("gdn")
    cuda = _cuda_generator(generator)
    tensors = _sample_on_gpu(rec, LARGE, cuda)
    h0 = torch.randn(LARGE.B, LARGE.HV, LARGE.K, LARGE.V, generator=cuda, device="cuda")
    torch.cuda.reset_peak_memory_stats()
    yield rec, tensors, h0, cuda
    del tensors, h0
    torch.cuda.empty_cache()


@pytest.mark.parametrize("kernel", ["chunk", "recurrent"])
def test_large_tensors_forward(kernel, large_inputs):
    rec, tensors, h0, _ = large_inputs
    assert tensors[0].numel() > 2**31 and tensors[2].numel() > 2**31
    o, ht, _ = _run(module("gdn"), kernel, tensors, h0, None, None, use_qk_l2norm_in_kernel=True)
    finite = bool(torch.isfinite(o).all()) and bool(torch.isfinite(ht).all())
    expected = _oracle(rec, _batch_tail(tensors, 1), h0[-1:], None, None, use_qk_l2norm_in_kernel=True)
    print(f"  peak GPU memory {torch.cuda.max_memory_allocated() / 1e9:.1f} GB")
    assert finite, f"{kernel}: outputs not finite"
    _check(f"gdn {kernel} {LARGE}: last batch element", _errors(rec, (o[-1:], ht[-1:], None), expected))


@pytest.mark.parametrize("kernel", ["chunk", "recurrent"])
def test_large_tensors_backward(kernel, large_inputs):
    rec, tensors, h0, cuda = large_inputs
    d_o = torch.randn(LARGE.B, LARGE.T, LARGE.HV, LARGE.V, generator=cuda, device="cuda", dtype=torch.bfloat16)
    d_ht = torch.randn(h0.shape, generator=cuda, device="cuda")
    o, ht, grads = _run(module("gdn"), kernel, tensors, h0, d_o, d_ht, use_qk_l2norm_in_kernel=True)
    print(f"  peak GPU memory {torch.cuda.max_memory_allocated() / 1e9:.1f} GB")
    assert all(bool(torch.isfinite(g).all()) for g in grads), f"{kernel}: gradients not finite"
    expected = _oracle(rec, _batch_tail(tensors, 1), h0[-1:], d_o[-1:], d_ht[-1:], use_qk_l2norm_in_kernel=True)
    got = (o[-1:], ht[-1:], _batch_tail(grads[:-1], 1) + [grads[-1][-1:]])
    _check(f"gdn {kernel} {LARGE} gradients: last batch element", _errors(rec, got, expected))
