"""verify: check the invariants of any IR stage. Tests run it after every pass.

A failure is an IRError: it means a pass (or a hand-built IR) is wrong, not the user's spec.
"""
from __future__ import annotations

import sympy

from ..errors import IRError
from ..ir.chunk import (
    Band,
    Broadcast,
    ChunkProgram,
    ClampBelow,
    ClampBelowGrad,
    CrossingSum,
    Cumsum,
    DecayMatrix,
    DecayedGram,
    DecayedMatMul,
    Diagonal,
    FiniteRows,
    Formula as ChunkFormula,
    LastRow,
    Load,
    Mask,
    MaskRows,
    SAVED,
    MatMul,
    NoChunkForm,
    Normalize,
    NormalizeGrad,
    PlaceLastRow,
    ReduceSum,
    StateIn,
    UnitLowerInverse,
    scaled_cumsum,
)
from ..ir.formula import HEAD_INDEX
from ..ir.plan import BackwardPlan, ChunkPlans, StageGraph
from ..ir.recurrence import GateKind, Recurrence
from ..ir.step import (
    DecayState,
    DeltaResidual,
    Formula,
    PredictValue,
    ReadLowRank,
    ReadOutput,
    ScaleValue,
    StepProgram,
    WriteLowRank,
    WriteState,
)
from ..ir.registry import TypeRegistry

_VERIFIERS = TypeRegistry("verifier", IRError)
verifies = _VERIFIERS.register


def verify(ir) -> None:
    _VERIFIERS.lookup(ir)(ir)


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise IRError(message)


@verifies(Recurrence)
def verify_recurrence(rec: Recurrence) -> None:
    names = [i.name for i in rec.inputs]
    _require(len(names) == len(set(names)), f"{rec.name}: duplicate input names {names}")
    _require((rec.log_decay is None) == (rec.gate is GateKind.NONE), f"{rec.name}: log_decay must be set exactly when gated")
    known = set(names) | {str(HEAD_INDEX)}
    formulas = (("log_decay", rec.log_decay), ("beta", rec.beta), ("low_rank_read", rec.low_rank_read),
                ("low_rank_write", rec.low_rank_write), ("delta_read", rec.delta_read), ("write_value", rec.write_value))
    # the token vectors a formula may read by name: k in the read vector, v in the written value
    vectors = {"delta_read": {"k"}, "write_value": {"v"}}
    for label, expr in formulas:
        if expr is None:
            continue
        stray = sorted(str(s) for s in expr.free_symbols if str(s) not in known | vectors.get(label, set()))
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
    low_rank = (rec.low_rank_read, rec.low_rank_write)
    if rec.has_low_rank:
        _require(all(rec.is_per_key_channel(e) for e in low_rank), f"{rec.name}: dplr takes two per-key-channel vectors")
        _require(rec.gate is GateKind.KEY_CHANNEL, f"{rec.name}: dplr decays per key channel")
    else:
        _require(low_rank == (None, None), f"{rec.name}: low-rank vectors belong to the dplr update only")
    if rec.delta_read is not None or rec.write_value is not None:
        _require(rec.is_delta, f"{rec.name}: a read vector and a written value belong to the delta rule only")
    if rec.delta_read is not None:
        _require(rec.is_per_key_channel(rec.delta_read) and not rec.is_per_value_channel(rec.delta_read),
                 f"{rec.name}: the read vector r_t is per key channel")
    if rec.write_value is not None:
        _require(rec.reads_token_vector(rec.write_value, "v") and not rec.is_per_key_channel(rec.write_value),
                 f"{rec.name}: the written value x_t is per value channel and reads v")
    for label, expr in formulas[:4]:
        _require(not rec.is_per_value_channel(expr), f"{rec.name}: {label} may not read per-value-channel inputs")


@verifies(StepProgram)
def verify_step_program(prog: StepProgram) -> None:
    rec = prog.recurrence
    verify_recurrence(rec)
    _require(rec.steps_per_token == 1, f"{rec.name}: a step program takes one step per row (lower_steps comes first)")
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
    _require((ReadLowRank in kinds) == (WriteLowRank in kinds) == rec.has_low_rank,
             f"{rec.name}: the low-rank read and write belong to the dplr update only")
    if rec.has_low_rank:
        first_change = kinds.index(DecayState) if DecayState in kinds else kinds.index(WriteState)
        _require(kinds.index(ReadLowRank) < first_change, f"{rec.name}: the low-rank term reads the state before the decay")
    for op in list(prog.prologue) + list(prog.body):
        if isinstance(op, Formula) and op.target == "g_t":
            _require(op.per_key == (rec.gate is GateKind.KEY_CHANNEL), f"{rec.name}: g_t shape disagrees with the gate kind")


