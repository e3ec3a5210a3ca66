"""plan: StageGraph -> kernel plans (which ops run in which kernel, what goes through memory).

Rules, in the order they apply:
 1. The scan kernel runs the scan phase, the output kernel the output phase (o, or in a backward
    program every gradient).
 2. A value a kernel needs is loaded when an earlier kernel stored it (rules 3-5 say which
    values cross kernels through buffers) and recomputed there otherwise.
 3. The scan is sequential: every op in it is on the critical path of the whole call. So the
    prepare values the scan reads are computed by prepare kernels and stored (the scan only
    loads them), unless recomputing one costs no more than loading it: a call input, or an
    elementwise formula of one tile of its own shape and scalars (d_O * scale). K x V values
    (as large as a state) are recomputed by the scan. Expensive prepare values only the output
    needs are computed in the output kernel.
 4. The entry state and scan values the output reads are stored by the scan kernel; a scan
    value that is an elementwise function of one other tile is recomputed from that tile.
 5. A triangular solve works from memory: its input is stored before it, its result is stored
    by it (16 x 16 blocks are loaded, solved and merged).
 6. Where the output kernel reads from memory only the entry state and rows the chunk program
    names chunk-size-free (the residual Vn), it may run at a multiple of the chunk size of the
    kernels before it: it computes everything else itself at its own chunk size, and reads the
    entry state of every one of its chunks, which the scan keeps. A forward call then runs its
    O(C^2)-per-chunk prepare work at a smaller chunk size and its output at the larger one
    (the generated module decides per call: `_scan_chunk_size`).
The plans differ in rule 3's grouping:
    fused  one prepare kernel (system, solve and its application; the solve's input and output
           go through memory inside that kernel, which stays in cache)
    split  one kernel per step: build the system, solve it, apply it
"""
from __future__ import annotations

from ..ir.chunk import ROW_LOCAL_OPS, Broadcast, ChunkProgram, FiniteRows, Formula, Load, UnitLowerInverse
from ..ir.plan import Buffer, ChunkPlans, Kernel, Plan, StageGraph

FP32_BUFFER_SHAPES = (("C", "C"), ("C",), (), ("K",))

PLAN_SUMMARIES = {
    "fused": "all prepare work in one kernel",
    "split": "prepare work split at each triangular solve: build the system, solve it, apply it",
}


