"""autodiff: forward chunk program -> backward chunk program, by reverse-mode AD over its tile ops.

Per chunk the forward maps (inputs, entry state H) to (O, exit state H'). Its vector-Jacobian
product maps (dO, dH') to (d inputs, dH): that is the backward chunk program. Run over the chunks
in reverse, each dH feeding the previous chunk's dH', seeded by the final-state gradient dht and
ending in dh0, it is the whole backward (docs/design.md §3).

The backward program first repeats the forward ops it needs. Values the forward plans store in
memory (entry states H, W, U, the solved system, the residuals) are read back (`saved:` loads)
instead of recomputed here; whether they are kept from the forward call or recomputed by
re-running the forward kernels is the save_policy pass's choice. Then, in reverse program order,
each op's adjoint rule (ADJOINTS) turns the gradient of its output into contributions to the
gradients of its inputs; a value read by several ops sums its contributions. Ops that no output
needs are dropped.

Adjoint rules: elementwise formulas by sympy.diff; a broadcast sums back; cumsum -> reverse cumsum;
last row -> placed on the last row; exp2(G_i - G_j) -> ln2 * (row sums - column sums) of dD * D,
or, where G is a scaled cumsum(g), straight to dg: ln2 dD * D summed over the pairs whose span
holds each row;
the per-channel decayed product M = sum_c a_ic b_jc exp2(x_ic - y_jc) -> da, db by the same decayed
product applied to dM (and its transpose), dx = ln2 a * da, dy = -ln2 b * db (one decay: their sum);
masks mask; a floor passes the gradient where it does not clamp; matmuls transpose; X = (I + A)^-1 -> dA = StrictLower(-X^T dX X^T); the L2 norm ->
its Jacobian-vector product.
"""
from __future__ import annotations

import sympy

from ..errors import IRError
from ..ir.chunk import (
    COTANGENT,
    SAVED,
    Band,
    Broadcast,
    ChunkOp,
    ChunkProgram,
    ClampBelow,
    ClampBelowGrad,
    CrossingSum,
    Cumsum,
    DecayMatrix,
    DecayedGram,
    DecayedMatMul,
    Diagonal,
    FiniteRows,
    Formula,
    LastRow,
    Load,
    Mask,
    MaskRows,
    MatMul,
    Normalize,
    NormalizeGrad,
    PlaceLastRow,
    ReduceSum,
    StateIn,
    UnitLowerInverse,
    scaled_cumsum,
)
from ..ir.formula import derivative
from ..ir.plan import ChunkPlans
from ..ir.registry import TypeRegistry
from .derive_chunk import Builder

NOT_DIFFERENTIABLE = ("scale", "h")  # Load sources that take no gradient
LN2 = sympy.log(2)

ADJOINTS = TypeRegistry("adjoint rule", IRError)
adjoint = ADJOINTS.register


class Sweep:
    """The reverse sweep's state: the builder and each value's gradient contributions."""

    def __init__(self, builder: Builder, forward: ChunkProgram):
        self.b = builder
        self.forward = forward  # the definitions an adjoint rule may look through
        self.contributions: dict[str, list[str]] = {}

    def shape(self, name: str):
        return self.b.shapes[name]

    def contribute(self, value: str, gradient: str) -> None:
        self.contributions.setdefault(value, []).append(gradient)

    def gradient(self, value: str) -> str | None:
        """The summed gradient of `value`, or None if nothing depends on it."""
        parts = self.contributions.get(value)
        if not parts:
            return None
        if len(parts) == 1:
            return parts[0]
        return str(self.b.formula(f"d_{value}", sum(sympy.Symbol(p) for p in parts), self.shape(value)))

    def name(self, arg: str, op: ChunkOp) -> str:
        return self.b.fresh(f"d_{arg}_via_{op.out}")


def reduce_to(sweep: Sweep, value: str, shape, name: str) -> str:
    """Sum `value` down to `shape` (its broadcast source shape)."""
    source = sweep.shape(value)
    if source == shape:
        return value
    if shape == ():
        axes = tuple(range(len(source)))
    elif shape == source[:1]:  # spread along the columns (a C-vector, a K-vector over K x V)
        axes = tuple(range(1, len(source)))
    else:  # a K- or V-vector spread along the rows
        axes = (0,)
    return str(sweep.b.add(ReduceSum(name, shape, value, axes)))


