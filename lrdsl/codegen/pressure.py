"""Register pressure of a chunk kernel: the most tile bytes one program holds at once.

A kernel's values are tiles (C x K, C x V blocks, C x C, K x V blocks, C-vectors). What the
compiler cannot keep in a program's registers it spills to local memory, and a kernel that spills
in its inner work runs several times slower (BENCHMARKS.md: the backward output kernel). This
walks a kernel body in the order codegen emits it (schedule.place_values: plain segments and V
loops; schedule.eager_sums: running sums) and adds up the tiles live at each point:
    a value lives from its definition to its last reader (a value read inside a V loop lives to
    the end of that loop; a sum over V lives from the start of its loop); a term summed eagerly
    dies at once; a result written out and not read again dies at once; the q/k gradients a
    key-head program sums over its value heads live through the whole kernel. A reader is what
    the emitted code reads (schedule.emitted_args: an L2-norm adjoint reads the normalised rows,
    an exclusive suffix sum its inclusive sibling),
    and a tile held in its stored dtype (KernelContext.in_storage_dtype) counts at the inputs'
    width, as does an input loaded a V loop ahead of its segment (schedule.loads_issued_early)
    until its conversion.
The estimate counts values, not Triton's temporaries or layout conversions, so it is a lower
bound; its use is comparing chunk sizes and kernels of one spec, not predicting spills exactly.
"""
from __future__ import annotations

from ..passes.plan import FP32_BUFFER_SHAPES
from .kernels import key_head_results
from .schedule import eager_sums, is_loadable, loads_issued_early, place_values, readers

ACC_BYTES = 4  # a tile's elements are fp32 unless a loaded value stays in the matmul dtype


def _elements(ctx, value: str, dims: dict[str, int]) -> int:
    size = 1
    for axis in ctx.shape(value):
        size *= dims[axis]
    return size


def _tile_bytes(ctx, value: str, dims: dict[str, int], operand_bytes: int) -> int:
    size = _elements(ctx, value, dims)
    kept_as_operand = is_loadable(ctx, value) and ctx.load_dtype(value) == "DOT_DTYPE"
    # a tile held in the dtype it is stored in: the inputs' width, but for the buffers kept in fp32
    kept_as_stored = ctx.in_storage_dtype(value) and ctx.shape(value) not in FP32_BUFFER_SHAPES
    return size * (operand_bytes if kept_as_operand or kept_as_stored else ACC_BYTES)


Point = tuple[int, int]  # (segment: 2 x plain index, or 2 x loop index + 1; position within it)


def live_ranges(ctx, place: dict, eager: dict) -> dict[str, tuple[Point, Point]]:
    """Each value's (first, last) point alive in the kernel body, from the schedule's placement
    and its reader lists (schedule.readers, built from schedule.emitted_args): the same answer
    to "who reads this tile" that placed it. A running sum's range starts at its first term."""
    order = {value: i for i, value in enumerate(ctx.kernel.computes)}

    def start(value: str) -> tuple:
        kind, index = place[value]
        if kind == "sum":
            return (2 * index + 1, -1)  # zeroed before its loop, accumulated through it
        return (2 * index + (kind == "loop"), order[value])

    def end(value: str) -> tuple:
        if value in eager:
            return start(value)  # added to its running sum as soon as it exists
        ends = [start(value)]
        for reader in readers(ctx, value):
            kind, index = place[reader]
            if kind in ("loop", "sum") and place[value][0] == "plain" or kind == "sum":
                ends.append((2 * index + 1, len(order)))  # read in every iteration of the loop
            else:
                ends.append(start(reader))
        return max(ends)

    ranges = {value: (start(value), end(value)) for value in ctx.kernel.computes}
    for total in {total for total, _ in eager.values()}:  # a running sum lives from its first term on
        ranges[total] = (min(start(t) for t, (s, _) in eager.items() if s == total), end(total))
    return ranges


def peak_tile_bytes(ctx, chunk: int, head_dim: int, block_v: int, operand_bytes: int = 2) -> int:
    """The most tile bytes live at once in one program of a chunk-parallel kernel (K = V =
    head_dim, V tiles block_v wide, matmul operands of operand_bytes per element)."""
    place, _ = place_values(ctx)
    eager = ctx.eager = eager_sums(ctx, place)
    dims = {"C": chunk, "K": head_dim, "V": block_v}
    order = {value: i for i, value in enumerate(ctx.kernel.computes)}
    ranges = live_ranges(ctx, place, eager)
    intervals = [(first, last, _tile_bytes(ctx, v, dims, operand_bytes)) for v, (first, last) in ranges.items()]
    # inputs loaded a V loop ahead of their segment: held unconverted (16 bits for 16-bit inputs)
    # from the end of the segment before that loop to their conversion
    for value, index in loads_issued_early(ctx, place).items():
        intervals.append(((2 * index - 2, len(order)), ranges[value][0], _elements(ctx, value, dims) * operand_bytes))
    # the q/k gradients a key-head program sums over its value heads
    group_sums = sum(_tile_bytes(ctx, value, dims, operand_bytes) for _, value in key_head_results(ctx))
    points = sorted({s for s, _, _ in intervals})
    return group_sums + max((sum(b for s, e, b in intervals if s <= p <= e) for p in points), default=0)
