"""Module emitter: all stages of one spec -> the source of one standalone Python module.

The module imports torch and triton only; `lrdsl compile` writes it to a file, `lrdsl.load`
caches and imports it.
"""
from __future__ import annotations

from .. import __version__
from ..errors import CompileError
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


def emit_recurrent_section(step: StepProgram) -> str:
    rec = step.recurrence
    return render(
        "recurrent_api.py.jinja",
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
    plans = stages["save"]
    if isinstance(plans, NoChunkForm):
        # every module has a differentiable chunk(): a recurrence the passes cannot chunk is
        # refused here, in one line naming what is missing, never emitted half
        raise CompileError(f"{spec_path}: cannot compile {plans.describe()}")
    signatures = [
        f"recurrent({signature(_positional(rec), RECURRENT_OPTIONS)}) -> (o, final_state | None)   [differentiable]",
        f"chunk({signature(_positional(rec), CHUNK_OPTIONS)}) -> (o, final_state | None)   [differentiable]",
        "prepare_varlen(cu_seqlens, chunk_size=64) -> VarlenChunks, for chunk(..., chunk_indices=)",
    ]
    sections = [emit_recurrent_section(stages["step"]), emit_chunk_section(plans, _positional(rec))]
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