@adjoint(Formula)
def _formula(op: Formula, dy: str, sweep: Sweep):
    for symbol in sorted(op.expr.free_symbols, key=str):
        arg = str(symbol)
        partial = derivative(op.expr, symbol)
        if partial == 0:
            continue
        name = sweep.name(arg, op)
        if sweep.shape(arg) == op.shape:
            yield arg, str(sweep.b.formula(name, sympy.Symbol(dy) * partial, op.shape))
            continue
        # a scalar read by a tile: its gradient sums over the tile (rows past the end included,
        # where every gradient is 0 because their inputs are)
        spread = str(sweep.b.formula(f"{name}_tile", sympy.Symbol(dy) * partial, op.shape))
        yield arg, reduce_to(sweep, spread, sweep.shape(arg), name)


@adjoint(Broadcast)
def _broadcast(op: Broadcast, dy: str, sweep: Sweep):
    yield op.x, reduce_to(sweep, dy, sweep.shape(op.x), sweep.name(op.x, op))


@adjoint(MaskRows)
def _mask_rows(op: MaskRows, dy: str, sweep: Sweep):
    yield op.x, str(sweep.b.add(MaskRows(sweep.name(op.x, op), op.shape, dy)))


@adjoint(FiniteRows)
def _finite_rows(op: FiniteRows, dy: str, sweep: Sweep):
    yield op.x, dy  # the identity where x is finite; the backward guards no non-finite rows


@adjoint(ClampBelow)
def _clamp_below(op: ClampBelow, dy: str, sweep: Sweep):
    # a floored log-decay takes no gradient: the recurrence's is exp(g) (...), below exp(floor)
    yield op.x, str(sweep.b.add(ClampBelowGrad(sweep.name(op.x, op), op.shape, op.x, dy, op.floor)))


@adjoint(Cumsum)
def _cumsum(op: Cumsum, dy: str, sweep: Sweep):
    adjoint_op = Cumsum(sweep.name(op.x, op), op.shape, dy, reverse=not op.reverse, exclusive=op.exclusive)
    yield op.x, str(sweep.b.add(adjoint_op))


@adjoint(LastRow)
def _last_row(op: LastRow, dy: str, sweep: Sweep):
    yield op.x, str(sweep.b.add(PlaceLastRow(sweep.name(op.x, op), sweep.shape(op.x), dy)))


@adjoint(DecayMatrix)
def _decay(op: DecayMatrix, dy: str, sweep: Sweep):
    # D_ij = exp2(x_i - x_j): dx_i += ln2 sum_j dD_ij D_ij, dx_j -= ln2 sum_i dD_ij D_ij.
    b = sweep.b
    source = scaled_cumsum(sweep.forward, op.x)
    if source is not None and not source[0].exclusive:
        # x = c cumsum(g): D_ij depends on g_t for j < t <= i, so dg_t = ln2 c sum of dD_ij D_ij
        # over those pairs, summed directly. Through dx, the suffix sum of (row sums - column
        # sums) would add and then cancel every pair inside the span: at strong decay dg is tiny
        # beside those pairs and the rounding of the cancellation swamps it where one token's
        # update steps pair with decay 1 (Gated DeltaProduct's d_g 0.8-5.2 off at g = -20 on
        # every token, fp32). The pair (i, i) spans no row: it drops out by itself.
        cumsum, factor = source
        weighted = b.formula(b.fresh(f"{dy}_times_{op.out}"), sympy.Symbol(dy) * sympy.Symbol(op.out) * LN2 * factor, ("C", "C"))
        yield cumsum.x, str(b.add(CrossingSum(sweep.name(cumsum.x, op), ("C",), str(weighted))))
        return
    # The diagonal (exp2(0) = 1) depends on nothing: leaving it out avoids summing a term into
    # both the row and the column sum only to cancel it.
    weighted = b.formula(b.fresh(f"{dy}_times_{op.out}"), sympy.Symbol(dy) * sympy.Symbol(op.out) * LN2, ("C", "C"))
    if op.inclusive:
        weighted = b.add(Mask(b.fresh(f"{weighted}_offdiag"), ("C", "C"), str(weighted), inclusive=False))
    rows = b.add(ReduceSum(b.fresh(f"{weighted}_rowsum"), ("C",), str(weighted), (1,)))
    cols = b.add(ReduceSum(b.fresh(f"{weighted}_colsum"), ("C",), str(weighted), (0,)))
    yield op.x, str(b.formula(sweep.name(op.x, op), rows - cols, ("C",)))


