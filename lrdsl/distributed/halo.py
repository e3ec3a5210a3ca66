"""A causal convolution on one rank's slice: the halo of tokens its first piece needs from earlier ranks.

A causal convolution of width W reads, at a sequence's first local token, the W - 1 tokens
before it; where the sequence began on an earlier rank, those live there. Each rank's last
W - 1 tokens go to every rank in one all_gather (the backward: an all_reduce of their
gradients, which hands each rank the gradient of its own tail); a rank whose first piece
continues prepends the last `pre_num_conv_tokens` of them (the context's, FLA's meaning) to that
piece, runs the convolution, and drops the halo's outputs. The same markers as chunk.py's keep
every rank's backward calling the collective once, in order.
"""
from __future__ import annotations

import torch

from ..errors import InputError
from .chunk import _Anchor, _Tie, _all_gather


def causal_conv_with_halo(conv, x, ctx):
    """conv(x', cu_seqlens') [1, T', D] on this rank's tokens x [1, T, D] with the halo from the
    earlier ranks prepended to the first piece (x', cu_seqlens': the context's pieces, the first
    one longer by the halo), the halo's rows dropped: [1, T, D]. `conv` takes (x, cu_seqlens) and
    returns the convolution's output (a packed causal convolution, such as the Qwen3.5 layer's)."""
    W = ctx.conv1d_kernel_size
    if W is None:
        raise InputError("causal_conv_with_halo: the context has no conv1d_kernel_size: build it with "
                         "build_cp_context(..., conv1d_kernel_size=W)")
    if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[0] != 1 or x.shape[1] != ctx.num_tokens:
        got = list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise InputError(f"causal_conv_with_halo: x must be [1, {ctx.num_tokens}, D] (this rank's slice), got {got}")
    width = max(W - 1, 1)  # the tail each rank sends (one row even for W = 1, which needs none)
    T, D = x.shape[1], x.shape[2]
    tail = x[0, max(T - width, 0):]
    if tail.shape[0] < width:  # a slice shorter than the halo: zeros before it (never read)
        tail = torch.cat([tail.new_zeros(width - tail.shape[0], D), tail])
    training = torch.is_grad_enabled() and x.requires_grad
    if training:
        tail = _Tie.apply(tail, x)
    tails = _all_gather(tail, ctx)  # [world, width, D]
    h = ctx.pre_num_conv_tokens
    if h == 0:
        y = conv(x, ctx.cu_seqlens)
    else:
        first = ctx.rank - ctx.pre_num_ranks
        # the earlier ranks' tokens of this sequence, in order; only the last h are read, and a rank
        # holding fewer than W - 1 tokens sends all of them, so these are contiguous tokens
        before = torch.cat([tails[r, max(width - ctx.num_tokens, 0):] for r in range(first, ctx.rank)])[-h:]
        cu = torch.cat([ctx.cu_seqlens[:1], ctx.cu_seqlens[1:] + h])
        y = conv(torch.cat([before[None].to(x.dtype), x], dim=1), cu)[:, h:]
    if training:
        y = _Anchor.apply(y, tails)
    return y
