"""stage_graph: chunk program -> StageGraph, every op sorted into prepare / scan / output.

The entry state is what makes the sequence sequential. Ops that do not read it (directly or
not) are chunk-parallel and can run before the scan; ops on the path from the entry state to the
exit state form the scan; the rest read entry states but feed nothing sequential, so they run
chunk-parallel once the scan has stored every entry state.
"""
from __future__ import annotations

import networkx as nx

from ..ir.chunk import ChunkProgram
from ..ir.plan import StageGraph


def build_stage_graph(prog: ChunkProgram) -> StageGraph:
    graph = nx.DiGraph()
    for op in prog.ops:
        graph.add_node(op.out)
        graph.add_edges_from((arg, op.out) for arg in op.args())
    entry, exit_state = prog.state_in, prog.output("state")
    reads_state = {entry} | nx.descendants(graph, entry)
    scan = reads_state & ({exit_state} | nx.ancestors(graph, exit_state))
    phases = []
    for op in prog.ops:
        if op.out in scan:
            phases.append((op.out, "scan"))
        elif op.out in reads_state:
            phases.append((op.out, "output"))
        else:
            phases.append((op.out, "prepare"))
    return StageGraph(prog, tuple(phases))
