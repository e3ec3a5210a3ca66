"""Where in a chunk kernel each value is computed, chosen to keep few tiles live at once.

A chunk-parallel kernel's body is a sequence of plain segments and loops over blocks of BV value
columns: plain 0, loop 0, plain 1, loop 1, ... Every value gets a place:
    ("plain", i)  computed in plain segment i (no V axis)
    ("loop", i)   computed inside V loop i (a tile with a V axis: one BV block at a time)
    ("sum", i)    a value without a V axis read from V tiles: accumulated inside loop i, ready in
                  plain segment i + 1

Registers are what a kernel runs out of first (a tile the compiler cannot keep in registers is
spilled to local memory, which costs more than recomputing it), so two rules keep tiles short-lived:
  - sinking: a plain value moves down to the last segment before its first reader, so a tile
    read only after a V loop is not held across it;
  - eager sums: a gradient summed from several contributions (d_k = d_k_via_QKt + d_k_via_KKt
    + ...) is accumulated as each contribution is computed, so one running tile lives instead
    of every contribution until the last one exists.
Loads are the exception to sinking's "as late as possible": an input read first after a V loop
is loaded before that loop (loads_issued_early), 16 bits held to hide the memory latency.
"""
from __future__ import annotations

import sympy

from ..errors import CompileError
from ..ir.chunk import Cumsum, Formula, Load, MatMul, Normalize, NormalizeGrad, ReduceSum

Place = tuple[str, int]


def has_v(shape) -> bool:
    return "V" in shape


def is_loadable(ctx, value: str) -> bool:
    """Values a kernel can (re)load wherever it needs them: call inputs and buffers."""
    return value in ctx.kernel.loads or isinstance(ctx.prog.op(value), Load)


def inclusive_sibling(ctx, value: str) -> str | None:
    """For an exclusive suffix sum of a C vector (a scalar gate's decay to the chunk's end): the
    inclusive prefix sum s of the same values that this kernel computes before it, or None. Its
    emitter then takes the difference sum_{j > i} x_j = (the chunk's total) - s_i instead of a
    C x C masked sum per row.

    Not for C x K gates: their exclusive sums are a gather and a scan either way, and as
    differences ptxas compiled rwkv7's backward output kernel (C = 16, 16 warps) with 32
    registers and 4.3 KB of spills per thread instead of 128 and 1.3 KB (lrdsl resources;
    tests/test_resources.py). (The exclusive prefix sums, the low-rank update's, are C x K.)"""
    op = ctx.prog.op(value)
    if not isinstance(op, Cumsum) or not (op.exclusive and op.reverse) or op.shape != ("C",):
        return None
    for other in ctx.kernel.computes:
        if other == value:
            return None
        candidate = ctx.prog.op(other)
        if isinstance(candidate, Cumsum) and candidate.x == op.x and not candidate.reverse and not candidate.exclusive:
            return other
    return None


def normalized_here(ctx, x: str) -> str | None:
    """The value this kernel normalises `x` into, if it does (its rows are the unit vectors): the
    adjoint of that normalisation then reads those rows and their norms instead of x."""
    for value in ctx.kernel.computes:
        op = ctx.prog.op(value)
        if isinstance(op, Normalize) and op.x == x:
            return value
    return None


def emitted_args(ctx, value: str) -> tuple[str, ...]:
    """The values an op's emitted code reads: its arguments, with two exceptions where the emitter
    reads a neighbour instead (the one answer placement, reader lists and the register-pressure
    estimate all use, so they agree on how long each tile lives):
      - the adjoint of a normalisation this kernel computes reads the normalised rows (and their
        norms), not the raw ones (normalized_here);
      - an exclusive suffix sum taken as a difference reads its inclusive sibling, and the
        chunk's total from it, not the summed values (inclusive_sibling).
    Every emitter that starts to read another value than its arguments adds it here."""
    op = ctx.prog.op(value)
    if isinstance(op, NormalizeGrad) and (normalized := normalized_here(ctx, op.x)) is not None:
        return (normalized, op.dy)
    if (sibling := inclusive_sibling(ctx, value)) is not None:
        return (sibling,)
    return tuple(op.args())


def reader_index(ctx) -> dict[str, list[str]]:
    """value -> the values this kernel computes whose code reads it (emitted_args), in program
    order: built once per kernel (KernelContext.reader_index), read many times."""
    index: dict[str, list[str]] = {}
    for value in ctx.kernel.computes:
        for arg in dict.fromkeys(emitted_args(ctx, value)):
            index.setdefault(arg, []).append(value)
    return index


def readers(ctx, value: str) -> list[str]:
    return ctx.reader_index.get(value, [])


