"""Stage graph and kernel plans: how a chunk program becomes launches.

StageGraph  sorts every op of the chunk program into a phase:
              prepare  chunk-parallel, does not read the entry state (W, U, the triangular system)
              scan     on the path from the entry state to the exit state: sequential over chunks
              output   reads the entry state but does not lead to the exit state: chunk-parallel
                       again once every entry state is known
Plan        groups ops into kernels and says which values cross kernels through memory
            (buffers) and which are recomputed where they are needed.
"""
from __future__ import annotations

from dataclasses import dataclass

import networkx as nx

from .chunk import ChunkProgram, Shape, shape_text

PHASES = ("prepare", "scan", "output")


@dataclass(frozen=True)
class StageGraph:
    program: ChunkProgram
    phases: tuple[tuple[str, str], ...]  # (value, phase) in program order

    def phase(self, value: str) -> str:
        return dict(self.phases)[value]

    def graph(self) -> nx.DiGraph:
        """The dataflow graph: an edge a -> b when op b reads value a."""
        g = nx.DiGraph()
        for op in self.program.ops:
            g.add_node(op.out, op=op, phase=self.phase(op.out))
            for arg in op.args():
                g.add_edge(arg, op.out)
        return g

    def crossings(self) -> tuple[tuple[str, str, str], ...]:
        """(value, from phase, to phase) for every value read in a later phase than its own."""
        seen = []
        for op in self.program.ops:
            for arg in op.args():
                src, dst = self.phase(arg), self.phase(op.out)
                if src != dst and (arg, src, dst) not in seen:
                    seen.append((arg, src, dst))
        return tuple(seen)

    def describe(self) -> str:
        prog = self.program
        lines = [f"stage graph {prog.recurrence.name}"]
        for phase in PHASES:
            members = [name for name, p in self.phases if p == phase]
            kind = "sequential over chunks" if phase == "scan" else "chunk-parallel"
            lines.append(f"  {phase:<8} ({kind}): {', '.join(members) or '-'}")
        lines.append("  crossing phases:")
        for value, src, dst in self.crossings():
            lines.append(f"    {value:<16} {shape_text(prog.shape(value)):<6} {src} -> {dst}")
        return "\n".join(lines)


@dataclass(frozen=True)
class Buffer:
    """A value stored to memory by one kernel and read by another, one tile per chunk."""

    value: str
    shape: Shape
    dtype: str  # "fp32", or "io": the dtype of q, k, v

    @property
    def layout(self) -> str:
        return BUFFER_LAYOUTS[self.shape]


# How each per-chunk tile shape lies in memory (NC = number of chunks of all sequences).
BUFFER_LAYOUTS: dict[Shape, str] = {
    ("C", "K"): "[B, T, HV, K]",
    ("C", "V"): "[B, T, HV, V]",
    ("C", "C"): "[B, T, HV, C]",
    ("C",): "[B, T, HV]",
    (): "[NC, HV]",
    ("K",): "[NC, HV, K]",
    ("K", "V"): "[NC, HV, K, V]",
}


@dataclass(frozen=True)
class Kernel:
    name: str
    kind: str  # "chunk": a program per (chunk, head); "scan": a program per (V block, sequence x head)
    computes: tuple[str, ...]  # ops evaluated here, in program order
    loads: tuple[str, ...]  # buffers read
    stores: tuple[str, ...]  # buffers written

    def describe(self) -> str:
        return (
            f"    kernel {self.name} ({self.kind})\n"
            f"      loads    {', '.join(self.loads) or '-'}\n"
            f"      computes {', '.join(self.computes)}\n"
            f"      stores   {', '.join(self.stores) or '-'}"
        )