# -- chunk programs ----------------------------------------------------------------------------

_LOAD_SHAPES = {"q": ("C", "K"), "k": ("C", "K"), "v": ("C", "V"), "scale": (), "h": (), "dO": ("C", "V")}
_INPUT_SHAPES = {"token": ("C",), "token_key": ("C", "K"), "head": (), "head_key": ("K",), "token_value": ("C", "V")}


def _matmul_shape(op: MatMul, shapes) -> tuple | None:
    a, b = shapes[op.a], shapes[op.b]
    if len(a) != 2 or len(b) != 2:
        return None
    a = a[::-1] if op.transpose_a else a
    b = b[::-1] if op.transpose_b else b
    return (a[0], b[1]) if a[1] == b[0] else None


def _expected_shape(op, shapes, rec) -> tuple | None:
    """The shape an op must have given its inputs, or None where any shape is fine."""
    if isinstance(op, Load):
        if op.source in _LOAD_SHAPES:
            return _LOAD_SHAPES[op.source]
        if op.source.startswith(SAVED):
            return None  # a forward value read back: its shape is the forward's
        return _INPUT_SHAPES[rec.input(op.source).role.value]
    if isinstance(op, StateIn):
        return ("K", "V")
    if isinstance(op, (Normalize, MaskRows, FiniteRows, ClampBelow, ClampBelowGrad, Cumsum, Mask)):
        return shapes[op.x]
    if isinstance(op, LastRow):
        return shapes[op.x][1:]
    if isinstance(op, (DecayMatrix, DecayedGram)):
        return ("C", "C")
    if isinstance(op, DecayedMatMul):
        return ("C", "K")
    if isinstance(op, (Diagonal, CrossingSum)):
        return ("C",)
    if isinstance(op, Band):
        return ("C", "C")
    if isinstance(op, MatMul):
        return _matmul_shape(op, shapes)
    if isinstance(op, UnitLowerInverse):
        return ("C", "C")
    if isinstance(op, NormalizeGrad):
        return shapes[op.x]
    if isinstance(op, PlaceLastRow):
        return ("C",) + shapes[op.x]
    if isinstance(op, ReduceSum):
        return tuple(a for i, a in enumerate(shapes[op.x]) if i not in op.axes)
    return None


def _exclusive_beside_inclusive(prog: ChunkProgram, x: str, y: str) -> bool:
    """x = exclusive cumsum(g) * c and y = cumsum(g) * c for one g and one constant c (so that
    x_i = y_(i-1), which the adjoint of a two-decay DecayedGram relies on)."""
    found = scaled_cumsum(prog, x), scaled_cumsum(prog, y)
    if None in found:
        return False
    (cx, fx), (cy, fy) = found
    return cx.exclusive and not cy.exclusive and cx.x == cy.x and fx == fy


