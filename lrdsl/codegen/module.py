"""Module emitter: all stages of one spec -> the source of one standalone Python module.

The module imports torch and triton only; `lrdsl compile` writes it to a file, `lrdsl.load`
caches and imports it.
"""
from __future__ import annotations

import hashlib

from ..version import __version__
from ..errors import CompileError
from ..ir.chunk import NoChunkForm
from ..ir.recurrence import Recurrence
from ..ir.step import StepProgram
from .chunk import emit_chunk_section
from .names import CHECKPOINT_OPTIONS, CHUNK_OPTIONS, CP_OPTIONS, POSITIONAL, RECURRENT_OPTIONS, STATES_OPTIONS, VERIFY_OPTIONS, forward_options, signature
from .printer import HELPERS
from .recurrent import (
    commit_kernel_name,
    decay_op,
    emit_commit_kernel,
    emit_recurrent_kernel,
    emit_tree_verify_kernel,
    has_low_rank,
    kernel_name,
    tree_verify_kernel_name,
)
from .templating import host_code, render

# Launch settings of the recurrent kernel (decode, verify, short sequences), from a sweep on the
# H200 (BENCHMARKS.md, "Serving launch sweep"): 16 value columns per program make many small
# programs, which keeps more state loads in flight than 32, and one warp per 64 fp32 state values
# a thread (K = 128: one warp) keeps the K x BV tile in registers without idle lanes. B = 256
# decode went 373 -> 324 us and verify of 4 tokens 573 -> 405 us against 32 columns on 4 warps.
RECURRENT_BLOCK_V = 16
RECURRENT_STATE_VALUES_PER_THREAD = 64
# The commit kernel replays stored vectors (no reductions): 32 columns on 4 warps measured best.
COMMIT_BLOCK_V = 32
COMMIT_NUM_WARPS = 4


def _positional(rec: Recurrence) -> list[str]:
    """The public functions' positional parameters: q, k, v, then the spec's inputs by their names."""
    return list(POSITIONAL) + [i.name for i in rec.inputs]


def _draft_layout(step: StepProgram) -> tuple[str, str]:
    """A Draft's buffers k, u, g, b, r: (their shapes as the Draft docstring writes them, the tuple
    of shapes _draft_shapes returns, None for a buffer this spec's step does not have)."""
    shapes = {"k": "B, T, HV, K", "u": "B, T, HV, V"}
    decay = decay_op(step)
    if decay is not None:
        shapes["g"] = "B, T, HV, K" if decay.per_key else "B, T, HV"
    if has_low_rank(step):
        shapes.update(b="B, T, HV, K", r="B, T, HV, V")
    doc = "   ".join(f"{name} [{shape}]" for name, shape in shapes.items())
    if decay is None:
        doc += "   g None (no gate)"
    if not has_low_rank(step):
        doc += "   b, r None (no low-rank term)"
    tuples = ", ".join(f"({shapes[name]})" if name in shapes else "None" for name in ("k", "u", "g", "b", "r"))
    return doc, tuples


def emit_recurrent_section(step: StepProgram, rec: Recurrence) -> str:
    """The recurrent section: the kernels of `step` (over the rows lower_steps made), the public
    functions with the parameters of `rec`, the spec's recurrence."""
    draft_doc, draft_tuples = _draft_layout(step)
    return render(
        "recurrent_api.py.jinja",
        kernel=emit_recurrent_kernel(step).rstrip("\n"),
        kernel_name=kernel_name(step),
        commit_kernel=emit_commit_kernel(step).rstrip("\n"),
        commit_kernel_name=commit_kernel_name(step),
        tree_verify_kernel=emit_tree_verify_kernel(step).rstrip("\n"),
        tree_verify_kernel_name=tree_verify_kernel_name(step),
        spec_name=rec.name,
        positional=", ".join(_positional(rec)),
        signature=signature(_positional(rec), RECURRENT_OPTIONS),
        forward_options=forward_options(RECURRENT_OPTIONS),
        verify_signature=signature(_positional(rec), VERIFY_OPTIONS),
        verify_forward_options=forward_options(VERIFY_OPTIONS),
        draft_shapes_doc=draft_doc,
        draft_shapes_tuple=draft_tuples,
        block_v=RECURRENT_BLOCK_V,
        state_values_per_warp=32 * RECURRENT_STATE_VALUES_PER_THREAD,
        commit_block_v=COMMIT_BLOCK_V,
        commit_num_warps=COMMIT_NUM_WARPS,
        steps=rec.steps_per_token,
    )


