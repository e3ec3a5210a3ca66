"""factor_scalars: scalar factors moved off tiles onto the (smaller) values summed from them.

Reverse-mode differentiation scales whole tiles: the output's gradient by the attention scale
(`d_QH = d_O*scale`), a subtraction's by -1 (`d_WH = -d_Vn`), the decay's log-derivative by the
chunk's total decay (`2**G_last*H*d_H_next*log(2)`). When the scaled tile is only summed (a sum
over its axes, or a matmul contracting its V axis), the factor can be applied to the sum instead:

    sum(s * P)                 ->  s * sum(P)
    (s * X) @ B  (over V)      ->  s * (X @ B)

with s a product of factors that read only rank-0 values (scale, G_last, numbers). The chunk
kernels then multiply once per (chunk, head) after their V loop instead of once per element of
every V block, and a 16-bit input (d_O) goes into its matmul as it was loaded, without the round
trip through fp32 that scaling it took (one rounding fewer: the gradients are as close to the
float64 oracle or closer). A matmul contracting C (the backward scan's `q_decayed^T @ d_QH`) keeps
its scaled operand: its result has a V axis, and multiplying it would put the factor on the
scan's chain from state to state.

A rewritten value keeps its name (its readers are unchanged); the unscaled sum is
`<name>_unscaled`, and a tile formula left with only some of its factors `<tile>_unscaled`
(with underscores appended where a value, an input's, already has that name). A
scaled operand no other op reads is dropped.
"""
from __future__ import annotations

from dataclasses import replace

import sympy

from ..ir.chunk import ChunkOp, ChunkProgram, Formula, MatMul, ReduceSum


def factor_scalars(prog: ChunkProgram) -> ChunkProgram:
    """The program with every scalar factor of a summed-only tile moved onto its sum."""
    ops = list(prog.ops)
    shapes = {op.out: op.shape for op in ops}
    rank0 = {name for name, shape in shapes.items() if shape == ()}
    for op in prog.ops:
        if isinstance(op, ReduceSum):
            ops = _factor_sum(ops, op, rank0)
        elif isinstance(op, MatMul) and "V" not in op.shape and "V" in shapes[op.a]:
            ops = _factor_matmul(ops, op, rank0)
    outputs = {value for _, value in prog.outputs}
    read = {arg for op in ops for arg in op.args()}
    # the scaled operands the matmuls no longer read (d_QH = d_O*scale where only they read it)
    ops = [op for op in ops if op.out in read or op.out in outputs or op.out not in _operands(prog)]
    return replace(prog, ops=tuple(ops))


def _operands(prog: ChunkProgram) -> set[str]:
    return {arg for op in prog.ops if isinstance(op, MatMul) for arg in op.args()}


def split_scalar_factors(expr: sympy.Expr, rank0: set[str]) -> tuple[sympy.Expr, sympy.Expr]:
    """expr = s * rest, s the product of expr's factors that read only rank-0 values (numbers
    included); (1, expr) where there are none or expr is no product."""
    if not isinstance(expr, sympy.Mul):
        return sympy.Integer(1), expr
    scalar, rest = [], []
    for factor in expr.args:
        (scalar if {str(s) for s in factor.free_symbols} <= rank0 else rest).append(factor)
    return sympy.Mul(*scalar), sympy.Mul(*rest)


def _fresh(taken: set[str], name: str) -> str:
    """`name`, or `name` with underscores appended until no value has it (an input may be called
    d_W_via_WH_unscaled: inputs keep their names); the name is taken from then on."""
    while name in taken:
        name += "_"
    taken.add(name)
    return name


def _readers(ops: list[ChunkOp], value: str) -> list[ChunkOp]:
    return [op for op in ops if value in op.args()]


def _scaled(ops: list[ChunkOp], value: str, rank0: set[str]) -> tuple[sympy.Expr, sympy.Expr] | None:
    """(s, rest) when `value` is a Formula s * rest with a scalar factor s and a tile left."""
    op = next(o for o in ops if o.out == value)
    if not isinstance(op, Formula):
        return None
    scalar, rest = split_scalar_factors(op.expr, rank0)
    if scalar == 1 or rest == 1:
        return None
    return scalar, rest


def _replace_op(ops: list[ChunkOp], old: ChunkOp, new: list[ChunkOp]) -> list[ChunkOp]:
    index = ops.index(old)
    return ops[:index] + new + ops[index + 1:]


def _factor_sum(ops: list[ChunkOp], op: ReduceSum, rank0: set[str]) -> list[ChunkOp]:
    """sum(s * P) -> s * sum(P), when the sum is the tile's only reader."""
    found = _scaled(ops, op.x, rank0)
    if found is None or len(_readers(ops, op.x)) != 1:
        return ops
    scalar, rest = found
    tile = next(o for o in ops if o.out == op.x)
    taken = {o.out for o in ops}
    unscaled_sum = _fresh(taken, f"{op.out}_unscaled")
    if isinstance(rest, sympy.Symbol):
        summed, new_tile = str(rest), []
    else:
        summed = _fresh(taken, f"{op.x}_unscaled")
        new_tile = [Formula(summed, tile.shape, rest)]
    ops = _replace_op(ops, tile, new_tile)
    return _replace_op(ops, op, [ReduceSum(unscaled_sum, op.shape, summed, op.axes),
                                 Formula(op.out, op.shape, scalar * sympy.Symbol(unscaled_sum))])


def _factor_matmul(ops: list[ChunkOp], op: MatMul, rank0: set[str]) -> list[ChunkOp]:
    """(s_a * X) @ (s_b * Y) over V -> s_a * s_b * (X @ Y), for operands scaled by a scalar."""
    scalar, operands = sympy.Integer(1), []
    for operand in (op.a, op.b):
        found = _scaled(ops, operand, rank0)
        if found is not None and isinstance(found[1], sympy.Symbol):
            scalar, operand = scalar * found[0], str(found[1])
        operands.append(operand)
    if scalar == 1:
        return ops
    unscaled = _fresh({o.out for o in ops}, f"{op.out}_unscaled")
    return _replace_op(ops, op, [replace(op, out=unscaled, a=operands[0], b=operands[1]),
                                 Formula(op.out, op.shape, scalar * sympy.Symbol(unscaled))])
