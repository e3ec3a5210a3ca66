"""Symbolic proof that a derived chunk program equals the unrolled recurrence.

For tiny sizes (C = 2 and 3, K = V = 2) every input is a sympy symbol: q, k, v entries, the raw
inputs of the gate and beta formulas (per token, head and key channel), the entry state H and
the scale. The chunk program is
evaluated on sympy matrices (lrdsl.ir.evaluate) and the recurrence is unrolled token by token
from the recurrence IR; each entry of O and of the exit state must agree exactly. A tail case
(C = 3 with 2 rows in the sequence) checks the padding rules of the last chunk.

`lrdsl check SPEC --prove` and the tests run it for every spec.
"""
from __future__ import annotations

from dataclasses import dataclass

import sympy

from ..ir.chunk import SAVED, ChunkProgram, Load
from ..ir.evaluate import evaluate_sympy
from ..ir.formula import HEAD_INDEX
from ..ir.recurrence import GateKind, InputRole

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


class SymbolicChunk:
    """One chunk's inputs as symbols: q, k, v (rows past the sequence end are 0, as the kernels
    load them), the spec's per-token and per-head inputs, the entry state H, scale and h."""

    def __init__(self, rec, C: int, rows: int, K: int, V: int, scale=None):
        self.rec, self.C, self.rows, self.K, self.V = rec, C, rows, K, V
        self.q, self.k, self.v = _matrix("q", C, K), _matrix("k", C, K), _matrix("v", C, V)
        for x in (self.q, self.k, self.v):
            for i in range(rows, C):
                x[i, :] = sympy.zeros(1, x.cols)
        self.H = _matrix("H", K, V)
        self.scale = sympy.Symbol("scale", positive=True) if scale is None else scale
        self.head = sympy.Symbol("h", nonnegative=True, integer=True)
        self.raw = {}
        for inp in rec.inputs:
            if inp.role is InputRole.TOKEN:
                self.raw[inp.name] = sympy.Matrix(
                    C, 1, lambda i, j, n=inp.name: sympy.Symbol(f"{n}_{i}", real=True) if i < rows else 0
                )
            elif inp.role in (InputRole.TOKEN_KEY, InputRole.TOKEN_VALUE):
                width = K if inp.role is InputRole.TOKEN_KEY else V
                self.raw[inp.name] = sympy.Matrix(
                    C, width, lambda i, j, n=inp.name: sympy.Symbol(f"{n}_{i}{j}", real=True) if i < rows else 0
                )
            elif inp.role is InputRole.HEAD_KEY:
                self.raw[inp.name] = sympy.Matrix(1, K, lambda i, j, n=inp.name: sympy.Symbol(f"{n}_{j}", real=True))
            else:
                self.raw[inp.name] = sympy.Symbol(inp.name, real=True)

    @property
    def sizes(self) -> dict:
        return {"C": self.C, "K": self.K, "V": self.V}

    def sources(self) -> dict:
        """Load source -> value."""
        return {"q": self.q, "k": self.k, "v": self.v, "scale": self.scale, str(HEAD_INDEX): self.head, **self.raw}

    def evaluate(self, prog: ChunkProgram, state, extra_sources=None, saved=None) -> dict:
        sources = {**self.sources(), **(extra_sources or {})}
        env = {prog.state_in: state}
        for op in prog.ops:
            if isinstance(op, Load):
                env[op.out] = saved[op.source[len(SAVED):]] if op.source.startswith(SAVED) else sources[op.source]
        return evaluate_sympy(prog, env, self.sizes, valid_rows=self.rows)

    def values_at(self, t: int, channel: int = 0) -> dict:
        """Formula symbol -> its value at row t (and key channel `channel` for per-channel inputs,
        or value channel `channel` for token_value inputs and v: a formula reads one kind)."""
        roles = {i.name: i.role for i in self.rec.inputs}
        values = {HEAD_INDEX: self.head}
        values[sympy.Symbol("k")] = self.k[t, min(channel, self.K - 1)]
        values[sympy.Symbol("v")] = self.v[t, min(channel, self.V - 1)]
        for name, x in self.raw.items():
            role = roles[name]
            if role is InputRole.TOKEN:
                values[sympy.Symbol(name)] = x[t, 0]
            elif role in (InputRole.TOKEN_KEY, InputRole.TOKEN_VALUE):
                values[sympy.Symbol(name)] = x[t, min(channel, x.cols - 1)]
            elif role is InputRole.HEAD_KEY:
                values[sympy.Symbol(name)] = x[0, channel]
            else:
                values[sympy.Symbol(name)] = x
        return values

    def vector_at(self, expr, t: int) -> sympy.Matrix:
        """A per-key-channel formula at row t, as a K x 1 column."""
        return sympy.Matrix(self.K, 1, lambda c, _: expr.subs(self.values_at(t, c), simultaneous=True))

    def value_vector_at(self, expr, t: int) -> sympy.Matrix:
        """A per-value-channel formula (of v and token_value inputs) at row t, as a 1 x V row."""
        return sympy.Matrix(1, self.V, lambda _, j: expr.subs(self.values_at(t, j), simultaneous=True))

    def unrolled(self):
        """The recurrence token by token (docs/design.md §1): (output rows, final state)."""
        rec, S, outputs = self.rec, self.H, []
        for t in range(self.rows):
            values = self.values_at(t)
            S_before = S
            if rec.gate is GateKind.KEY_CHANNEL:  # Diag(exp(g_t)) S: row c of the state decays by channel c
                decay = [sympy.exp(rec.log_decay.subs(self.values_at(t, c), simultaneous=True)) for c in range(self.K)]
                S = sympy.diag(*decay) * S
            elif rec.gate is not GateKind.NONE:
                S = sympy.exp(rec.log_decay.subs(values, simultaneous=True)) * S
            if rec.is_delta:  # u_t = x_t - S'^T r_t (r_t = k_t, x_t = v_t unless the spec says otherwise)
                r = self.k[t, :].T if rec.delta_read is None else self.vector_at(rec.delta_read, t)
                x = self.v[t, :] if rec.write_value is None else self.value_vector_at(rec.write_value, t)
                u = x - (S.T * r).T
            else:
                u = self.v[t, :]
            if rec.has_beta:
                u = rec.beta.subs(values, simultaneous=True) * u
            S = S + self.k[t, :].T * u
            if rec.has_low_rank:  # + b_t (a_t^T S_{t-1})
                a, b = (self.vector_at(e, t) for e in (rec.low_rank_read, rec.low_rank_write))
                S = S + b * (a.T * S_before)
            outputs.append((self.scale * S.T * self.q[t, :].T).T)
        return outputs, S


