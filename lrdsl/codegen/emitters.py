"""One registered emitter per chunk op (CHUNK_EMITTERS): the Triton lines that compute the op's
value from its arguments' registers, and the helpers of the key-channel gates' per-channel decayed
products that modules using them carry."""
from __future__ import annotations

from ..errors import CompileError
from ..ir.chunk import (
    Band,
    COTANGENT,
    SAVED,
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
from ..ir.formula import HEAD_INDEX
from ..ir.recurrence import InputRole
from ..ir.registry import TypeRegistry
from .context import (
    COTANGENT_POINTER,
    KernelContext,
    boundary_read,
    buffer_address,
    buffer_param,
    emit_buffer_load,
    is_copy,
    load_line,
    read_in_acc,
    saved_param,
    tile_address,
    var,
)
from .names import input_pointer
from .printer import to_triton
from .row_guards import guard_lines
from .schedule import inclusive_sibling, normalized_here
from .templating import render


CHUNK_EMITTERS = TypeRegistry("chunk kernel emitter", CompileError)
SOLVE_BLOCK = 16  # the triangular solve works on 16 x 16 blocks


def input_load(op: Load, ctx: KernelContext) -> tuple[str, str, str, str | None]:
    """(pointer, offsets, mask, register dtype) of the memory read behind a Load that reads
    memory (op.reads_memory): a call input's tile, row or head value."""
    if op.source in ("q", "k"):
        return (op.source, *tile_address(op.shape, "H", "i_h", "K", ctx.kernel.kind), ctx.load_dtype(op.out))
    if op.source in ("v", COTANGENT):
        pointer = "v" if op.source == "v" else COTANGENT_POINTER
        return (pointer, *tile_address(op.shape, "HV", "i_hv", "V", ctx.kernel.kind), ctx.load_dtype(op.out))
    if op.source.startswith(SAVED):
        offsets, mask = buffer_address(op.shape, ctx.kernel.kind, made_elsewhere=ctx.kernel.kind == "chunk")
        return (saved_param(op.source), offsets, mask, ctx.load_dtype(op.out))
    pointer = input_pointer(op.source)
    role = ctx.prog.recurrence.input(op.source).role
    if role is InputRole.HEAD:
        return (pointer, "i_hv", "", "ACC")
    if role is InputRole.TOKEN:
        return (pointer, *tile_address(op.shape, "HV", "i_hv", "", ctx.kernel.kind), "ACC")
    if role is InputRole.TOKEN_KEY:  # [B, T, HV, K]: like v, by value head
        return (pointer, *tile_address(op.shape, "HV", "i_hv", "K", ctx.kernel.kind), "ACC")
    if role is InputRole.TOKEN_VALUE:  # [B, T, HV, V]: like v
        return (pointer, *tile_address(op.shape, "HV", "i_hv", "V", ctx.kernel.kind), "ACC")
    return (pointer, "i_hv * K + o_k", "m_k", "ACC")  # HEAD_KEY: [HV, K]


@CHUNK_EMITTERS.register(Load)
def _load(op: Load, ctx: KernelContext) -> list[str]:
    target = var(op.out)
    if op.source == "scale":
        return [f"{target} = scale"]
    if op.source == str(HEAD_INDEX):
        return [f"{target} = i_hv.to(ACC)  # the value-head index h"]
    pointer, offsets, mask, dtype = input_load(op, ctx)
    if op.out in ctx.issued_early:  # loaded before the previous V loop, in the dtype it is stored in
        lines = [f"{target} = {target}.to({dtype})"] if dtype else []
    else:
        lines = [load_line(target, pointer, offsets, mask, dtype)]
    if op.out in ctx.guarded:  # rows past the sequence end load as 0: no mask on the marks
        lines += guard_lines(ctx, op.out, target, target, "finite")
    return lines


@CHUNK_EMITTERS.register(StateIn)
def _state_in(op: StateIn, ctx: KernelContext) -> list[str]:
    # Only the scan computes the entry state: it is the loop-carried state variable itself.
    return []


def _row_norm(value: str) -> str:
    """The row norms of a Normalize's input (a temporary outside the b_ namespace of values)."""
    return f"row_norm_{value}"


@CHUNK_EMITTERS.register(Normalize)
def _normalize(op: Normalize, ctx: KernelContext) -> list[str]:
    x, y = var(op.x), var(op.out)
    # the row norms are named: an adjoint in the same kernel reads them (_normalize_grad), so the
    # input tile dies here instead of living until the gradient
    norm = _row_norm(op.out)
    return [
        f"{y} = {x}",
        "if USE_QK_L2NORM:",
        f"    {norm} = tl.sqrt(tl.sum({x} * {x}, axis=1) + 1e-6)",
        f"    {y} = {x} / {norm}[:, None]",
    ]


@CHUNK_EMITTERS.register(Formula)
def _formula(op: Formula, ctx: KernelContext) -> list[str]:
    if is_copy(op):  # a copy of a tile held in its storage dtype keeps that dtype
        return [f"{var(op.out)} = {var(op.args()[0])}"]
    # a state tile with a full-precision source at a sequence boundary is read from it there
    names = {a: boundary_read(a, ctx) if ctx.boundary_state(a) else read_in_acc(ctx, a) for a in op.args()}
    text = to_triton(op.expr, names)
    arg_shapes = {ctx.shape(a) for a in op.args()}
    if op.shape and arg_shapes <= {()}:  # only scalars read: spread the value over the tile
        text = f"tl.zeros({ctx.block(op.shape)}, dtype=ACC) + ({text})"
    return [f"{var(op.out)} = {text}"]


@CHUNK_EMITTERS.register(MaskRows)
def _mask_rows(op: MaskRows, ctx: KernelContext) -> list[str]:
    if len(op.shape) == 1:
        return [f"{var(op.out)} = tl.where(m_t, {var(op.x)}, 0.0)"]
    if op.shape not in (("C", "K"), ("C", "V")):
        raise CompileError(f"rows_in_sequence of a {' x '.join(op.shape)} tile: only C, C x K and C x V values are masked")
    # a C x K tile (a per-key-channel formula): key lanes past K (BK pads K to a power of two)
    # too; a formula of the zero-padded inputs need not be 0 there, and a gram over keys sums it.
    # A C x V tile (a per-value-channel formula) the same over its block's value lanes.
    lanes = "m_k" if op.shape == ("C", "K") else "m_v"
    return [f"{var(op.out)} = tl.where(m_t[:, None] & {lanes}[None, :], {var(op.x)}, 0.0)"]


@CHUNK_EMITTERS.register(FiniteRows)
def _finite_rows(op: FiniteRows, ctx: KernelContext) -> list[str]:
    x = var(op.x)
    if op.out not in ctx.guarded:  # a backward kernel: the value as it is
        return [f"{var(op.out)} = {x}"]
    # a formula of padded inputs need not be finite past the sequence end (or past K)
    in_sequence = {("C",): "m_t", ("C", "K"): "m_t[:, None] & m_k[None, :]", ("C", "V"): "m_t[:, None] & m_v[None, :]"}[op.shape]
    return guard_lines(ctx, op.out, var(op.out), x, "log_decay" if op.log_decay else "finite", in_sequence)


@CHUNK_EMITTERS.register(ClampBelow)
def _clamp_below(op: ClampBelow, ctx: KernelContext) -> list[str]:
    # a comparison, not tl.maximum: a NaN stays NaN (maximum may return the other operand), and
    # -inf becomes the floor
    x = var(op.x)
    return [f"{var(op.out)} = tl.where({x} < {op.floor!r}, {op.floor!r}, {x})"]


@CHUNK_EMITTERS.register(ClampBelowGrad)
def _clamp_below_grad(op: ClampBelowGrad, ctx: KernelContext) -> list[str]:
    return [f"{var(op.out)} = tl.where({var(op.x)} < {op.floor!r}, 0.0, {var(op.dy)})"]


@CHUNK_EMITTERS.register(Broadcast)
def _broadcast(op: Broadcast, ctx: KernelContext) -> list[str]:
    source, x = ctx.shape(op.x), var(op.x)
    if source == ():
        return [f"{var(op.out)} = tl.zeros({ctx.block(op.shape)}, dtype=ACC) + {x}"]
    spread = f"{x}[:, None]" if source == op.shape[:1] else f"{x}[None, :]"
    return [f"{var(op.out)} = tl.broadcast_to({spread}, {ctx.block(op.shape)})"]


@CHUNK_EMITTERS.register(Cumsum)
def _cumsum(op: Cumsum, ctx: KernelContext) -> list[str]:
    sibling = inclusive_sibling(ctx, op.out)
    if sibling:
        # the suffix sum as a difference, from the inclusive sum s this kernel already holds: the
        # chunk's total (its last row, which padded rows past the sequence end repeat) - s_i.
        # Exactly 0 on the last row; elsewhere the error is that of the chunk's total, as in the
        # decay matrix's exp2(G_i - G_j)
        s = var(sibling)
        return [f"{var(op.out)} = {last_row(s, op.shape)} - {s}"]
    if op.exclusive:
        # sum_{j < i} x_j (or j > i) with no inclusive sum at hand: a masked C x C sum
        rows_before = "o_c[None, :] > o_c[:, None]" if op.reverse else "o_c[None, :] < o_c[:, None]"
        x = var(op.x)
        if op.shape == ("C",):
            return [f"{var(op.out)} = tl.sum(tl.where({rows_before}, {x}[None, :], 0.0), axis=1)"]
        # per key channel: the rows shifted by one (each row's own value drops out), then an
        # inclusive sum -- summed directly too
        neighbour, inside = ("tl.minimum(o_c + 1, BT - 1)", "o_c < BT - 1") if op.reverse else ("tl.maximum(o_c - 1, 0)", "o_c > 0")
        rows = f"tl.broadcast_to(({neighbour})[:, None], {ctx.block(op.shape)})"
        reverse = ", reverse=True" if op.reverse else ""
        return [
            f"{var(op.out)} = tl.where(({inside})[:, None], tl.gather({x}, {rows}, axis=0), 0.0)",
            f"{var(op.out)} = tl.cumsum({var(op.out)}, axis=0{reverse})",
        ]
    reverse = ", reverse=True" if op.reverse else ""
    return [f"{var(op.out)} = tl.cumsum({var(op.x)}, axis=0{reverse})"]


def last_row(x: str, shape) -> str:
    """The chunk's last row of the tile x of `shape` (C or C x K; padded rows past the sequence
    end repeat the last real value)."""
    rows = "o_c == BT - 1" if shape == ("C",) else "(o_c == BT - 1)[:, None]"
    return f"tl.sum(tl.where({rows}, {x}, 0.0), axis=0)"


@CHUNK_EMITTERS.register(LastRow)
def _last_row(op: LastRow, ctx: KernelContext) -> list[str]:
    return [f"{var(op.out)} = {last_row(var(op.x), ctx.shape(op.x))}"]


def _lower(inclusive: bool) -> str:
    return f"o_c[:, None] {'>=' if inclusive else '>'} o_c[None, :]"


@CHUNK_EMITTERS.register(DecayMatrix)
def _decay(op: DecayMatrix, ctx: KernelContext) -> list[str]:
    x = var(op.x)
    return [f"{var(op.out)} = tl.exp2(tl.where({_lower(op.inclusive)}, {x}[:, None] - {x}[None, :], float('-inf')))"]


# -- key-channel gates: per-channel decayed products (helpers in KEY_CHANNEL_HELPERS) ------------


@CHUNK_EMITTERS.register(DecayedGram)
def _decayed_gram(op: DecayedGram, ctx: KernelContext) -> list[str]:
    args = f"{var(op.a)}, {var(op.b)}, {var(op.x)}, {var(op.column_decay)}, {op.inclusive}, {op.y is not None}"
    return [f"{var(op.out)} = decayed_gram({args}, BT, DOT_DTYPE, DOT_PRECISION)"]


@CHUNK_EMITTERS.register(DecayedMatMul)
def _decayed_matmul(op: DecayedMatMul, ctx: KernelContext) -> list[str]:
    args = f"{var(op.m)}, {var(op.b)}, {var(op.x)}, {var(op.column_decay)}, {op.transpose}"
    return [f"{var(op.out)} = decayed_matmul({args}, BT, DOT_DTYPE, DOT_PRECISION)"]


@CHUNK_EMITTERS.register(Diagonal)
def _diagonal(op: Diagonal, ctx: KernelContext) -> list[str]:
    return [f"{var(op.out)} = tl.sum(tl.where(o_c[:, None] == o_c[None, :], {var(op.x)}, 0.0), axis=1)"]


@CHUNK_EMITTERS.register(CrossingSum)
def _crossing_sum(op: CrossingSum, ctx: KernelContext) -> list[str]:
    # the suffix sums down each column, R_tj = sum_{i >= t} x_ij, then row t's sum over j < t:
    # every term is a pair that spans row t, so nothing is added only to cancel
    out = var(op.out)
    return [f"{out} = tl.cumsum({var(op.x)}, axis=0, reverse=True)  # C x C until the next line",
            f"{out} = tl.sum(tl.where(o_c[None, :] < o_c[:, None], {out}, 0.0), axis=1)"]


KEY_CHANNEL_OPS = (DecayedGram, DecayedMatMul)  # the ops that call the helpers below
# Triton helpers of the per-channel decayed products; written into modules whose chunk programs
# use them. exp2(x_i - x_j) per key channel spans up to C steps of decay: split as
# exp2(x_i) * exp2(-x_j) over the whole chunk it overflows (g = -30 per step is -43 in log2 units
# per row). Instead every pair i > j is split at a row r between them, inside a block of rows that
# holds both: exp2(x_i - x_r) * exp2(x_r - x_j), each factor at most 1, so nothing overflows and a
# factor that underflows to 0 belongs to a product that is below fp32's range anyway. (The dplr
# update's products pair an exclusive row decay x with an inclusive column decay y: the same split
# with y at the row r.) Blocks of
# 2, 4, ..., C rows, split in their middle, cover every pair exactly once: log2(C) tensor-core
# products per decayed product, plus the diagonal (exp2(0) = 1) where it is included.
KEY_CHANNEL_HELPERS = '''\
@triton.jit
def decay_split(x, y, S: tl.constexpr, BT: tl.constexpr, R: tl.constexpr):
    """One level of the per-channel decay split: blocks of 2S rows split at their row r = R
    (S: the second half's first row; S - 1: the first half's last row; either lies between the
    rows of every pair the level covers).

    Returns up = exp2(x_i - y_r) on rows i of a block's second half (else 0), down = exp2(y_r - y_j)
    on rows j of its first half (else 0), and pairs[i, j]: i in the second half and j in the first
    half of the same block. y does not increase down the rows, and x is y (R either row) or the
    exclusive decay beside an inclusive y (x_i = y_(i-1); R = S - 1), so both factors are at most 1."""
    BK: tl.constexpr = x.shape[1]
    blocks = tl.reshape(y, (BT // (2 * S), 2 * S, BK))
    middle = (tl.arange(0, 2 * S) == R)[None, :, None]
    y_mid = tl.sum(tl.where(middle, blocks, 0.0), axis=1)  # one row per block, exactly
    y_mid = tl.reshape(tl.broadcast_to(y_mid[:, None, :], (BT // (2 * S), 2 * S, BK)), (BT, BK))
    o_c = tl.arange(0, BT)
    second = (o_c // S) % 2 == 1
    first = (o_c // S) % 2 == 0
    up = tl.exp2(tl.where(second[:, None], x - y_mid, float("-inf")))
    down = tl.exp2(tl.where(first[:, None], y_mid - y, float("-inf")))
    pairs = (o_c[:, None] // (2 * S) == o_c[None, :] // (2 * S)) & second[:, None] & first[None, :]
    return up, down, pairs


@triton.jit
def decayed_gram(a, b, x, y, INCLUSIVE: tl.constexpr, TWO_DECAYS: tl.constexpr, BT: tl.constexpr,
                 DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """BT x BT: sum_c a_ic b_jc exp2(x_ic - y_jc) where i > j (i >= j if INCLUSIVE, where y is x),
    else 0. With one decay (y is x) it splits at the second half's first row; with two (x the
    exclusive decay) at the first half's last row, the only row between every pair then."""
    o_c = tl.arange(0, BT)
    m = tl.zeros((BT, BT), dtype=x.dtype)
    if INCLUSIVE:  # the diagonal decays by exp2(0) = 1
        m += tl.where(o_c[:, None] == o_c[None, :], tl.sum(a * b, axis=1)[:, None], 0.0)
    for level in tl.static_range(7):  # blocks of 2S rows, S = 1, 2, 4, ... < BT
        if (1 << level) < BT:
            if TWO_DECAYS:
                up, down, pairs = decay_split(x, y, 1 << level, BT, (1 << level) - 1)
            else:
                up, down, pairs = decay_split(x, y, 1 << level, BT, 1 << level)
            part = tl.dot((a * up).to(DOT_DTYPE), tl.trans((b * down).to(DOT_DTYPE)), input_precision=DOT_PRECISION)
            m += tl.where(pairs, part, 0.0)
    return m


@triton.jit
def decayed_matmul(m, b, x, y, TRANSPOSE: tl.constexpr, BT: tl.constexpr, DOT_DTYPE: tl.constexpr,
                   DOT_PRECISION: tl.constexpr):
    """BT x BK: sum_{j < i} m_ij b_jc exp2(x_ic - y_jc), or with TRANSPOSE
    sum_{j > i} m_ji b_jc exp2(x_jc - y_ic).

    Two forms, by what an H100 measured. From C = 32 on at K <= 128 the levels run as a loop
    with the decayed tile fed to 16-bit dots in two parts (dot_of_rounded_parts): unrolled, each
    level's operand tiles kept shared memory of their own (kda's backward output kernel at C = 64:
    155,648 bytes, 57,344 as a loop, and the second dot unrolled did not fit sm_90), and gla's
    forward + backward at C = 32 ran 6.55 -> 5.29 ms. At C = 16 (four levels) and at K > 128 they
    unroll with one dot per level: as a loop kda's forward + backward at C = 16 ran 7.74 -> 9.65 ms
    (ptxas spilled 348 -> 1,176 bytes per thread), and at K = 256 the loop or the second dot
    starved the kernel of registers (kda_fused_gate, kda_neg_eigval: 32-64 of 255)."""
    BK: tl.constexpr = x.shape[1]
    out = tl.zeros((BT, BK), dtype=x.dtype)
    if BT < 32 or BK > 128:
        for level in tl.static_range(7):  # blocks of 2S rows, S = 1, 2, 4, ... < BT
            if (1 << level) < BT:
                up, down, pairs = decay_split(x, y, 1 << level, BT, (1 << level) - 1)
                block = tl.where(pairs, m, 0.0).to(DOT_DTYPE)
                if TRANSPOSE:
                    out += down * tl.dot(tl.trans(block), (b * up).to(DOT_DTYPE), input_precision=DOT_PRECISION)
                else:
                    out += up * tl.dot(block, (b * down).to(DOT_DTYPE), input_precision=DOT_PRECISION)
    else:
        S = 1
        while S < BT:
            out += decayed_level(m, b, x, y, S, TRANSPOSE, BT, DOT_DTYPE, DOT_PRECISION)
            S *= 2
    return out


@triton.jit
def decayed_level(m, b, x, y, S, TRANSPOSE: tl.constexpr, BT: tl.constexpr, DOT_DTYPE: tl.constexpr,
                  DOT_PRECISION: tl.constexpr):
    """decayed_matmul's pairs (i, j) in one block of 2S rows with i in its second half and j in
    its first. They split at the first half's last row r (y_r gathered per row): exp2(x_i - y_j)
    = exp2(x_i - y_r) exp2(y_r - y_j), both factors <= 1. decay_split's split, for a runtime S
    (its reshape needs S at compile time); the unrolled form keeps decay_split, since with this
    gather there gla's K = 256 kernel spilled twice as much."""
    BK: tl.constexpr = x.shape[1]
    o_c = tl.arange(0, BT)
    r = (o_c // (2 * S)) * (2 * S) + S - 1
    y_r = tl.gather(y, tl.broadcast_to(r[:, None], (BT, BK)), axis=0)
    second = (o_c // S) % 2 == 1
    first = (o_c // S) % 2 == 0
    up = tl.exp2(tl.where(second[:, None], x - y_r, float("-inf")))
    down = tl.exp2(tl.where(first[:, None], y_r - y, float("-inf")))
    pairs = (o_c[:, None] // (2 * S) == o_c[None, :] // (2 * S)) & second[:, None] & first[None, :]
    block = tl.where(pairs, m, 0.0).to(DOT_DTYPE)
    if TRANSPOSE:
        part = down * dot_of_rounded_parts(tl.trans(block), b * up, DOT_DTYPE, DOT_PRECISION)
    else:
        part = up * dot_of_rounded_parts(block, b * down, DOT_DTYPE, DOT_PRECISION)
    return part


@triton.jit
def dot_of_rounded_parts(a, tile, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """a @ tile for an fp32 tile, which 16-bit dots take as two: its rounding, then the rounding
    of what that left. A gate's gradient sums these products over the chunk with terms that
    cancel, and one bf16 rounding of the decayed tile survived the sum: kda_fused_gate's d_a
    grew with the chunk size to 9.6e-3 at C = 64 on an H100 (replayed on the CPU: 6.6e-3 at
    C = 32, 8.9e-3 at C = 64; 3.1-3.2e-3 at both with the second dot)."""
    rounded = tile.to(DOT_DTYPE)
    product = tl.dot(a, rounded, input_precision=DOT_PRECISION)
    if DOT_DTYPE == tl.bfloat16 or DOT_DTYPE == tl.float16:
        product += tl.dot(a, (tile - rounded.to(tile.dtype)).to(DOT_DTYPE), input_precision=DOT_PRECISION)
    return product
'''


def uses_key_channel_helpers(*programs: ChunkProgram) -> bool:
    return any(isinstance(op, KEY_CHANNEL_OPS) for prog in programs for op in prog.ops)


@CHUNK_EMITTERS.register(Band)
def _band(op: Band, ctx: KernelContext) -> list[str]:
    gap = "(o_c[:, None] - o_c[None, :])"
    keep = f"({gap} >= {op.lo})" + (f" & ({gap} <= {op.hi})" if op.hi is not None else "")
    return [f"{var(op.out)} = tl.where({keep}, {var(op.x)}, 0.0)"]


@CHUNK_EMITTERS.register(Mask)
def _mask(op: Mask, ctx: KernelContext) -> list[str]:
    return [f"{var(op.out)} = tl.where({_lower(op.inclusive)}, {var(op.x)}, 0.0)"]


@CHUNK_EMITTERS.register(MatMul)
def _matmul(op: MatMul, ctx: KernelContext) -> list[str]:
    def operand(name: str, transpose: bool) -> str:
        x = f"{var(name)}.to(DOT_DTYPE)"
        return f"tl.trans({x})" if transpose else x

    a, b = operand(op.a, op.transpose_a), operand(op.b, op.transpose_b)
    return [f"{ctx.assign(op.out)}tl.dot({a}, {b}, input_precision=DOT_PRECISION)"]


@CHUNK_EMITTERS.register(ReduceSum)
def _reduce_sum(op: ReduceSum, ctx: KernelContext) -> list[str]:
    # padded rows and columns hold 0 in every tile, so sums need no masks
    x = var(op.x)
    if op.shape == ():
        return [f"{ctx.assign(op.out)}tl.sum({x})"]
    (axis,) = op.axes
    return [f"{ctx.assign(op.out)}tl.sum({x}, axis={axis})"]


@CHUNK_EMITTERS.register(PlaceLastRow)
def _place_last_row(op: PlaceLastRow, ctx: KernelContext) -> list[str]:
    if op.shape == ("C",):
        return [f"{var(op.out)} = tl.where(o_c == BT - 1, {var(op.x)}, 0.0)"]
    return [f"{var(op.out)} = tl.where((o_c == BT - 1)[:, None], {var(op.x)}[None, :], 0.0)"]


@CHUNK_EMITTERS.register(NormalizeGrad)
def _normalize_grad(op: NormalizeGrad, ctx: KernelContext) -> list[str]:
    x, dy, dx = var(op.x), var(op.dy), var(op.out)
    # temporaries outside the b_ namespace of values: 1 / the row norms, the normalised rows
    r, y = f"inv_norm_{op.out}", f"unit_{op.out}"
    normalized = normalized_here(ctx, op.x)
    if normalized is not None:  # this kernel normalised x: its rows and norms, not x again
        return [
            f"{dx} = {dy}",
            "if USE_QK_L2NORM:",
            f"    {r} = 1.0 / {_row_norm(normalized)}",
            f"    {dx} = {r}[:, None] * ({dy} - {var(normalized)} * tl.sum({var(normalized)} * {dy}, axis=1)[:, None])",
        ]
    return [
        f"{dx} = {dy}",
        "if USE_QK_L2NORM:",
        f"    {r} = 1.0 / tl.sqrt(tl.sum({x} * {x}, axis=1) + 1e-6)",
        f"    {y} = {x} * {r}[:, None]",
        f"    {dx} = {r}[:, None] * ({dy} - {y} * tl.sum({y} * {dy}, axis=1)[:, None])",
    ]


@CHUNK_EMITTERS.register(UnitLowerInverse)
def _unit_lower_inverse(op: UnitLowerInverse, ctx: KernelContext) -> list[str]:
    in_memory = {b.value for b in ctx.plan.buffers}
    if op.a not in in_memory or op.out not in in_memory:
        raise CompileError(f"the triangular solve needs {op.a} and {op.out} in memory (plan {ctx.plan.name})")
    lines = render("solve_blocks.py.jinja", a=buffer_param(op.a), x=buffer_param(op.out), block=SOLVE_BLOCK)
    lines = lines.rstrip("\n").split("\n")
    if any(op.out in ctx.prog.op(v).args() for v in ctx.kernel.computes):
        lines += [f"# {op.out} whole, for the matmuls below", *emit_buffer_load(op.out, ctx)[1:]]
    return lines
