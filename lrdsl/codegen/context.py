"""The context a chunk kernel is emitted in: which program, plan and kernel, what each value reads
and how each tile is held (KernelContext), the Triton names of values and parameters, and where a
tile lives in memory (the addressing helpers the emitters and kernels share).

Tiles are ACC (fp32; fp64 for fp64 inputs) in registers; matmul operands are cast to DOT_DTYPE
(the q/k/v dtype on a GPU, ACC in the interpreter, where 16-bit dots are wrong), accumulating in
fp32 or wider.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from ..ir.chunk import (
    COTANGENT,
    SAVED,
    ChunkProgram,
    Formula,
    Load,
    MatMul,
    UnitLowerInverse,
)
from ..ir.plan import Kernel, Plan
from .names import gradient_pointer
from .row_guards import find_guarded, guard_lines, poisoned
from .schedule import reader_index, readers


BLOCK_DIMS = {"C": "BT", "K": "BK", "V": "BV"}


def var(name: str) -> str:
    return f"b_{name}"


def buffer_param(value: str) -> str:
    return f"buf_{value}"


def narrowed_param(value: str) -> str:
    """The parameter of the narrowed copy of a kept buffer a kernel writes as it reads the buffer
    (None where the call keeps no such copy): `narrowed_T`."""
    return f"narrowed_{value}"


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
    issued_early: frozenset = frozenset()  # input loads issued before the V loop ahead of their segment
    # buffers this kernel, their last reader in the forward call, also writes in the matmul operand
    # dtype as it loads them: the copies the backward keeps (SavePolicy.narrowed), written here
    # instead of converted by a pass of their own after the kernel
    narrowed_copies: tuple[str, ...] = ()

    @cached_property
    def reader_index(self) -> dict[str, list[str]]:
        return reader_index(self)

    @cached_property
    def guarded(self) -> dict[str, str]:
        """The values whose non-finite rows this kernel guards, and the flag each sets (row_guards)."""
        return find_guarded(self)

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
            if self.shape(value) == ("C", "C") and not read_only_by_solves(self, value):
                return buffer_param(value)
        for value in self.kernel.computes:
            op = self.prog.op(value)
            if isinstance(op, Load) and op.source.startswith(SAVED) and op.shape == ("C", "C"):
                return saved_param(op.source)
        return None

    def readers(self, value: str) -> list:
        """The ops of this kernel that read `value`."""
        return [self.prog.op(v) for v in readers(self, value)]

    def boundary_state(self, value: str) -> tuple[str, str] | None:
        """(kernel parameter, the test on the chunk) where `value` is a state-sized tile
        a formula reads in a chunk kernel of the backward, and a full-precision copy of it exists
        at a sequence boundary: the forward's entry states (its only state-sized buffer, in the
        inputs' dtype) begin with the initial state itself at the sequence's first chunk, and the
        backward's entry states d_H_next with d_final at its last. Formulas read those there: a
        sum over the state like <H, d_H_next> (a scalar gate's gradient) would otherwise round
        both tiles, which for a one-token sequence with a given initial state and final-state
        gradient costs its gate gradient 1.5e-2 of relative error in bf16 (matmuls keep reading
        the buffer: their operands are 16-bit anyway)."""
        if self.prog.direction != "backward" or self.kernel.kind != "chunk" or self.shape(value) != ("K", "V"):
            return None
        if not any(isinstance(op, Formula) and not is_copy(op) for op in self.readers(value)):
            return None
        op = self.prog.op(value)
        if isinstance(op, Load) and op.source.startswith(SAVED):
            return "initial_state", "i_t == 0"
        if value == self.prog.state_in:
            return "d_final", "i_t == tl.cdiv(eos - bos, BT) - 1"
        return None

    def boundary_states(self) -> list[str]:
        """The kernel parameters boundary_state gives this kernel's values (launcher locals too)."""
        boundaries = (self.boundary_state(v) for v in set(self.kernel.computes) | set(self.kernel.loads))
        params = {boundary[0] for boundary in boundaries if boundary}
        return [p for p in BOUNDARY_PARAMS if p in params]

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
        copy = is_copy(op) and self.in_storage_dtype(op.args()[0])
        if len(op.shape) != 2 or not (loaded or copy):
            return False
        return self._readers_convert(value)

    def _readers_convert(self, value: str) -> bool:
        if self.stored_here(value) or value in self.eager or value in {v for _, v in self.prog.results}:
            return False
        ops = self.readers(value)
        return bool(ops) and all(
            isinstance(op, MatMul) or (isinstance(op, Formula) and (not is_copy(op) or self._readers_convert(op.out)))
            for op in ops
        )


# Call inputs a chunk kernel may hold in their own dtype (KernelContext.in_storage_dtype): the
# others (gates, betas) are loaded in ACC whatever their readers.
STORAGE_DTYPE_SOURCES = ("q", "k", "v", COTANGENT)


# The full-precision sources of KernelContext.boundary_state (kernel parameters, launcher locals,
# in parameter order): the constexpr saying the call passed one, and where it applies.
BOUNDARY_PARAMS = {
    "initial_state": ("USE_INITIAL_STATE", "the sequence's first chunk enters with the initial state"),
    "d_final": ("USE_FINAL_STATE_GRADIENT", "the sequence's last chunk leaves with the final state's gradient"),
}


def boundary_flags(params: list[str]) -> list[str]:
    return [BOUNDARY_PARAMS[p][0] for p in params]


def boundary_launch(params: list[str]) -> str:
    """The launch keywords of boundary_flags(params): whether the call passed each tensor, and the
    states' layout."""
    return "".join(f"{flag}={param} is not None, " for param, flag in zip(params, boundary_flags(params))) + \
        'STATE_V_FIRST=c["state_v_first"],'


def read_in_acc(ctx: KernelContext, value: str) -> str:
    """A value as an elementwise formula reads it: in ACC (converted where it is held in its
    storage dtype)."""
    return f"{var(value)}.to(ACC)" if ctx.in_storage_dtype(value) else var(value)


def boundary_read(value: str, ctx: KernelContext) -> str:
    """A boundary-state value as a formula reads it: in ACC, from the call's full-precision tensor
    at the boundary chunk (_state_at_boundary; that load is masked off at the other chunks)."""
    pointer, at = ctx.boundary_state(value)
    flag, _ = BOUNDARY_PARAMS[pointer]
    return (f"_state_at_boundary({read_in_acc(ctx, value)}, {pointer}, {at}, i_n, i_hv, o_k, o_v, m_k[:, None] & m_v[None, :], "
            f"{flag}, HV, K, V, STATE_V_FIRST, ACC)")


def is_copy(op) -> bool:
    """A formula that is one value unchanged (d_U = d_Vn: the same tile under a second name)."""
    return isinstance(op, Formula) and op.expr.is_Symbol


def read_only_by_solves(ctx: KernelContext, value: str) -> bool:
    ops = ctx.readers(value)
    return bool(ops) and all(isinstance(op, UnitLowerInverse) for op in ops)


# -- addressing --------------------------------------------------------------------------------

# How a kernel kind addresses a chunk's rows in a token-major tensor. Chunk-parallel kernels
# ("chunk"): a scalar (int64: the chunk's first row `row0`, the head) plus offsets within the
# chunk (int32: rows o_c, columns), added to the pointer in that order, so the per-element
# arithmetic stays 32-bit (sm_90: fewer registers and integer instructions per load and store;
# gdn's forward + backward 4-6 % faster, BENCHMARKS.md round 22). The scans ("scan") keep an int64
# row per element, (bos + o_t): the first-row form measured slower in gdn's forward scan at
# 1 x 32768 (64 programs, fewer than the multiprocessors: each waits on its own chain).
FIRST_ROW = "row0"


def tile_address(shape, row_stride: str, head_offset: str, width: str, kind: str) -> tuple[str, str]:
    """Offsets and mask of a per-row tile in a token-major tensor [.., T, heads, width], in a
    kernel of `kind` (Kernel.kind)."""
    column = None if shape == ("C",) else {"K": ("o_k", "m_k"), "V": ("o_v", "m_v"), "C": ("o_c", None)}[shape[1]]
    mask = "m_t" if column is None else "m_t[:, None]" + (f" & {column[1]}[None, :]" if column[1] else "")
    if kind == "scan":
        if column is None:
            return f"(bos + o_t) * {row_stride} + {head_offset}", mask
        return f"(bos + o_t)[:, None] * ({row_stride} * {width}) + {head_offset} * {width} + {column[0]}[None, :]", mask
    if column is None:
        return f"({FIRST_ROW} * {row_stride} + {head_offset}) + o_c * {row_stride}", mask
    stride = f"({row_stride} * {width})"
    return f"({FIRST_ROW} * {stride} + {head_offset} * {width}) + (o_c[:, None] * {stride} + {column[0]}[None, :])", mask


def buffer_address(shape, kind: str, made_elsewhere: bool = False) -> tuple[str, str]:
    """Offsets and mask of this chunk's tile in a buffer (layouts in lrdsl.ir.plan), in a kernel
    of `kind`.
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
    return tile_address(shape, "HV", "i_hv", width, kind)


def sub_chunk_matrix_address() -> tuple[str, str]:
    """A C x C buffer made at chunk size CC_BT, a multiple of BT (the forward call's solved system,
    which the backward keeps under save_solve while it runs at its own smaller chunk size): each
    row holds CC_BT columns, and this chunk's tile is the diagonal block of its sub-chunk, which
    is what solving at BT gives. Where CC_BT == BT the column offset is 0."""
    offsets = f"({FIRST_ROW} * (HV * CC_BT) + i_hv * CC_BT + (i_t * BT) % CC_BT) + (o_c[:, None] * (HV * CC_BT) + o_c[None, :])"
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
    offsets, mask = buffer_address(ctx.shape(value), ctx.kernel.kind, made_elsewhere=made_elsewhere)
    line = load_line(var(value), buffer_param(value), offsets, mask, ctx.load_dtype(value))
    lines = [f"# {value}: stored by an earlier kernel", line]
    if value in ctx.guarded:
        lines += guard_lines(ctx, value, var(value), var(value), "not_nan")
    if value in ctx.narrowed_copies:
        copy = narrowed_param(value)
        lines += [f"# the copy of {value} the backward keeps, in the matmul operand dtype (None: not kept narrowed)",
                  f"if {copy} is not None:",
                  "    " + store_line(copy, offsets, mask, var(value))]
    return lines


def emit_buffer_store(value: str, ctx: KernelContext) -> list[str]:
    if ctx.kernel.kind == "scan" and value == ctx.prog.state_in:
        # the entry state of every STATE_EVERY-th chunk, in its slot i_s (scan_kernel.py.jinja)
        offsets = "(i_s * HV + i_hv) * (K * V) + o_k[:, None] * V + o_v[None, :]"
        return ["if i_t % STATE_EVERY == 0:",
                "    " + store_line(buffer_param(value), offsets, "m_k[:, None] & m_v[None, :]", var(value))]
    offsets, mask = buffer_address(ctx.shape(value), ctx.kernel.kind)
    rows, tile = poisoned(ctx, value, var(value))
    return rows + [store_line(buffer_param(value), offsets, mask, tile)]
