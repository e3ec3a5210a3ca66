"""Recurrent (decode) kernel: step program -> Triton, one registered emitter per step op.

Each emitter returns an Emission: `setup` lines run once before the token loop (pointer set-up),
`lines` go where the op sits (the prologue, or the loop body), `advance` lines move pointers to
the next token at the end of the body.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..errors import CompileError
from ..ir.formula import HEAD_INDEX
from ..ir.recurrence import InputRole
from ..ir.step import (
    DecayState,
    DeltaResidual,
    Formula,
    LoadInput,
    LoadVector,
    NormalizeL2,
    PredictValue,
    ReadLowRank,
    ReadOutput,
    ScaleValue,
    StepProgram,
    StoreOutput,
    WriteLowRank,
    WriteState,
)
from ..ir.registry import TypeRegistry
from .names import input_pointer
from .printer import to_triton
from .templating import indent, render

STEP_EMITTERS = TypeRegistry("recurrent kernel emitter", CompileError)


@dataclass
class Emission:
    lines: list[str]
    setup: list[str] = field(default_factory=list)
    advance: list[str] = field(default_factory=list)


def input_register(name: str) -> str:
    """The register of a spec input: b_in_<name>, apart from the kernel's own b_q, b_s, b_p, ..."""
    return "b_" + input_pointer(name)


def formula_names(prog: StepProgram) -> dict[str, str]:
    names = {i.name: input_register(i.name) for i in prog.recurrence.inputs}
    names.update(k="b_k", v="b_v", h="f_hv")  # k, v: delta_read and write_value may read them
    return names


@STEP_EMITTERS.register(LoadVector)
def _load_vector(op: LoadVector, prog: StepProgram) -> Emission:
    if op.source == "v":
        base, stride, mask = "(bos * HV + i_hv) * V + o_v", "HV * V", "m_v"
    else:
        base, stride, mask = "(bos * H + i_h) * K + o_k", "H * K", "m_k"
    p = f"p_{op.source}"
    return Emission(
        setup=[f"{p} = {op.source} + {base}"],
        lines=[f"b_{op.source} = tl.load({p}, mask={mask}, other=0.0).to(ACC)"],
        advance=[f"{p} += {stride}"],
    )


@STEP_EMITTERS.register(LoadInput)
def _load_input(op: LoadInput, prog: StepProgram) -> Emission:
    pointer, register = input_pointer(op.name), input_register(op.name)
    p = f"p_{pointer}"
    if op.role is InputRole.HEAD:
        return Emission([f"{register} = tl.load({pointer} + i_hv).to(ACC)"])
    if op.role is InputRole.HEAD_KEY:
        return Emission([f"{register} = tl.load({pointer} + i_hv * K + o_k, mask=m_k, other=0.0).to(ACC)"])
    if op.role is InputRole.TOKEN:
        return Emission(
            setup=[f"{p} = {pointer} + bos * HV + i_hv"],
            lines=[f"{register} = tl.load({p}).to(ACC)"],
            advance=[f"{p} += HV"],
        )
    if op.role is InputRole.TOKEN_VALUE:  # [B, T, HV, V]: like v, this program's value block
        return Emission(
            setup=[f"{p} = {pointer} + (bos * HV + i_hv) * V + o_v"],
            lines=[f"{register} = tl.load({p}, mask=m_v, other=0.0).to(ACC)"],
            advance=[f"{p} += HV * V"],
        )
    return Emission(
        setup=[f"{p} = {pointer} + (bos * HV + i_hv) * K + o_k"],
        lines=[f"{register} = tl.load({p}, mask=m_k, other=0.0).to(ACC)"],
        advance=[f"{p} += HV * K"],
    )


@STEP_EMITTERS.register(NormalizeL2)
def _normalize(op: NormalizeL2, prog: StepProgram) -> Emission:
    x = f"b_{op.target}"
    return Emission(
        [
            "if USE_QK_L2NORM:",
            f"    {x} = {x} / tl.sqrt(tl.sum({x} * {x}) + 1e-6)",
        ]
    )


@STEP_EMITTERS.register(Formula)
def _formula(op: Formula, prog: StepProgram) -> Emission:
    lines = [f"# {op.target} = {op.expr}"]
    if HEAD_INDEX in op.expr.free_symbols:
        lines.append("f_hv = i_hv.to(ACC)  # the value-head index h")
    value = to_triton(op.expr, formula_names(prog))
    if op.per_key:
        # key lanes past K (BK pads K to a power of two) hold 0: the formula of zero-padded
        # inputs need not be 0, and a low-rank vector there would write into the state's padding
        value = f"tl.where(m_k, {value}, 0.0)"
    if op.per_value:  # the same for value lanes past V (BV pads a block of V)
        value = f"tl.where(m_v, {value}, 0.0)"
    lines.append(f"{op.target} = {value}")
    return Emission(lines)