@verifies(ChunkProgram)
def verify_chunk_program(prog: ChunkProgram) -> None:
    rec = prog.recurrence
    verify_recurrence(rec)
    shapes: dict[str, tuple] = {}
    for index, op in enumerate(prog.ops):
        where = f"{rec.name} chunk op {index} ({op.out} = {op.describe()})"
        _require(op.out not in shapes, f"{where}: {op.out} is defined twice")
        missing = [a for a in op.args() if a not in shapes]
        _require(not missing, f"{where}: reads {missing} before any definition")
        _require(all(axis in ("C", "K", "V") for axis in op.shape), f"{where}: unknown axis in {op.shape}")
        expected = _expected_shape(op, shapes, rec)
        if isinstance(op, MatMul):
            _require(expected is not None, f"{where}: operand shapes {shapes[op.a]}, {shapes[op.b]} do not contract")
        if expected is not None:
            _require(op.shape == expected, f"{where}: shape {op.shape}, expected {expected}")
        if isinstance(op, ChunkFormula):
            bad = [a for a in op.args() if shapes[a] not in ((), op.shape)]
            _require(not bad, f"{where}: elementwise over {bad} whose shapes differ from {op.shape}")
        if isinstance(op, Broadcast):
            source = shapes[op.x]
            _require(
                source == () or (len(source) == 1 and source in (op.shape[:1], op.shape[1:])),
                f"{where}: cannot broadcast {source} to {op.shape}",
            )
        if isinstance(op, (DecayMatrix, Cumsum)):
            _require(shapes[op.x][:1] == ("C",), f"{where}: needs a per-row value, got {shapes[op.x]}")
        if isinstance(op, DecayedGram):
            operands = [shapes[a] for a in op.args()]
            _require(all(o == ("C", "K") for o in operands), f"{where}: needs C x K tiles, got {operands}")
            # the diagonal exp2(x_i - y_i) is 1 only when both decays are one
            _require(not (op.inclusive and op.y is not None), f"{where}: an inclusive product takes one decay")
        if isinstance(op, DecayedMatMul):
            operands = [shapes[a] for a in op.args()]
            _require(operands[0] == ("C", "C") and all(o == ("C", "K") for o in operands[1:]),
                     f"{where}: needs C x C, then C x K tiles, got {operands}")
        if isinstance(op, DecayedGram) and op.y is not None:
            _require(_exclusive_beside_inclusive(prog, op.x, op.y),
                     f"{where}: two decays must be the exclusive and inclusive cumulative sums of one log-decay")
        if isinstance(op, ClampBelowGrad):
            _require(shapes[op.dy] == shapes[op.x], f"{where}: the gradient's shape {shapes[op.dy]} is not {shapes[op.x]}")
        if isinstance(op, (Mask, UnitLowerInverse, Diagonal, CrossingSum, Band)):
            arg = op.a if isinstance(op, UnitLowerInverse) else op.x
            _require(shapes[arg] == ("C", "C"), f"{where}: needs a C x C matrix")
        shapes[op.out] = op.shape
    kinds = [type(op) for op in prog.ops]
    _require(kinds.count(StateIn) == 1, f"{rec.name}: a chunk program has exactly one entry state")
    roles = dict(prog.outputs)
    _require(shapes.get(roles.get("state")) == ("K", "V"), f"{rec.name}: the exit state must be K x V")
    for value in prog.chunk_size_free:
        # a chunk-size-free value is a tile of rows, one per token (no axis over the chunk's columns)
        shape = shapes.get(value)
        _require(shape is not None and shape[:1] == ("C",) and "C" not in shape[1:],
                 f"{rec.name}: chunk-size-free {value} must be a per-row value of the program, got {shape}")
    if prog.direction == "forward":
        _require(set(roles) == {"o", "state"}, f"{rec.name}: outputs must be o and state, got {sorted(roles)}")
        _require(shapes.get(roles.get("o")) == ("C", "V"), f"{rec.name}: the output o must be C x V")
        _require((UnitLowerInverse in kinds) == (rec.is_delta or rec.has_low_rank),
                 f"{rec.name}: a triangular system belongs to the delta rule and the dplr update only")
        per_channel = rec.gate is GateKind.KEY_CHANNEL
        _require((DecayMatrix in kinds) == (rec.has_gate and not per_channel),
                 f"{rec.name}: decay matrices belong to scalar and constant gates only")
        _require((DecayedGram in kinds) == per_channel, f"{rec.name}: per-channel decayed products belong to key-channel gates only")
        _require((ClampBelow in kinds) == rec.has_gate, f"{rec.name}: a gated chunk program floors its log-decay (hard resets)")
        return
    _require(prog.direction == "backward", f"{rec.name}: unknown direction {prog.direction!r}")
    # the call's inputs and their tiles' shapes: a gradient need not be of a value the backward
    # loads (a plain update with a constant beta reads the forward's Vn = beta v back, never v)
    inputs = {name: _LOAD_SHAPES[name] for name in ("q", "k", "v")}
    inputs.update({i.name: _INPUT_SHAPES[i.role.value] for i in rec.inputs})
    for role, value in prog.results:
        _require(role.startswith("grad:"), f"{rec.name}: a backward program outputs gradients, got {role}")
        source = role[len("grad:"):]
        _require(source in inputs, f"{rec.name}: gradient of {source}, which is not an input of the call")
        _require(shapes[value] == inputs[source], f"{rec.name}: d{source} has shape {shapes[value]}, {source} {inputs[source]}")
    _require(UnitLowerInverse not in kinds, f"{rec.name}: the backward reads the solved system back, it never solves")


@verifies(NoChunkForm)
def verify_no_chunk_form(item: NoChunkForm) -> None:
    verify_recurrence(item.recurrence)
    _require(bool(item.reason), f"{item.recurrence.name}: a missing chunk form must say why")


# -- stage graphs and plans --------------------------------------------------------------------

