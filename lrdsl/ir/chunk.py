"""Chunk IR: the tile-level program of one chunk (docs/design.md §2).

One program describes the work on one chunk of C rows of one value head, given the chunk's entry
state H (K x V); it produces the chunk's output O (C x V) and its exit state (K x V). Applying it
chunk after chunk, each exit state feeding the next entry, is the whole sequence.

Values are named tiles in SSA form. A shape is a tuple of axes: "C" (rows of the chunk; a C x C
matrix is ("C", "C")), "K" (key channels), "V" (value columns); () is a scalar. Every op names
the value it defines (`out`), the values it reads (`args()`) and its shape.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from functools import cached_property, lru_cache

import sympy

from .formula import HEAD_INDEX
from .recurrence import Recurrence

Shape = tuple[str, ...]


def shape_text(shape: Shape) -> str:
    return " x ".join(shape) if shape else "1"


@dataclass(frozen=True)
class ChunkOp(ABC):
    out: str
    shape: Shape

    def args(self) -> tuple[str, ...]:
        return ()

    @abstractmethod
    def describe(self) -> str:
        """The right-hand side, as `lrdsl show --stage chunk` prints it."""

    @property
    def expensive(self) -> bool:
        """Whether recomputing this op in another kernel costs real work (matmuls, solves)."""
        return False


@dataclass(frozen=True)
class Load(ChunkOp):
    """A call input's tile for this chunk: q, k (C x K), v (C x V), a declared input, the
    scalar `scale`, or `h`, the value-head index. Rows past the sequence end read as 0."""

    source: str

    def describe(self):
        return f"load {self.source}"

    @property
    def reads_memory(self) -> bool:
        """False for `scale` (a kernel argument) and `h`, the value-head index (the program's own)."""
        return self.source not in ("scale", str(HEAD_INDEX))


@dataclass(frozen=True)
class StateIn(ChunkOp):
    """The chunk's entry state H: the initial state (or 0) for a sequence's first chunk, else the
    previous chunk's exit state."""

    def describe(self):
        return "entry state"


@dataclass(frozen=True)
class Normalize(ChunkOp):
    """Rows divided by sqrt(sum of squares + 1e-6), only when use_qk_l2norm_in_kernel is set."""

    x: str

    def args(self):
        return (self.x,)

    def describe(self):
        return f"l2norm_rows({self.x})   [if use_qk_l2norm_in_kernel]"


@dataclass(frozen=True)
class Formula(ChunkOp):
    """Elementwise: `expr` over values (its free symbols are value names). Every value read has
    this op's shape or is a scalar."""

    expr: sympy.Expr

    def args(self):
        return _symbol_names(self.expr)

    def describe(self):
        return str(self.expr)


@lru_cache(maxsize=4096)
def _symbol_names(expr: sympy.Expr) -> tuple[str, ...]:
    """The names `expr` reads, sorted. Cached: codegen asks every op for its arguments again and
    again (which values read which), and printing sympy symbols is slow."""
    return tuple(sorted(str(s) for s in expr.free_symbols))


@dataclass(frozen=True)
class MaskRows(ChunkOp):
    """Rows past the sequence end set to 0 (a formula of padded inputs need not be 0); the code
    generator also zeroes a C x K tile's lanes past K, where it pads K to a power of two."""

    x: str

    def args(self):
        return (self.x,)

    def describe(self):
        return f"rows_in_sequence({self.x})"


@dataclass(frozen=True)
class FiniteRows(ChunkOp):
    """x with its non-finite entries set to 0 (a log-decay keeps -inf, a hard reset): a per-token
    value of the recurrence, computed from the call's inputs. In the forward kernels a row that
    held one also poisons the results: every output row and stored row from it on, and the exit
    state, become NaN (docs/design.md §2, "Non-finite inputs"), so a NaN at token t reaches only
    what the recurrence reaches from t on, never the rows before it through a masked product
    (0 * NaN). The backward copies x: its kernels guard nothing (docs/design.md §2)."""

    x: str
    log_decay: bool = False  # -inf is a value, not a fault

    def args(self):
        return (self.x,)

    def describe(self):
        return f"finite_rows({self.x}{', -inf kept' if self.log_decay else ''})"


@dataclass(frozen=True)
class ClampBelow(ChunkOp):
    """max(x, floor) elementwise; NaN stays NaN. The gate's log-decay is floored before its
    cumulative sums (docs/design.md §2, "Hard resets"): a decay of exp(floor) already drops the
    state below fp32's resolution, and a stronger one (-1e9, -inf) would make every later
    difference G_i - G_j of the chunk's fp32 prefix sums lose all its digits."""

    x: str
    floor: float

    def args(self):
        return (self.x,)

    def describe(self):
        return f"max({self.x}, {self.floor:g})"


@dataclass(frozen=True)
class ClampBelowGrad(ChunkOp):
    """dy where x >= floor (and where x is NaN), else 0: the adjoint of ClampBelow. Appears in
    backward programs only (no adjoint rule)."""

    x: str
    dy: str
    floor: float

    def args(self):
        return (self.x, self.dy)

    def describe(self):
        return f"{self.dy} where not {self.x} < {self.floor:g}, else 0"


@dataclass(frozen=True)
class Broadcast(ChunkOp):
    """x repeated to this op's shape: a scalar everywhere; a vector along the axis it shares with
    the tile, the first axis first: a C-vector over C x _ (x_i in every column of row i), a
    K-vector over C x K (x in every row) and over K x V (x_k in every column of row k)."""

    x: str

    def args(self):
        return (self.x,)

    def describe(self):
        return f"broadcast({self.x})"


@dataclass(frozen=True)
class Cumsum(ChunkOp):
    """Prefix sum over the rows of the chunk (reverse: suffix sum); inclusive, or exclusive of
    the row itself. An exclusive sum is its own op, not a formula of the inclusive one, so its
    derivative is the exclusive adjoint sum (a formula `total - s` would route the gradient
    through terms that cancel). A scalar gate's suffix sum may still be emitted as a difference
    where the kernel holds the inclusive sum (codegen.schedule.inclusive_sibling): exactly 0 on
    its last row."""

    x: str
    reverse: bool = False
    exclusive: bool = False

    def args(self):
        return (self.x,)

    def describe(self):
        kind = ("reverse_" if self.reverse else "") + ("exclusive_" if self.exclusive else "")
        return f"{kind}cumsum({self.x})"


def scaled_cumsum(prog: "ChunkProgram", value: str) -> tuple[Cumsum, sympy.Expr] | None:
    """(cumsum, c) where `value` = c * cumsum for a prefix sum (not reversed) and a constant c, the
    value itself being such a sum with c = 1; None for anything else."""
    op = prog.op(value)
    factor = sympy.Integer(1)
    if isinstance(op, Formula):
        if len(op.args()) != 1:
            return None
        inner = sympy.Symbol(op.args()[0])
        factor = sympy.simplify(op.expr / inner)
        if not factor.is_number:  # not linear in the sum
            return None
        op = prog.op(str(inner))
    if not isinstance(op, Cumsum) or op.reverse:
        return None
    return op, factor


@dataclass(frozen=True)
class LastRow(ChunkOp):
    """The last row of the chunk (padded rows past the sequence end carry the last real value)."""

    x: str

    def args(self):
        return (self.x,)

    def describe(self):
        return f"last_row({self.x})"


@dataclass(frozen=True)
class DecayMatrix(ChunkOp):
    """C x C: exp2(x_i - x_j) where i > j (i >= j if inclusive), else 0. Masked before the exp2,
    so the upper triangle never overflows."""

    x: str
    inclusive: bool

    def args(self):
        return (self.x,)

    def describe(self):
        where = "i >= j" if self.inclusive else "i > j"
        return f"exp2({self.x}_i - {self.x}_j) where {where}, else 0"


@dataclass(frozen=True)
class DecayedGram(ChunkOp):
    """C x C, the key-channel gate's decayed product of two C x K tiles:
        M_ij = sum_c a_ic b_jc exp2(x_ic - y_jc)   where i > j (i >= j if inclusive), else 0.
    x is a per-channel cumulative log2-decay (non-increasing down the rows), and y the same one
    (None) or, for the dplr update, the inclusive decay beside the exclusive x of the same
    log-decays (x_i = y_(i-1): the verifier checks both come from one g), so every factor
    exp2(x_ic - y_jc) with i > j (i >= j when y is x) is at most 1, and exactly 1 for i = j + 1. It is never
    split as exp2(x_i) * exp2(-y_j) over the whole chunk (that overflows at strong decay): kernels
    split each pair at a row between them, so both factors stay at most 1 (see the emitter)."""

    a: str
    b: str
    x: str
    inclusive: bool
    y: str | None = None  # the columns' decay; None: x

    @property
    def column_decay(self) -> str:
        return self.x if self.y is None else self.y

    def args(self):
        return (self.a, self.b, self.x) + (() if self.y is None else (self.y,))

    def describe(self):
        where = "i >= j" if self.inclusive else "i > j"
        return f"sum_c {self.a}_ic {self.b}_jc exp2({self.x}_ic - {self.column_decay}_jc) where {where}, else 0"

    @property
    def expensive(self):
        return True


@dataclass(frozen=True)
class DecayedMatMul(ChunkOp):
    """C x K, the strict lower triangle of a C x C matrix m (i > j) applied to a C x K tile b
    under the same per-channel decay as DecayedGram (rows' decay x, columns' decay y):
        out_ic = sum_{j < i} m_ij b_jc exp2(x_ic - y_jc)            (transpose = False)
        out_ic = sum_{j > i} m_ji b_jc exp2(x_jc - y_ic)            (transpose = True)
    The adjoints of DecayedGram: dM -> da (not transposed) and db (transposed). It appears in
    backward programs only, so it has no adjoint rule of its own."""

    m: str
    b: str
    x: str
    transpose: bool = False
    y: str | None = None  # None: x

    @property
    def column_decay(self) -> str:
        return self.x if self.y is None else self.y

    def args(self):
        return (self.m, self.b, self.x) + (() if self.y is None else (self.y,))

    def describe(self):
        y = self.column_decay
        if self.transpose:
            return f"sum_{{j > i}} {self.m}_ji {self.b}_jc exp2({self.x}_jc - {y}_ic)"
        return f"sum_{{j < i}} {self.m}_ij {self.b}_jc exp2({self.x}_ic - {y}_jc)"

    @property
    def expensive(self):
        return True


@dataclass(frozen=True)
class Band(ChunkOp):
    """C x C: x where lo <= i - j (<= hi, when hi is set), else 0. Appears in backward programs
    only (no adjoint rule): it splits the gradient of a two-decay DecayedGram into the adjacent
    pairs (i - j = 1, whose decay exp2(x_i - y_(i-1)) is exactly 1) and the rest."""

    x: str
    lo: int
    hi: int | None = None

    def args(self):
        return (self.x,)

    def describe(self):
        upper = f" <= {self.hi}" if self.hi is not None else ""
        return f"band({self.x}, {self.lo} <= i - j{upper})"


@dataclass(frozen=True)
class Diagonal(ChunkOp):
    """C: the diagonal of a C x C matrix. Appears in backward programs only (no adjoint rule)."""

    x: str

    def args(self):
        return (self.x,)

    def describe(self):
        return f"diagonal({self.x})"


@dataclass(frozen=True)
class CrossingSum(ChunkOp):
    """C: out_t = sum of x_ij over the pairs j < t <= i, those whose span (j, i] holds row t.
    Appears in backward programs only (no adjoint rule): the gradient of the log-decay increments
    g from the pair decays exp2(c (s_i - s_j)), s = cumsum(g), summed pair by pair instead of as
    the suffix sum of (row sums - column sums), in which every pair inside the span cancels."""

    x: str

    def args(self):
        return (self.x,)

    def describe(self):
        return f"crossing_sum({self.x})"


@dataclass(frozen=True)
class Mask(ChunkOp):
    """C x C: x where i > j (i >= j if inclusive), else 0."""

    x: str
    inclusive: bool

    def args(self):
        return (self.x,)

    def describe(self):
        return f"{'lower' if self.inclusive else 'strict_lower'}({self.x})"


@dataclass(frozen=True)
class MatMul(ChunkOp):
    """a @ b, either operand optionally transposed; fp32 accumulation."""

    a: str
    b: str
    transpose_a: bool = False
    transpose_b: bool = False

    def args(self):
        return (self.a, self.b)

    def describe(self):
        a = f"{self.a}^T" if self.transpose_a else self.a
        b = f"{self.b}^T" if self.transpose_b else self.b
        return f"{a} @ {b}"

    @property
    def expensive(self):
        return True


@dataclass(frozen=True)
class UnitLowerInverse(ChunkOp):
    """(I + a)^-1 for strictly lower-triangular a: forward substitution on 16 x 16 diagonal
    blocks, then block merges. Works from memory: its input is stored first."""

    a: str

    def args(self):
        return (self.a,)

    def describe(self):
        return f"(I + {self.a})^-1"

    @property
    def expensive(self):
        return True


@dataclass(frozen=True)
class ReduceSum(ChunkOp):
    """x summed over the given axes (positions in x's shape); the backward's adjoint of Broadcast."""

    x: str
    axes: tuple[int, ...]

    def args(self):
        return (self.x,)

    def describe(self):
        return f"sum({self.x}, axes={list(self.axes)})"


@dataclass(frozen=True)
class PlaceLastRow(ChunkOp):
    """A C-row tile that is x on the last row and 0 elsewhere: the adjoint of LastRow."""

    x: str

    def args(self):
        return (self.x,)

    def describe(self):
        return f"on_last_row({self.x})"


@dataclass(frozen=True)
class NormalizeGrad(ChunkOp):
    """The adjoint of Normalize: with y = x r, r = 1/sqrt(sum x^2 + 1e-6),
    dx = r (dy - y * rowsum(y * dy)); dx = dy when use_qk_l2norm_in_kernel is off."""

    x: str
    dy: str

    def args(self):
        return (self.x, self.dy)

    def describe(self):
        return f"l2norm_rows_grad({self.x}, {self.dy})   [dy if not use_qk_l2norm_in_kernel]"


# Load sources besides q, k, v, scale, h and declared inputs:
COTANGENT = "dO"  # the output's gradient, C x V
SAVED = "saved:"  # prefix: a value the forward pass stored (entry states, W, U, ...)


# ops whose result's row i reads only row i of their per-row arguments (and scalars or vectors
# without rows): plan rule 6's chunk-size-free values, row_guards' NaN reach
ROW_LOCAL_OPS = (Normalize, Formula, MaskRows, FiniteRows, ClampBelow, Broadcast)


@dataclass(frozen=True)
class ChunkProgram:
    recurrence: Recurrence
    ops: tuple[ChunkOp, ...]
    # forward: ("o", O), ("state", exit state); backward: ("state", dH) and ("grad:<input>", d<input>)
    outputs: tuple[tuple[str, str], ...]
    direction: str = "forward"  # "backward": the entry state is dH of the next chunk, the scan runs in reverse
    # per-row values whose rows do not depend on the chunk size: the derivation names them (the
    # residual Vn is what the recurrence writes at each token, whatever chunk holds the token)
    chunk_size_free: tuple[str, ...] = ()

    def op(self, name: str) -> ChunkOp:
        return self._ops_by_name[name]

    @cached_property
    def _ops_by_name(self) -> dict[str, ChunkOp]:
        """Each value's op (values are SSA: one op each), for codegen's many look-ups."""
        return {op.out: op for op in self.ops}

    def shape(self, name: str) -> Shape:
        return self.op(name).shape

    def output(self, role: str) -> str:
        return dict(self.outputs)[role]

    @property
    def results(self) -> tuple[tuple[str, str], ...]:
        """(role, value) of every output but the exit state: o, or the gradients."""
        return tuple((role, value) for role, value in self.outputs if role != "state")

    @property
    def state_in(self) -> str:
        return next(op.out for op in self.ops if isinstance(op, StateIn))

    def describe(self) -> str:
        r = self.recurrence
        width = max(len(op.out) for op in self.ops)
        if self.direction == "backward":
            lines = [f"backward chunk program {r.name}   (one chunk, one value head; reverse scan carries "
                     f"{self.state_in}: K x V; saved: forward buffers)"]
        else:
            lines = [f"chunk program {r.name}   (one chunk of C rows, one value head; entry state H: K x V; log2 units)"]
        for op in self.ops:
            lines.append(f"  {op.out:<{width}} : {shape_text(op.shape):<5} = {op.describe()}")
        lines.append("  outputs: " + ", ".join(f"{role} = {name}" for role, name in self.outputs))
        return "\n".join(lines)


@dataclass(frozen=True)
class NoChunkForm:
    """What the chunk stages hold for a recurrence lrdsl cannot chunk yet; the module then has
    only the recurrent kernel."""

    recurrence: Recurrence
    reason: str

    def describe(self) -> str:
        return f"no chunk form for {self.recurrence.name}: {self.reason}"


def result_param(role: str) -> str:
    """The kernel parameter (and module variable) an output role is written to: o, d_q, d_beta, ..."""
    return "o" if role == "o" else "d_" + role.split(":", 1)[1]