@STEP_EMITTERS.register(DecayState)
def _decay(op: DecayState, prog: StepProgram) -> Emission:
    if op.per_key:
        return Emission(["# S <- Diag(exp(g_t)) S", "b_s *= tl.exp(g_t)[:, None]"])
    return Emission(["# S <- exp(g_t) * S", "b_s *= tl.exp(g_t)"])


@STEP_EMITTERS.register(PredictValue)
def _predict(op: PredictValue, prog: StepProgram) -> Emission:
    read = "b_k" if op.read == "k" else op.read
    return Emission([f"# p = S^T {op.read}", f"b_p = tl.sum(b_s * {read}[:, None], axis=0)"])


@STEP_EMITTERS.register(DeltaResidual)
def _residual(op: DeltaResidual, prog: StepProgram) -> Emission:
    x = "b_v" if op.value == "v" else op.value
    if op.with_beta:
        return Emission([f"# u = beta_t * ({op.value} - p)", f"b_u = beta_t * ({x} - b_p)"])
    return Emission([f"# u = {op.value} - p", f"b_u = {x} - b_p"])


@STEP_EMITTERS.register(ScaleValue)
def _scale_value(op: ScaleValue, prog: StepProgram) -> Emission:
    if op.with_beta:
        return Emission(["# u = beta_t * v", "b_u = beta_t * b_v"])
    return Emission(["# u = v", "b_u = b_v"])


@STEP_EMITTERS.register(ReadLowRank)
def _read_low_rank(op: ReadLowRank, prog: StepProgram) -> Emission:
    return Emission(["# r = S^T a_t (the state before this step's decay)", "b_r = tl.sum(b_s * a_t[:, None], axis=0)"])


@STEP_EMITTERS.register(WriteLowRank)
def _write_low_rank(op: WriteLowRank, prog: StepProgram) -> Emission:
    return Emission(["# S <- S + b_t r^T", "b_s += b_t[:, None] * b_r[None, :]"])


@STEP_EMITTERS.register(WriteState)
def _write(op: WriteState, prog: StepProgram) -> Emission:
    return Emission(["# S <- S + k u^T", "b_s += b_k[:, None] * b_u[None, :]"])


@STEP_EMITTERS.register(ReadOutput)
def _read(op: ReadOutput, prog: StepProgram) -> Emission:
    return Emission(["# o = scale * S^T q", "b_o = scale * tl.sum(b_s * b_q[:, None], axis=0)"])


@STEP_EMITTERS.register(StoreOutput)
def _store(op: StoreOutput, prog: StepProgram) -> Emission:
    return Emission(
        setup=["p_o = o + (bos * HV + i_hv) * V + o_v"],
        lines=["# a padding slot's output is zeros, whatever its inputs hold",
               "tl.store(p_o, tl.where(live, b_o, 0.0).to(p_o.dtype.element_ty), mask=m_v)"],
        advance=["p_o += HV * V"],
    )


def kernel_name(prog: StepProgram) -> str:
    return f"{prog.recurrence.name}_recurrent_fwd_kernel"


def commit_kernel_name(prog: StepProgram) -> str:
    return f"{prog.recurrence.name}_commit_kernel"


def tree_verify_kernel_name(prog: StepProgram) -> str:
    return f"{prog.recurrence.name}_tree_verify_kernel"


def decay_op(prog: StepProgram) -> DecayState | None:
    return next((op for op in prog.body if isinstance(op, DecayState)), None)


def has_low_rank(prog: StepProgram) -> bool:
    return any(isinstance(op, WriteLowRank) for op in prog.body)


# What verify stores per draft token and value head so that commit can replay the token's state
# update without the state in between: the key it wrote with (after the L2 norm), the residual
# u, the log-decay g_t when the spec has a gate (per key channel for a key-channel gate), and,
# for a low-rank (dplr) update, the vector b_t its second rank-one term writes along and
# r = S^T a_t, what that term read. r depends on the state before the token, which only verify
# holds, so verify stores it and commit replays S <- D_t S + k u^T + b_t r^T from the row alone.
# Buffers are fp32, token-major: k, b [B, T, HV, K]; u, r [B, T, HV, V]; g [B, T, HV(, K)].
# The K-wide ones are stored by the first value block's programs only (the others hold the same);
# u and r by every value block, each its own columns.
DRAFT_ADDRESS = {
    "k": ("draft_k", "(t * HV + i_hv) * K + o_k", "m_k & (i_v == 0)"),
    "u": ("draft_u", "(t * HV + i_hv) * V + o_v", "m_v"),
    "g_scalar": ("draft_g", "t * HV + i_hv", "i_v == 0"),
    "g_per_key": ("draft_g", "(t * HV + i_hv) * K + o_k", "m_k & (i_v == 0)"),
    "b": ("draft_b", "(t * HV + i_hv) * K + o_k", "m_k & (i_v == 0)"),
    "r": ("draft_r", "(t * HV + i_hv) * V + o_v", "m_v"),
}
DRAFT_VALUES = {"k": "b_k", "u": "b_u", "g_scalar": "g_t", "g_per_key": "g_t", "b": "b_t", "r": "b_r"}
# as the step program names them (lrdsl show --stage step)
DRAFT_SYMBOLS = {"k": "k", "u": "u", "g_scalar": "g_t", "g_per_key": "g_t", "b": "b_t", "r": "r"}