@adjoint(DecayedGram)
def _decayed_gram(op: DecayedGram, dy: str, sweep: Sweep):
    # M_ij = sum_c a_ic b_jc E_ijc, E_ijc = exp2(x_ic - x_jc), over i > j:
    #   da_ic = sum_j dM_ij b_jc E_ijc,  db_jc = sum_i dM_ij a_ic E_ijc   (the same decays)
    #   dx_ic = ln2 (a_ic da_ic - b_ic db_ic): x_i gains as row, loses as column.
    # An inclusive M's diagonal (E = 1) adds dM_ii b_i to da_i and dM_ii a_i to db_i but nothing
    # to dx: it is kept out of dx rather than summed in twice to cancel (at strong decay dx is
    # tiny and the cancellation's rounding would swamp it).
    b = sweep.b
    if op.y is not None:
        yield from _two_decay_gram(op, dy, sweep)
        return
    da = b.add(DecayedMatMul(b.fresh(f"{sweep.name(op.a, op)}_below"), ("C", "K"), dy, op.b, op.x))
    db = b.add(DecayedMatMul(b.fresh(f"{sweep.name(op.b, op)}_above"), ("C", "K"), dy, op.a, op.x, transpose=True))
    a_, b_ = sympy.Symbol(op.a), sympy.Symbol(op.b)
    dx = b.formula(sweep.name(op.x, op), LN2 * (a_ * da - b_ * db), ("C", "K"))
    if op.inclusive:
        diagonal = b.add(Diagonal(b.fresh(f"{dy}_diagonal"), ("C",), dy))
        diagonal = b.rows(f"{diagonal}_rows", diagonal, ("C", "K"))
        da = b.formula(sweep.name(op.a, op), da + diagonal * b_, ("C", "K"))
        db = b.formula(sweep.name(op.b, op), db + diagonal * a_, ("C", "K"))
    yield op.a, str(da)
    yield op.b, str(db)
    yield op.x, str(dx)


def _two_decay_gram(op: DecayedGram, dy: str, sweep: Sweep):
    """M_ij = sum_c a_ic b_jc exp2(x_ic - y_jc) over i > j, x the exclusive and y the inclusive
    decay of one g (x_i = y_(i-1)): dx_ic = ln2 a_ic sum_j dM_ij b_jc E_ijc, dy_jc = -ln2 b_jc
    sum_i dM_ij a_ic E_ijc. The adjacent pairs (i = j + 1, E = exp2(0) = 1) move neither decay:
    they are kept out of dx and dy (their cumulative sums would add and then cancel them, and at
    strong decay dx and dy are tiny beside them) and added to da and db as plain products."""
    b = sweep.b
    CK = ("C", "K")
    far = str(b.add(Band(b.fresh(f"{dy}_far"), ("C", "C"), dy, lo=2)))
    near = str(b.add(Band(b.fresh(f"{dy}_adjacent"), ("C", "C"), dy, lo=1, hi=1)))
    da_far = b.add(DecayedMatMul(b.fresh(f"{sweep.name(op.a, op)}_far"), CK, far, op.b, op.x, y=op.y))
    db_far = b.add(DecayedMatMul(b.fresh(f"{sweep.name(op.b, op)}_far"), CK, far, op.a, op.x, transpose=True, y=op.y))
    da_near = b.matmul(f"{sweep.name(op.a, op)}_adjacent", near, op.b, CK)
    db_near = b.matmul(f"{sweep.name(op.b, op)}_adjacent", near, op.a, CK, transpose_a=True)
    a_, b_ = sympy.Symbol(op.a), sympy.Symbol(op.b)
    yield op.x, str(b.formula(sweep.name(op.x, op), LN2 * a_ * da_far, CK))
    yield op.y, str(b.formula(sweep.name(op.y, op), -LN2 * b_ * db_far, CK))
    yield op.a, str(b.formula(sweep.name(op.a, op), da_far + da_near, CK))
    yield op.b, str(b.formula(sweep.name(op.b, op), db_far + db_near, CK))


@adjoint(Mask)
def _mask(op: Mask, dy: str, sweep: Sweep):
    yield op.x, str(sweep.b.add(Mask(sweep.name(op.x, op), op.shape, dy, op.inclusive)))


