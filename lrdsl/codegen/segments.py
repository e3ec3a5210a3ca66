"""Segmented scans: whether a scan kernel may cut a sequence into segments that run side by side.

A scan walks a sequence's chunks one after another, one program per (sequence, value head, block
of value columns): a long sequence with few heads leaves most of the GPU idle while each program
waits on its own chain of matmuls. Where the scan's per-chunk update is linear in the carried
state and in the chunk's V-axis inputs (v, dO, U, ...), with coefficients that read neither (the
decays, the keys, the solved system's rows), a run of chunks takes its entry state X to M @ X + B,
and each column of the state evolves on its own. The generated module then runs a long scan in
three steps (`_scan` in the chunk section):
  1. every segment at once computes its map: B from a zero state with its inputs, M's columns from
     the identity with the V-axis inputs masked to 0 (K more value columns; the kernel stores no
     per-chunk buffer in this mode);
  2. `_combine_segments_kernel` chains the maps from the initial state, a short sequential pass
     of S matmuls, storing every segment's entry state and the final state;
  3. every segment at once re-runs from its entry state, storing its per-chunk buffers.
This module decides, on the chunk IR and op by op, whether a scan kernel is such an affine map.
A scan that is not is never segmented (its launcher says why in a comment).
"""
from __future__ import annotations

import sympy

from ..ir.chunk import Broadcast, ChunkProgram, Formula, Load, MaskRows, MatMul, ReduceSum, StateIn
from ..ir.plan import Kernel
from .schedule import has_v

# ops linear in their one argument: a value derived from the state or a V-axis input stays so
LINEAR_OPS = (Broadcast, MaskRows, ReduceSum)


def carries_input(prog: ChunkProgram, kernel: Kernel, value: str) -> bool:
    """Whether `value` is one of the scan's linear inputs: the entry state, or a tile with a V axis
    read from memory (a call input or a buffer), which a transition column reads as 0."""
    if value in kernel.loads:
        return has_v(prog.shape(value))
    op = prog.op(value)
    return isinstance(op, StateIn) or (isinstance(op, Load) and has_v(op.shape))


def segment_refusal(prog: ChunkProgram, kernel: Kernel) -> str | None:
    """None where the scan `kernel` maps (state, V-axis inputs) to its next state linearly, else
    the first op that breaks it, in words."""
    carried = {value for value in kernel.loads if carries_input(prog, kernel, value)}
    for value in kernel.computes:
        op = prog.op(value)
        if carries_input(prog, kernel, value):
            carried.add(value)
            continue
        read = [a for a in op.args() if a in carried]
        if not read:
            continue  # a coefficient: reads neither the state nor a V-axis input
        carried.add(value)
        if isinstance(op, MatMul):
            if op.a in carried and op.b in carried:
                return f"{value} = {op.describe()} multiplies two tiles that depend on the state"
        elif isinstance(op, Formula):
            reason = _formula_refusal(op, read)
            if reason:
                return f"{value} = {op.describe()} {reason}"
        elif not isinstance(op, LINEAR_OPS):
            return f"{value} = {op.describe()} ({type(op).__name__}) is not a linear op"
    return None


def _formula_refusal(op: Formula, read: list[str]) -> str | None:
    """Why an elementwise formula is not homogeneous linear in the values `read`, or None."""
    symbols = {str(s): s for s in op.expr.free_symbols}
    carried = [symbols[name] for name in read]
    if sympy.simplify(op.expr.subs({s: 0 for s in carried})) != 0:
        return "has a term that depends on neither the state nor a V-axis input"
    for s in carried:
        if set(sympy.diff(op.expr, s).free_symbols) & set(carried):
            return f"is not linear in {s}"
    return None
