"""Chunk kernels: one Triton kernel per planned kernel, one registered emitter per chunk op.

A kernel's body is its ops in program order. Ops whose tile has a V axis run inside a loop over
blocks of BV value columns (chunk-parallel kernels) or on the program's own block (the scan,
which puts value blocks on the grid: state columns evolve independently). Values named in the
plan's buffers are loaded where a kernel reads them and stored right after they are computed.

Tiles are ACC (fp32; fp64 for fp64 inputs) in registers; matmul operands are cast to DOT_DTYPE
(the q/k/v dtype on a GPU, ACC in the interpreter, where 16-bit dots are wrong), accumulating in
fp32 or wider.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import CompileError
from ..ir.chunk import (
    Band,
    COTANGENT,
    SAVED,
    Broadcast,
    ChunkOp,
    ChunkProgram,
    Cumsum,
    DecayMatrix,
    DecayedGram,
    DecayedMatMul,
    Diagonal,
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
from ..ir.plan import BackwardPlan, ChunkPlans, Kernel, Plan
from ..ir.recurrence import InputRole
from ..registry import TypeRegistry
from .names import CHUNK_OPTIONS, forward_options, gradient_pointer, input_pointer, signature
from .pressure import peak_tile_bytes
from .printer import to_triton
from .schedule import eager_sums, first_reader_segment, has_v, is_loadable, place_values, readers
from .templating import indent, render

CHUNK_EMITTERS = TypeRegistry("chunk kernel emitter", CompileError)

BLOCK_DIMS = {"C": "BT", "K": "BK", "V": "BV"}
SOLVE_BLOCK = 16  # the triangular solve works on 16 x 16 blocks


def var(name: str) -> str:
    return f"b_{name}"


def buffer_param(value: str) -> str:
    return f"buf_{value}"


def saved_param(source: str) -> str:
    """The parameter of a forward buffer the backward reads (`saved:H` -> saved_H)."""
    return "saved_" + source[len(SAVED):]


def result_param(role: str) -> str:
    """The kernel parameter (and launcher local) a result role is written to: o, d_q, d_in_beta, ..."""
    return "o" if role == "o" else gradient_pointer(role.split(":", 1)[1])


# The pointer of the output's gradient (the backward's cotangent): a fixed name outside the
# input namespaces (lrdsl.codegen.names).
COTANGENT_POINTER = "d_o"


@dataclass
class KernelContext:
    prog: ChunkProgram
    plan: Plan
    kernel: Kernel
    accumulators: frozenset = frozenset()  # values summed over the V loop: `+=` instead of `=`
    eager: dict = field(default_factory=dict)  # term -> (sum, starts it): schedule.eager_sums

    def assign(self, value: str) -> str:
        return f"{var(value)} {'+=' if value in self.accumulators else '='} "

    def shape(self, value: str):
        return self.prog.shape(value)

    def block(self, shape) -> str:
        dims = [BLOCK_DIMS[a] for a in shape]
        return f"({dims[0]},)" if len(dims) == 1 else "(" + ", ".join(dims) + ")"

    def stored_here(self, value: str) -> bool:
        return value in self.kernel.stores

    def solves(self) -> bool:
        """Whether this kernel runs a triangular solve (its block merges take SOLVE_PRECISION)."""
        return any(isinstance(self.prog.op(v), UnitLowerInverse) for v in self.kernel.computes)

    def chunk_matrix_source(self) -> str | None:
        """The parameter of the first C x C buffer made by another kernel that this chunk kernel
        loads (its width is the kernel's CC_BT), or None."""
        if self.kernel.kind != "chunk":
            return None
        for value in self.kernel.loads:
            # a solve addresses the blocks of its input itself
            if self.shape(value) == ("C", "C") and not _read_only_by_solves(self, value):
                return buffer_param(value)
        for value in self.kernel.computes:
            op = self.prog.op(value)
            if isinstance(op, Load) and op.source.startswith(SAVED) and op.shape == ("C", "C"):
                return saved_param(op.source)
        return None

    def readers(self, value: str) -> list:
        """The ops of this kernel that read `value`."""
        return [self.prog.op(v) for v in readers(self, value)]

    def load_dtype(self, value: str) -> str | None:
        """The register dtype a loaded value gets: DOT_DTYPE when only matmuls read it here (a
        16-bit operand stays 16-bit: half the registers, no round trip through fp32); None (its
        storage dtype) for a tile only matmuls and elementwise formulas read (`in_storage_dtype`);
        else ACC."""
        ops = self.readers(value)
        if ops and all(isinstance(op, MatMul) for op in ops) and not self.stored_here(value):
            return "DOT_DTYPE"
        if self.in_storage_dtype(value):
            return None
        return "ACC"

    def in_storage_dtype(self, value: str) -> bool:
        """Whether a tile stays in registers in the dtype it is stored in (16 bits for 16-bit
        inputs: half the registers of fp32), each reader converting it where it reads it: a
        matmul to DOT_DTYPE, an elementwise formula to ACC. Converting a 16-bit number to fp32 is
        exact, so the results are the same bit for bit. A loaded tile of two axes qualifies, and
        so does a copy of one (d_U = d_Vn) whose readers qualify; a value stored, written as a
        result or summed eagerly is converted once, where it is defined."""
        op = self.prog.op(value)
        loaded = value in self.kernel.loads or (
            isinstance(op, Load) and (op.source in STORAGE_DTYPE_SOURCES or op.source.startswith(SAVED)))
        copy = _is_copy(op) and self.in_storage_dtype(op.args()[0])
        if len(op.shape) != 2 or not (loaded or copy):
            return False
        return self._readers_convert(value)

    def _readers_convert(self, value: str) -> bool:
        if self.stored_here(value) or value in self.eager or value in {v for _, v in self.prog.results}:
            return False
        ops = self.readers(value)
        return bool(ops) and all(
            isinstance(op, MatMul) or (isinstance(op, Formula) and (not _is_copy(op) or self._readers_convert(op.out)))
            for op in ops
        )


# Call inputs a chunk kernel may hold in their own dtype (KernelContext.in_storage_dtype): the
# others (gates, betas) are loaded in ACC whatever their readers.
STORAGE_DTYPE_SOURCES = ("q", "k", "v", COTANGENT)


def _read(ctx: KernelContext, value: str) -> str:
    """A value as an elementwise formula reads it: in ACC (converted where it is held in its
    storage dtype)."""
    return f"{var(value)}.to(ACC)" if ctx.in_storage_dtype(value) else var(value)


def _is_copy(op) -> bool:
    """A formula that is one value unchanged (d_U = d_Vn: the same tile under a second name)."""
    return isinstance(op, Formula) and op.expr.is_Symbol


# -- addressing --------------------------------------------------------------------------------

ROW = "(bos + o_t)"


def tile_address(shape, row_stride: str, head_offset: str, width: str) -> tuple[str, str]:
    """Offsets and mask of a per-row tile in a token-major tensor [.., T, heads, width]."""
    if shape == ("C",):
        return f"{ROW} * {row_stride} + {head_offset}", "m_t"
    column = {"K": ("o_k", "m_k"), "V": ("o_v", "m_v"), "C": ("o_c", None)}[shape[1]]
    offsets = f"{ROW}[:, None] * ({row_stride} * {width}) + {head_offset} * {width} + {column[0]}[None, :]"
    mask = "m_t[:, None]" + (f" & {column[1]}[None, :]" if column[1] else "")
    return offsets, mask


def buffer_address(shape, made_elsewhere: bool = False) -> tuple[str, str]:
    """Offsets and mask of this chunk's tile in a buffer (layouts in lrdsl.ir.plan).
    made_elsewhere: a C x C tile another kernel stored, maybe at a multiple of this chunk size."""
    if shape == ("C", "C") and made_elsewhere:
        return sub_chunk_matrix_address()
    if shape == ():
        return "i_c * HV + i_hv", ""
    if shape == ("K",):
        return "(i_c * HV + i_hv) * K + o_k", "m_k"
    if shape == ("K", "V"):
        return "(i_c * HV + i_hv) * (K * V) + o_k[:, None] * V + o_v[None, :]", "m_k[:, None] & m_v[None, :]"
    width = {("C", "K"): "K", ("C", "V"): "V", ("C", "C"): "BT", ("C",): ""}[shape]
    return tile_address(shape, "HV", "i_hv", width)


def sub_chunk_matrix_address() -> tuple[str, str]:
    """A C x C buffer made at chunk size CC_BT, a multiple of BT (the forward call's solved system,
    which the backward keeps under save_solve while it runs at its own smaller chunk size): each
    row holds CC_BT columns, and this chunk's tile is the diagonal block of its sub-chunk, which
    is what solving at BT gives. Where CC_BT == BT the column offset is 0."""
    offsets = f"{ROW}[:, None] * (HV * CC_BT) + i_hv * CC_BT + (i_t * BT) % CC_BT + o_c[None, :]"
    return offsets, "m_t[:, None]"


def load_line(target: str, pointer: str, offsets: str, mask: str, dtype: str | None = "ACC") -> str:
    """A tile's load, converted to `dtype` (None: kept in the dtype it is stored in)."""
    convert = f".to({dtype})" if dtype else ""
    if not mask:
        return f"{target} = tl.load({pointer} + {offsets}){convert}"
    return f"{target} = tl.load({pointer} + {offsets}, mask={mask}, other=0.0){convert}"


def store_line(pointer: str, offsets: str, mask: str, value: str) -> str:
    masked = f", mask={mask}" if mask else ""
    return f"tl.store({pointer} + {offsets}, {value}.to({pointer}.dtype.element_ty){masked})"


def emit_buffer_load(value: str, ctx: KernelContext) -> list[str]:
    made_elsewhere = ctx.kernel.kind == "chunk" and not ctx.stored_here(value)
    offsets, mask = buffer_address(ctx.shape(value), made_elsewhere=made_elsewhere)
    line = load_line(var(value), buffer_param(value), offsets, mask, ctx.load_dtype(value))
    return [f"# {value}: stored by an earlier kernel", line]


def emit_buffer_store(value: str, ctx: KernelContext) -> list[str]:
    offsets, mask = buffer_address(ctx.shape(value))
    return [store_line(buffer_param(value), offsets, mask, var(value))]


# -- op emitters -----------------------------------------------------------------------------


@CHUNK_EMITTERS.register(Load)
def _load(op: Load, ctx: KernelContext) -> list[str]:
    target = var(op.out)
    if op.source == "scale":
        return [f"{target} = scale"]
    if op.source == str(HEAD_INDEX):
        return [f"{target} = i_hv.to(ACC)  # the value-head index h"]
    if op.source in ("q", "k"):
        offsets, mask = tile_address(op.shape, "H", "i_h", "K")
        return [load_line(target, op.source, offsets, mask, ctx.load_dtype(op.out))]
    if op.source in ("v", COTANGENT):
        offsets, mask = tile_address(op.shape, "HV", "i_hv", "V")
        return [load_line(target, "v" if op.source == "v" else COTANGENT_POINTER, offsets, mask, ctx.load_dtype(op.out))]
    if op.source.startswith(SAVED):
        offsets, mask = buffer_address(op.shape, made_elsewhere=ctx.kernel.kind == "chunk")
        return [load_line(target, saved_param(op.source), offsets, mask, ctx.load_dtype(op.out))]
    role = ctx.prog.recurrence.input(op.source).role
    if role is InputRole.HEAD:
        return [load_line(target, input_pointer(op.source), "i_hv", "")]
    if role is InputRole.TOKEN:
        offsets, mask = tile_address(op.shape, "HV", "i_hv", "")
        return [load_line(target, input_pointer(op.source), offsets, mask)]
    if role is InputRole.TOKEN_KEY:  # [B, T, HV, K]: like v, by value head
        offsets, mask = tile_address(op.shape, "HV", "i_hv", "K")
        return [load_line(target, input_pointer(op.source), offsets, mask)]
    return [load_line(target, input_pointer(op.source), "i_hv * K + o_k", "m_k")]  # HEAD_KEY: [HV, K]


@CHUNK_EMITTERS.register(StateIn)
def _state_in(op: StateIn, ctx: KernelContext) -> list[str]:
    # Only the scan computes the entry state: it is the loop-carried state variable itself.
    return []


def _row_norm(value: str) -> str:
    """The row norms of a Normalize's input (a temporary outside the b_ namespace of values)."""
    return f"row_norm_{value}"


def emitted_args(ctx: KernelContext, value: str) -> tuple[str, ...]:
    """The values an op's emitted code reads: its arguments, but for the adjoint of a
    normalisation this kernel computes, which reads the normalised rows instead of the raw ones."""
    op = ctx.prog.op(value)
    if isinstance(op, NormalizeGrad) and (normalized := _normalized_here(ctx, op.x)) is not None:
        return (normalized, op.dy)
    return op.args()


def _normalized_here(ctx: KernelContext, x: str) -> str | None:
    """The value this kernel normalises `x` into, if it does (its rows are the unit vectors)."""
    for value in ctx.kernel.computes:
        op = ctx.prog.op(value)
        if isinstance(op, Normalize) and op.x == x:
            return value
    return None


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
    # a copy of a tile held in its storage dtype keeps that dtype
    names = {a: var(a) if _is_copy(op) else _read(ctx, a) for a in op.args()}
    text = to_triton(op.expr, names)
    arg_shapes = {ctx.shape(a) for a in op.args()}
    if op.shape and arg_shapes <= {()}:  # only scalars read: spread the value over the tile
        text = f"tl.zeros({ctx.block(op.shape)}, dtype=ACC) + ({text})"
    return [f"{var(op.out)} = {text}"]


@CHUNK_EMITTERS.register(MaskRows)
def _mask_rows(op: MaskRows, ctx: KernelContext) -> list[str]:
    if len(op.shape) == 1:
        return [f"{var(op.out)} = tl.where(m_t, {var(op.x)}, 0.0)"]
    if op.shape != ("C", "K"):
        raise CompileError(f"rows_in_sequence of a {' x '.join(op.shape)} tile: only C and C x K values are masked")
    # a C x K tile (a per-key-channel formula): key lanes past K (BK pads K to a power of two)
    # too; a formula of the zero-padded inputs need not be 0 there, and a gram over keys sums it
    return [f"{var(op.out)} = tl.where(m_t[:, None] & m_k[None, :], {var(op.x)}, 0.0)"]


@CHUNK_EMITTERS.register(Broadcast)
def _broadcast(op: Broadcast, ctx: KernelContext) -> list[str]:
    source, x = ctx.shape(op.x), var(op.x)
    if source == ():
        return [f"{var(op.out)} = tl.zeros({ctx.block(op.shape)}, dtype=ACC) + {x}"]
    spread = f"{x}[:, None]" if source == op.shape[:1] else f"{x}[None, :]"
    return [f"{var(op.out)} = tl.broadcast_to({spread}, {ctx.block(op.shape)})"]


@CHUNK_EMITTERS.register(Cumsum)
def _cumsum(op: Cumsum, ctx: KernelContext) -> list[str]:
    if op.exclusive:
        # sum_{j < i} x_j (or j > i): a masked C x C sum, exact where inclusive-minus-x would cancel
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


@CHUNK_EMITTERS.register(LastRow)
def _last_row(op: LastRow, ctx: KernelContext) -> list[str]:
    rows = "o_c == BT - 1" if op.shape == () else "(o_c == BT - 1)[:, None]"
    return [f"{var(op.out)} = tl.sum(tl.where({rows}, {var(op.x)}, 0.0), axis=0)"]


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

    It splits at the first half's last row: with one decay that is the row before decayed_gram's,
    and with the same split the compiler would share the product's operand tiles with a
    decayed_gram of the same inputs earlier in the kernel and keep them in shared memory until
    here (a backward kernel then asked for 320 KB)."""
    out = tl.zeros((BT, x.shape[1]), dtype=x.dtype)
    for level in tl.static_range(7):
        if (1 << level) < BT:
            up, down, pairs = decay_split(x, y, 1 << level, BT, (1 << level) - 1)
            block = tl.where(pairs, m, 0.0).to(DOT_DTYPE)
            if TRANSPOSE:
                out += down * tl.dot(tl.trans(block), (b * up).to(DOT_DTYPE), input_precision=DOT_PRECISION)
            else:
                out += up * tl.dot(block, (b * down).to(DOT_DTYPE), input_precision=DOT_PRECISION)
    return out
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
    normalized = _normalized_here(ctx, op.x)
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


# -- kernels -----------------------------------------------------------------------------------


def kernel_inputs(ctx: KernelContext) -> list[str]:
    """The call inputs a kernel reads: q, k, v, d_o, then the spec's inputs, in positional order."""
    sources = {ctx.prog.op(v).source for v in ctx.kernel.computes if isinstance(ctx.prog.op(v), Load)}
    order = ["q", "k", "v", COTANGENT] + [i.name for i in ctx.prog.recurrence.inputs]
    return [COTANGENT_POINTER if n == COTANGENT else input_pointer(n) for n in order if n in sources]


def kernel_saved(ctx: KernelContext) -> list[str]:
    """Forward buffers a backward kernel reads."""
    return [
        saved_param(ctx.prog.op(v).source)
        for v in ctx.kernel.computes
        if isinstance(ctx.prog.op(v), Load) and ctx.prog.op(v).source.startswith(SAVED)
    ]


def kernel_buffers(ctx: KernelContext) -> list[str]:
    used = set(ctx.kernel.loads) | set(ctx.kernel.stores)
    return [b.value for b in ctx.plan.buffers if b.value in used]


def kernel_results(ctx: KernelContext) -> list[tuple[str, str]]:
    """(role, value) of the program's results this kernel computes and writes."""
    return [(role, value) for role, value in ctx.prog.results if value in ctx.kernel.computes]


def kernel_params(ctx: KernelContext) -> list[str]:
    params = kernel_inputs(ctx) + kernel_saved(ctx) + [buffer_param(b) for b in kernel_buffers(ctx)]
    return params + [result_param(role) for role, _ in kernel_results(ctx)]


def _read_only_by_solves(ctx: KernelContext, value: str) -> bool:
    ops = ctx.readers(value)
    return bool(ops) and all(isinstance(op, UnitLowerInverse) for op in ops)


def _op_lines(ctx: KernelContext, value: str) -> list[str]:
    """An op's lines: a comment with its formula, its code, then its stores."""
    op: ChunkOp = ctx.prog.op(value)
    lines = [f"# {value} = {op.describe()}"]
    eager_terms = [t for t, (total, _) in ctx.eager.items() if total == value]
    if eager_terms:
        rest = [a for a in op.args() if a not in eager_terms]
        lines[0] += f"   (accumulated as {', '.join(eager_terms)} were computed)"
        if rest:
            lines.append(f"{var(value)} += " + " + ".join(_read(ctx, a) for a in rest))
    else:
        lines.extend(CHUNK_EMITTERS.lookup(op)(op, ctx))
    if value in ctx.eager:
        total, starts = ctx.eager[value]
        lines.append(f"{var(total)} {'=' if starts else '+='} {var(value)}  # running sum {total}")
    if ctx.stored_here(value) and not isinstance(op, UnitLowerInverse):  # a solve stores its own result
        lines.extend(emit_buffer_store(value, ctx))
    for role, result in ctx.prog.results:
        if result != value:
            continue
        if is_key_head_result(role):
            lines.append(f"{group_sum_var(role)} += {var(value)}")
        else:
            lines.extend(emit_result_store(role, value, ctx))
    return lines


# q and k have one head per group of HV // H value heads (GVA): their gradients sum over the group.
KEY_HEAD_INPUTS = ("q", "k")


def is_key_head_result(role: str) -> bool:
    return role.startswith("grad:") and role.split(":", 1)[1] in KEY_HEAD_INPUTS


def group_sum_var(role: str) -> str:
    return f"group_sum_{result_param(role)}"  # outside the b_ namespace of values


def key_head_results(ctx: KernelContext) -> list[tuple[str, str]]:
    """(role, value) of the q/k gradients a kernel writes: it then runs one program per key head."""
    return [(role, value) for role, value in kernel_results(ctx) if is_key_head_result(role)]


def wrap_in_group_loop(ctx: KernelContext, body: list[str]) -> list[str]:
    """Runs `body` for each value head of the program's key head, summing the q/k gradients."""
    results = key_head_results(ctx)
    lines = [f"    {group_sum_var(role)} = tl.zeros({ctx.block(ctx.shape(value))}, dtype=ACC)" for role, value in results]
    lines += [
        "    for i_g in range(HV // H):",
        "        i_hv = i_h * (HV // H) + i_g  # GVA: the value heads reading key head i_h",
        *[("    " + line) if line else line for line in "\n".join(body).split("\n")],
    ]
    for role, value in results:
        offsets, mask = tile_address(ctx.shape(value), "H", "i_h", "K")
        lines += ["    " + line for line in guarded_store(result_param(role), offsets, mask, group_sum_var(role))]
    return lines


def emit_result_store(role: str, value: str, ctx: KernelContext) -> list[str]:
    shape = ctx.shape(value)
    if shape in ((), ("K",)):  # a per-head input's gradient: one per chunk, summed after the kernel
        offsets, mask = buffer_address(shape)
    else:
        width = {("C", "K"): "K", ("C", "V"): "V", ("C",): ""}[shape]
        offsets, mask = tile_address(shape, "HV", "i_hv", width)
    return guarded_store(result_param(role), offsets, mask, var(value))


def guarded_store(pointer: str, offsets: str, mask: str, value: str) -> list[str]:
    """A result's store, skipped when the caller passes None for it (a gradient autograd does not
    ask for): the test is resolved at compile time, and the work only that store needed goes
    with it."""
    return [f"if {pointer} is not None:", "    " + store_line(pointer, offsets, mask, value)]


def emit_scan_body(ctx: KernelContext) -> list[str]:
    """The scan's per-chunk body: every op in program order (its V block is the program's own)."""
    ctx.eager = eager_sums(ctx, None)
    lines = []
    for value in ctx.kernel.loads:
        lines.extend(emit_buffer_load(value, ctx))
    for value in ctx.kernel.computes:
        op = ctx.prog.op(value)
        if not has_v(op.shape) and any(has_v(ctx.shape(a)) for a in op.args()):
            raise CompileError(f"{ctx.prog.recurrence.name}: {value} sums over V inside the scan, whose programs own one V block")
        lines.extend(_op_lines(ctx, value))
    return lines


def emit_chunk_body(ctx: KernelContext) -> list[str]:
    """A chunk-parallel kernel's body: plain segments and loops over blocks of V columns."""
    place, accumulators = place_values(ctx)
    ctx.accumulators = frozenset(accumulators)
    ctx.eager = eager_sums(ctx, place)
    count = 1 + max((i for kind, i in place.values() if kind != "plain"), default=-1)
    plain: list[list[str]] = [[] for _ in range(count + 1)]
    loops: list[list[str]] = [[] for _ in range(count)]
    loaded_in_loop: list[set[str]] = [set() for _ in range(count)]

    def load_into(index: int, value: str) -> None:
        if value in loaded_in_loop[index]:
            return
        loaded_in_loop[index].add(value)
        if value in ctx.kernel.loads:
            loops[index].extend(emit_buffer_load(value, ctx))
        else:
            loops[index].extend(_op_lines(ctx, value))

    # a buffer tile without a V axis is loaded just before its first reader in its segment (or
    # before the segment's V loop when that loop reads it first): loaded at the segment's top, a
    # tile read only at its end would hold registers through everything in between
    pending: dict[str, int] = {
        value: first_reader_segment(ctx, place, value) or 0
        for value in ctx.kernel.loads
        if not has_v(ctx.shape(value)) and not _read_only_by_solves(ctx, value)  # a solve reads blocks itself
    }
    for value in ctx.kernel.computes:
        op = ctx.prog.op(value)
        kind, index = place[value]
        if kind == "plain":
            for arg in op.args():
                if pending.get(arg) == index:
                    plain[index].extend(emit_buffer_load(arg, ctx))
                    del pending[arg]
            plain[index].extend(_op_lines(ctx, value))
            continue
        for arg in op.args():
            if has_v(ctx.shape(arg)) and is_loadable(ctx, arg):
                load_into(index, arg)
        if kind == "sum":
            plain[index].append(f"{var(value)} = tl.zeros({ctx.block(op.shape)}, dtype=ACC)  # summed over V below")
            loops[index].extend(_op_lines(ctx, value))
        elif not is_loadable(ctx, value):
            loops[index].extend(_op_lines(ctx, value))
        else:
            load_into(index, value)

    for value, index in pending.items():  # read first inside V loop `index`
        plain[index].extend(emit_buffer_load(value, ctx))
    body = []
    for index in range(count + 1):
        body.extend(indent(plain[index], 4).split("\n") if plain[index] else [])
        if index < count:
            body += [
                "",
                "    for i_v in range(0, tl.cdiv(V, BV)):",
                "        o_v = i_v * BV + tl.arange(0, BV)",
                "        m_v = o_v < V",
                indent(loops[index], 8),
                "",
            ]
    return wrap_in_group_loop(ctx, body) if key_head_results(ctx) else body


def kernel_function_name(prog: ChunkProgram, kernel: Kernel) -> str:
    direction = "_bwd" if prog.direction == "backward" else ""
    return f"{prog.recurrence.name}_chunk{direction}_{kernel.name}_kernel"


KERNEL_DOCS = {
    "prepare": "Chunk-parallel work before the scan",
    "system": "Builds the triangular system of each chunk",
    "solve": "Solves the triangular system of each chunk",
    "apply": "Applies the solved system: the chunk-parallel inputs of the scan",
    "scan": "The sequential scan over chunks",
    "output": "Chunk-parallel output once every entry state is stored",
}


def emit_kernel(prog: ChunkProgram, plan: Plan, kernel: Kernel) -> str:
    ctx = KernelContext(prog, plan, kernel)
    backward = prog.direction == "backward"
    common = dict(
        kernel_name=kernel_function_name(prog, kernel),
        params=", ".join(kernel_params(ctx)),
        doc=f"{KERNEL_DOCS[kernel.name]} of `{prog.recurrence.name}`{' (backward)' if backward else ''}.",
        computes=", ".join(kernel.computes),
    )
    if kernel.kind == "scan":
        return render(
            "scan_kernel.py.jinja",
            **common,
            reverse=backward,
            state=prog.state_in,
            state_var=var(prog.state_in),
            next_var=var(prog.output("state")),
            body=indent(emit_scan_body(ctx), 8),
        )
    body = "\n".join(emit_chunk_body(ctx))
    return render("chunk_kernel.py.jinja", **common, key_head_programs=bool(key_head_results(ctx)), body=body,
                  chunk_matrices=ctx.chunk_matrix_source() is not None, solves=ctx.solves())


# -- the module section ------------------------------------------------------------------------

# Launch settings per kernel role (value columns per block, warps, pipeline stages); the module
# carries them. Backward roles are the backward program's kernel names with "bwd_" in front.
CHUNK_LAUNCH = {
    "prepare": {"BV": 64, "num_warps": 4, "num_stages": 2},
    "system": {"BV": 64, "num_warps": 4, "num_stages": 2},
    # one warp: the solve's tiles are 16 x 16 blocks, and within a warp its row reductions are
    # register shuffles, with no shared memory or barrier between warps (H200, 4 x 4096: the
    # forward 1.337 -> 1.167 ms against 4 warps)
    "solve": {"BV": 64, "num_warps": 1, "num_stages": 2},
    # apply and output: a third stage hides their tile loads (H200, gdn forward 1.214 -> 1.192 ms
    # each at 4 x 4096, 2.140 -> 2.127 / 2.109 ms at 1 x 65536)
    "apply": {"BV": 64, "num_warps": 4, "num_stages": 3},
    # the scans: 64 value columns per program where that still gives every multiprocessor a
    # program (CHUNK_LAUNCH_FEW_PROGRAMS below otherwise): each chunk's keys and W are read once
    # for twice the columns (gdn forward at 4 x 4096: 1.214 -> 1.147 ms; forward + backward with
    # the backward scan so: 6.127 -> 5.651 ms)
    "scan": {"BV": 64, "num_warps": 4, "num_stages": 2},
    "output": {"BV": 64, "num_warps": 4, "num_stages": 3},
    "bwd_prepare": {"BV": 64, "num_warps": 4, "num_stages": 2},
    "bwd_scan": {"BV": 64, "num_warps": 4, "num_stages": 3},
    "bwd_output": {"BV": 64, "num_warps": 8, "num_stages": 1},
}
# Smaller settings where the backward's output kernel holds larger tiles, else it runs out of
# shared memory: K > 128 key channels (bf16 operands), or fp32 operands (precision="tf32").
# The forward output kernel keeps 32 columns and 2 stages: with BK = 256, BV = 32 and one stage it
# computed wrong results on the H200 (triton 3.6.0), while these were checked there.
# The scans, apply and output keep there the settings they were checked with (32 value columns,
# 2 stages): the wider or deeper ones above were measured at K = 128 with 16-bit operands only.
_CHECKED_WIDE = {"scan": {"BV": 32, "num_stages": 2}, "bwd_scan": {"BV": 32, "num_stages": 2},
                 "apply": {"num_stages": 2}, "output": {"num_stages": 2}}
CHUNK_LAUNCH_WIDE_K = {**_CHECKED_WIDE, "bwd_output": {"BV": 32, "num_warps": 8, "num_stages": 1}}
CHUNK_LAUNCH_FP32 = {**_CHECKED_WIDE, "bwd_output": {"BV": 32, "num_warps": 4, "num_stages": 1}}
# fp32 and fp64 inputs multiply in their own width whatever the precision: their tiles take twice
# (four times) the shared memory of 16-bit ones, so none of the wider settings for 16-bit inputs
# apply (128 value columns for the backward output kernel would need 304,640 bytes at C = 32).
CHUNK_LAUNCH_WIDE_INPUTS = {**_CHECKED_WIDE}
# The largest chunk size whose kernels fit an sm_90 block's shared memory (232,448 bytes), by
# (precision, K > 128), after how many per-key-channel decayed products (DecayedGram,
# DecayedMatMul: each holds C x K operand tiles) the backward's output kernel, the largest
# kernel, computes. Measured with `python -m lrdsl.resources SPEC --chunk-size C --kernels
# bwd_output` on that kernel at its launch settings (bytes; the sizes chunk() refuses, marked
# over, were compiled with the module's LARGEST_CHUNK_SIZE lifted in the measuring process):
#   0 (gdn, scalar gates)   C = 64: 73,728 (K = 128), 139,264 (K = 256); fp32 operands ("tf32")
#                           at C = 64, K = 128: 237,568, over, so tf32 takes C <= 32 everywhere
#                           (73,728 at C = 32)
#   3 (gla)                 C = 64, K = 256: 98,304
#   5 (kda and variants)    C = 64: 155,648 at K = 128, 303,104 at K = 256 (over; 36,864 at C = 32);
#                           tf32 C = 32: 69,632 / 118,784
#   10 (rwkv7, dplr)        C = 64, K = 128: 417,792 (over; 126,976 at C = 32, 212,992 at K = 256);
#                           tf32 C = 32, K = 128: 282,624 (over; 120,832 at C = 16); tf32 at K = 256
#                           233,472 even at C = 16: no chunk size fits (None), chunk() refuses it
# A program with more decayed products than measured here is refused at compile time.
LARGEST_CHUNK_SIZES = (  # (at most this many decayed products, {(precision, K > 128): chunk size or None})
    (3, {("input", False): 64, ("input", True): 64, ("tf32", False): 32, ("tf32", True): 32}),
    (5, {("input", False): 64, ("input", True): 32, ("tf32", False): 32, ("tf32", True): 32}),
    (10, {("input", False): 32, ("input", True): 32, ("tf32", False): 16, ("tf32", True): None}),
)


def backward_key_channel_products(item: BackwardPlan) -> int:
    """How many per-key-channel decayed products the backward's output kernel computes."""
    prog = item.backward.graph.program
    output = next(k for k in item.backward.plans[0].kernels if k.name == "output")
    return sum(isinstance(prog.op(value), KEY_CHANNEL_OPS) for value in output.computes)


def largest_chunk_sizes(item: BackwardPlan) -> dict:
    """The generated module's LARGEST_CHUNK_SIZE, from what the backward's output kernel computes
    (how many per-key-channel decayed products), never from the spec's name."""
    prog = item.backward.graph.program
    products = backward_key_channel_products(item)
    for most, sizes in LARGEST_CHUNK_SIZES:
        if products <= most:
            return sizes
    raise CompileError(f"{prog.recurrence.name}: the backward's output kernel computes {products} per-key-channel "
                       f"decayed products, more than any chunk size was measured to fit (python -m lrdsl.resources)")


# The scan walks a sequence's chunks one after another, so where its programs at 64 value columns
# would leave multiprocessors idle (few sequences x heads) it takes 32 columns (twice the
# programs) and a deeper pipeline, which hides each step's loads behind the previous step's
# matmuls. Measured on the H200, gdn 1 x 65536 with 8 value heads (16 programs at 64 columns):
# forward 2.893 ms at 64 columns, 2.140 at 32 with 3 stages, 1.981 with 4; the backward scan
# 13.27 / 11.49 (3 stages) / 11.52 ms (4) forward + backward; at 1 x 32768 with 32 value heads
# (64 programs at 64 columns) the forward took 2.826 (64 columns), 2.460 (64, 4 stages) and
# 2.395 ms (32, 4 stages), the backward scan 11.97 ms at 64 columns against 11.64 at 32.
CHUNK_LAUNCH_FEW_PROGRAMS = {"scan": {"BV": 32, "num_stages": 4}, "bwd_scan": {"BV": 32, "num_stages": 3}}
# Where even 32 columns give fewer programs than half the multiprocessors, 16 (the narrowest tile
# a matmul takes): gdn 1 x 65536 with 8 value heads (32 programs at 32 columns) forward 1.902 ->
# 1.867 ms, forward + backward (the backward scan so) 10.328 -> 9.987 ms. At 1 x 32768 with 32
# value heads (128 programs at 32 columns) 16 columns were slower: 2.357 -> 2.808 and 11.44 -> 11.59.
CHUNK_LAUNCH_FEWER_PROGRAMS = {"scan": {"BV": 16}, "bwd_scan": {"BV": 16}}
# Below the largest chunk size (C = 32: the backward's usual case, and kda's and gla's forward)
# tiles are half as tall, and the settings change where that was measured to pay (H200, bf16):
#  - the backward output kernel takes 128 value columns per program in 2 stages: 7.27 -> 6.88 ms
#    forward + backward at 4 x 4096 (gdn) for the 2 stages, 6.127 -> 5.652 ms for the 128
#    columns; at C = 64 one stage was 2.4 ms faster (spills bind there);
#  - the system and output kernels run 2 warps (32-row tiles give 4 warps little to share):
#    kda's forward 1.90 -> 1.59 ms, gla's 1.02 -> 0.86 ms (4 x 4096, H = HV = 16) together with
#    the scan's 64 columns. Each alone gained 4-13 %.
#    Not where the kernel computes per-key-channel decayed products (their C x K operand tiles
#    come on top): gla's forward + backward took 5.654 ms at 128 columns, 5.353 at 64.
CHUNK_LAUNCH_SMALL_CHUNK = {"bwd_output": {"BV": 128, "num_stages": 2}, "system": {"num_warps": 2},
                            "output": {"num_warps": 2}}
CHUNK_LAUNCH_SMALL_CHUNK_KEY_CHANNEL = {**CHUNK_LAUNCH_SMALL_CHUNK, "bwd_output": {"num_stages": 2}}

# The backward recomputes the forward's buffers, or reads only the solved systems (save policies
# "recompute", "save_solve"), and so may use its own chunk size. Its output kernel holds many
# more tiles than any forward kernel (every gradient of a chunk), and past the register file it
# spills in its inner work: at C = 64 the gdn estimate is 2.4x the register file and the kernel
# took 6.2 ms at 4 x 4096 (H200), at C = 32 (1.07x) it took 3.4 ms and forward + backward fell
# from 9.6 to 7.3 ms, at C = 16 (0.7x) the scans' extra steps cost more than the kernel gained
# (8.7 ms). The estimate is a lower bound (Triton's temporaries are not counted), so a kernel may
# exceed the register file by a quarter.
REGISTER_FILE_BYTES_PER_WARP = 32 * 255 * 4  # 32 threads x 255 registers of 4 bytes
BACKWARD_PRESSURE_TOLERANCE = 1.25
# The forward picks its chunk size by the same estimate, with less slack: its kernels are shorter,
# so the scan's steps (twice as many at half the chunk size) weigh less against a spilling kernel.
# Measured on the H200 (4 x 4096, H = HV = 16, K = V = 128, bf16, forward alone): kda (apply 1.26x
# the register file at C = 64, 0.63x at 32) took 2.91 ms at 64 and 1.90 ms at 32; gla (output
# 1.13x / 0.53x) 1.20 and 1.02 ms; gdn (output 0.88x) is as fast or faster at 64 (1.21 vs 1.24
# ms at 4 x 4096 with HV = 32, 2.12 vs 2.70 ms at 1 x 65536).
FORWARD_PRESSURE_TOLERANCE = 1.1
PRESSURE_HEAD_DIM = 128  # the head dimension the estimate assumes (K = V)
CHUNK_SIZE_CHOICES = (64, 32, 16)
PRECISION_OPERAND_BYTES = {"input": 2, "tf32": 4}  # the estimate assumes 16-bit inputs


def backward_chunk_sizes(backward: ChunkPlans, largest_sizes: dict) -> dict[str, int]:
    """Per precision, the largest chunk size at which every backward kernel's live tiles
    (pressure.peak_tile_bytes) stay within BACKWARD_PRESSURE_TOLERANCE x its program's register
    file, at most the module's largest (largest_sizes: its LARGEST_CHUNK_SIZE)."""
    prog, plan = backward.graph.program, backward.plans[0]
    return {precision: _largest_fitting_registers(prog, plan, largest_sizes[precision, False], precision,
                                                  BACKWARD_PRESSURE_TOLERANCE)
            for precision in PRECISION_OPERAND_BYTES}


def forward_chunk_sizes(forward: ChunkPlans, largest_sizes: dict) -> dict[tuple[str, str], int]:
    """Per (plan, precision), the chunk size chunk() runs at where the call gives none: the largest
    at which every kernel of the plan stays within FORWARD_PRESSURE_TOLERANCE x its registers, at
    most the module's largest."""
    prog = forward.graph.program
    return {(plan.name, precision): _largest_fitting_registers(prog, plan, largest_sizes[precision, False], precision,
                                                               FORWARD_PRESSURE_TOLERANCE)
            for plan in forward.plans for precision in PRECISION_OPERAND_BYTES}


def _largest_fitting_registers(prog: ChunkProgram, plan: Plan, largest: int, precision: str, tolerance: float) -> int:
    """The largest of CHUNK_SIZE_CHOICES up to largest (at K = PRESSURE_HEAD_DIM, what the estimate
    assumes) whose kernels fit tolerance x their registers; the smallest if none does."""
    fits = [c for c in CHUNK_SIZE_CHOICES if c <= largest and _fits_registers(prog, plan, c, precision, tolerance)]
    return fits[0] if fits else CHUNK_SIZE_CHOICES[-1]


def _fits_registers(prog: ChunkProgram, plan: Plan, chunk: int, precision: str, tolerance: float) -> bool:
    for kernel in plan.kernels:
        if kernel.kind == "scan":  # its tiles do not grow with the chunk size: the state is K x BV
            continue
        role = ("bwd_" if prog.direction == "backward" else "") + kernel.name
        launch = dict(CHUNK_LAUNCH[role], **(CHUNK_LAUNCH_FP32.get(role, {}) if precision == "tf32" else {}))
        peak = peak_tile_bytes(KernelContext(prog, plan, kernel), chunk, PRESSURE_HEAD_DIM, launch["BV"],
                               PRECISION_OPERAND_BYTES[precision])
        if peak > tolerance * launch["num_warps"] * REGISTER_FILE_BYTES_PER_WARP:
            return False
    return True


BUFFER_SHAPES = {
    ("C", "K"): "(B, T, HV, K)",
    ("C", "V"): "(B, T, HV, V)",
    ("C", "C"): "(B, T, HV, BT)",
    ("C",): "(B, T, HV)",
    (): "(NC, HV)",
    ("K",): "(NC, HV, K)",
    ("K", "V"): "(NC, HV, K, V)",
}


def _unpack_extras(prog: ChunkProgram) -> str:
    names = [input_pointer(i.name) for i in prog.recurrence.inputs]
    if not names:
        return "# no inputs besides q, k, v"
    return f"{', '.join(names)}{',' if len(names) == 1 else ''} = c[\"extras\"]"


def _calls(prog: ChunkProgram, plan: Plan) -> list[dict]:
    calls = []
    for kernel in plan.kernels:
        ctx = KernelContext(prog, plan, kernel)
        calls.append(
            dict(
                kind=kernel.kind,
                name=kernel.name,
                role=("bwd_" if prog.direction == "backward" else "") + kernel.name,
                function=kernel_function_name(prog, kernel),
                grid="key_head_grid" if key_head_results(ctx) else "chunk_grid",
                args=", ".join(kernel_params(ctx)),
                params=kernel_params(ctx),
                chunk_matrix_source=ctx.chunk_matrix_source(),
                solves=ctx.solves(),
                # a kernel that stores no buffer is needed only for the results it writes
                results=[] if kernel.stores else [result_param(role) for role, _ in kernel_results(ctx)],
            )
        )
    return calls


def _buffers(plan: Plan) -> list[dict]:
    return [
        dict(
            name=b.value,
            param=buffer_param(b.value),
            shape=BUFFER_SHAPES[b.shape],
            dtype="acc_dtype" if b.dtype == "fp32" else "c[\"io_dtype\"]",
            users=tuple(k.name for k in plan.kernels if b.value in k.loads or b.value in k.stores),
        )
        for b in plan.buffers
    ]


def _launcher(prog: ChunkProgram, plan: Plan) -> str:
    buffers, calls = _buffers(plan), _calls(prog, plan)
    # Each buffer is allocated just before its first user and released after the last user that
    # runs, unless the caller keeps it: the memory of a buffer the later kernels no longer read
    # (the system once solved, the solve's inputs once applied) goes to the next ones.
    for call in calls:
        call["allocates"] = [b for b in buffers if b["users"][0] == call["name"]]
        call["uses"] = [b for b in buffers if call["name"] in b["users"]]
    return render(
        "chunk_launcher.py.jinja",
        plan_name=plan.name,
        summary=plan.summary,
        extras_unpack=_unpack_extras(prog),
        buffers=buffers,
        calls=calls,
    ).rstrip("\n")


RESULT_SHAPES = {
    ("C", "K"): "(B, T, HV, K)", ("C", "V"): "(B, T, HV, V)", ("C",): "(B, T, HV)", (): "(NC, HV)", ("K",): "(NC, HV, K)",
}


def _backward_launcher(item: BackwardPlan) -> str:
    prog = item.backward.graph.program
    plan = item.backward.plans[0]  # the backward has no solve: its plans coincide
    inputs = ["q", "k", "v"] + [i.name for i in prog.recurrence.inputs]
    produced = dict(prog.results)
    results = []
    for name in inputs:
        role = f"grad:{name}"
        if role not in produced:
            continue
        shape = prog.shape(produced[role])
        results.append(
            dict(
                param=result_param(role),
                shape="(B, T, H, K)" if is_key_head_result(role) else RESULT_SHAPES[shape],
                input=input_pointer(name),
                index=inputs.index(name),
                per_chunk=shape in ((), ("K",)),
            )
        )
    result_names = ", ".join(result_param(f"grad:{n}") if f"grad:{n}" in produced else "None" for n in inputs)
    buffers, calls = _buffers(plan), _calls(prog, plan)
    # Every array is allocated just before the first kernel that uses it and dropped after the
    # last one (the forward's buffers too, as the backward reads them): the memory peak is then
    # what one kernel needs plus what crosses it, not every buffer of the call at once.
    variables = {b["param"]: b["users"] for b in buffers}
    variables.update({f"saved_{name}": tuple(c["name"] for c in calls if f"saved_{name}" in c["params"]) for name in item.reads})
    for call in calls:
        call["allocates"] = [b for b in buffers if b["users"][0] == call["name"]]
        call["allocates_results"] = [r for r in results if _first_user(calls, r["param"]) is call]
        call["releases"] = [v for v, users in variables.items() if users and users[-1] == call["name"]]
    return render(
        "chunk_backward.py.jinja",
        extras_unpack=_unpack_extras(prog),
        saved_names=list(item.reads),
        results=results,
        result_names=result_names,
        calls=calls,
    ).rstrip("\n")


def _first_user(calls: list[dict], param: str) -> dict:
    """The first call that takes `param` (a gradient: allocated just before it)."""
    for call in calls:
        if param in call["params"]:
            return call
    raise CompileError(f"no backward kernel writes {param}")


def emit_chunk_section(item: BackwardPlan, positional: list[str]) -> str:
    plans = item.forward
    prog = plans.graph.program
    kernels: dict[str, str] = {}
    programs = [(prog, p) for p in plans.plans] + [(item.backward.graph.program, item.backward.plans[0])]
    for program, plan in programs:
        for kernel in plan.kernels:
            source = emit_kernel(program, plan, kernel)
            name = kernel_function_name(program, kernel)
            if kernels.setdefault(name, source) != source:
                raise CompileError(f"two plans define kernel {name} differently")
    first = kernel_function_name(prog, plans.plans[0].kernels[0])
    save_policies = {
        policy.name: {"kept": dict(policy.kept), "rerun": dict(policy.rerun), "any_chunk_size": dict(policy.any_chunk_size),
                      "narrowed": dict(policy.narrowed)}
        for policy in item.policies
    }
    if uses_key_channel_helpers(prog, item.backward.graph.program):
        kernels = {"decayed products": KEY_CHANNEL_HELPERS.rstrip("\n"), **kernels}
    largest = largest_chunk_sizes(item)
    return render(
        "chunk_api.py.jinja",
        plan_names=[p.name for p in plans.plans],
        default_plan=plans.default,
        plan_doc=[f"  {p.name}: {p.summary}: {' -> '.join(k.name for k in p.kernels)}" for p in plans.plans]
        + [f"  backward: {' -> '.join(k.name for k in item.backward.plans[0].kernels)} (the scan in reverse)"],
        launch=repr(CHUNK_LAUNCH),
        launch_wide=repr(CHUNK_LAUNCH_WIDE_K),
        launch_fp32=repr(CHUNK_LAUNCH_FP32),
        launch_wide_inputs=repr(CHUNK_LAUNCH_WIDE_INPUTS),
        launch_few_programs=repr(CHUNK_LAUNCH_FEW_PROGRAMS),
        launch_fewer_programs=repr(CHUNK_LAUNCH_FEWER_PROGRAMS),
        launch_small_chunk=repr(CHUNK_LAUNCH_SMALL_CHUNK_KEY_CHANNEL if backward_key_channel_products(item)
                                else CHUNK_LAUNCH_SMALL_CHUNK),
        largest_chunk_size=repr(largest),
        backward_chunk_size=repr(backward_chunk_sizes(item.backward, largest)),
        forward_chunk_size=repr(forward_chunk_sizes(plans, largest)),
        kernels="\n\n".join(kernels.values()).rstrip("\n"),
        launchers=[_launcher(prog, p) for p in plans.plans],
        backward=_backward_launcher(item),
        save_policies=repr(save_policies),
        default_policy=item.default_policy,
        spec_name=prog.recurrence.name,
        positional=", ".join(positional),
        signature=signature(positional, CHUNK_OPTIONS),
        forward_options=forward_options(CHUNK_OPTIONS),
        first_kernel=first,
    )
