"""Chunk kernels: one Triton kernel per planned kernel, one registered emitter per chunk op.

A kernel's body is its ops in program order. Ops whose tile has a V axis run inside a loop over
blocks of BV value columns (chunk-parallel kernels) or on the program's own block (the scan,
which puts value blocks on the grid: state columns evolve independently). Values named in the
plan's buffers are loaded where a kernel reads them and stored right after they are computed.

Tiles are fp32 in registers; matmul operands are cast to DOT_DTYPE (the q/k/v dtype on a GPU,
fp32 in the interpreter, where 16-bit dots are wrong) with fp32 accumulation.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import CompileError
from ..ir.chunk import (
    Broadcast,
    ChunkOp,
    ChunkProgram,
    Cumsum,
    DecayMatrix,
    Formula,
    LastRow,
    Load,
    Mask,
    MaskRows,
    MatMul,
    Normalize,
    StateIn,
    UnitLowerInverse,
)
from ..ir.formula import HEAD_INDEX
from ..ir.plan import ChunkPlans, Kernel, Plan
from ..ir.recurrence import InputRole
from .emitters import EmitterRegistry
from .printer import to_triton
from .templating import indent, render

CHUNK_EMITTERS = EmitterRegistry("chunk kernel")

BLOCK_DIMS = {"C": "BT", "K": "BK", "V": "BV"}
SOLVE_BLOCK = 16  # the triangular solve works on 16 x 16 blocks


def var(name: str) -> str:
    return f"b_{name}"


def buffer_param(value: str) -> str:
    return f"buf_{value}"


@dataclass
class KernelContext:
    prog: ChunkProgram
    plan: Plan
    kernel: Kernel

    @property
    def is_scan(self) -> bool:
        return self.kernel.kind == "scan"

    def shape(self, value: str):
        return self.prog.shape(value)

    def block(self, shape) -> str:
        dims = [BLOCK_DIMS[a] for a in shape]
        return f"({dims[0]},)" if len(dims) == 1 else "(" + ", ".join(dims) + ")"

    def stored_here(self, value: str) -> bool:
        return value in self.kernel.stores


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


def buffer_address(shape) -> tuple[str, str]:
    """Offsets and mask of this chunk's tile in a buffer (layouts in lrdsl.ir.plan)."""
    if shape == ():
        return "i_c * HV + i_hv", ""
    if shape == ("K", "V"):
        return "(i_c * HV + i_hv) * (K * V) + o_k[:, None] * V + o_v[None, :]", "m_k[:, None] & m_v[None, :]"
    width = {("C", "K"): "K", ("C", "V"): "V", ("C", "C"): "BT", ("C",): ""}[shape]
    return tile_address(shape, "HV", "i_hv", width)


def load_line(target: str, pointer: str, offsets: str, mask: str) -> str:
    if not mask:
        return f"{target} = tl.load({pointer} + {offsets}).to(tl.float32)"
    return f"{target} = tl.load({pointer} + {offsets}, mask={mask}, other=0.0).to(tl.float32)"


def store_line(pointer: str, offsets: str, mask: str, value: str) -> str:
    masked = f", mask={mask}" if mask else ""
    return f"tl.store({pointer} + {offsets}, {value}.to({pointer}.dtype.element_ty){masked})"


def emit_buffer_load(value: str, ctx: KernelContext) -> list[str]:
    offsets, mask = buffer_address(ctx.shape(value))
    return [f"# {value}: stored by an earlier kernel", load_line(var(value), buffer_param(value), offsets, mask)]


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
        return [f"{target} = i_hv.to(tl.float32)  # the value-head index h"]
    if op.source in ("q", "k"):
        offsets, mask = tile_address(op.shape, "H", "i_h", "K")
        return [load_line(target, op.source, offsets, mask)]
    if op.source == "v":
        offsets, mask = tile_address(op.shape, "HV", "i_hv", "V")
        return [load_line(target, "v", offsets, mask)]
    role = ctx.prog.recurrence.input(op.source).role
    if role is InputRole.HEAD:
        return [load_line(target, op.source, "i_hv", "")]
    if role is InputRole.TOKEN:
        offsets, mask = tile_address(op.shape, "HV", "i_hv", "")
        return [load_line(target, op.source, offsets, mask)]
    raise CompileError(f"{ctx.prog.recurrence.name}: chunk kernels take no {role.value} inputs yet ({op.source})")


@CHUNK_EMITTERS.register(StateIn)
def _state_in(op: StateIn, ctx: KernelContext) -> list[str]:
    # Only the scan computes the entry state: it is the loop-carried state variable itself.
    return []


