"""Module emitter: all stages of one spec -> the source of one standalone Python module.

The module imports torch and triton only; `lrdsl compile` writes it to a file, `lrdsl.load`
caches and imports it.
"""
from __future__ import annotations

from .. import __version__
from ..ir.chunk import NoChunkForm
from ..ir.recurrence import Recurrence
from ..ir.step import StepProgram
from .chunk import emit_chunk_section
from .names import CHUNK_OPTIONS, POSITIONAL, RECURRENT_OPTIONS, forward_options, signature
from .printer import HELPERS
from .recurrent import emit_recurrent_kernel, kernel_name
from .templating import render

# Launch defaults of the recurrent kernel: value columns per program and warps.
RECURRENT_BLOCK_V = 32
RECURRENT_NUM_WARPS = 4


def _positional(rec: Recurrence) -> list[str]:
    """The public functions' positional parameters: q, k, v, then the spec's inputs by their names."""
    return list(POSITIONAL) + [i.name for i in rec.inputs]


def emit_recurrent_section(step: StepProgram, no_chunk_reason: str | None) -> str:
    rec = step.recurrence
    return render(
        "recurrent_api.py.jinja",
        has_chunk=no_chunk_reason is None,
        no_chunk_reason=no_chunk_reason or "",
        kernel=emit_recurrent_kernel(step),
        kernel_name=kernel_name(step),
        spec_name=rec.name,
        positional=", ".join(_positional(rec)),
        signature=signature(_positional(rec), RECURRENT_OPTIONS),
        forward_options=forward_options(RECURRENT_OPTIONS),
        block_v=RECURRENT_BLOCK_V,
        num_warps=RECURRENT_NUM_WARPS,
    )


def emit_module(stages: dict, spec_path: str) -> str:
    rec: Recurrence = stages["recurrence"]
    signatures = [f"recurrent({signature(_positional(rec), RECURRENT_OPTIONS)}) -> (o, final_state | None)"]
    if not isinstance(stages["save"], NoChunkForm):
        signatures[0] += "   [differentiable]"
    plans = stages["save"]
    sections = [emit_recurrent_section(stages["step"], plans.reason if isinstance(plans, NoChunkForm) else None)]
    if isinstance(plans, NoChunkForm):
        signatures.append(f"chunk: not generated ({plans.reason}); mod.chunk raises an AttributeError that says so")
    else:
        signatures.append(f"chunk({signature(_positional(rec), CHUNK_OPTIONS)}) -> (o, final_state | None)   [differentiable]")
        signatures.append("prepare_varlen(cu_seqlens, chunk_size=64) -> VarlenChunks, for chunk(..., chunk_indices=)")
        sections.append(emit_chunk_section(plans, _positional(rec)))
    inputs_tuple = "(" + "".join(f"({i.name!r}, {i.role.value!r}), " for i in rec.inputs) + ")"
    return render(
        "module.py.jinja",
        spec_name=rec.name,
        spec_path=spec_path,
        version=__version__,
        recurrence_doc=rec.describe(),
        signatures=signatures,
        inputs_tuple=inputs_tuple,
        helpers=HELPERS,
        sections="\n\n".join(sections),
    )
