"""Evaluate a chunk program on concrete or symbolic values.

Two backends, one rule per op type each:
 - torch float64 tiles (`evaluate_torch`; lrdsl.verification.chunk_reference runs whole sequences on it):
   checks the derived chunk form numerically against the oracle, independently of Triton;
 - sympy matrices (`evaluate_sympy`): the symbolic proof that the chunk form equals the
   unrolled recurrence (lrdsl.verification.prove).

Values are tiles shaped exactly as the IR says: (C,) vectors, (C, K) matrices, () scalars.
Rows past the sequence end (`valid_rows`) are zero in the loaded inputs, as in the kernels.
Broadcast spreads a vector along the axis it shares with the tile, the first axis first: a
C-vector along columns (row i holds x_i), a K-vector over C x K along rows, over K x V along columns.
"""
from __future__ import annotations

import math

import sympy
import torch

from .chunk import (
    Band,
    Broadcast,
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
)
from .formula import torch_function

# ---------------------------------------------------------------------------------------------
# torch float64
# ---------------------------------------------------------------------------------------------

class Context:
    def __init__(self, prog: ChunkProgram, sizes: dict, valid_rows: int, l2norm: bool):
        self.shapes = {op.out: op.shape for op in prog.ops}
        self.sizes = sizes
        self.valid_rows = valid_rows
        self.l2norm = l2norm

    def dims(self, shape) -> tuple[int, ...]:
        return tuple(self.sizes[a] for a in shape)


def _lower(C: int, inclusive: bool) -> torch.Tensor:
    i = torch.arange(C)
    return (i[:, None] >= i[None, :]) if inclusive else (i[:, None] > i[None, :])


def _t_formula(op: Formula, env, ctx):
    symbols, fn = torch_function(op.expr)
    return fn(*[env[str(s)] for s in symbols]).expand(ctx.dims(op.shape))


def _t_broadcast(op: Broadcast, env, ctx):
    x, source = env[op.x], ctx.shapes[op.x]
    if source == ():
        return x.expand(ctx.dims(op.shape))
    if source == op.shape[:1]:
        return x[:, None].expand(ctx.dims(op.shape))
    return x[None, :].expand(ctx.dims(op.shape))


def _t_mask_rows(op: MaskRows, env, ctx):
    rows = (torch.arange(ctx.sizes["C"]) < ctx.valid_rows).view(-1, *([1] * (len(op.shape) - 1)))
    return torch.where(rows, env[op.x], torch.zeros((), dtype=torch.float64))


def _t_finite_rows(op: FiniteRows, env, ctx):
    # the values only: the poisoning of later rows is the kernels' (docs/design.md §2)
    x = env[op.x]
    ok = ~torch.isnan(x) & (x < math.inf) if op.log_decay else torch.isfinite(x)
    return torch.where(ok, x, 0.0)


def _t_normalize(op: Normalize, env, ctx):
    x = env[op.x]
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6) if ctx.l2norm else x


def _t_decay(op: DecayMatrix, env, ctx):
    x = env[op.x]
    exponent = torch.where(_lower(x.shape[0], op.inclusive), x[:, None] - x[None, :], -math.inf)
    return torch.exp2(exponent)


def _t_channel_decay(x: torch.Tensor, y: torch.Tensor, inclusive: bool) -> torch.Tensor:
    """C x C x K: exp2(x_ic - y_jc) where i > j (i >= j), else 0 -- exactly, pair by pair."""
    inside = _lower(x.shape[0], inclusive)[:, :, None]
    return torch.exp2(torch.where(inside, x[:, None, :] - y[None, :, :], -math.inf))


def _t_decayed_gram(op: DecayedGram, env, ctx):
    decay = _t_channel_decay(env[op.x], env[op.column_decay], op.inclusive)
    return torch.einsum("ic,jc,ijc->ij", env[op.a], env[op.b], decay)


def _t_decayed_matmul(op: DecayedMatMul, env, ctx):
    decay = _t_channel_decay(env[op.x], env[op.column_decay], inclusive=False)
    if op.transpose:  # out_ic = sum_j m_ji b_jc decay_jic
        return torch.einsum("ji,jc,jic->ic", env[op.m], env[op.b], decay)
    return torch.einsum("ij,jc,ijc->ic", env[op.m], env[op.b], decay)


