"""save_policy: for each forward value the backward reads, keep it from the forward call or
recompute it by re-running forward kernels in the backward.

The choice is made per tensor from the forward's stage graph:
    recompute     (default) keep nothing: the backward re-runs the forward kernels that store what
                  it reads (the entry states are B * ceil(T/C) * HV * K * V values: large)
    save_prepare  keep what the prepare phase stores (W, U, the solved system: chunk-local, as
                  large as the inputs) and re-run only the scan for the entry states
    save          keep everything the backward reads; re-run nothing (most memory, least time)
Kernels a re-run needs are re-run too, unless the buffers they read are kept.
"""
from __future__ import annotations

from ..ir.chunk import SAVED, ChunkProgram, Load, NoChunkForm
from ..ir.plan import BackwardPlan, ChunkPlans, Plan, SavePolicy

POLICIES = {
    "recompute": "keep nothing from the forward; re-run the forward kernels the backward reads from",
    "save_prepare": "keep the prepare phase's buffers (chunk-local); re-run the scan for the entry states",
    "save": "keep every forward buffer the backward reads; re-run nothing",
}


def _reads(backward: ChunkProgram) -> tuple[str, ...]:
    return tuple(op.source[len(SAVED):] for op in backward.ops if isinstance(op, Load) and op.source.startswith(SAVED))


def _choose(plan: Plan, forward: ChunkPlans, reads: tuple[str, ...], policy: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(buffers kept, kernels re-run) for one forward plan under one policy."""
    phase = forward.graph.phase
    if policy == "save":
        wanted_kept = set(reads)
    elif policy == "save_prepare":
        wanted_kept = {b.value for b in plan.buffers if phase(b.value) == "prepare"}
    else:
        wanted_kept = set()
    producer = {value: kernel for kernel in plan.kernels for value in kernel.stores}
    rerun: list = []
    needed = [v for v in reads if v not in wanted_kept]
    while needed:
        kernel = producer[needed.pop()]
        if kernel not in rerun:
            rerun.append(kernel)
            needed += [v for v in kernel.loads if v not in wanted_kept]
    order = [k.name for k in plan.kernels]
    rerun_names = tuple(sorted((k.name for k in rerun), key=order.index))
    # keep what the backward or a re-run kernel reads and nobody recomputes
    used = set(reads) | {v for k in rerun for v in k.loads}
    produced = {v for k in rerun for v in k.stores}
    kept = tuple(b.value for b in plan.buffers if b.value in used and b.value not in produced)
    return kept, rerun_names


def choose_saved(forward: ChunkPlans | NoChunkForm, backward: ChunkPlans | NoChunkForm) -> BackwardPlan | NoChunkForm:
    if isinstance(backward, NoChunkForm):
        return backward
    reads = _reads(backward.graph.program)
    policies = []
    for name, summary in POLICIES.items():
        choices = [(plan.name, _choose(plan, forward, reads, name)) for plan in forward.plans]
        policies.append(
            SavePolicy(name, summary, tuple((p, kept) for p, (kept, _) in choices), tuple((p, rerun) for p, (_, rerun) in choices))
        )
    return BackwardPlan(forward, backward, reads, tuple(policies))
