"""Symbolic proof that a derived chunk program equals the unrolled recurrence.

For tiny sizes (C = 2 and 3, K = V = 2) every input is a sympy symbol: q, k, v entries, the raw
inputs of the gate and beta formulas, the entry state H and the scale. The chunk program is
evaluated on sympy matrices (lrdsl.ir.evaluate) and the recurrence is unrolled token by token
from the recurrence IR; each entry of O and of the exit state must agree exactly. A tail case
(C = 3 with 2 rows in the sequence) checks the padding rules of the last chunk.

`lrdsl check SPEC --prove` and the tests run it for every spec.
"""
from __future__ import annotations

from dataclasses import dataclass

import sympy

from .ir.chunk import SAVED, ChunkProgram, Load
from .ir.evaluate import evaluate_sympy
from .ir.formula import HEAD_INDEX
from .ir.recurrence import GateKind, InputRole

CASES = ((2, 2), (3, 3), (3, 2))  # (C, rows in the sequence)


@dataclass(frozen=True)
class ProofResult:
    C: int
    rows: int
    entries: int  # how many scalar identities were checked
    failures: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not self.failures


def _matrix(name: str, rows: int, cols: int) -> sympy.Matrix:
    return sympy.Matrix(rows, cols, lambda i, j: sympy.Symbol(f"{name}_{i}{j}", real=True))


def _is_zero(expr) -> bool:
    expr = sympy.expand(sympy.sympify(expr).rewrite(sympy.exp))
    if expr == 0:
        return True
    return sympy.simplify(expr) == 0


def prove_case(prog: ChunkProgram, C: int, rows: int, K: int = 2, V: int = 2) -> ProofResult:
    rec = prog.recurrence
    q, k, v = _matrix("q", C, K), _matrix("k", C, K), _matrix("v", C, V)
    # rows past the sequence end are loaded as 0, as the kernels do
    for x in (q, k, v):
        for i in range(rows, C):
            x[i, :] = sympy.zeros(1, x.cols)
    H = _matrix("H", K, V)
    scale = sympy.Symbol("scale", positive=True)
    raw = {}
    for inp in rec.inputs:
        if inp.role is InputRole.TOKEN:
            raw[inp.name] = sympy.Matrix(C, 1, lambda i, j: sympy.Symbol(f"{inp.name}_{i}", real=True) if i < rows else 0)
        elif inp.role is InputRole.HEAD:
            raw[inp.name] = sympy.Symbol(inp.name, real=True)
        else:
            raise ValueError(f"{rec.name}: the proof handles per-token and per-head scalar inputs only")
    head = sympy.Symbol("h", nonnegative=True, integer=True)

    env = {prog.state_in: H}
    for op in prog.ops:
        if not isinstance(op, Load):
            continue
        env[op.out] = {"q": q, "k": k, "v": v, "scale": scale, str(HEAD_INDEX): head}.get(op.source, raw.get(op.source))
    out = evaluate_sympy(prog, env, {"C": C, "K": K, "V": V}, valid_rows=rows)
    O, H_next = out[prog.output("o")], out[prog.output("state")]

    # the recurrence, token by token (DESIGN.md section 1)
    S = H
    expected_rows = []
    for t in range(rows):
        values = {sympy.Symbol(name): (x[t, 0] if isinstance(x, sympy.MatrixBase) else x) for name, x in raw.items()}
        values[HEAD_INDEX] = head
        if rec.gate is not GateKind.NONE:
            S = sympy.exp(rec.log_decay.subs(values, simultaneous=True)) * S
        if rec.is_delta:
            u = v[t, :] - (S.T * k[t, :].T).T
        else:
            u = v[t, :]
        if rec.has_beta:
            u = rec.beta.subs(values, simultaneous=True) * u
        S = S + k[t, :].T * u
        expected_rows.append((scale * S.T * q[t, :].T).T)

    failures = []
    entries = 0
    for t in range(rows):
        for j in range(V):
            entries += 1
            if not _is_zero(O[t, j] - expected_rows[t][0, j]):
                failures.append(f"O[{t},{j}]")
    for i in range(K):
        for j in range(V):
            entries += 1
            if not _is_zero(H_next[i, j] - S[i, j]):
                failures.append(f"state[{i},{j}]")
    return ProofResult(C, rows, entries, tuple(failures))


