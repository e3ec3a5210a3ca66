"""The compiler pipeline: the passes in order, each with why it sits where it does.

`run_pipeline` returns every stage by name; `lrdsl show SPEC --stage NAME` prints one of them.

One rule holds for every pass, so it lives here and not in the passes: a recurrence with no
chunk form (derive_chunk's `NoChunkForm`) has none at any later stage either. A pass whose source
is a NoChunkForm is not run; the stage it would produce holds that NoChunkForm, so every stage
exists and the module emitter refuses it in one line.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..ir.chunk import NoChunkForm
from ..spec import Spec
from .canonicalize import canonicalize
from .autodiff import autodiff
from .derive_chunk import derive_chunk
from .derive_step import derive_step
from .factor_scalars import factor_scalars
from .lower_steps import lower_steps
from .plan import plan_kernels
from .save_policy import choose_saved
from .stage_graph import build_stage_graph
from .verify import verify


@dataclass(frozen=True)
class Pass:
    name: str  # the stage this pass produces
    source: str | tuple[str, ...]  # the stage(s) it reads
    run: Callable
    why: str

    @property
    def sources(self) -> tuple[str, ...]:
        return (self.source,) if isinstance(self.source, str) else self.source


PASSES: tuple[Pass, ...] = (
    Pass("recurrence", "spec", canonicalize, "first: every later pass reads the strict IR, never the forgiving spec"),
    Pass("substeps", "recurrence", lower_steps, "before any kernel form: several steps per token become ordinary sub-step rows, so every later pass and kernel serves them unchanged"),
    Pass("step", "substeps", derive_step, "the recurrent kernel needs only the recurrence, so it is lowered straight from it"),
    Pass("chunk", "substeps", derive_chunk, "the chunkwise form also follows from the recurrence alone"),
    Pass("stages", "chunk", build_stage_graph, "phases need the whole chunk program: what reads the entry state, what leads to the exit"),
    Pass("plan", "stages", plan_kernels, "grouping into kernels needs the phases and which values are costly to recompute"),
    Pass("backward", "plan", autodiff, "after planning: the backward reads back what the forward plans store instead of recomputing it"),
    Pass("backward_factored", "backward", factor_scalars, "on the derived adjoints, whose tiles it rescales: before phases and kernels, so the sums it adds are planned like any value"),
    Pass("backward_stages", "backward_factored", build_stage_graph, "the backward is a chunk program like the forward: the same phases, its scan in reverse"),
    Pass("backward_plan", "backward_stages", plan_kernels, "the same kernel grouping rules as the forward"),
    Pass("save", ("plan", "backward_plan"), choose_saved, "last: what to keep from the forward depends on both sides' kernels"),
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
        sources = [stages[s] for s in p.sources]
        unchunked = next((s for s in sources if isinstance(s, NoChunkForm)), None)
        stages[p.name] = unchunked if unchunked is not None else p.run(*sources)
        if check:
            verify(stages[p.name])
    return stages