@dataclass(frozen=True)
class Plan:
    name: str
    summary: str
    kernels: tuple[Kernel, ...]
    buffers: tuple[Buffer, ...]
    # the output kernel reads only entry states and chunk-size-free rows from memory, so it may
    # run at a multiple of the chunk size the kernels before it ran at (plan rule 6)
    output_at_multiple: bool = False

    def buffer(self, value: str) -> Buffer:
        return next(b for b in self.buffers if b.value == value)

    def describe(self) -> str:
        lines = [f"  plan {self.name}: {self.summary}"]
        if self.output_at_multiple:
            lines.append("    output kernel may run at a multiple of the scan's chunk size")
        lines += [k.describe() for k in self.kernels]
        lines.append("    buffers: " + (", ".join(f"{b.value} {b.layout} {b.dtype}" for b in self.buffers) or "-"))
        return "\n".join(lines)


@dataclass(frozen=True)
class ChunkPlans:
    graph: StageGraph
    plans: tuple[Plan, ...]

    @property
    def default(self) -> str:
        return self.plans[0].name

    def plan(self, name: str) -> Plan:
        return next(p for p in self.plans if p.name == name)

    def describe(self) -> str:
        lines = [f"kernel plans {self.graph.program.recurrence.name} (default: {self.default})"]
        lines += [p.describe() for p in self.plans]
        return "\n".join(lines)


@dataclass(frozen=True)
class SavePolicy:
    """What the backward gets from the forward call and what it recomputes, per forward plan."""

    name: str
    summary: str
    kept: tuple[tuple[str, tuple[str, ...]], ...]  # (forward plan, buffers kept from the forward call)
    rerun: tuple[tuple[str, tuple[str, ...]], ...]  # (forward plan, forward kernels the backward re-runs)
    # (forward plan, whether the backward may run at a chunk size dividing the forward's: what it
    # keeps is valid there)
    any_chunk_size: tuple[tuple[str, bool], ...] = ()
    # (forward plan, kept fp32 buffers later read only as matmul operands: kept in the operand dtype)
    narrowed: tuple[tuple[str, tuple[str, ...]], ...] = ()
    # (forward plan, entry-state buffers kept from the forward call, from which the re-run scan
    # starts each run of its chunks instead of walking whole sequences)
    resumed: tuple[tuple[str, tuple[str, ...]], ...] = ()

    def kept_by(self, plan: str) -> tuple[str, ...]:
        return dict(self.kept)[plan]

    def rerun_by(self, plan: str) -> tuple[str, ...]:
        return dict(self.rerun)[plan]

    def any_chunk_size_by(self, plan: str) -> bool:
        return dict(self.any_chunk_size).get(plan, False)

    def narrowed_by(self, plan: str) -> tuple[str, ...]:
        return dict(self.narrowed).get(plan, ())

    def resumed_by(self, plan: str) -> tuple[str, ...]:
        return dict(self.resumed).get(plan, ())


@dataclass(frozen=True)
class BackwardPlan:
    """The backward's kernels and, per save policy, how it obtains the forward values it reads."""

    forward: ChunkPlans
    backward: ChunkPlans
    reads: tuple[str, ...]  # forward buffers the backward program loads
    policies: tuple[SavePolicy, ...]  # the first is the default

    @property
    def default_policy(self) -> str:
        return self.policies[0].name

    def policy(self, name: str) -> SavePolicy:
        return next(p for p in self.policies if p.name == name)

    def describe(self) -> str:
        lines = [self.backward.describe().replace("kernel plans", "backward kernel plans", 1)]
        lines.append(f"forward values the backward reads: {', '.join(self.reads) or '-'}")
        lines.append(f"save policies (default: {self.default_policy}):")
        for policy in self.policies:
            lines.append(f"  {policy.name}: {policy.summary}")
            for plan, kept in policy.kept:
                rerun = policy.rerun_by(plan)
                size = "its own chunk size" if policy.any_chunk_size_by(plan) else "the forward's chunk size"
                narrowed = policy.narrowed_by(plan)
                operands = f" ({', '.join(narrowed)} in the matmul operand dtype)" if narrowed else ""
                resumed = policy.resumed_by(plan)
                states = f", and the entry states {', '.join(resumed)} the re-run scan starts from" if resumed else ""
                lines.append(
                    f"    forward plan {plan}: keep {', '.join(kept) or 'nothing'}{operands}{states}; "
                    f"backward re-runs {', '.join(rerun) or 'nothing'}; at {size}"
                )
        return "\n".join(lines)
