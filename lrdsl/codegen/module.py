"""Module emitter: all stages of one spec -> the source of one standalone Python module.

The module imports torch and triton only; `lrdsl compile` writes it to a file, `lrdsl.load`
caches and imports it.
"""
from __future__ import annotations

import hashlib

from .. import __version__
from ..errors import CompileError
from ..ir.chunk import NoChunkForm
from ..ir.recurrence import Recurrence
from ..ir.step import StepProgram
from .chunk import emit_chunk_section
from .names import CHUNK_OPTIONS, POSITIONAL, RECURRENT_OPTIONS, VERIFY_OPTIONS, forward_options, signature
from .printer import HELPERS
from .recurrent import commit_kernel_name, commit_refusal, decay_op, emit_commit_kernel, emit_recurrent_kernel, kernel_name
from .templating import render

# Launch defaults of the recurrent kernel: value columns per program and warps.
RECURRENT_BLOCK_V = 32
RECURRENT_NUM_WARPS = 4


def _positional(rec: Recurrence) -> list[str]:
    """The public functions' positional parameters: q, k, v, then the spec's inputs by their names."""
    return list(POSITIONAL) + [i.name for i in rec.inputs]


def _draft_g_shape(step: StepProgram) -> tuple[str, str]:
    """(as the Draft docstring writes it, as _draft_shapes returns it) of a Draft's g."""
    decay = decay_op(step)
    if decay is None:
        return "None (no gate)", "None"
    return ("[B, T, HV, K]", "(B, T, HV, K)") if decay.per_key else ("[B, T, HV]", "(B, T, HV)")


def emit_recurrent_section(step: StepProgram) -> str:
    rec = step.recurrence
    g_shape, g_tuple = _draft_g_shape(step)
    return render(
        "recurrent_api.py.jinja",
        kernel=emit_recurrent_kernel(step).rstrip("\n"),
        kernel_name=kernel_name(step),
        commit_kernel=emit_commit_kernel(step).rstrip("\n"),
        commit_kernel_name=commit_kernel_name(step),
        commit_refusal=commit_refusal(step),
        spec_name=rec.name,
        positional=", ".join(_positional(rec)),
        signature=signature(_positional(rec), RECURRENT_OPTIONS),
        forward_options=forward_options(RECURRENT_OPTIONS),
        verify_signature=signature(_positional(rec), VERIFY_OPTIONS),
        verify_forward_options=forward_options(VERIFY_OPTIONS),
        draft_g_shape=g_shape,
        draft_g_tuple=g_tuple,
        block_v=RECURRENT_BLOCK_V,
        num_warps=RECURRENT_NUM_WARPS,
    )


# The custom ops' namespace holds a hash of the module's text: modules of two specs that share a
# name (or of one spec compiled by two lrdsl versions) register ops of their own, and loading the
# same text twice registers the same ops again.
OPS_KEY_PLACEHOLDER = "@@LRDSL_OPS_KEY@@"


def emit_module(stages: dict, spec_path: str) -> str:
    rec: Recurrence = stages["recurrence"]
    plans = stages["save"]
    if isinstance(plans, NoChunkForm):
        # every module has a differentiable chunk(): a recurrence the passes cannot chunk is
        # refused here, in one line naming what is missing, never emitted half
        raise CompileError(f"{spec_path}: cannot compile {plans.describe()}")
    signatures = [
        f"recurrent({signature(_positional(rec), RECURRENT_OPTIONS)}) -> (o, final_state | None)   [differentiable]",
        f"verify({signature(_positional(rec), VERIFY_OPTIONS)}) -> (o, Draft)",
        "commit(draft, num_accepted, validate=True)",
        f"chunk({signature(_positional(rec), CHUNK_OPTIONS)}) -> (o, final_state | None)   [differentiable]",
        "prepare_varlen(cu_seqlens, chunk_size=64, cu_seqlens_cpu=None) -> VarlenChunks, for chunk(..., chunk_indices=)",
    ]
    sections = [emit_recurrent_section(stages["step"]), emit_chunk_section(plans, _positional(rec))]
    sections.append(render(
        "custom_ops.py.jinja",
        namespace=f"lrdsl_{rec.name}_{OPS_KEY_PLACEHOLDER}",
        has_gate=decay_op(stages["step"]) is not None,
        kernel_name=kernel_name(stages["step"]),
    ))
    inputs_tuple = "(" + "".join(f"({i.name!r}, {i.role.value!r}), " for i in rec.inputs) + ")"
    source = render(
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
    ops_key = hashlib.sha256(source.encode()).hexdigest()[:12]
    return source.replace(OPS_KEY_PLACEHOLDER, ops_key)