@CHUNK_EMITTERS.register(Normalize)
def _normalize(op: Normalize, ctx: KernelContext) -> list[str]:
    x, y = var(op.x), var(op.out)
    return [
        f"{y} = {x}",
        "if USE_QK_L2NORM:",
        f"    {y} = {x} / tl.sqrt(tl.sum({x} * {x}, axis=1) + 1e-6)[:, None]",
    ]


@CHUNK_EMITTERS.register(Formula)
def _formula(op: Formula, ctx: KernelContext) -> list[str]:
    names = {a: var(a) for a in op.args()}
    text = to_triton(op.expr, names)
    arg_shapes = {ctx.shape(a) for a in op.args()}
    if op.shape and arg_shapes <= {()}:  # only scalars read: spread the value over the tile
        text = f"tl.zeros({ctx.block(op.shape)}, dtype=tl.float32) + ({text})"
    return [f"{var(op.out)} = {text}"]


@CHUNK_EMITTERS.register(MaskRows)
def _mask_rows(op: MaskRows, ctx: KernelContext) -> list[str]:
    rows = "m_t" if len(op.shape) == 1 else "m_t[:, None]"
    return [f"{var(op.out)} = tl.where({rows}, {var(op.x)}, 0.0)"]


@CHUNK_EMITTERS.register(Broadcast)
def _broadcast(op: Broadcast, ctx: KernelContext) -> list[str]:
    source, x = ctx.shape(op.x), var(op.x)
    if source == ():
        return [f"{var(op.out)} = tl.zeros({ctx.block(op.shape)}, dtype=tl.float32) + {x}"]
    spread = f"{x}[:, None]" if source == ("C",) else f"{x}[None, :]"
    return [f"{var(op.out)} = tl.broadcast_to({spread}, {ctx.block(op.shape)})"]


@CHUNK_EMITTERS.register(Cumsum)
def _cumsum(op: Cumsum, ctx: KernelContext) -> list[str]:
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


@CHUNK_EMITTERS.register(Mask)
def _mask(op: Mask, ctx: KernelContext) -> list[str]:
    return [f"{var(op.out)} = tl.where({_lower(op.inclusive)}, {var(op.x)}, 0.0)"]


@CHUNK_EMITTERS.register(MatMul)
def _matmul(op: MatMul, ctx: KernelContext) -> list[str]:
    def operand(name: str, transpose: bool) -> str:
        x = f"{var(name)}.to(DOT_DTYPE)"
        return f"tl.trans({x})" if transpose else x

    a, b = operand(op.a, op.transpose_a), operand(op.b, op.transpose_b)
    return [f"{var(op.out)} = tl.dot({a}, {b}, input_precision=DOT_PRECISION)"]


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


def _has_v(shape) -> bool:
    return "V" in shape


def kernel_inputs(ctx: KernelContext) -> list[str]:
    """The call inputs a kernel reads: q, k, v, then the spec's inputs, in positional order."""
    sources = {ctx.prog.op(v).source for v in ctx.kernel.computes if isinstance(ctx.prog.op(v), Load)}
    order = ["q", "k", "v"] + [i.name for i in ctx.prog.recurrence.inputs]
    return [name for name in order if name in sources]


def kernel_buffers(ctx: KernelContext) -> list[str]:
    used = set(ctx.kernel.loads) | set(ctx.kernel.stores)
    return [b.value for b in ctx.plan.buffers if b.value in used]


def writes_output(ctx: KernelContext) -> bool:
    return ctx.prog.output("o") in ctx.kernel.computes


def kernel_params(ctx: KernelContext) -> list[str]:
    params = kernel_inputs(ctx) + [buffer_param(b) for b in kernel_buffers(ctx)]
    return params + (["o"] if writes_output(ctx) else [])


def _read_only_by_solves(ctx: KernelContext, value: str) -> bool:
    readers = [ctx.prog.op(v) for v in ctx.kernel.computes if value in ctx.prog.op(v).args()]
    return bool(readers) and all(isinstance(op, UnitLowerInverse) for op in readers)