def _band(C: int, op: Band):
    """Which (i, j) a Band keeps, as a C x C boolean torch tensor."""
    i = torch.arange(C)
    gap = i[:, None] - i[None, :]
    keep = gap >= op.lo
    return keep & (gap <= op.hi) if op.hi is not None else keep


def _t_cumsum(op: Cumsum, env, ctx):
    x = env[op.x]
    x = x.flip(0) if op.reverse else x
    out = torch.cumsum(x, 0)
    if op.exclusive:  # shifted by one row, exactly
        out = torch.cat([torch.zeros_like(out[:1]), out[:-1]])
    return out.flip(0) if op.reverse else out


def _t_crossing_sum(op: CrossingSum, env, ctx):
    x = env[op.x]
    C = x.shape[0]
    return torch.stack([x[t:, :t].sum() for t in range(C)])


def _t_matmul(op: MatMul, env, ctx):
    a = env[op.a].T if op.transpose_a else env[op.a]
    b = env[op.b].T if op.transpose_b else env[op.b]
    return a @ b


def _t_normalize_grad(op: NormalizeGrad, env, ctx):
    x, dy = env[op.x], env[op.dy]
    if not ctx.l2norm:
        return dy
    r = 1 / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)
    y = x * r
    return r * (dy - y * (y * dy).sum(-1, keepdim=True))


def _t_place_last_row(op: PlaceLastRow, env, ctx):
    out = torch.zeros(ctx.dims(op.shape), dtype=torch.float64)
    out[-1] = env[op.x]
    return out


TORCH_RULES = {
    Load: lambda op, env, ctx: env[op.out],
    StateIn: lambda op, env, ctx: env[op.out],
    Normalize: _t_normalize,
    Formula: _t_formula,
    MaskRows: _t_mask_rows,
    ClampBelow: lambda op, env, ctx: torch.where(env[op.x] < op.floor, op.floor, env[op.x]),
    FiniteRows: _t_finite_rows,
    ClampBelowGrad: lambda op, env, ctx: torch.where(env[op.x] < op.floor, 0.0, env[op.dy]),
    Broadcast: _t_broadcast,
    Cumsum: _t_cumsum,
    LastRow: lambda op, env, ctx: env[op.x][-1],
    DecayMatrix: _t_decay,
    DecayedGram: _t_decayed_gram,
    DecayedMatMul: _t_decayed_matmul,
    Diagonal: lambda op, env, ctx: torch.diagonal(env[op.x]),
    CrossingSum: _t_crossing_sum,
    Band: lambda op, env, ctx: torch.where(_band(env[op.x].shape[0], op), env[op.x], 0.0),
    Mask: lambda op, env, ctx: torch.where(_lower(env[op.x].shape[0], op.inclusive), env[op.x], 0.0),
    MatMul: _t_matmul,
    UnitLowerInverse: lambda op, env, ctx: torch.linalg.inv(torch.eye(env[op.a].shape[0], dtype=torch.float64) + env[op.a]),
    ReduceSum: lambda op, env, ctx: env[op.x].sum(dim=op.axes) if op.axes else env[op.x],
    PlaceLastRow: _t_place_last_row,
    NormalizeGrad: _t_normalize_grad,
}


def evaluate_torch(prog: ChunkProgram, env: dict, sizes: dict, valid_rows: int, l2norm: bool) -> dict:
    """Evaluate every op of one chunk; `env` holds the Load and StateIn values (float64)."""
    ctx = Context(prog, sizes, valid_rows, l2norm)
    env = dict(env)
    for op in prog.ops:
        env[op.out] = TORCH_RULES[type(op)](op, env, ctx)
    return env


# ---------------------------------------------------------------------------------------------
# sympy: (C,) vectors are C x 1 matrices, (K,) vectors 1 x K, scalars plain expressions
# ---------------------------------------------------------------------------------------------


