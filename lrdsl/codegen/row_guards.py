"""Non-finite inputs in the forward chunk kernels (docs/design.md §2, "Non-finite inputs").

The recurrence reaches from token t only tokens t, t+1, ...: a NaN or an inf at token t leaves
every output row before t and every earlier state exact. A chunk kernel mixes the rows of a chunk
in masked matrix products, where the masked entries are 0 and 0 * NaN = NaN: left alone, one bad
token would make every row of its chunk NaN. So the forward kernels guard their per-row tiles:
 1. guarded tiles: the per-row tiles (C, C x K, C x V) a forward kernel loads from q, k, v or
    from a buffer, and the chunk program's FiniteRows values (the gate, beta and low-rank vectors
    computed from the call's other inputs, whose formulas may map an inf to a finite value):
    their non-finite entries become 0 where they are read. A buffer's test is x != x: the only
    non-finite value a forward buffer holds is the NaN rule 3 wrote there.
 2. a row of a guarded tile that held one marks the chunk's row in `rows_bad` (values on a path
    to the exit state) or in `rows_bad_own` (values that reach only their own output row: q).
 3. every per-row tile the kernel stores (a buffer, the output) is NaN from the first row marked
    in rows_bad on and on the rows marked in rows_bad_own; the scan's exit state is NaN when
    rows_bad marks any row of the chunk.
Everything a kernel computes from the guarded tiles is finite, and its rows before the first
marked one are what they would be without the bad token: the chunk form is causal in its rows
(the exit state and the suffix decays are not, and the state is poisoned). C x C buffers (the
solved systems) are neither guarded nor poisoned: built from guarded tiles they are finite, and
the kernels that read them read the chunk's per-row tiles too. The backward kernels guard nothing
yet: a non-finite input's gradients come out NaN on every row, where the oracle's are NaN from
its token on (docs/design.md §2). One more rule keeps the guards off where they buy nothing:
 4. a kernel's buffer tiles are left unguarded where NaN needs no help (nan_propagates): the
    buffers' NaN rows start at the first marked row (rule 3), and where every per-row tile the
    kernel stores takes its row i from rows <= i of them (row-local ops, prefix sums, products
    that contract the other operand's K or V axis) the NaN arrives on exactly the rows rule 3
    names, and in the exit state through the products that sum over the chunk's rows. A scan
    then runs no test, no row reduction and no select on its critical path: gdn's forward scan
    took 2.03 ms with them at 1 x 32768, 16/32 (H100; BENCHMARKS.md round 35).
"""
from __future__ import annotations

from ..ir.chunk import ROW_LOCAL_OPS, Cumsum, FiniteRows, Load, MatMul

ROWS_BAD = "rows_bad"  # the chunk's rows whose tokens made a value on the way to the state non-finite
ROWS_BAD_OWN = "rows_bad_own"  # rows whose output alone a non-finite value reaches (q)
GUARDED_SOURCES = ("q", "k", "v")  # call inputs guarded where they are loaded (rule 1)
ROW_SHAPES = (("C",), ("C", "K"), ("C", "V"))
# how far a NaN row of a buffer tile reaches within a kernel (nan_propagates)
UNTOUCHED, LATER_ROWS, EVERY_ROW = 0, 1, 2


def _reaches_state(ctx) -> frozenset:
    prog = ctx.prog
    reached, stack = set(), [prog.output("state")]
    while stack:
        value = stack.pop()
        if value not in reached:
            reached.add(value)
            stack.extend(prog.op(value).args())
    return frozenset(reached)


def guarded_values(ctx) -> dict[str, str]:
    """value -> the flag (ROWS_BAD or ROWS_BAD_OWN) its non-finite rows set, for every value this
    kernel guards (rule 1); empty in backward kernels. (KernelContext.guarded caches it.)"""
    return ctx.guarded


def _reach(ctx, value: str, reach: dict[str, int]) -> int:
    """How far NaN rows of the buffer tiles reach into `value`: not at all, its rows from the first
    NaN row on (and only those), or possibly every row (row-mixing ops are taken at their worst)."""
    op = ctx.prog.op(value)
    worst = max((reach.get(a, UNTOUCHED) for a in op.args()), default=UNTOUCHED)
    if worst == UNTOUCHED:
        return UNTOUCHED
    if ctx.shape(value)[:1] != ("C",):
        return EVERY_ROW  # a value without rows: a NaN anywhere in the chunk is all of it
    per_row_args = [a for a in op.args() if ctx.shape(a)[:1] == ("C",)]
    whole_args = [a for a in op.args() if a not in per_row_args]
    if any(reach.get(a, UNTOUCHED) for a in whole_args):
        return EVERY_ROW  # a chunk-wide NaN broadcast to every row
    if isinstance(op, ROW_LOCAL_OPS) or (isinstance(op, Cumsum) and not op.reverse):
        return worst
    if isinstance(op, MatMul) and not op.transpose_a and ctx.shape(op.a)[:1] == ("C",) and not reach.get(op.b):
        return worst  # row i of a @ b is row i of a against all of b
    return EVERY_ROW


