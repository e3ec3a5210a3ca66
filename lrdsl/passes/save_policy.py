"""save_policy: for each forward value the backward reads, keep it from the forward call or
recompute it by re-running forward kernels in the backward.

The choice is made per tensor from the forward's stage graph:
    save_states   (default) save_solve, and keep the scan's entry states: where the re-run scan
                  would have few programs, the generated module keeps one of them per
                  RESUME_EVERY forward chunks and the re-run starts each run of chunks between
                  two from the first, all side by side, instead of walking whole sequences
                  (about B * ceil(T/C) / RESUME_EVERY * HV * K * V values in the inputs' dtype
                  kept); elsewhere none (the same as save_solve)
    save          keep everything the backward reads; re-run nothing (most memory, least
                  time). What it keeps holds only at the chunk size it was made at, so a call
                  that needs gradients runs its forward at the backward's chunk size
    save_solve    keep the solved triangular systems (C x C per row) and re-run the
                  rest: a solution is still valid at a smaller chunk size (its diagonal blocks),
                  so the backward keeps its own chunk size and skips building and solving its
                  systems (specs without a solve: the same as recompute)
    recompute     keep nothing: the backward re-runs the forward kernels that store what it
                  reads (the entry states are B * ceil(T/C) * HV * K * V values: large)
    save_prepare  keep what the prepare phase stores (W, U, the solved system: chunk-local, as
                  large as the inputs) and re-run only the scan for the entry states
Kernels a re-run needs are re-run too, unless the buffers they read are kept.
"""
from __future__ import annotations

import sympy

from ..ir.chunk import (
    SAVED,
    Band,
    Broadcast,
    ChunkProgram,
    ClampBelow,
    Cumsum,
    DecayedGram,
    DecayMatrix,
    FiniteRows,
    Formula,
    Load,
    Mask,
    MaskRows,
    MatMul,
    Normalize,
    UnitLowerInverse,
)
from ..ir.plan import BackwardPlan, ChunkPlans, Plan, SavePolicy

# The first is the default: what a model trained without activation checkpointing should hold,
# once per layer, from its forward to its backward. save_states keeps the solved systems (gdn at 32
# value heads, K = V = 128, bf16: 5.0 KiB per token, `lrdsl memory`; FLA keeps about 4) and re-runs
# the rest; save keeps every buffer the backward reads (58.0 KiB per token: 14 times as much) and
# was measured 4-17 % faster for forward + backward (BENCHMARKS.md round 21: gdn 4.30 -> 3.70 ms at
# 4 x 4096 on an H200). A 48-layer model at 32K tokens a step would hold 89 GB under save, 7.7
# under save_states; save remains the choice where memory allows (save_policy="save", per call or
# per layer). save was the default from round 21 to session 56.
POLICIES = {
    "save_states": "keep the solved systems and, where the re-run scan has few programs, some entry states; re-run the rest",
    "save": "keep every forward buffer the backward reads; re-run nothing (a call that needs gradients runs its forward at the backward's chunk size)",
    "save_solve": "keep the solved systems (C x C, chunk-local); re-run the rest, the backward at its own chunk size",
    "recompute": "keep nothing from the forward; re-run the forward kernels the backward reads from",
    "save_prepare": "keep the prepare phase's buffers (chunk-local); re-run the scan for the entry states",
}


# -- which C x C values a smaller chunk size reproduces -------------------------------------------
#
# The backward may run at a chunk size that divides the forward's (its kernels' registers hold
# smaller tiles). A kept C x C buffer is then read per sub-chunk: its diagonal block. That block
# equals the value computed at the sub-chunk size when entry (i, j) depends only on rows i and j
# (and the rows between them, for a triangular solve) and not on where the chunk starts. Values
# are classed bottom-up:
#   "row"    per-row values of the row's own inputs (loads, norms, elementwise formulas)
#   "offset" prefix sums from the chunk start: the start shifts every row by one constant, which
#            cancels in a difference x_i - x_j (and in a constant multiple of the sum)
#   "pair"   C x C values whose (i, j) entry depends on rows i..j only, origin-free
# anything else (a decay to the chunk end, exp2 of a prefix sum, a product over the whole chunk)
# is "other", and a buffer of it is not read at another chunk size.

_ROW_SHAPES = (("C",), ("C", "K"), ("C", "V"))
_CONSTANT_SHAPES = ((), ("K",))  # the same for every row: scale, the head index, per-head parameters


