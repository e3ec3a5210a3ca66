"""Chunk kernels: one Triton kernel per planned kernel.

A kernel's body is its ops in program order, each printed by its op's emitter. Ops whose tile has
a V axis run inside a loop over blocks of BV value columns (chunk-parallel kernels) or on the
program's own block (the scan, which puts value blocks on the grid: state columns evolve
independently). Values named in the plan's buffers are loaded where a kernel reads them and stored
right after they are computed.
"""
from __future__ import annotations

from ..errors import CompileError
from ..ir.chunk import (
    COTANGENT,
    SAVED,
    ChunkOp,
    ChunkProgram,
    Load,
    UnitLowerInverse,
)
from ..ir.plan import Kernel, Plan
from .context import (
    COTANGENT_POINTER,
    KernelContext,
    boundary_flags,
    buffer_address,
    buffer_param,
    emit_buffer_load,
    emit_buffer_store,
    load_line,
    narrowed_param,
    read_in_acc,
    read_only_by_solves,
    result_param,
    saved_param,
    store_line,
    tile_address,
    var,
)
from .emitters import CHUNK_EMITTERS, input_load
from .names import input_pointer
from .row_guards import init_lines, poisoned, state_poison_lines
from .schedule import (
    eager_sums,
    first_reader_segment,
    has_v,
    is_loadable,
    loads_issued_early,
    place_values,
)
from .templating import indent, render



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
    params += [narrowed_param(b) for b in ctx.narrowed_copies]
    return params + [result_param(role) for role, _ in kernel_results(ctx)] + ctx.boundary_states()



def _op_lines(ctx: KernelContext, value: str) -> list[str]:
    """An op's lines: a comment with its formula, its code, then its stores (in a scan, only where
    it is not computing a segment's transition, which writes nothing per chunk)."""
    op: ChunkOp = ctx.prog.op(value)
    lines = [f"# {value} = {op.describe()}"]
    eager_terms = [t for t, (total, _) in ctx.eager.items() if total == value]
    if eager_terms:
        rest = [a for a in op.args() if a not in eager_terms]
        lines[0] += f"   (accumulated as {', '.join(eager_terms)} were computed)"
        if rest:
            lines.append(f"{var(value)} += " + " + ".join(read_in_acc(ctx, a) for a in rest))
    else:
        lines.extend(CHUNK_EMITTERS.lookup(op)(op, ctx))
    if value in ctx.eager:
        total, starts = ctx.eager[value]
        lines.append(f"{var(total)} {'=' if starts else '+='} {var(value)}  # running sum {total}")
    if ctx.kernel.kind == "scan" and value == ctx.prog.output("state"):
        lines.extend(state_poison_lines(ctx, var(value)))
    writes = []
    if ctx.stored_here(value) and not isinstance(op, UnitLowerInverse):  # a solve stores its own result
        writes.extend(emit_buffer_store(value, ctx))
    for role, result in ctx.prog.results:
        if result != value:
            continue
        if is_key_head_result(role):
            writes.append(f"{group_sum_var(role)} += {var(value)}")
        else:
            writes.extend(emit_result_store(role, value, ctx))
    if writes and ctx.kernel.kind == "scan":
        writes = ["if not TRANSITION:", *("    " + line for line in writes)]
    return lines + writes


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
        offsets, mask = tile_address(ctx.shape(value), "H", "i_h", "K", ctx.kernel.kind)
        lines += ["    " + line for line in guarded_store(result_param(role), offsets, mask, group_sum_var(role))]
    return lines


def emit_result_store(role: str, value: str, ctx: KernelContext) -> list[str]:
    shape = ctx.shape(value)
    if shape in ((), ("K",)):  # a per-head input's gradient: one per chunk, summed after the kernel
        offsets, mask = buffer_address(shape, ctx.kernel.kind)
    else:
        width = {("C", "K"): "K", ("C", "V"): "V", ("C",): ""}[shape]
        offsets, mask = tile_address(shape, "HV", "i_hv", width, ctx.kernel.kind)
    rows, tile = poisoned(ctx, value, var(value))
    store = guarded_store(result_param(role), offsets, mask, tile)
    return store[:1] + ["    " + line for line in rows] + store[1:]


def guarded_store(pointer: str, offsets: str, mask: str, value: str) -> list[str]:
    """A result's store, skipped when the caller passes None for it (a gradient autograd does not
    ask for): the test is resolved at compile time, and the work only that store needed goes
    with it."""
    return [f"if {pointer} is not None:", "    " + store_line(pointer, offsets, mask, value)]


def emit_scan_body(ctx: KernelContext) -> list[str]:
    """The scan's per-chunk body: every op in program order (its V block is the program's own)."""
    ctx.eager = eager_sums(ctx, None)
    lines = init_lines(ctx)
    for value in ctx.kernel.loads:
        lines.extend(emit_buffer_load(value, ctx))
    for value in ctx.kernel.computes:
        op = ctx.prog.op(value)
        if not has_v(op.shape) and any(has_v(ctx.shape(a)) for a in op.args()):
            raise CompileError(f"{ctx.prog.recurrence.name}: {value} sums over V inside the scan, whose programs own one V block")
        lines.extend(_op_lines(ctx, value))
    return lines


def issue_loads_early(ctx: KernelContext, place: dict, count: int) -> list[list[str]]:
    """Per plain segment i, the loads schedule.loads_issued_early issues at the end of segment
    i - 1 (unconverted); sets ctx.issued_early, so the Load emitter writes only the conversion
    where the value is placed."""
    early: list[list[str]] = [[] for _ in range(count + 1)]
    issued = loads_issued_early(ctx, place)
    for value, index in issued.items():
        op = ctx.prog.op(value)
        pointer, offsets, mask, _ = input_load(op, ctx)
        early[index] += [f"# {value} = {op.describe()}   (issued here, ahead of the V loop: converted where it is read)",
                         load_line(var(value), pointer, offsets, mask, None)]
    ctx.issued_early = frozenset(issued)
    return early


def emit_chunk_body(ctx: KernelContext) -> list[str]:
    """A chunk-parallel kernel's body: plain segments and loops over blocks of V columns."""
    place, accumulators = place_values(ctx)
    ctx.accumulators = frozenset(accumulators)
    ctx.eager = eager_sums(ctx, place)
    count = 1 + max((i for kind, i in place.values() if kind != "plain"), default=-1)
    early = issue_loads_early(ctx, place, count)
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
        if not has_v(ctx.shape(value)) and not read_only_by_solves(ctx, value)  # a solve reads blocks itself
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
    body = ["    " + line for line in init_lines(ctx)]
    for index in range(count + 1):
        body.extend(indent(plain[index], 4).split("\n") if plain[index] else [])
        if index < count:
            body.extend(indent(early[index + 1], 4).split("\n") if early[index + 1] else [])  # the next segment's loads
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


def emit_kernel(prog: ChunkProgram, plan: Plan, kernel: Kernel, narrowed_copies: tuple[str, ...] = ()) -> str:
    ctx = KernelContext(prog, plan, kernel, narrowed_copies=narrowed_copies)
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
                  chunk_matrices=ctx.chunk_matrix_source() is not None, solves=ctx.solves(),
                  boundary_flags=boundary_flags(ctx.boundary_states()))
