"""derive_step: Recurrence IR -> the per-token step program of the recurrent kernel.

The lowering is read straight off the recurrence (docs/design.md §1): the gate kind picks the
decay op, the update rule picks predict/residual or a scaled write (the dplr update adds the
low-rank term, read before the decay), beta is applied where the spec declares it. The delta
rule predicts along its read vector r_t and takes its residual from its written value x_t when
the spec gives them (formulas.delta_read, formulas.write_value), along k and from v otherwise. Per-head inputs and formulas that read no per-token input are hoisted into
the prologue, so the body does only per-token work.
"""
from __future__ import annotations

from ..ir.recurrence import GateKind, Recurrence
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


def derive_step(rec: Recurrence) -> StepProgram:
    prologue = [LoadInput(i.name, i.role) for i in rec.head_inputs]
    body = [LoadVector("q"), LoadVector("k"), LoadVector("v")]
    body += [LoadInput(i.name, i.role) for i in rec.token_inputs]
    body += [NormalizeL2("q"), NormalizeL2("k")]

    formulas = (("g_t", rec.log_decay), ("beta_t", rec.beta), ("a_t", rec.low_rank_read), ("b_t", rec.low_rank_write),
                ("r_t", rec.delta_read), ("x_t", rec.write_value))
    for target, expr in formulas:
        if expr is None:
            continue
        op = Formula(target, expr, per_key=rec.is_per_key_channel(expr), per_value=rec.is_per_value_channel(expr))
        # A formula of per-head inputs only (a constant gate, a per-head beta) is loop-invariant.
        (body if rec.is_per_token(expr) else prologue).append(op)

    if rec.has_low_rank:  # it reads the state before this step's decay
        body.append(ReadLowRank())
    if rec.gate is not GateKind.NONE:
        body.append(DecayState(per_key=rec.gate is GateKind.KEY_CHANNEL))
    if rec.is_delta:
        read = "k" if rec.delta_read is None else "r_t"
        value = "v" if rec.write_value is None else "x_t"
        body += [PredictValue(read), DeltaResidual(with_beta=rec.has_beta, value=value)]
    else:
        body.append(ScaleValue(with_beta=rec.has_beta))
    body.append(WriteState())
    if rec.has_low_rank:
        body.append(WriteLowRank())
    body += [ReadOutput(), StoreOutput()]
    return StepProgram(rec, tuple(prologue), tuple(body))
