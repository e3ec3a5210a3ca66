"""The compiler pipeline: the passes in order, each with why it sits where it does.

`run_pipeline` returns every stage by name; `lrdsl show SPEC --stage NAME` prints one of them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..spec import Spec
from .canonicalize import canonicalize
from .derive_chunk import derive_chunk
from .derive_step import derive_step
from .plan import plan_kernels
from .stage_graph import build_stage_graph
from .verify import verify


@dataclass(frozen=True)
class Pass:
    name: str  # the stage this pass produces
    source: str  # the stage it reads
    run: Callable
    why: str


PASSES: tuple[Pass, ...] = (
    Pass("recurrence", "spec", canonicalize, "first: every later pass reads the strict IR, never the forgiving spec"),
    Pass("step", "recurrence", derive_step, "the recurrent kernel needs only the recurrence, so it is lowered straight from it"),
    Pass("chunk", "recurrence", derive_chunk, "the chunkwise form also follows from the recurrence alone"),
    Pass("stages", "chunk", build_stage_graph, "phases need the whole chunk program: what reads the entry state, what leads to the exit"),
    Pass("plan", "stages", plan_kernels, "grouping into kernels needs the phases and which values are costly to recompute"),
)

STAGES: tuple[str, ...] = ("spec",) + tuple(p.name for p in PASSES)


def run_pipeline(spec: Spec, until: str | None = None, check: bool = False) -> dict[str, object]:
    """Run the passes on `spec` (up to stage `until`); with `check`, verify each stage produced."""
    if until is not None and until not in STAGES:
        raise ValueError(f"unknown stage {until!r}; stages: {', '.join(STAGES)}")
    stages: dict[str, object] = {"spec": spec}
    for p in PASSES:
        if until in stages:
            break
        stages[p.name] = p.run(stages[p.source])
        if check:
            verify(stages[p.name])
    return stages
