"""verify: check the invariants of any IR stage. Tests run it after every pass.

A failure is an IRError: it means a pass (or a hand-built IR) is wrong, not the user's spec.
"""
from __future__ import annotations

from ..errors import IRError
from ..ir.formula import HEAD_INDEX
from ..ir.recurrence import GateKind, Recurrence
from ..ir.step import DecayState, DeltaResidual, Formula, PredictValue, ReadOutput, ScaleValue, StepProgram, WriteState

_VERIFIERS = {}


def verifies(ir_type):
    def register(fn):
        _VERIFIERS[ir_type] = fn
        return fn

    return register


def verify(ir) -> None:
    checker = _VERIFIERS.get(type(ir))
    if checker is None:
        raise IRError(f"no verifier for IR of type {type(ir).__name__}")
    checker(ir)


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise IRError(message)


@verifies(Recurrence)
def verify_recurrence(rec: Recurrence) -> None:
    names = [i.name for i in rec.inputs]
    _require(len(names) == len(set(names)), f"{rec.name}: duplicate input names {names}")
    _require((rec.log_decay is None) == (rec.gate is GateKind.NONE), f"{rec.name}: log_decay must be set exactly when gated")
    known = set(names) | {str(HEAD_INDEX)}
    for label, expr in (("log_decay", rec.log_decay), ("beta", rec.beta)):
        if expr is None:
            continue
        stray = sorted(str(s) for s in expr.free_symbols if str(s) not in known)
        _require(not stray, f"{rec.name}: {label} reads undeclared {stray}")
    if rec.gate is GateKind.CONSTANT:
        _require(not rec.is_per_token(rec.log_decay), f"{rec.name}: a constant gate may not read per-token inputs")
    if rec.gate in (GateKind.SCALAR, GateKind.KEY_CHANNEL):
        _require(rec.is_per_token(rec.log_decay), f"{rec.name}: a {rec.gate.value} gate must read a per-token input")
    _require(
        rec.is_per_key_channel(rec.log_decay) == (rec.gate is GateKind.KEY_CHANNEL),
        f"{rec.name}: per-key-channel decay inputs go with gate = key_channel and only with it",
    )
    _require(not rec.is_per_key_channel(rec.beta), f"{rec.name}: beta must be one value per token and head")


@verifies(StepProgram)
def verify_step_program(prog: StepProgram) -> None:
    rec = prog.recurrence
    verify_recurrence(rec)
    defined = {"S"}
    for where, ops in (("prologue", prog.prologue), ("body", prog.body)):
        for index, op in enumerate(ops):
            missing = [name for name in op.uses() if name not in defined]
            _require(not missing, f"{rec.name} step {where}[{index}] {type(op).__name__} reads {missing} before any definition")
            defined.update(op.defines())
    kinds = [type(op) for op in prog.body]
    _require(kinds.count(WriteState) == 1, f"{rec.name}: the body must write the state exactly once")
    _require(kinds.count(ReadOutput) == 1, f"{rec.name}: the body must read the output exactly once")
    _require(kinds.index(ReadOutput) > kinds.index(WriteState), f"{rec.name}: the output reads the state after the write")
    _require((DecayState in kinds) == rec.has_gate, f"{rec.name}: a decay op belongs in the body exactly when gated")
    if DecayState in kinds:
        _require(kinds.index(DecayState) < kinds.index(WriteState), f"{rec.name}: decay comes before the write")
    _require((PredictValue in kinds) == rec.is_delta, f"{rec.name}: predict belongs to the delta rule only")
    _require((DeltaResidual in kinds) == rec.is_delta, f"{rec.name}: the residual belongs to the delta rule only")
    _require((ScaleValue in kinds) != rec.is_delta, f"{rec.name}: the plain update scales v instead of a residual")
    if rec.is_delta:
        _require(kinds.index(DecayState if rec.has_gate else PredictValue) <= kinds.index(PredictValue),
                 f"{rec.name}: the delta rule predicts from the decayed state")
    for op in list(prog.prologue) + list(prog.body):
        if isinstance(op, Formula) and op.target == "g_t":
            _require(op.per_key == (rec.gate is GateKind.KEY_CHANNEL), f"{rec.name}: g_t shape disagrees with the gate kind")
