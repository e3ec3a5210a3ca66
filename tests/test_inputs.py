"""Bad tensors at call time: one clear InputError naming the tensor and the expected shape."""
from __future__ import annotations

import pytest
import torch

from lrdsl.verification.workloads import Shape, make_inputs

from helpers import module, recurrence

SHAPE = Shape(1, 5, 2, 4, 8, 8)


@pytest.fixture
def gdn(generator):
    rec = recurrence("gdn")
    return module("gdn"), make_inputs(rec, SHAPE, generator=generator)


def call_error(mod, *args, **kwargs) -> str:
    with pytest.raises(mod.InputError) as info:
        mod.recurrent(*args, **kwargs)
    message = str(info.value)
    assert "\n" not in message and message.startswith("gdn.recurrent: ")
    return message


def test_wrong_rank(gdn):
    mod, (q, k, v, g, beta) = gdn
    assert "q must be [B, T, H, K], got [5, 2, 8]" in call_error(mod, q[0], k, v, g, beta)


def test_k_shape_differs(gdn):
    mod, (q, k, v, g, beta) = gdn
    assert "k must be [B, T, H, K] = [1, 5, 2, 8] like q, got [1, 5, 2, 4]" in call_error(mod, q, k[..., :4], v, g, beta)


def test_v_length_differs(gdn):
    mod, (q, k, v, g, beta) = gdn
    assert "v must be [B, T, HV, V] with B=1, T=5" in call_error(mod, q, k, v[:, :4], g, beta)


def test_value_heads_not_a_multiple(gdn):
    mod, (q, k, v, g, beta) = gdn
    message = call_error(mod, q, k, v[:, :, :3], g[..., :3], beta[..., :3])
    assert "HV=3 must be a positive multiple of the key heads H=2" in message


def test_gate_shape(gdn):
    mod, (q, k, v, g, beta) = gdn
    assert "g must be [B, T, HV] = [1, 5, 4], got [1, 5, 2]" in call_error(mod, q, k, v, g[..., :2], beta)


def test_batch_with_cu_seqlens(generator):
    rec = recurrence("gdn")
    q, k, v, g, beta = make_inputs(rec, Shape(2, 5, 2, 4, 8, 8), generator=generator)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    message = call_error(module("gdn"), q, k, v, g, beta, cu_seqlens=cu)
    assert "with cu_seqlens the batch must be 1" in message and "B=2" in message


def test_cu_seqlens_dtype(gdn):
    mod, (q, k, v, g, beta) = gdn
    message = call_error(mod, q, k, v, g, beta, cu_seqlens=torch.tensor([0.0, 5.0]))
    assert "cu_seqlens must be int32 or int64" in message


def test_cu_seqlens_values(gdn):
    mod, (q, k, v, g, beta) = gdn
    message = call_error(mod, q, k, v, g, beta, cu_seqlens=torch.tensor([0, 4, 3, 5]))
    assert "cu_seqlens must rise from 0 to T=5" in message


def test_initial_state_shape(gdn):
    mod, (q, k, v, g, beta) = gdn
    message = call_error(mod, q, k, v, g, beta, initial_state=torch.zeros(1, 4, 8, 7))
    assert "initial_state must be [N, HV, K, V] = [1, 4, 8, 8], got [1, 4, 8, 7]" in message


def test_different_devices(gdn):
    mod, (q, k, v, g, beta) = gdn
    message = call_error(mod, q, k, v, g.to("meta"), beta)
    assert "g is on meta but q is on cpu" in message


def test_integer_dtype(gdn):
    mod, (q, k, v, g, beta) = gdn
    assert "v must be float32, float16, bfloat16 or float64, got torch.int64" in call_error(mod, q, k, v.long(), g, beta)


def test_mixed_qkv_dtypes(gdn):
    mod, (q, k, v, g, beta) = gdn
    assert "q, k, v must share one dtype" in call_error(mod, q, k.half(), v, g, beta)


def test_not_a_tensor(gdn):
    mod, (q, k, v, g, beta) = gdn
    assert "beta must be a torch.Tensor, got list" in call_error(mod, q, k, v, g, [0.5])


def test_bad_scale(gdn):
    mod, (q, k, v, g, beta) = gdn
    assert "scale must be a finite number" in call_error(mod, q, k, v, g, beta, scale=float("nan"))


def test_head_dim_too_large(generator):
    rec = recurrence("gdn")
    q, k, v, g, beta = make_inputs(rec, Shape(1, 2, 1, 1, 300, 8), generator=generator)
    assert "head dims K=300, V=8 must lie in 1..256" in call_error(module("gdn"), q, k, v, g, beta)