_PHASE_ORDER = {"prepare": 0, "scan": 1, "output": 2}


@verifies(StageGraph)
def verify_stage_graph(stages: StageGraph) -> None:
    prog = stages.program
    verify_chunk_program(prog)
    name = prog.recurrence.name
    _require([v for v, _ in stages.phases] == [op.out for op in prog.ops], f"{name}: every op needs exactly one phase")
    _require(all(p in _PHASE_ORDER for _, p in stages.phases), f"{name}: unknown phase")
    _require(stages.phase(prog.state_in) == "scan", f"{name}: the entry state belongs to the scan")
    _require(stages.phase(prog.output("state")) == "scan", f"{name}: the exit state belongs to the scan")
    for op in prog.ops:
        for arg in op.args():
            _require(
                _PHASE_ORDER[stages.phase(arg)] <= _PHASE_ORDER[stages.phase(op.out)],
                f"{name}: {op.out} ({stages.phase(op.out)}) reads {arg} from the later phase {stages.phase(arg)}",
            )


@verifies(ChunkPlans)
def verify_chunk_plans(plans: ChunkPlans) -> None:
    verify_stage_graph(plans.graph)
    prog = plans.graph.program
    name = prog.recurrence.name
    ops = {op.out: op for op in prog.ops}
    _require(len({p.name for p in plans.plans}) == len(plans.plans), f"{name}: plan names must differ")
    for plan in plans.plans:
        where = f"{name} plan {plan.name}"
        buffers = {b.value for b in plan.buffers}
        stored: set[str] = set()
        scans = [k for k in plan.kernels if k.kind == "scan"]
        _require(len(scans) == 1, f"{where}: exactly one scan kernel")
        _require(prog.output("state") in scans[0].computes, f"{where}: the scan computes the exit state")
        for role, value in prog.results:
            _require(sum(value in k.computes for k in plan.kernels) >= 1, f"{where}: no kernel computes {role}")
        for kernel in plan.kernels:
            for value in kernel.loads:
                _require(value in stored, f"{where}: kernel {kernel.name} reads {value} before any kernel stores it")
            available = set(kernel.loads)
            for value in kernel.computes:
                missing = [a for a in ops[value].args() if a not in available]
                _require(not missing, f"{where}: kernel {kernel.name} computes {value} without {missing}")
                available.add(value)
                if isinstance(ops[value], UnitLowerInverse):
                    _require(ops[value].a in buffers and value in buffers, f"{where}: a solve works from memory")
            for value in kernel.stores:
                _require(value in available and value in buffers, f"{where}: kernel {kernel.name} stores {value} it lacks")
            stored |= set(kernel.stores)
        _require(buffers == stored, f"{where}: buffers {sorted(buffers)} but kernels store {sorted(stored)}")
        if plan.output_at_multiple:  # rule 6: one chunk kernel after the scan, reading its entry states
            _require(plan.kernels[-1].kind == "chunk" and plan.kernels[-2] is scans[0]
                     and prog.state_in in plan.kernels[-1].loads,
                     f"{where}: an output kernel at a multiple of the scan's chunk size must follow the scan and read its entry states")


@verifies(BackwardPlan)
def verify_backward_plan(item: BackwardPlan) -> None:
    verify_chunk_plans(item.forward)
    verify_chunk_plans(item.backward)
    name = item.forward.graph.program.recurrence.name
    _require(item.backward.graph.program.direction == "backward", f"{name}: the backward plans must plan a backward program")
    for policy in item.policies:
        for plan in item.forward.plans:
            kept, rerun = set(policy.kept_by(plan.name)), policy.rerun_by(plan.name)
            produced = set(kept)
            for kernel in plan.kernels:
                if kernel.name not in rerun:
                    continue
                missing = [v for v in kernel.loads if v not in produced]
                _require(not missing, f"{name} policy {policy.name}: re-run {kernel.name} lacks {missing}")
                produced |= set(kernel.stores)
            lacking = [v for v in item.reads if v not in produced]
            _require(not lacking, f"{name} policy {policy.name}, plan {plan.name}: the backward lacks {lacking}")
            # resumed states: the entry states of a scan the backward re-runs, which the forward stores
            scans = [k for k in plan.kernels if k.kind == "scan" and k.name in rerun]
            for state in policy.resumed_by(plan.name):
                _require(state == item.forward.graph.program.state_in and any(state in k.stores for k in scans),
                         f"{name} policy {policy.name}, plan {plan.name}: {state} is not the entry state a re-run scan stores")
