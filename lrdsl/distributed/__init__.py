"""Context parallelism on torch.distributed: one packed batch cut into contiguous token slices,
one per rank, run through every generated module's chunk() (docs/design.md §9).

    ctx = lrdsl.distributed.build_cp_context(cu_seqlens, group)   # global cu_seqlens, FLA's meaning
    o, ht = module.chunk(q, k, v, ..., cp_context=ctx)            # this rank's slice of tokens

context.py: which pieces of which sequences a rank holds (host arithmetic on cu_seqlens, no
communication). chunk.py: the exchange of state maps that lets every rank start its first piece
from the state the earlier ranks leave it, forward and backward (autograd through one
all_gather). halo.py: a causal convolution's halo of tokens from the earlier ranks (the Qwen3.5
layer's short convolution).
"""
from .context import CPContext, build_cp_context
from .halo import causal_conv_with_halo

__all__ = ["CPContext", "build_cp_context", "causal_conv_with_halo"]