@adjoint(MatMul)
def _matmul(op: MatMul, dy: str, sweep: Sweep):
    b = sweep.b
    a_shape, b_shape = sweep.shape(op.a), sweep.shape(op.b)
    # C = op(a) op(b):  d op(a) = dC op(b)^T,  d op(b) = op(a)^T dC
    if op.transpose_a:
        da = MatMul(sweep.name(op.a, op), a_shape, op.b, dy, transpose_a=op.transpose_b, transpose_b=True)
    else:
        da = MatMul(sweep.name(op.a, op), a_shape, dy, op.b, transpose_b=not op.transpose_b)
    yield op.a, str(b.add(da))
    if op.transpose_b:
        db = MatMul(sweep.name(op.b, op), b_shape, dy, op.a, transpose_a=True, transpose_b=op.transpose_a)
    else:
        db = MatMul(sweep.name(op.b, op), b_shape, op.a, dy, transpose_a=not op.transpose_a)
    yield op.b, str(b.add(db))


@adjoint(UnitLowerInverse)
def _inverse(op: UnitLowerInverse, dy: str, sweep: Sweep):
    # X = (I + A)^-1: dA = -X^T dX X^T, on the strict lower triangle (A's only free entries)
    b = sweep.b
    left = b.add(MatMul(b.fresh(f"{op.out}T_{dy}"), ("C", "C"), op.out, dy, transpose_a=True))
    both = b.add(MatMul(b.fresh(f"{left}_{op.out}T"), ("C", "C"), str(left), op.out, transpose_b=True))
    negated = b.formula(b.fresh(f"minus_{both}"), -both, ("C", "C"))
    yield op.a, str(b.add(Mask(sweep.name(op.a, op), ("C", "C"), str(negated), inclusive=False)))


@adjoint(Normalize)
def _normalize(op: Normalize, dy: str, sweep: Sweep):
    yield op.x, str(sweep.b.add(NormalizeGrad(sweep.name(op.x, op), op.shape, op.x, dy)))


def _saved_values(plans: ChunkPlans) -> set[str]:
    """Forward values every plan keeps in memory: the backward reads them instead of recomputing."""
    sets = [{b.value for b in plan.buffers} for plan in plans.plans]
    return set.intersection(*sets)


def autodiff(plans: ChunkPlans) -> ChunkProgram:
    forward = plans.graph.program
    saved = _saved_values(plans)
    b = Builder()
    # the forward values, recomputed or read back; the forward's names are kept
    for op in forward.ops:
        if op.out in saved:
            b.add(Load(op.out, op.shape, SAVED + op.out))
        else:
            b.add(op)
    sweep = Sweep(b, forward)
    sweep.contribute(forward.output("o"), str(b.load(COTANGENT, ("C", "V"), "d_" + forward.output("o"))))
    d_state = b.add(StateIn(b.fresh("d_" + forward.output("state")), ("K", "V")))
    sweep.contribute(forward.output("state"), str(d_state))

    outputs = []
    for op in reversed(forward.ops):
        dy = sweep.gradient(op.out)
        if dy is None:
            continue
        if isinstance(op, StateIn):
            outputs.insert(0, ("state", dy))
        elif isinstance(op, Load):
            if op.source not in NOT_DIFFERENTIABLE:
                outputs.append((f"grad:{op.source}", dy))
        else:
            for arg, contribution in ADJOINTS.lookup(op)(op, dy, sweep):
                sweep.contribute(arg, contribution)
    outputs = _order_outputs(forward, outputs)
    return ChunkProgram(forward.recurrence, _live_ops(b.ops, [v for _, v in outputs]), tuple(outputs), "backward")


def _order_outputs(forward: ChunkProgram, outputs):
    """state first, then gradients in the order of the call's inputs."""
    order = ["q", "k", "v"] + [i.name for i in forward.recurrence.inputs]
    grads = {role: value for role, value in outputs}
    ordered = [("state", grads.pop("state"))]
    ordered += [(f"grad:{n}", grads.pop(f"grad:{n}")) for n in order if f"grad:{n}" in grads]
    assert not grads, grads
    return tuple(ordered)


def _live_ops(ops: list[ChunkOp], roots: list[str]) -> tuple[ChunkOp, ...]:
    """Dead-code elimination: the ops some output needs, in program order."""
    by_name = {op.out: op for op in ops}
    live, stack = set(), list(roots)
    while stack:
        value = stack.pop()
        if value in live:
            continue
        live.add(value)
        stack.extend(by_name[value].args())
    return tuple(op for op in ops if op.out in live)