def emit_kernel_body(ctx: KernelContext) -> tuple[list[str], list[str]]:
    """(lines outside the V loop, lines per block of value columns)."""
    plain: list[str] = []
    per_v: list[str] = []
    for value in ctx.kernel.loads:
        if not _read_only_by_solves(ctx, value):  # a solve reads its input block by block
            (per_v if _has_v(ctx.shape(value)) else plain).extend(emit_buffer_load(value, ctx))
    for value in ctx.kernel.computes:
        op: ChunkOp = ctx.prog.op(value)
        in_v = _has_v(op.shape)
        if not in_v and any(_has_v(ctx.shape(a)) for a in op.args()):
            raise CompileError(f"{ctx.prog.recurrence.name}: {value} sums over V inside kernel {ctx.kernel.name}")
        lines = per_v if in_v else plain
        lines.append(f"# {value} = {op.describe()}")
        lines.extend(CHUNK_EMITTERS.emit(op, ctx))
        if ctx.stored_here(value) and not isinstance(op, UnitLowerInverse):  # a solve stores its own result
            lines.extend(emit_buffer_store(value, ctx))
        if value == ctx.prog.output("o"):
            offsets, mask = tile_address(("C", "V"), "HV", "i_hv", "V")
            lines.append(store_line("o", offsets, mask, var(value)))
    return plain, per_v


def kernel_function_name(prog: ChunkProgram, kernel: Kernel) -> str:
    return f"{prog.recurrence.name}_chunk_{kernel.name}_kernel"


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
    plain, per_v = emit_kernel_body(ctx)
    common = dict(
        kernel_name=kernel_function_name(prog, kernel),
        params=", ".join(kernel_params(ctx)),
        doc=f"{KERNEL_DOCS[kernel.name]} of `{prog.recurrence.name}`.",
        computes=", ".join(kernel.computes),
    )
    if kernel.kind == "scan":
        return render(
            "scan_kernel.py.jinja",
            **common,
            state=prog.state_in,
            state_var=var(prog.state_in),
            next_var=var(prog.output("state")),
            body=indent(plain + per_v, 8),
        )
    return render("chunk_kernel.py.jinja", **common, plain=indent(plain, 4), per_v=indent(per_v, 8))


# -- the module section ------------------------------------------------------------------------

# Launch settings per kernel role (value columns per block, warps); the module carries them.
CHUNK_LAUNCH = {
    "prepare": {"BV": 64, "num_warps": 4},
    "system": {"BV": 64, "num_warps": 4},
    "solve": {"BV": 64, "num_warps": 4},
    "apply": {"BV": 64, "num_warps": 4},
    "scan": {"BV": 32, "num_warps": 4},
    "output": {"BV": 64, "num_warps": 4},
}

BUFFER_SHAPES = {
    ("C", "K"): "(B, T, HV, K)",
    ("C", "V"): "(B, T, HV, V)",
    ("C", "C"): "(B, T, HV, BT)",
    ("C",): "(B, T, HV)",
    (): "(NC, HV)",
    ("K", "V"): "(NC, HV, K, V)",
}


def _launcher(prog: ChunkProgram, plan: Plan) -> str:
    names = [i.name for i in prog.recurrence.inputs]
    unpack = f"{', '.join(names)}{',' if len(names) == 1 else ''} = extras" if names else "# no inputs besides q, k, v"
    buffers = [
        dict(
            param=buffer_param(b.value),
            value=f"{b.value}: {' x '.join(b.shape) or 'scalar'} per chunk",
            shape=BUFFER_SHAPES[b.shape],
            dtype="torch.float32" if b.dtype == "fp32" else "q.dtype",
        )
        for b in plan.buffers
    ]
    calls = []
    for kernel in plan.kernels:
        ctx = KernelContext(prog, plan, kernel)
        calls.append(
            dict(kind=kernel.kind, name=kernel.name, function=kernel_function_name(prog, kernel), args=", ".join(kernel_params(ctx)))
        )
    return render(
        "chunk_launcher.py.jinja",
        plan_name=plan.name,
        summary=plan.summary,
        extras_unpack=unpack,
        buffers=buffers,
        calls=calls,
    ).rstrip("\n")


def emit_chunk_section(plans: ChunkPlans, positional: str, extras: str) -> str:
    prog = plans.graph.program
    kernels: dict[str, str] = {}
    for plan in plans.plans:
        for kernel in plan.kernels:
            source = emit_kernel(prog, plan, kernel)
            name = kernel_function_name(prog, kernel)
            if kernels.setdefault(name, source) != source:
                raise CompileError(f"two plans define kernel {name} differently")
    first = kernel_function_name(prog, plans.plans[0].kernels[0])
    return render(
        "chunk_api.py.jinja",
        plan_names=[p.name for p in plans.plans],
        default_plan=plans.default,
        plan_doc=[f"  {p.name}: {p.summary}: {' -> '.join(k.name for k in p.kernels)}" for p in plans.plans],
        launch=repr(CHUNK_LAUNCH),
        kernels="\n\n".join(kernels.values()).rstrip("\n"),
        launchers=[_launcher(prog, p) for p in plans.plans],
        spec_name=prog.recurrence.name,
        positional=positional,
        extras=extras,
        first_kernel=first,
    )