def _class_of_shape(shape, pair_ok: bool = False) -> str:
    """The class of an origin-free value of this shape."""
    if shape in _CONSTANT_SHAPES:
        return "constant"
    if shape in _ROW_SHAPES:
        return "row"
    return "pair" if pair_ok and shape == ("C", "C") else "other"


def _value_classes(prog: ChunkProgram) -> dict[str, object]:
    """Each value's class: "constant", "row", "pair", "other", or ("offset", sum, factor) for
    factor * (a prefix sum of `sum` from the chunk start)."""
    classes: dict[str, object] = {}
    for op in prog.ops:
        args = [classes.get(a, "other") for a in op.args()]
        shape = prog.shape(op.out)
        kind: object = "other"
        if isinstance(op, Load):
            kind = _class_of_shape(shape)
        elif isinstance(op, (Normalize, MaskRows, FiniteRows, ClampBelow)) and args == ["row"]:
            kind = "row"
        elif isinstance(op, Cumsum) and args == ["row"] and not op.reverse:
            kind = ("offset", op.x, sympy.Integer(1))  # inclusive or exclusive: the same shift
        elif isinstance(op, Formula):
            offsets = [c for c in args if isinstance(c, tuple)]
            if not offsets and all(c in ("constant", "row") for c in args):
                kind = _class_of_shape(shape)
            elif not offsets and shape == ("C", "C") and all(c in ("constant", "row", "pair") for c in args):
                kind = "pair"  # elementwise over pairs (and constants)
            elif len(args) == 1 and offsets:
                ratio = sympy.simplify(op.expr / next(iter(op.expr.free_symbols)))
                if ratio.is_number:  # a multiple of the prefix sum shifts by a multiple of its constant
                    kind = ("offset", offsets[0][1], offsets[0][2] * ratio)
        elif isinstance(op, Broadcast) and args[0] in ("constant", "row"):
            kind = _class_of_shape(shape, pair_ok=True)  # onto C x C: entry (i, j) is x_i
        elif isinstance(op, DecayMatrix) and isinstance(args[0], tuple):
            kind = "pair"  # exp2(x_i - x_j): the shift cancels
        elif isinstance(op, DecayedGram):
            rows = [classes.get(op.a), classes.get(op.b)]
            decays = [classes.get(op.x), classes.get(op.column_decay)]
            # the shift cancels in x_i - y_j only when both are the same multiple of one sum
            if rows == ["row", "row"] and isinstance(decays[0], tuple) and decays[0] == decays[1]:
                kind = "pair"
        elif isinstance(op, MatMul) and args == ["row", "row"] and shape == ("C", "C"):
            # rows of a times rows of b, over the channels: entry (i, j) reads rows i and j
            kind = "pair" if not op.transpose_a and op.transpose_b else "other"
        elif isinstance(op, (Mask, Band)) and args == ["pair"]:
            kind = "pair"
        elif isinstance(op, UnitLowerInverse) and args == ["pair"]:
            kind = "pair"  # a block lower-triangular matrix's inverse has its blocks' inverses on the diagonal
        classes[op.out] = kind
    return classes


def sub_chunk_values(prog: ChunkProgram) -> frozenset[str]:
    """The C x C values a chunk size dividing C reproduces as their diagonal blocks."""
    return frozenset(v for v, kind in _value_classes(prog).items() if kind == "pair")


def _reads(backward: ChunkProgram, values: tuple[str, ...] | None = None) -> tuple[str, ...]:
    """The forward buffers the backward program (or those of its values) loads."""
    ops = backward.ops if values is None else [backward.op(v) for v in values]
    return tuple(op.source[len(SAVED):] for op in ops if isinstance(op, Load) and op.source.startswith(SAVED))