def nan_propagates(ctx) -> bool:
    """Rule 4: whether NaN rows of this kernel's buffer tiles reach each per-row tile it stores
    only from their own row on, so that the kernel needs no guard on them."""
    reach = {v: LATER_ROWS for v in ctx.kernel.loads if ctx.shape(v) in ROW_SHAPES}
    for value in ctx.kernel.computes:
        if value not in reach:
            reach[value] = _reach(ctx, value, reach)
    results = {value for _, value in ctx.prog.results}
    stored = [v for v in ctx.kernel.computes if v in ctx.kernel.stores or v in results]
    return all(reach[v] != EVERY_ROW for v in stored if ctx.shape(v) in ROW_SHAPES)


def find_guarded(ctx) -> dict[str, str]:
    if ctx.prog.direction != "forward":
        return {}
    reaching = _reaches_state(ctx)
    values = [] if nan_propagates(ctx) else [v for v in ctx.kernel.loads if ctx.shape(v) in ROW_SHAPES]
    for value in ctx.kernel.computes:
        op = ctx.prog.op(value)
        if isinstance(op, FiniteRows) or (isinstance(op, Load) and op.source in GUARDED_SOURCES):
            values.append(value)
    return {v: ROWS_BAD if v in reaching else ROWS_BAD_OWN for v in values}


def init_lines(ctx) -> list[str]:
    """The flags, no row marked yet (per chunk: a scan emits them at the top of its chunk loop)."""
    flags = sorted(set(guarded_values(ctx).values()))
    return [f"{flag} = o_c < 0  # rows with a non-finite value (lrdsl/codegen/row_guards.py)" for flag in flags]


def guard_lines(ctx, value: str, target: str, source: str, test: str, in_sequence: str | None = None) -> list[str]:
    """Rules 1 and 2 for the tile `source` of `value`, into `target`: `test` is "finite",
    "not_nan" or "log_decay" (not NaN and not +inf: -inf is a hard reset); `in_sequence` masks
    the marks to the rows (and lanes) of the sequence where the tile is not 0 there already."""
    ok = {
        "finite": f"tl.abs({source}) < float('inf')",
        "not_nan": f"{source} == {source}",
        "log_decay": f"({source} == {source}) & ({source} < float('inf'))",
    }[test]
    flag = guarded_values(ctx)[value]
    bad = f"~ok_{value}" if in_sequence is None else f"~ok_{value} & {in_sequence}"
    marked = bad if len(ctx.shape(value)) == 1 else f"tl.max(({bad}).to(tl.int32), axis=1) > 0"
    return [
        f"ok_{value} = {ok}",
        f"{flag} = {flag} | ({marked})",
        f"{target} = tl.where(ok_{value}, {source}, 0.0).to({source}.dtype)",
    ]


def poisoned(ctx, value: str, expr: str) -> tuple[list[str], str]:
    """Rule 3 for a per-row tile `expr` of `value` the kernel stores: (the line naming the
    poisoned rows, the tile with them NaN); no change where the kernel guards nothing."""
    flags = set(guarded_values(ctx).values())
    if not flags or ctx.shape(value) not in ROW_SHAPES:
        return [], expr
    parts = []
    if ROWS_BAD in flags:
        parts.append(f"(tl.cumsum({ROWS_BAD}.to(tl.int32), axis=0) > 0)")
    if ROWS_BAD_OWN in flags:
        parts.append(ROWS_BAD_OWN)
    rows = "rows_poisoned" if len(ctx.shape(value)) == 1 else "rows_poisoned[:, None]"
    return ([f"rows_poisoned = {' | '.join(parts)}  # from the first non-finite token on"],
            f"tl.where({rows}, float('nan'), {expr})")


def state_poison_lines(ctx, value: str) -> list[str]:
    """Rule 3 for the scan's exit state."""
    if ROWS_BAD not in set(guarded_values(ctx).values()):
        return []
    return [f"{value} = tl.where(tl.max({ROWS_BAD}.to(tl.int32)) > 0, float('nan'), {value})"
            "  # a non-finite token in the chunk"]
