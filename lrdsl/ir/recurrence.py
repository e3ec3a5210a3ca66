"""Recurrence IR: the strict, canonical description of one token mixer.

Per value head the state S is K x V. With q_t, k_t in R^K and v_t in R^V (docs/design.md §1):

    decay   S' = D_t S_{t-1}        D_t from the gate kind and the log-decay formula
    delta   u_t = beta_t (x_t - S'^T r_t),  S_t = S' + k_t u_t^T
            (r_t, the read vector, defaults to k_t; x_t, the written value, to v_t)
    plain   S_t = S' + k_t (beta_t v_t)^T
    dplr    S_t = S' + b_t (a_t^T S_{t-1}) + k_t (beta_t v_t)^T     (diagonal plus low rank:
            S_t = (D_t + b_t a_t^T) S_{t-1} + k_t (beta_t v_t)^T; a_t, b_t K-vectors from formulas)
    output  o_t = scale * S_t^T q_t

The delta rule is the dplr update with b_t = k_t, a_t = -beta_t D_t r_t and the write beta_t k_t x_t^T.

With steps_per_token = n > 1 (Gated DeltaProduct) token t decays once, then takes n update steps
j = 0 .. n-1, each with its own k, v and step inputs, and is read once after the last:
q [B, T, H, K], k [B, T*n, H, K], v [B, T*n, HV, V], o [B, T, HV, V] (step j of token t is row t*n + j).

q, k, v are implicit inputs; `inputs` lists the spec's further inputs in positional order.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import sympy

from .formula import HEAD_INDEX, symbols_of


class GateKind(str, Enum):
    NONE = "none"  # D_t = 1
    SCALAR = "scalar"  # D_t = exp(g_t), one g per token and value head
    KEY_CHANNEL = "key_channel"  # D_t = Diag(exp(g_t)), g_t in R^K
    CONSTANT = "constant"  # D_t = exp(c_h), one constant per value head


class UpdateRule(str, Enum):
    DELTA = "delta"
    PLAIN = "plain"
    DPLR = "dplr"  # diagonal plus low rank: the state read by a_t is written along b_t


class InputRole(str, Enum):
    TOKEN = "token"  # [B, T, HV]
    TOKEN_KEY = "token_key"  # [B, T, HV, K]
    HEAD = "head"  # [HV]
    HEAD_KEY = "head_key"  # [HV, K]
    TOKEN_VALUE = "token_value"  # [B, T, HV, V]

    @property
    def shape(self) -> tuple[str, ...]:
        return ROLE_SHAPES[self]

    @property
    def per_token(self) -> bool:
        return self in (InputRole.TOKEN, InputRole.TOKEN_KEY, InputRole.TOKEN_VALUE)

    @property
    def per_key_channel(self) -> bool:
        return self in (InputRole.TOKEN_KEY, InputRole.HEAD_KEY)

    @property
    def per_value_channel(self) -> bool:
        return self is InputRole.TOKEN_VALUE


ROLE_SHAPES = {
    InputRole.TOKEN: ("B", "T", "HV"),
    InputRole.TOKEN_KEY: ("B", "T", "HV", "K"),
    InputRole.HEAD: ("HV",),
    InputRole.HEAD_KEY: ("HV", "K"),
    InputRole.TOKEN_VALUE: ("B", "T", "HV", "V"),
}

# q, k, v are part of every recurrence; their shapes are fixed by the contract.
QKV_SHAPES = {"q": ("B", "T", "H", "K"), "k": ("B", "T", "H", "K"), "v": ("B", "T", "HV", "V")}
# The token vectors the delta update's formulas may read by name besides the inputs: k in
# delta_read (a K-vector per token), v in write_value (a V-vector per token).
TOKEN_VECTORS = ("k", "v")


@dataclass(frozen=True)
class Input:
    name: str
    role: InputRole


@dataclass(frozen=True)
class Recurrence:
    name: str
    update: UpdateRule
    gate: GateKind
    log_decay: sympy.Expr | None  # natural-log decay; None exactly when gate is NONE
    beta: sympy.Expr | None  # write strength; None means beta = 1
    inputs: tuple[Input, ...]  # positional inputs after q, k, v
    summary: str = ""
    # dplr only: the low-rank term b_t (a_t^T S_{t-1}), a_t and b_t K-vectors (per key channel)
    low_rank_read: sympy.Expr | None = None  # a_t
    low_rank_write: sympy.Expr | None = None  # b_t
    # delta only: u_t = beta_t (x_t - S'^T r_t); None means r_t = k_t, x_t = v_t
    delta_read: sympy.Expr | None = None  # r_t, a K-vector
    write_value: sympy.Expr | None = None  # x_t, a V-vector
    steps_per_token: int = 1  # update steps per token, after one decay (Gated DeltaProduct's n)

    @property
    def is_delta(self) -> bool:
        return self.update is UpdateRule.DELTA

    @property
    def has_low_rank(self) -> bool:
        return self.update is UpdateRule.DPLR

    @property
    def formulas(self) -> tuple[sympy.Expr, ...]:
        """Every formula of the recurrence that is present."""
        exprs = (self.log_decay, self.beta, self.low_rank_read, self.low_rank_write, self.delta_read, self.write_value)
        return tuple(e for e in exprs if e is not None)

    @property
    def has_gate(self) -> bool:
        return self.gate is not GateKind.NONE

    @property
    def has_beta(self) -> bool:
        return self.beta is not None

    def input(self, name: str) -> Input:
        for inp in self.inputs:
            if inp.name == name:
                return inp
        raise KeyError(name)

    @property
    def token_inputs(self) -> tuple[Input, ...]:
        return tuple(i for i in self.inputs if i.role.per_token)

    @property
    def head_inputs(self) -> tuple[Input, ...]:
        return tuple(i for i in self.inputs if not i.role.per_token)

    def formula_inputs(self, expr: sympy.Expr | None) -> tuple[Input, ...]:
        """The declared inputs a formula reads, in positional order."""
        if expr is None:
            return ()
        used = symbols_of(expr)
        return tuple(i for i in self.inputs if i.name in used)

    def rows_per_token(self, inp: Input) -> int:
        """How many rows per token a per-token input holds: the gate's inputs one (a token decays
        once), the other formulas' (beta, the low-rank vectors, the delta rule's read vector and written
        value) steps_per_token, one per step."""
        gate = {i.name for i in self.formula_inputs(self.log_decay)}
        return 1 if inp.name in gate else self.steps_per_token

    def uses_head_index(self, expr: sympy.Expr | None) -> bool:
        return expr is not None and HEAD_INDEX in expr.free_symbols

    def reads_token_vector(self, expr: sympy.Expr | None, name: str) -> bool:
        """Whether a formula reads k or v (TOKEN_VECTORS) by name."""
        return expr is not None and name in symbols_of(expr)

    def is_per_token(self, expr: sympy.Expr | None) -> bool:
        return any(i.role.per_token for i in self.formula_inputs(expr)) or any(
            self.reads_token_vector(expr, name) for name in TOKEN_VECTORS
        )

    def is_per_key_channel(self, expr: sympy.Expr | None) -> bool:
        return any(i.role.per_key_channel for i in self.formula_inputs(expr)) or self.reads_token_vector(expr, "k")

    def is_per_value_channel(self, expr: sympy.Expr | None) -> bool:
        return any(i.role.per_value_channel for i in self.formula_inputs(expr)) or self.reads_token_vector(expr, "v")

    def describe(self) -> str:
        """One canonical text form: what `lrdsl show --stage recurrence` prints."""
        lines = [f"recurrence {self.name}"]
        if self.summary:
            lines.append(f"  summary   {self.summary}")
        lines.append(f"  update    {self.update.value}")
        lines.append(f"  gate      {self.gate.value}")
        n = self.steps_per_token
        rows = "T" if n == 1 else f"T*{n}"
        signature = ["q[B,T,H,K]", f"k[B,{rows},H,K]", f"v[B,{rows},HV,V]"]
        signature += [f"{i.name}[{','.join(self._shape_text(i))}]" for i in self.inputs]
        lines.append(f"  inputs    {', '.join(signature)}")
        lines.append(f"  log_decay {self.log_decay if self.log_decay is not None else '0 (no decay)'}")
        lines.append(f"  beta      {self.beta if self.beta is not None else '1'}")
        if n > 1:
            lines.append(f"  steps     {n} per token (one decay, {n} update steps, one read-out)")
        if self.has_low_rank:
            lines.append(f"  low_rank  b_t (a_t^T S_(t-1)),  a_t = {self.low_rank_read},  b_t = {self.low_rank_write}")
        if self.delta_read is not None:
            lines.append(f"  read      r_t = {self.delta_read}   (u_t = beta_t (x_t - S'^T r_t))")
        if self.write_value is not None:
            lines.append(f"  write     x_t = {self.write_value}")
        return "\n".join(lines)

    def _shape_text(self, inp: Input) -> tuple[str, ...]:
        rows = self.rows_per_token(inp)
        return tuple(f"T*{rows}" if d == "T" and rows > 1 else d for d in inp.role.shape)

    def fingerprint(self) -> str:
        """Exact text identity of this IR (formulas as sympy trees), for cache keys."""
        return "\n".join(
            [self.describe(), sympy.srepr(self.log_decay), sympy.srepr(self.beta), sympy.srepr(self.low_rank_read),
             sympy.srepr(self.low_rank_write), sympy.srepr(self.delta_read), sympy.srepr(self.write_value)]
        )