def test_missing_positional_argument(gdn):
    mod, (q, k, v, g, beta) = gdn
    with pytest.raises(TypeError, match="beta"):
        mod.recurrent(q, k, v, g)


def test_tf32_chunk_size_default_and_limit(device):
    """precision="tf32" takes chunk_size 32 by default; 64 does not fit a GPU block's shared
    memory with fp32 operands and is refused with one line naming the limit."""
    import pytest
    import torch

    from helpers import module

    mod = module("gdn")
    q = torch.randn(1, 40, 1, 16, device=device)
    v = torch.randn(1, 40, 2, 16, device=device)
    g, beta = -torch.rand(1, 40, 2, device=device), torch.rand(1, 40, 2, device=device)
    from lrdsl import reference
    from lrdsl.verification.workloads import relative_error

    from helpers import recurrence

    o, _ = mod.chunk(q, q, v, g, beta, precision="tf32")
    expected, _ = reference.run(recurrence("gdn"), q.double(), q.double(), v.double(), g.double(), beta.double())
    assert relative_error(o, expected) <= 2e-3
    with pytest.raises(mod.InputError, match="chunk_size <= 32"):
        mod.chunk(q, q, v, g, beta, precision="tf32", chunk_size=64)


@pytest.mark.parametrize("name", ["kda", "kda_fused_gate", "kda_neg_eigval"])
def test_key_channel_delta_chunk_size_follows_key_width(name, generator, device):
    """The delta rule's backward with per-key-channel decayed products (5 in its output kernel):
    at K > 128 that kernel does not fit an sm_90 block at C = 64, so chunk() defaults to 32 there
    and refuses 64 in one line; at K <= 128 it keeps 64. The rule comes from the backward program
    (how many decayed products its output kernel computes), not the spec's name."""
    from lrdsl import reference
    from lrdsl.verification.workloads import relative_error

    mod, rec = module(name), recurrence(name)
    assert mod.largest_chunk_size(128) == 64 and mod.largest_chunk_size(129) == 32
    assert mod.largest_chunk_size(128, "tf32") == 32 and mod.largest_chunk_size(256, "tf32") == 32
    tensors = [t.to(device) for t in make_inputs(rec, Shape(1, 5, 1, 1, 136, 8), generator=generator)]
    with pytest.raises(mod.InputError) as info:
        mod.chunk(*tensors, chunk_size=64)
    message = str(info.value)
    assert "\n" not in message and message == (
        f"{name}.chunk: chunk_size=64 with precision='input' and K=136 needs more shared memory than a GPU "
        "block has: use chunk_size <= 32")
    o, _ = mod.chunk(*tensors)  # the default: 32
    expected, _ = reference.run(rec, *(t.double() for t in tensors))
    assert relative_error(o, expected) <= 2e-3


@pytest.mark.parametrize("name", ["gdn", "gla"])
def test_chunk_size_with_few_decayed_products_keeps_64_at_wide_keys(name):
    mod = module(name)
    assert mod.largest_chunk_size(256) == 64 and mod.largest_chunk_size(256, "tf32") == 32


def test_dplr_chunk_size(generator, device):
    """rwkv7's backward output kernel computes 10 decayed products: 434,176 bytes at C = 64,
    K = 128, so 32 (16 with tf32) at every K, and 64 is refused in one line; with tf32 at K > 128
    not even 16 fits (235,520 bytes at K = 256), so that precision is refused there."""
    mod, rec = module("rwkv7"), recurrence("rwkv7")
    assert [mod.largest_chunk_size(K, p) for K in (64, 256) for p in ("input", "tf32")] == [32, 16, 32, None]
    tensors = [t.to(device) for t in make_inputs(rec, Shape(1, 5, 1, 1, 8, 8), generator=generator)]
    with pytest.raises(mod.InputError, match=r"^rwkv7.chunk: chunk_size=64 with precision='input' and K=8 needs more "
                                             r"shared memory than a GPU block has: use chunk_size <= 32$"):
        mod.chunk(*tensors, chunk_size=64)
    wide = [t.to(device) for t in make_inputs(rec, Shape(1, 5, 1, 1, 200, 8), generator=generator)]
    with pytest.raises(mod.InputError, match=r"^rwkv7.chunk: precision='tf32' with K=200 needs more shared memory than "
                                             r"a GPU block has at every chunk size: use precision='input' or K <= 128$"):
        mod.chunk(*wide, precision="tf32")