def prove_case(prog: ChunkProgram, C: int, rows: int, K: int = 2, V: int = 2) -> ProofResult:
    chunk = SymbolicChunk(prog.recurrence, C, rows, K, V)
    out = chunk.evaluate(prog, chunk.H)
    O, H_next = out[prog.output("o")], out[prog.output("state")]
    expected_rows, S = chunk.unrolled()
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
    chunk = SymbolicChunk(forward.recurrence, C, rows, K, V, scale=sympy.Rational(1, 2))
    dO = _matrix("dO", C, V)
    for i in range(rows, C):
        dO[i, :] = sympy.zeros(1, V)
    dH_next = _matrix("dHn", K, V)
    saved = chunk.evaluate(forward, chunk.H)
    grads = chunk.evaluate(backward, dH_next, extra_sources={"dO": dO}, saved=saved)

    outputs, S = chunk.unrolled()
    loss = sum(outputs[t][0, j] * dO[t, j] for t in range(rows) for j in range(V))
    loss += sum(S[i, j] * dH_next[i, j] for i in range(K) for j in range(V))

    failures = []
    entries = 0
    sources = chunk.sources()
    for role, value in backward.outputs:
        target = chunk.H if role == "state" else sources[role[len("grad:"):]]
        got = grads[value]
        if not isinstance(target, sympy.MatrixBase):
            target, got = sympy.Matrix([[target]]), sympy.Matrix([[got]])
        for i in range(target.rows):
            for j in range(target.cols):
                symbol = target[i, j]
                if not isinstance(symbol, sympy.Symbol):
                    continue  # a padded row: no input there
                entries += 1
                if not _is_zero(got[i, j] - sympy.diff(loss, symbol)):
                    failures.append(f"{role}[{i},{j}]")
    return ProofResult(C, rows, entries, tuple(failures))


def prove_backward(forward: ChunkProgram, backward: ChunkProgram) -> list[ProofResult]:
    return [prove_backward_case(forward, backward, C, rows) for C, rows in ((2, 2), (3, 2))]