class _Planner:
    def __init__(self, stages: StageGraph):
        self.stages = stages
        self.prog: ChunkProgram = stages.program
        self.order = {op.out: i for i, op in enumerate(self.prog.ops)}

    def closure(self, targets, available) -> list[str]:
        """Ops a kernel must evaluate to produce `targets`, reading `available` from memory."""
        needed, stack = set(), list(targets)
        while stack:
            value = stack.pop()
            if value in needed or value in available:
                continue
            needed.add(value)
            stack.extend(self.prog.op(value).args())
        return sorted(needed, key=self.order.get)

    def inputs_of(self, computes) -> set[str]:
        """Values read by `computes` but not computed by them."""
        inside = set(computes)
        return {a for v in computes for a in self.prog.op(v).args() if a not in inside}

    def plan(self, name: str) -> Plan:
        phase = self.stages.phase
        exit_state = self.prog.output("state")
        results = [value for _, value in self.prog.results]
        scan_values = {v for v, p in self.stages.phases if p == "scan"}

        # rules 2, 3, 5: what must live in memory before the scan
        solves = [op for op in self.prog.ops if isinstance(op, UnitLowerInverse)]
        # a K x V value is as large as a state: the scan recomputes it rather than reading it
        prepared = sorted(
            (v for v in self.scan_frontier(scan_values) if not self.as_cheap_as_a_load(v) and self.prog.shape(v) != ("K", "V")),
            key=self.order.get,
        )
        memory = set(prepared) | {op.a for op in solves} | {op.out for op in solves}

        # rules 1, 4: the output kernel loads scan values (the entry state among them) and stored
        # values; everything else it needs it evaluates itself
        # a scan value that is an elementwise function of one other tile (d = -x, d = x) is
        # recomputed from that tile rather than stored beside it
        recomputable = {v for v in scan_values if self.follows_one_tile(v)}
        output_computes = self.closure(results, memory | (scan_values - recomputable))
        scan_stores = sorted((v for v in self.inputs_of(output_computes) if phase(v) == "scan"), key=self.order.get)
        scan_computes = self.closure([exit_state], memory)

        kernels = self.prepare_kernels(name, prepared, solves, memory) if prepared else []
        kernels.append(self.kernel("scan", "scan", scan_computes, scan_stores))
        kernels.append(self.kernel("output", "chunk", output_computes, []))
        stored = [v for k in kernels for v in k.stores]
        missing = [v for k in kernels for v in k.loads if v not in stored]
        assert not missing, f"plan {name}: kernels read {missing} that no kernel stores"
        # the triangular system, per-row and per-chunk values (decays, betas) stay fp32; tiles of
        # the inputs' width (and states) take the inputs' dtype
        buffers = tuple(
            Buffer(v, self.prog.shape(v), "fp32" if self.prog.shape(v) in FP32_BUFFER_SHAPES else "io")
            for v in sorted(stored, key=self.order.get)
        )
        # rule 6
        output_at_multiple = set(kernels[-1].loads) <= {self.prog.state_in} | self.chunk_size_free()
        return Plan(name, PLAN_SUMMARIES[name], tuple(kernels), buffers, output_at_multiple)

    def chunk_size_free(self) -> set[str]:
        """Values whose rows do not depend on the chunk size: those the chunk program names, and
        row by row functions of them and of the call's inputs (a load, a row norm, an elementwise
        formula, a row mask, a floor, a broadcast); a sum over the chunk's rows, its last row or a product
        with another row's values depends on where the chunk starts."""
        free = set(self.prog.chunk_size_free)
        for op in self.prog.ops:
            if "C" in op.shape[1:]:
                continue  # a C x C tile's columns are the chunk's rows
            if isinstance(op, Load) or (isinstance(op, ROW_LOCAL_OPS) and set(op.args()) <= free):
                free.add(op.out)
        return free

    def scan_frontier(self, scan_values: set[str]) -> set[str]:
        """The prepare values the scan reads: inputs of its ops, and the inputs of the K x V
        values among them (which the scan recomputes rather than loads)."""
        frontier, stack = set(), list(self.inputs_of(scan_values))
        while stack:
            value = stack.pop()
            if value in frontier:
                continue
            frontier.add(value)
            if self.prog.shape(value) == ("K", "V"):
                stack.extend(self.prog.op(value).args())
        return frontier

    def as_cheap_as_a_load(self, value: str) -> bool:
        """Recomputing `value` reads no more memory than loading it would and does no row-wise
        work (sums, cumsums, norms): a call input, or elementwise formulas, broadcasts and
        finite-row guards of at most one tile of `value`'s shape plus scalars that are themselves
        this cheap."""
        op = self.prog.op(value)
        if isinstance(op, Load):
            return True
        if not isinstance(op, (Formula, Broadcast, FiniteRows)):
            return False
        tiles = [a for a in op.args() if self.prog.shape(a) != ()]
        if len(tiles) > 1 or any(self.prog.shape(a) != op.shape for a in tiles):
            return False
        return all(self.as_cheap_as_a_load(a) for a in op.args())

    def follows_one_tile(self, value: str) -> bool:
        op = self.prog.op(value)
        if not isinstance(op, Formula):
            return False
        tiles = [a for a in op.args() if self.prog.shape(a) == op.shape]
        scalars = [a for a in op.args() if self.prog.shape(a) == ()]
        return len(tiles) == 1 and len(tiles) + len(scalars) == len(op.args()) and all(
            self.stages.phase(a) == "prepare" for a in scalars
        )

    def kernel(self, name: str, kind: str, computes: list[str], stores: list[str]) -> Kernel:
        loads = sorted(self.inputs_of(computes), key=self.order.get)
        return Kernel(name, kind, tuple(computes), tuple(loads), tuple(stores))

    def prepare_kernels(self, name: str, prepared: list[str], solves, memory: set[str]) -> list[Kernel]:
        if name == "fused" or not solves:
            computes = self.closure(prepared, set())
            return [self.kernel("prepare", "chunk", computes, [v for v in computes if v in memory])]
        kernels, done = [], set()
        for solve in solves:
            kernels.append(self.kernel("system", "chunk", self.closure([solve.a], done), [solve.a]))
            kernels.append(self.kernel("solve", "chunk", [solve.out], [solve.out]))
            done |= {solve.a, solve.out}
        rest = self.closure(prepared, done)
        kernels.append(self.kernel("apply", "chunk", rest, [v for v in rest if v in memory]))
        return kernels


def plan_kernels(stages: StageGraph) -> ChunkPlans:
    planner = _Planner(stages)
    # split first: the default, faster than fused at every training shape measured (BENCHMARKS.md)
    return ChunkPlans(stages, tuple(planner.plan(name) for name in ("split", "fused")))

