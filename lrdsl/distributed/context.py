"""Which pieces of which packed sequences a rank holds: build_cp_context and its CPContext.

The batch is one packed row (B = 1) of T tokens with global cu_seqlens (FLA's meaning: sequence
n is tokens cu_seqlens[n]:cu_seqlens[n + 1]); rank r of a group of W holds tokens
[r * T / W, (r + 1) * T / W). A sequence crossing a slice boundary is cut into pieces, one per
rank it touches. Every rank computes the whole layout from cu_seqlens alone, so building a
context exchanges nothing: the exchange happens in chunk() (lrdsl/distributed/chunk.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import InputError


def _fail(message: str):
    raise InputError(f"build_cp_context: {message}")


@dataclass(frozen=True)
class CPContext:
    """This rank's slice of a packed batch (FLA's FLACPContext, plus what initial and final states need).

    group, rank, world_size: the process group and this rank in it.
    cu_seqlens [n + 1] (the global cu_seqlens' dtype and device), cu_seqlens_cpu (its host copy):
        the local pieces, in local token offsets: what chunk() runs on. Pass `cu_seqlens=None`
        (or this very tensor) to chunk() with cp_context.
    num_tokens: the local slice's length, T / world_size.
    sequence_ids: the global index of the sequence of each local piece.
    pre_num_ranks: how many earlier ranks hold pieces of this rank's first sequence (0: it starts
        here); post_num_ranks: how many later ranks hold pieces of its last sequence (0: it ends
        here). is_first_rank = pre_num_ranks == 0, is_last_rank = post_num_ranks == 0 (FLA's names).
    first_sequence_ranks, last_sequence_ranks: the ranks sharing the first / last local sequence.
    initial_state_ids: the global indices of the sequences that START on this rank, in order:
        chunk(..., initial_state=h0[initial_state_ids]) takes their initial states (a sequence's
        initial state goes to the rank holding its first token, and its gradient comes back there).
    final_state_ids: the global indices of the sequences that END on this rank, in order:
        chunk(..., output_final_state=True) returns exactly their final states, so every final
        state is returned once, by the rank holding the sequence's last token.
    conv1d_kernel_size, pre_num_conv_tokens: FLA's short-convolution halo (the tokens of the first
        sequence an earlier rank holds that a causal convolution of that width reads:
        min(width - 1, tokens on earlier ranks)); recorded, not used by chunk().
    continues: for every rank of the group, whether its first piece continues a sequence begun
        on an earlier rank (the chain of state maps in chunk() reads it).
    """

    group: object
    rank: int
    world_size: int
    cu_seqlens: torch.Tensor
    cu_seqlens_cpu: torch.Tensor
    num_tokens: int
    sequence_ids: tuple[int, ...]
    pre_num_ranks: int
    post_num_ranks: int
    initial_state_ids: tuple[int, ...]
    final_state_ids: tuple[int, ...]
    conv1d_kernel_size: int | None = None
    pre_num_conv_tokens: int = 0
    continues: tuple[bool, ...] = field(default=(), repr=False)

    @property
    def is_first_rank(self) -> bool:
        return self.pre_num_ranks == 0

    @property
    def is_last_rank(self) -> bool:
        return self.post_num_ranks == 0

    @property
    def first_sequence_ranks(self) -> tuple[int, ...]:
        return tuple(range(self.rank - self.pre_num_ranks, self.rank + 1))

    @property
    def last_sequence_ranks(self) -> tuple[int, ...]:
        return tuple(range(self.rank, self.rank + self.post_num_ranks + 1))

    def run_chunk(self, chunk, tensors, options):
        """A generated module's chunk() on this rank's slice: what chunk(..., cp_context=self) calls."""
        from .chunk import context_parallel_chunk  # chunk.py imports torch.distributed's collectives

        return context_parallel_chunk(self, chunk, tensors, options)


def build_cp_context(cu_seqlens, group=None, conv1d_kernel_size=None, cu_seqlens_cpu=None) -> CPContext:
    """This rank's CPContext for a packed batch with global `cu_seqlens` [N + 1] (FLA's signature).

    group: the torch.distributed process group the batch is split over (None: the default group);
    its size must divide the number of tokens. cu_seqlens_cpu: the host copy of cu_seqlens (else
    it is copied to the host once: one synchronisation). Sequences must not be empty.
    """
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        _fail("torch.distributed is not initialised: call torch.distributed.init_process_group first")
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        _fail("cu_seqlens must be a 1-D tensor [N + 1] of sequence boundaries, N >= 1")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        _fail(f"cu_seqlens must be int32 or int64, got {cu_seqlens.dtype}")
    if conv1d_kernel_size is not None and (not isinstance(conv1d_kernel_size, int) or conv1d_kernel_size < 1):
        _fail(f"conv1d_kernel_size must be a positive int or None, got {conv1d_kernel_size!r}")
    host = cu_seqlens.detach().cpu() if cu_seqlens_cpu is None else cu_seqlens_cpu
    if host.shape != cu_seqlens.shape or host.device.type != "cpu":
        _fail("cu_seqlens_cpu must be the host copy of cu_seqlens")
    bounds = [int(x) for x in host.tolist()]
    if bounds[0] != 0:
        _fail(f"cu_seqlens must start at 0, got {bounds[0]}")
    if any(b <= a for a, b in zip(bounds, bounds[1:])):
        n = next(i for i, (a, b) in enumerate(zip(bounds, bounds[1:])) if b <= a)
        _fail(f"sequence {n} is empty or cu_seqlens decreases there ({bounds[n]} -> {bounds[n + 1]}): "
              f"context parallelism takes non-empty sequences")
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    total = bounds[-1]
    if total % world:
        _fail(f"{total} tokens do not split evenly over {world} ranks")
    local = total // world
    starts = set(bounds)
    # rank r's first piece continues a sequence begun earlier where its first token starts none
    continues = tuple(r * local not in starts for r in range(world))
    lo, hi = rank * local, (rank + 1) * local
    ids = [n for n in range(len(bounds) - 1) if bounds[n] < hi and bounds[n + 1] > lo]
    pieces = [0] + [min(bounds[n + 1], hi) - lo for n in ids]
    pre = 0
    while rank - pre > 0 and continues[rank - pre]:
        pre += 1
    post = 0
    while rank + post + 1 < world and continues[rank + post + 1]:
        post += 1
    first = ids[0]
    conv_tokens = 0 if conv1d_kernel_size is None else min(conv1d_kernel_size - 1, lo - bounds[first])
    local_cpu = torch.tensor(pieces, dtype=cu_seqlens.dtype)  # the global one's dtype (FLA: int64)
    return CPContext(
        group=group, rank=rank, world_size=world,
        cu_seqlens=local_cpu.to(cu_seqlens.device), cu_seqlens_cpu=local_cpu, num_tokens=local,
        sequence_ids=tuple(ids), pre_num_ranks=pre, post_num_ranks=post,
        initial_state_ids=tuple(ids[1:] if pre else ids), final_state_ids=tuple(ids[:-1] if post else ids),
        conv1d_kernel_size=conv1d_kernel_size, pre_num_conv_tokens=conv_tokens, continues=continues,
    )
