"""The chunk section of a generated module: every kernel of every plan (forward and backward),
the launchers that allocate buffers and call them in plan order, and the tables of launch
settings and chunk sizes they read (lrdsl/codegen/launch.py).
"""
from __future__ import annotations

from ..errors import CompileError
from ..ir.chunk import ChunkProgram, UnitLowerInverse
from ..ir.plan import BackwardPlan, Plan
from .context import KernelContext, boundary_launch, buffer_param, narrowed_param, read_only_by_solves, result_param
from .emitters import KEY_CHANNEL_HELPERS, uses_key_channel_helpers
from .kernels import (
    emit_kernel,
    is_key_head_result,
    kernel_function_name,
    kernel_params,
    kernel_results,
    key_head_results,
)
from .launch import (
    backward_chunk_sizes,
    forward_chunk_sizes,
    largest_chunk_sizes,
    launch_tables,
)
from .names import CHECKPOINT_OPTIONS, CHUNK_OPTIONS, CP_OPTIONS, STATES_OPTIONS, forward_options, input_pointer, signature
from .segments import segment_refusal
from .templating import host_code, render


BUFFER_SHAPES = {
    ("C", "K"): "(B, T, HV, K)",
    ("C", "V"): "(B, T, HV, V)",
    ("C", "C"): "(B, T, HV, BT)",
    ("C",): "(B, T, HV)",
    (): "(NC, HV)",
    ("K",): "(NC, HV, K)",
    # entry states: a slot per chunk, or per STATE_EVERY chunks where the output kernel runs at a
    # multiple of the scan's chunk size (plan rule 6); c["state_slots"] counts them
    ("K", "V"): '(c["state_slots"], HV, K, V)',
}


def _unpack_extras(prog: ChunkProgram) -> str:
    names = [input_pointer(i.name) for i in prog.recurrence.inputs]
    if not names:
        return "# no inputs besides q, k, v"
    return f"{', '.join(names)}{',' if len(names) == 1 else ''} = c[\"extras\"]"


def narrowed_copies(item: BackwardPlan, plan: Plan) -> dict[str, tuple[str, ...]]:
    """Kernel name -> the kept buffers it writes a narrowed copy of (SavePolicy.narrowed under any
    policy): the buffer's last user in the forward call, where that kernel loads the buffer's
    tiles whole (a solve reads blocks of its input itself). Each program then stores the tile it
    has just loaded, rounded to the operand dtype as every later reader rounds it, instead of a
    conversion of the whole buffer after the kernel (which read it all again: 0.05 ms at 4 x 4096
    for gdn's solved systems, H200)."""
    prog, copies = item.forward.graph.program, {}
    narrowed = {value for policy in item.policies for value in policy.narrowed_by(plan.name)}
    for value in sorted(narrowed):
        users = [k for k in plan.kernels if value in k.loads or value in k.stores]
        last = users[-1]
        ctx = KernelContext(prog, plan, last)
        if last.kind == "chunk" and value in last.loads and not read_only_by_solves(ctx, value):
            copies.setdefault(last.name, []).append(value)
    return {name: tuple(values) for name, values in copies.items()}


def _calls(prog: ChunkProgram, plan: Plan, copies: dict[str, tuple[str, ...]] | None = None) -> list[dict]:
    calls, after_scan = [], False
    for kernel in plan.kernels:
        ctx = KernelContext(prog, plan, kernel, narrowed_copies=(copies or {}).get(kernel.name, ()))
        refusal = segment_refusal(prog, kernel) if kernel.kind == "scan" else None
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
                boundary_states=ctx.boundary_states(),
                boundary_launch=boundary_launch(ctx.boundary_states()),
                # a scan runs in segments where that pays, unless it is not an affine map of its state
                segmentable=kernel.kind == "scan" and refusal is None,
                segment_refusal=refusal,
                # a kernel that stores no buffer is needed only for the results it writes
                results=[] if kernel.stores else [result_param(role) for role, _ in kernel_results(ctx)],
                narrowed_copies=[dict(name=v, param=narrowed_param(v), buffer=buffer_param(v)) for v in ctx.narrowed_copies],
                # the launcher's call dict of this kernel: the output's own (`oc`) after the scan
                # where it may run at a multiple of the scan's chunk size (plan rule 6)
                call="oc" if after_scan and plan.output_at_multiple else "c",
            )
        )
        after_scan = after_scan or kernel.kind == "scan"
    return calls


def _users(plan: Plan, value: str) -> tuple[str, ...]:
    """The plan's kernels that read or write buffer `value`, in launch order."""
    return tuple(k.name for k in plan.kernels if value in k.loads or value in k.stores)


def _buffers(plan: Plan) -> list[dict]:
    return [
        dict(
            name=b.value,
            param=buffer_param(b.value),
            shape=BUFFER_SHAPES[b.shape],
            dtype="acc_dtype" if b.dtype == "fp32" else "c[\"io_dtype\"]",
            users=_users(plan, b.value),
        )
        for b in plan.buffers
    ]


