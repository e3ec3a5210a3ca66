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
from .printer import HELPERS
from .recurrent import emit_recurrent_kernel, kernel_name
from .templating import render

# Launch defaults of the recurrent kernel: value columns per program and warps.
RECURRENT_BLOCK_V = 32
RECURRENT_NUM_WARPS = 4


def _positional(rec: Recurrence) -> str:
    return ", ".join(["q", "k", "v"] + [i.name for i in rec.inputs])


def _extras_tuple(rec: Recurrence) -> str:
    names = [i.name for i in rec.inputs]
    return ", ".join(names) + ("," if len(names) == 1 else "")


def emit_recurrent_section(step: StepProgram) -> str:
    rec = step.recurrence
    return render(
        "recurrent_api.py.jinja",
        kernel=emit_recurrent_kernel(step),
        kernel_name=kernel_name(step),
        spec_name=rec.name,
        positional=_positional(rec),
        extras=_extras_tuple(rec),
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
    signature_tail = "scale=None, initial_state=None, output_final_state=False, cu_seqlens=None, use_qk_l2norm_in_kernel=False"
    signatures = [
        f"recurrent({_positional(rec)}, {signature_tail}) -> (o, final_state | None)   [differentiable]",
        f"chunk({_positional(rec)}, {signature_tail}, chunk_size=64, plan=None, chunk_indices=None,"
        " save_policy=None) -> (o, final_state | None)   [differentiable]",
        "prepare_varlen(cu_seqlens, chunk_size=64) -> (chunk_indices, chunk_offsets)",
    ]
    sections = [emit_recurrent_section(stages["step"]), emit_chunk_section(plans, _positional(rec), _extras_tuple(rec))]
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