def place_values(ctx) -> tuple[dict[str, Place], set[str]]:
    """(place of every value the kernel computes, the values summed over V).

    Each value first goes to the earliest segment its arguments allow; plain values then sink.
    """
    place: dict[str, Place] = {}
    accumulators = set()

    def ready(arg: str) -> int:
        """The earliest segment (plain or loop index) at which `arg` can be read."""
        if is_loadable(ctx, arg):
            return 0
        kind, index = place[arg]
        return index + 1 if kind == "sum" else index

    for value in ctx.kernel.computes:
        op = ctx.prog.op(value)
        if is_loadable(ctx, value) and not has_v(op.shape):
            place[value] = ("plain", 0)
            continue
        if has_v(op.shape):
            index = max([ready(a) for a in op.args()], default=0)
            for arg in op.args():
                if not is_loadable(ctx, arg) and place[arg][0] == "loop" and place[arg][1] != index:
                    raise CompileError(f"{ctx.prog.recurrence.name}: {value} needs the V tile {arg} of an earlier V loop")
            place[value] = ("loop", index)
        elif any(has_v(ctx.shape(a)) for a in op.args()):
            if not isinstance(op, (MatMul, ReduceSum)):
                raise CompileError(f"{ctx.prog.recurrence.name}: {value} sums over V but is no matmul or sum")
            place[value] = ("sum", max(ready(a) for a in op.args()))
            accumulators.add(value)
        else:
            place[value] = ("plain", max([ready(a) for a in emitted_args(ctx, value)], default=0))
    _sink_plain_values(ctx, place)
    return place, accumulators


def loads_issued_early(ctx, place: dict[str, Place]) -> dict[str, int]:
    """value -> plain segment i (i > 0) for the call inputs a kernel reads first in segment i:
    their loads are issued at the end of segment i - 1, ahead of V loop i - 1, in the dtype they
    are stored in, and converted in segment i where the value is placed. A chunk kernel runs few
    programs per multiprocessor, so a load issued where its tile is first read stalls the program
    for the whole memory latency; issued before the loop it arrives while the loop works (gdn's
    backward output kernel loads q, k and g after its V loop: forward + backward 2-3 % faster,
    BENCHMARKS.md round 20). One loop ahead only: a tile held across several loops would cost
    registers through all of them."""
    early = {}
    for value in ctx.kernel.computes:
        op = ctx.prog.op(value)
        kind, index = place[value]
        if isinstance(op, Load) and op.reads_memory and kind == "plain" and index > 0:
            early[value] = index
    return early


def first_reader_segment(ctx, place: dict[str, Place], value: str) -> int | None:
    """The segment index before which `value` must be ready: a reader in plain segment i or in
    V loop i (a sum accumulates in loop i) needs it in plain segment i. None: no reader here."""
    return min((place[v][1] for v in readers(ctx, value)), default=None)


def _sink_plain_values(ctx, place: dict[str, Place]) -> None:
    """Move each plain value down to the last plain segment before its first reader. Readers
    are placed first (reverse program order), so a chain sinks together."""
    for value in reversed(ctx.kernel.computes):
        kind, index = place[value]
        if kind != "plain":
            continue
        first = first_reader_segment(ctx, place, value)
        if first is not None and first > index:
            place[value] = ("plain", first)


def _sum_terms(op) -> list[str] | None:
    """The terms of a Formula that is a plain sum of distinct values (a + b + c), else None."""
    if not isinstance(op, Formula) or not op.expr.is_Add:
        return None
    if not all(isinstance(term, sympy.Symbol) for term in op.expr.args):
        return None
    return sorted(str(term) for term in op.expr.args)


def eager_sums(ctx, place: dict[str, Place] | None) -> dict[str, tuple[str, bool]]:
    """term -> (the sum it is accumulated into, whether it starts the accumulation).

    A term is accumulated eagerly when this kernel computes it, only the sum reads it, it is not
    stored or a result, it has the sum's shape and sits in the same segment as the sum (`place`
    None: the scan body, one segment). The first of a sum's eager terms, in emission order,
    starts the running tile; the sum's own line adds whatever terms were not eager."""
    results = {value for _, value in ctx.prog.results}
    order = {value: i for i, value in enumerate(ctx.kernel.computes)}

    def position(value: str):
        return (place[value][1], order[value]) if place is not None else (0, order[value])

    eager: dict[str, tuple[str, bool]] = {}
    for total in ctx.kernel.computes:
        terms = _sum_terms(ctx.prog.op(total))
        if terms is None:
            continue
        chosen = [
            t for t in terms
            if t in order and not is_loadable(ctx, t) and readers(ctx, t) == [total]
            and t not in ctx.kernel.stores and t not in results and ctx.shape(t) == ctx.shape(total)
            and (place is None or (place[t] == place[total] and place[t][0] in ("plain", "loop")))
        ]
        chosen.sort(key=position)
        for i, term in enumerate(chosen):
            eager[term] = (total, i == 0)
    return eager