def emit_steps_section(rec: Recurrence, rows: Recurrence) -> str:
    """The host code of steps_per_token > 1 (passes/lower_steps.py): the public functions' tokens
    -> the kernels' rows (`rows`, the lowered recurrence, may take the step gate after the spec's
    inputs), and the rows' outputs -> the tokens'."""
    return render(
        "steps_api.py.jinja",
        steps=rec.steps_per_token,
        rows_per_token=[rec.rows_per_token(i) if i.role.per_token else 0 for i in rec.inputs],
        step_gate=len(rows.inputs) > len(rec.inputs),
    )


# The custom ops' namespace holds a hash of the module's text: modules of two specs that share a
# name (or of one spec compiled by two lrdsl versions) register ops of their own, and loading the
# same text twice registers the same ops again.
OPS_KEY_PLACEHOLDER = "@@LRDSL_OPS_KEY@@"


def emit_module(stages: dict, spec_path: str) -> str:
    """The module's source. `spec_path` only names the spec in an error: the text depends on the
    spec's contents alone, so `gdn`, `specs/gdn.toml` and an absolute path give the same bytes
    (one cache key, one entry), and a path the file system accepts but UTF-8 cannot encode
    (Latin-1 bytes, a non-ASCII name under LC_ALL=C) never reaches the text or its digest."""
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
        f"chunk({signature(_positional(rec), CHUNK_OPTIONS + STATES_OPTIONS + CHECKPOINT_OPTIONS + CP_OPTIONS)}) -> (o, final_state | None[, h])   [differentiable]",
        "prepare_varlen(cu_seqlens, chunk_size=64, cu_seqlens_cpu=None) -> VarlenChunks, for chunk(..., chunk_indices=)",
        'intermediate_chunk_tokens(q, chunk_size=None, plan=None, precision="input", v=None) -> tokens per chunk of chunk()\'s h',
        "pack_states(states, state_v_first=False) -> int8 rows of an 8-bit state pool; unpack_states(rows, state_v_first=False) -> fp32 states",
    ]
    sections = [emit_recurrent_section(stages["step"], rec),
                emit_chunk_section(plans, _positional(rec), rec.steps_per_token)]
    if rec.steps_per_token > 1:
        sections.append(emit_steps_section(rec, stages["substeps"]))
    sections.append(render(
        "custom_ops.py.jinja",
        namespace=f"lrdsl_{rec.name}_{OPS_KEY_PLACEHOLDER}",
        has_gate=decay_op(stages["step"]) is not None,
        has_low_rank=has_low_rank(stages["step"]),
        kernel_name=kernel_name(stages["step"]),
    ))
    inputs_tuple = "(" + "".join(f"({i.name!r}, {i.role.value!r}), " for i in rec.inputs) + ")"
    source = render(
        "module.py.jinja",
        spec_name=rec.name,
        version=__version__,
        recurrence_doc=rec.describe(),
        signatures=signatures,
        inputs_tuple=inputs_tuple,
        helpers=HELPERS,
        host_helpers=host_code("helpers"),
        checks=host_code("checks"),
        sections="\n\n".join(sections),
        steps=rec.steps_per_token,
    )
    ops_key = hashlib.sha256(source.encode()).hexdigest()[:12]
    return source.replace(OPS_KEY_PLACEHOLDER, ops_key)