def _s_dims(ctx, shape):
    if shape == ():
        return None
    if len(shape) == 1:
        return (ctx.sizes[shape[0]], 1) if shape[0] == "C" else (1, ctx.sizes[shape[0]])
    return ctx.dims(shape)


def _s_formula(op: Formula, env, ctx):
    symbols = sorted(op.expr.free_symbols, key=str)
    dims = _s_dims(ctx, op.shape)
    if dims is None:
        return op.expr.subs({s: env[str(s)] for s in symbols}, simultaneous=True)

    def entry(i, j):
        values = {}
        for s in symbols:
            x = env[str(s)]
            values[s] = x[i, j] if isinstance(x, sympy.MatrixBase) else x
        return op.expr.subs(values, simultaneous=True)

    return sympy.Matrix(dims[0], dims[1], entry)


def _s_broadcast(op: Broadcast, env, ctx):
    x, source = env[op.x], ctx.shapes[op.x]
    dims = _s_dims(ctx, op.shape)
    if source == ():
        return sympy.Matrix(dims[0], dims[1], lambda i, j: x)

    def element(n):  # C-vectors are C x 1 matrices, K- and V-vectors 1 x N
        return x[n, 0] if source == ("C",) else x[0, n]

    if source == op.shape[:1]:
        return sympy.Matrix(dims[0], dims[1], lambda i, j: element(i))
    return sympy.Matrix(dims[0], dims[1], lambda i, j: element(j))


def _s_mask_rows(op: MaskRows, env, ctx):
    x = env[op.x]
    return sympy.Matrix(x.rows, x.cols, lambda i, j: x[i, j] if i < ctx.valid_rows else 0)


def _s_cumsum(op: Cumsum, env, ctx):
    x = env[op.x]
    rows = range(x.rows)

    def included(r, i):
        if op.reverse:
            return r > i if op.exclusive else r >= i
        return r < i if op.exclusive else r <= i

    return sympy.Matrix(x.rows, x.cols, lambda i, j: sum(x[r, j] for r in rows if included(r, i)))


def _s_crossing_sum(op: CrossingSum, env, ctx):
    x = env[op.x]
    C = x.rows
    return sympy.Matrix(C, 1, lambda t, _: sum(x[i, j] for i in range(t, C) for j in range(t)))


def _s_last_row(op: LastRow, env, ctx):
    x = env[op.x]
    return x[x.rows - 1, 0] if op.shape == () else x[x.rows - 1, :]


def _s_decay(op: DecayMatrix, env, ctx):
    x = env[op.x]

    def entry(i, j):
        inside = i >= j if op.inclusive else i > j
        return 2 ** (x[i, 0] - x[j, 0]) if inside else 0

    return sympy.Matrix(x.rows, x.rows, entry)


def _s_pair_decay(x, y, i, j, c):
    """exp2(x_ic - y_jc), the per-channel decay of one pair of rows."""
    return 2 ** (x[i, c] - y[j, c])


def _s_inside(i, j, inclusive):
    return i >= j if inclusive else i > j


def _s_decayed_gram(op: DecayedGram, env, ctx):
    a, b, x, y = env[op.a], env[op.b], env[op.x], env[op.column_decay]

    def entry(i, j):
        if not _s_inside(i, j, op.inclusive):
            return 0
        return sum(a[i, c] * b[j, c] * _s_pair_decay(x, y, i, j, c) for c in range(x.cols))

    return sympy.Matrix(x.rows, x.rows, entry)


def _s_decayed_matmul(op: DecayedMatMul, env, ctx):
    m, b, x, y = env[op.m], env[op.b], env[op.x], env[op.column_decay]
    rows = range(x.rows)

    def entry(i, c):
        if op.transpose:
            return sum(m[j, i] * b[j, c] * _s_pair_decay(x, y, j, i, c) for j in rows if j > i)
        return sum(m[i, j] * b[j, c] * _s_pair_decay(x, y, i, j, c) for j in rows if i > j)

    return sympy.Matrix(x.rows, x.cols, entry)


def _s_mask(op: Mask, env, ctx):
    x = env[op.x]
    return sympy.Matrix(x.rows, x.cols, lambda i, j: x[i, j] if (i >= j if op.inclusive else i > j) else 0)