def _choose(plan: Plan, forward: ChunkPlans, reads: tuple[str, ...], policy: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(buffers kept, kernels re-run) for one forward plan under one policy."""
    phase = forward.graph.phase
    if policy == "save":
        wanted_kept = set(reads)
    elif policy in ("save_solve", "save_states"):
        wanted_kept = {op.out for op in forward.graph.program.ops if isinstance(op, UnitLowerInverse)}
    elif policy == "save_prepare":
        wanted_kept = {b.value for b in plan.buffers if phase(b.value) == "prepare"}
    else:
        wanted_kept = set()
    producer = {value: kernel for kernel in plan.kernels for value in kernel.stores}
    rerun: list = []
    needed = [v for v in reads if v not in wanted_kept]
    while needed:
        kernel = producer[needed.pop()]
        if kernel not in rerun:
            rerun.append(kernel)
            needed += [v for v in kernel.loads if v not in wanted_kept]
    order = [k.name for k in plan.kernels]
    rerun_names = tuple(sorted((k.name for k in rerun), key=order.index))
    # keep what the backward or a re-run kernel reads and nobody recomputes
    used = set(reads) | {v for k in rerun for v in k.loads}
    produced = {v for k in rerun for v in k.stores}
    kept = tuple(b.value for b in plan.buffers if b.value in used and b.value not in produced)
    return kept, rerun_names


def _resumed(plan: Plan, forward: ChunkPlans, rerun: tuple[str, ...], policy: str) -> tuple[str, ...]:
    """The entry-state buffers the re-run scan starts from under save_states: what the forward's
    scan stores of the chunk's entry state (its StateIn value), when the backward re-runs it."""
    if policy != "save_states":
        return ()
    entry = forward.graph.program.state_in
    return tuple(entry for k in plan.kernels if k.kind == "scan" and k.name in rerun and entry in k.stores)


def _any_chunk_size(plan: Plan, backward: ChunkPlans, kept: tuple[str, ...], rerun: tuple[str, ...],
                    sub_chunk: frozenset[str]) -> bool:
    """Whether the backward may run at a chunk size dividing the forward's: every kept buffer is a
    C x C value that size reproduces, and no kernel reads such a kept buffer beside a C x C buffer
    made in the backward's own call (one kernel reads its C x C tiles at one width)."""
    if any(value not in sub_chunk for value in kept):
        return False
    shapes = {b.value: b.shape for b in plan.buffers}
    made_again = {v for k in plan.kernels if k.name in rerun for v in k.stores if shapes[v] == ("C", "C")}
    prog = backward.graph.program
    loads = [(k.kind, set(k.loads)) for k in plan.kernels if k.name in rerun] + [
        (k.kind, set(_reads(prog, k.computes))) for k in backward.plans[0].kernels
    ]
    for kind, read in loads:
        if kind == "scan" and read & set(kept):
            return False  # scans address C x C tiles at their own chunk size
        if read & set(kept) and read & made_again:
            return False
    return True


def _only_matmuls_read(prog: ChunkProgram, values: tuple[str, ...], value: str) -> bool:
    readers = [prog.op(v) for v in values if value in prog.op(v).args()]
    return all(isinstance(op, MatMul) for op in readers)


def _narrowed(plan: Plan, backward: ChunkPlans, forward_prog: ChunkProgram, kept: tuple[str, ...],
              rerun: tuple[str, ...]) -> tuple[str, ...]:
    """The kept fp32 buffers that every later reader (the re-run forward kernels, the backward's
    kernels) uses only as a matrix-product operand: kernels load them in the operand dtype, so
    the forward call may keep them in it (half the memory for 16-bit inputs, the same operands)."""
    prog = backward.graph.program
    narrowed = []
    for value in kept:
        if plan.buffer(value).dtype != "fp32":
            continue
        forward_ok = all(_only_matmuls_read(forward_prog, k.computes, value)
                         for k in plan.kernels if k.name in rerun and value in k.loads)
        loaded = [op.out for op in prog.ops if isinstance(op, Load) and op.source == SAVED + value]
        backward_ok = all(_only_matmuls_read(prog, k.computes, name) for k in backward.plans[0].kernels for name in loaded)
        if forward_ok and backward_ok:
            narrowed.append(value)
    return tuple(narrowed)


def choose_saved(forward: ChunkPlans, backward: ChunkPlans) -> BackwardPlan:
    reads = _reads(backward.graph.program)
    sub_chunk = sub_chunk_values(forward.graph.program)
    policies = []
    for name, summary in POLICIES.items():
        choices = [(plan, _choose(plan, forward, reads, name)) for plan in forward.plans]
        policies.append(
            SavePolicy(
                name,
                summary,
                tuple((p.name, kept) for p, (kept, _) in choices),
                tuple((p.name, rerun) for p, (_, rerun) in choices),
                tuple((p.name, _any_chunk_size(p, backward, kept, rerun, sub_chunk)) for p, (kept, rerun) in choices),
                tuple((p.name, _narrowed(p, backward, forward.graph.program, kept, rerun)) for p, (kept, rerun) in choices),
                tuple((p.name, _resumed(p, forward, rerun, name)) for p, (_, rerun) in choices),
            )
        )
    return BackwardPlan(forward, backward, reads, tuple(policies))