def _launcher(prog: ChunkProgram, plan: Plan, sources: dict[str, str] | None = None,
              copies: dict[str, tuple[str, ...]] | None = None) -> str:
    """One forward plan's launcher; `sources`: the kernels' source by function name (without
    them no array takes another's storage)."""
    buffers, calls = _buffers(plan), _calls(prog, plan, copies)
    # Each buffer is allocated just before its first user and released after the last user that
    # runs, unless the caller keeps it: the memory of a buffer the later kernels no longer read
    # (the system once solved, the solve's inputs once applied) goes to the next ones. A buffer a
    # scan writes may take the storage of one it reads for the last time (gdn: Vn in U's), where
    # the call made that one and does not keep it (decided at run time: _buffer_reusing). Only
    # scans: a forward chunk kernel may split its value columns over programs.
    # The output o, where the caller leaves it to the launcher (o=None), is allocated just before
    # the kernel that writes it, after the earlier kernels' buffers are released, and may take
    # the storage of a buffer that kernel reads for the last time the same way (gdn: Vn).
    scans = [c for c in calls if c["kind"] == "scan"]
    writes_o = [c for c in calls if c["kind"] == "chunk" and OUTPUT_PARAM in c["params"]]
    reuses = storage_reuses(plan, scans, [], sources or {})
    reuses.update(storage_reuses(plan, writes_o, [dict(param=OUTPUT_PARAM, shape=BUFFER_SHAPES[("C", "V")], per_chunk=False)],
                                 sources or {}))
    names = {buffer_param(b.value): b.value for b in plan.buffers}

    def reused(param):
        read = reuses.get(param)
        return None if read is None else dict(param=read, name=names[read])

    for buffer in buffers:
        buffer["reuses"] = reused(buffer["param"])
    for call in calls:
        call["writes_output"] = call in writes_o
        call["output_reuses"] = reused(OUTPUT_PARAM) if call in writes_o else None
        call["allocates"] = [b for b in buffers if b["users"][0] == call["name"]]
        call["uses"] = [b for b in buffers if call["name"] in b["users"]]
    return render(
        "chunk_launcher.py.jinja",
        plan_name=plan.name,
        summary=plan.summary,
        output_at_multiple=plan.output_at_multiple,
        extras_unpack=_unpack_extras(prog),
        buffers=buffers,
        calls=calls,
    ).rstrip("\n")


RESULT_SHAPES = {
    ("C", "K"): "(B, T, HV, K)", ("C", "V"): "(B, T, HV, V)", ("C",): "(B, T, HV)", (): "(NC, HV)", ("K",): "(NC, HV, K)",
}


# Tiles one program of a kernel kind both reads and writes whole, by shape: a scan program owns the
# rows of its chunks in its block of value columns (a C x K tile it reads whole is every program's);
# a chunk-parallel program owns its chunk's rows of its heads, all columns.
OWNED_TILES = {"scan": {("C", "V")}, "chunk": {("C", "V"), ("C", "K"), ("C",)}}


# The forward's output array, as the kernel that writes it names its pointer
OUTPUT_PARAM = "o"


def _stores_after_last_load(source: str, read: str, written: str) -> bool:
    """Whether, in a kernel's source, every load through pointer `read` comes before the first
    store through `written`: each program then reads a tile before it writes another array's tile
    at the same place, and the two arrays can share their storage."""
    lines = source.splitlines()
    loads = [i for i, line in enumerate(lines) if f"tl.load({read} +" in line]
    stores = [i for i, line in enumerate(lines) if f"tl.store({written} +" in line]
    return bool(loads) and bool(stores) and max(loads) < min(stores)


def storage_reuses(plan: Plan, calls: list[dict], results: list[dict], sources: dict[str, str]) -> dict[str, str]:
    """Backward arrays that take the storage of a buffer the same kernel reads for the last time
    (array -> buffer param): a buffer a kernel allocates and writes, or a gradient it writes, of
    the buffer's shape and dtype (a gradient's dtype is checked at run time), where each program
    reads the buffer's tile before it writes the array's at the same place (OWNED_TILES, and every
    load before the first store in the kernel's source). The memory of the two is then one at the
    kernel (gdn: d_Vn in d_Vn_via_QKtVn's in the scan, d_v in d_Vn's in the output kernel)."""
    buffers = {b.value: b for b in plan.buffers}
    kernels = {k.name: k for k in plan.kernels}
    reuses, taken = {}, set()
    for call in calls:
        kernel = kernels[call["name"]]
        dying = [buffers[v] for v in kernel.loads if v in buffers and v not in kernel.stores
                 and _users(plan, v)[-1] == kernel.name and buffers[v].shape in OWNED_TILES[kernel.kind]]
        writes = [(buffer_param(v), BUFFER_SHAPES[buffers[v].shape], buffers[v].dtype) for v in kernel.stores
                  if v in buffers and _users(plan, v)[0] == kernel.name]
        writes += [(r["param"], r["shape"], None) for r in results if not r["per_chunk"] and _first_user(calls, r["param"]) is call]
        for param, shape, dtype in writes:
            for buffer in dying:
                read = buffer_param(buffer.value)
                if read in taken or BUFFER_SHAPES[buffer.shape] != shape or dtype not in (None, buffer.dtype):
                    continue
                if _stores_after_last_load(sources.get(call["function"], ""), read, param):
                    reuses[param] = read
                    taken.add(read)
                    break
    return reuses