def draft_parts(prog: StepProgram) -> list[str]:
    decay = decay_op(prog)
    gate = [] if decay is None else ["g_per_key" if decay.per_key else "g_scalar"]
    return ["k", "u"] + gate + (["b", "r"] if has_low_rank(prog) else [])


def _draft_symbols(prog: StepProgram) -> str:
    return ", ".join(DRAFT_SYMBOLS[part] for part in draft_parts(prog))


def replayed_update(prog: StepProgram) -> str:
    """The state update commit replays per token, as its kernel's docstring writes it."""
    decay = decay_op(prog)
    decayed = "S" if decay is None else ("Diag(exp(g_t)) S" if decay.per_key else "exp(g_t) S")
    return f"S <- {decayed} + k u^T" + (" + b_t r^T" if has_low_rank(prog) else "")


def emit_draft_stores(prog: StepProgram) -> list[str]:
    lines = [f"# verify: what commit needs to replay this token ({_draft_symbols(prog)})"]
    for part in draft_parts(prog):
        pointer, offsets, mask = DRAFT_ADDRESS[part]
        lines.append(f"tl.store({pointer} + {offsets}, {DRAFT_VALUES[part]}, mask={mask})")
    return lines


# the step ops commit replays: the ones that write the state (what they read, verify stored)
REPLAYED_OPS = (DecayState, WriteState, WriteLowRank)


def emit_commit_kernel(prog: StepProgram) -> str:
    """The commit kernel: the step program's decay and writes, on what verify stored."""
    body = [f"# this token's {_draft_symbols(prog)}, as verify computed them"]
    for part in draft_parts(prog):
        pointer, offsets, mask = DRAFT_ADDRESS[part]
        mask = mask.replace(" & (i_v == 0)", "").replace("i_v == 0", "")  # every program reads them
        value = DRAFT_VALUES[part]
        body.append(f"{value} = tl.load({pointer} + {offsets}{f', mask={mask}, other=0.0' if mask else ''})")
    for op in prog.body:
        if isinstance(op, REPLAYED_OPS):
            body += STEP_EMITTERS.lookup(op)(op, prog).lines
    return render(
        "commit.py.jinja",
        kernel_name=commit_kernel_name(prog),
        spec_name=prog.recurrence.name,
        replayed_update=replayed_update(prog),
        body=indent(body, 8),
    )


@dataclass
class StepEmission:
    """A step program as Triton lines: the prologue's (set-up and loads, once per sequence), and
    the body's pointer set-up at the sequence's first row `bos`, per-token lines and pointer steps."""
    prologue: list[str]
    setup: list[str]
    body: list[str]
    advance: list[str]


def emit_step(prog: StepProgram) -> StepEmission:
    out = StepEmission([], [], [], [])
    for op in prog.prologue:
        emission = STEP_EMITTERS.lookup(op)(op, prog)
        out.prologue += emission.setup + emission.lines
    for op in prog.body:
        emission = STEP_EMITTERS.lookup(op)(op, prog)
        out.setup += emission.setup
        out.body += emission.lines
        out.advance += emission.advance
    return out


def _at_token(lines: list[str]) -> list[str]:
    """Pointer set-up lines, which address a sequence's first row `bos`, at row `t` instead."""
    return [re.sub(r"\bbos\b", "t", line) for line in lines]


def emit_tree_verify_kernel(prog: StepProgram) -> str:
    """The tree verify kernel: the step program's body run along each draft token's path, its
    pointers set at each row it runs (the rows of a path are not consecutive)."""
    step = emit_step(prog)
    return render(
        "tree_verify.py.jinja",
        kernel_name=tree_verify_kernel_name(prog),
        spec_name=prog.recurrence.name,
        input_pointers=[input_pointer(i.name) for i in prog.recurrence.inputs],
        prologue=indent(["# per-head inputs"] + step.prologue, 4) if step.prologue else "",
        pointers=indent(["# row t's pointers"] + _at_token(step.setup), 12),
        body=indent(step.body, 12),
        draft=indent(emit_draft_stores(prog), 12),
    )


def emit_recurrent_kernel(prog: StepProgram) -> str:
    step = emit_step(prog)
    setup = step.prologue + step.setup
    return render(
        "recurrent.py.jinja",
        kernel_name=kernel_name(prog),
        spec_name=prog.recurrence.name,
        input_pointers=[input_pointer(i.name) for i in prog.recurrence.inputs],
        setup=indent(["# pointers to the first token of this sequence, per-head inputs"] + setup, 4),
        body=indent(step.body, 8),
        draft=indent(emit_draft_stores(prog), 12),
        advance=indent(["# next token"] + step.advance, 8),
    )