def _s_band(op: Band, env, ctx):
    x = env[op.x]
    keep = _band(x.rows, op)
    return sympy.Matrix(x.rows, x.cols, lambda i, j: x[i, j] if keep[i, j] else 0)


def _s_matmul(op: MatMul, env, ctx):
    a = env[op.a].T if op.transpose_a else env[op.a]
    b = env[op.b].T if op.transpose_b else env[op.b]
    return a * b


def _s_normalize(op: Normalize, env, ctx):
    if ctx.l2norm:
        x = env[op.x]
        return sympy.Matrix(x.rows, x.cols, lambda i, j: x[i, j] / sympy.sqrt(sum(x[i, c] ** 2 for c in range(x.cols)) + sympy.Rational(1, 10**6)))
    return env[op.x]


def _s_reduce_sum(op: ReduceSum, env, ctx):
    x, source = env[op.x], ctx.shapes[op.x]
    if op.shape == ():
        return sum(x) if isinstance(x, sympy.MatrixBase) else x
    if source == ("C", "C"):  # row sums (axis 1) or column sums (axis 0), as a C x 1 vector
        if op.axes == (1,):
            return sympy.Matrix(x.rows, 1, lambda i, j: sum(x[i, c] for c in range(x.cols)))
        return sympy.Matrix(x.cols, 1, lambda i, j: sum(x[r, i] for r in range(x.rows)))
    if op.shape == ("C",):  # C x N summed over its columns
        return sympy.Matrix(x.rows, 1, lambda i, j: sum(x[i, c] for c in range(x.cols)))
    if op.axes == (1,):  # K x V summed over its columns, as a 1 x K row
        return sympy.Matrix(1, x.rows, lambda i, j: sum(x[j, c] for c in range(x.cols)))
    return sympy.Matrix(1, x.cols, lambda i, j: sum(x[r, j] for r in range(x.rows)))  # over rows


def _s_place_last_row(op: PlaceLastRow, env, ctx):
    x = env[op.x]
    C = ctx.sizes["C"]
    if op.shape == ("C",):
        return sympy.Matrix(C, 1, lambda i, j: x if i == C - 1 else 0)
    return sympy.Matrix(C, x.cols, lambda i, j: x[0, j] if i == C - 1 else 0)


SYMPY_RULES = {
    Load: lambda op, env, ctx: env[op.out],
    StateIn: lambda op, env, ctx: env[op.out],
    Normalize: _s_normalize,
    Formula: _s_formula,
    MaskRows: _s_mask_rows,
    # the proofs' symbols stand for log-decays above the floor, where the clamp is the identity
    ClampBelow: lambda op, env, ctx: env[op.x],
    FiniteRows: lambda op, env, ctx: env[op.x],
    ClampBelowGrad: lambda op, env, ctx: env[op.dy],
    Broadcast: _s_broadcast,
    Cumsum: _s_cumsum,
    LastRow: _s_last_row,
    DecayMatrix: _s_decay,
    DecayedGram: _s_decayed_gram,
    DecayedMatMul: _s_decayed_matmul,
    Diagonal: lambda op, env, ctx: sympy.Matrix(env[op.x].rows, 1, lambda i, j: env[op.x][i, i]),
    CrossingSum: _s_crossing_sum,
    Band: _s_band,
    Mask: _s_mask,
    MatMul: _s_matmul,
    UnitLowerInverse: lambda op, env, ctx: (sympy.eye(env[op.a].rows) + env[op.a]).inv(),
    ReduceSum: _s_reduce_sum,
    PlaceLastRow: _s_place_last_row,
    NormalizeGrad: lambda op, env, ctx: env[op.dy],  # the proof runs with the L2 norm off
}


def evaluate_sympy(prog: ChunkProgram, env: dict, sizes: dict, valid_rows: int) -> dict:
    ctx = Context(prog, sizes, valid_rows, l2norm=False)
    env = dict(env)
    for op in prog.ops:
        env[op.out] = SYMPY_RULES[type(op)](op, env, ctx)
    return env