def _backward_launcher(item: BackwardPlan, sources: dict[str, str]) -> str:
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
    reuses = storage_reuses(plan, calls, results, sources)
    for buffer in buffers:
        buffer["reuses"] = reuses.get(buffer["param"])
    for result in results:
        result["reuses"] = reuses.get(result["param"])
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
        reads_initial_state=any("initial_state" in call["boundary_states"] for call in calls),
    ).rstrip("\n")


def _first_user(calls: list[dict], param: str) -> dict:
    """The first call that takes `param` (a gradient: allocated just before it)."""
    for call in calls:
        if param in call["params"]:
            return call
    raise CompileError(f"no backward kernel writes {param}")


def emit_chunk_section(item: BackwardPlan, positional: list[str], steps: int = 1) -> str:
    """The chunk section; positional: the public parameters; steps: the spec's steps_per_token
    (above 1, chunk() hands its tokens to _chunk_by_token, which expands them to the kernels' rows)."""
    plans = item.forward
    prog = plans.graph.program
    kernels: dict[str, str] = {}
    programs = [(prog, p) for p in plans.plans] + [(item.backward.graph.program, item.backward.plans[0])]
    copies = {p.name: narrowed_copies(item, p) for p in plans.plans}
    for program, plan in programs:
        for kernel in plan.kernels:
            forward_copies = copies.get(plan.name, {}) if program is prog else {}
            source = emit_kernel(program, plan, kernel, forward_copies.get(kernel.name, ()))
            name = kernel_function_name(program, kernel)
            if kernels.setdefault(name, source) != source:
                raise CompileError(f"two plans define kernel {name} differently")
    first = kernel_function_name(prog, plans.plans[0].kernels[0])
    save_policies = {
        policy.name: {"kept": dict(policy.kept), "rerun": dict(policy.rerun), "any_chunk_size": dict(policy.any_chunk_size),
                      "narrowed": dict(policy.narrowed), "resumed": dict(policy.resumed)}
        for policy in item.policies
    }
    if uses_key_channel_helpers(prog, item.backward.graph.program):
        kernels = {"decayed products": KEY_CHANNEL_HELPERS.rstrip("\n"), **kernels}
    largest = largest_chunk_sizes(item)
    # plan rule 6 pays where the kernels before the scan solve a triangular system: O(C^2) work per
    # chunk that a smaller chunk size halves per token (the module's _scan_chunk_size)
    solves = any(isinstance(op, UnitLowerInverse) for op in prog.ops)
    smaller_scan_chunks = {p.name: p.output_at_multiple and solves for p in plans.plans}
    return render(
        "chunk_api.py.jinja",
        plan_names=[p.name for p in plans.plans],
        default_plan=plans.default,
        plan_doc=[f"  {p.name}: {p.summary}: {' -> '.join(k.name for k in p.kernels)}" for p in plans.plans]
        + [f"  backward: {' -> '.join(k.name for k in item.backward.plans[0].kernels)} (the scan in reverse)"],
        **{name: repr(table) for name, table in launch_tables(item).render().items()},
        largest_chunk_size=repr(largest),
        launch_rule=host_code("launch_rule"),
        programs=host_code("programs"),
        scan_segments=host_code("scan_segments"),
        backward_chunk_size=repr(backward_chunk_sizes(item)),
        forward_chunk_size=repr(forward_chunk_sizes(item)),
        smaller_scan_chunks=repr(smaller_scan_chunks),
        kernels="\n\n".join(kernels.values()).rstrip("\n"),
        launchers=[_launcher(prog, p, kernels, copies[p.name]) for p in plans.plans],
        backward=_backward_launcher(item, kernels),
        save_policies=repr(save_policies),
        default_policy=item.default_policy,
        spec_name=prog.recurrence.name,
        positional=", ".join(positional),
        signature=signature(positional, CHUNK_OPTIONS + STATES_OPTIONS + CHECKPOINT_OPTIONS + CP_OPTIONS),
        forward_options=forward_options(CHUNK_OPTIONS),
        first_kernel=first,
        entry_state=prog.state_in,
        steps=steps,
        # with several steps per token the public prepare_varlen takes token bounds (steps_api)
        prepare_rows="prepare_varlen" if steps == 1 else "_prepare_rows",
    )