def prove(prog: ChunkProgram) -> list[ProofResult]:
    return [prove_case(prog, C, rows) for C, rows in CASES]


# -- the backward --------------------------------------------------------------------------------


def prove_backward_case(forward: ChunkProgram, backward: ChunkProgram, C: int, rows: int, K: int = 2, V: int = 2) -> ProofResult:
    """The backward program's gradients equal sympy.diff of the unrolled recurrence.

    The loss is L = sum(dO * O) + sum(dH' * H') with symbolic cotangents dO and dH'; each input
    entry's derivative of L, taken symbolically from the token-by-token recurrence, must equal
    the backward program's output for it (and dH for the entry state).
    """
    rec = forward.recurrence
    q, k, v = _matrix("q", C, K), _matrix("k", C, K), _matrix("v", C, V)
    for x in (q, k, v):
        for i in range(rows, C):
            x[i, :] = sympy.zeros(1, x.cols)
    H = _matrix("H", K, V)
    scale = sympy.Rational(1, 2)
    raw = {}
    for inp in rec.inputs:
        if inp.role is InputRole.TOKEN:
            raw[inp.name] = sympy.Matrix(C, 1, lambda i, j: sympy.Symbol(f"{inp.name}_{i}", real=True) if i < rows else 0)
        elif inp.role is InputRole.HEAD:
            raw[inp.name] = sympy.Symbol(inp.name, real=True)
        else:
            raise ValueError(f"{rec.name}: the proof handles per-token and per-head scalar inputs only")
    head = sympy.Symbol("h", nonnegative=True, integer=True)
    dO = _matrix("dO", C, V)
    for i in range(rows, C):
        dO[i, :] = sympy.zeros(1, V)
    dH_next = _matrix("dHn", K, V)
    sources = {"q": q, "k": k, "v": v, "scale": scale, str(HEAD_INDEX): head, "dO": dO, **raw}

    env = {forward.state_in: H}
    for op in forward.ops:
        if isinstance(op, Load):
            env[op.out] = sources[op.source]
    sizes = {"C": C, "K": K, "V": V}
    fwd = evaluate_sympy(forward, env, sizes, valid_rows=rows)
    benv = {backward.state_in: dH_next}
    for op in backward.ops:
        if isinstance(op, Load):
            benv[op.out] = fwd[op.source[len(SAVED):]] if op.source.startswith(SAVED) else sources[op.source]
    bwd = evaluate_sympy(backward, benv, sizes, valid_rows=rows)

    # the loss from the unrolled recurrence
    S = H
    loss = 0
    for t in range(rows):
        values = {sympy.Symbol(name): (x[t, 0] if isinstance(x, sympy.MatrixBase) else x) for name, x in raw.items()}
        values[HEAD_INDEX] = head
        if rec.gate is not GateKind.NONE:
            S = sympy.exp(rec.log_decay.subs(values, simultaneous=True)) * S
        u = v[t, :] - (S.T * k[t, :].T).T if rec.is_delta else v[t, :]
        if rec.has_beta:
            u = rec.beta.subs(values, simultaneous=True) * u
        S = S + k[t, :].T * u
        o_t = (scale * S.T * q[t, :].T).T
        loss += sum(o_t[0, j] * dO[t, j] for j in range(V))
    loss += sum(S[i, j] * dH_next[i, j] for i in range(K) for j in range(V))

    failures = []
    entries = 0
    for role, value in backward.outputs:
        target = H if role == "state" else sources[role[len("grad:"):]]
        got = bwd[value]
        if not isinstance(target, sympy.MatrixBase):
            target, got = sympy.Matrix([[target]]), sympy.Matrix([[got]]) if not isinstance(got, sympy.MatrixBase) else got
        for i in range(target.rows):
            for j in range(target.cols):
                symbol = target[i, j]
                if not isinstance(symbol, sympy.Symbol):
                    continue  # a padded row: no input there
                entries += 1
                expected = sympy.diff(loss, symbol)
                if not _is_zero(got[i, j] - expected):
                    failures.append(f"{role}[{i},{j}]")
    return ProofResult(C, rows, entries, tuple(failures))


def prove_backward(forward: ChunkProgram, backward: ChunkProgram) -> list[ProofResult]:
    return [prove_backward_case(forward, backward, C, rows) for C, rows in ((2, 2), (3, 2))]
