"""Step IR: the per-token program of the recurrent (decode) kernel.

One program per value head and block of value columns; the state S (K x V, fp32) lives in
registers across tokens. `prologue` runs once per program (per-head inputs and formulas), `body`
once per token. Every op names the variables it reads and writes so the verifier can check that
each use has a definition before it.

Variables: `q`, `k` are K-vectors, `v`, `p`, `u`, `r`, `o` are V-vectors, `S` is the state; `g_t`
is the log-decay (scalar, or a K-vector for key-channel gates), `beta_t` the write strength,
`a_t`, `b_t` the dplr update's low-rank K-vectors, `r_t` (K) and `x_t` (V) the delta update's
read vector and written value where the spec gives them (else k and v themselves).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import sympy

from .recurrence import InputRole, Recurrence


@dataclass(frozen=True)
class StepOp(ABC):
    def uses(self) -> tuple[str, ...]:
        return ()

    def defines(self) -> tuple[str, ...]:
        return ()

    @abstractmethod
    def describe(self) -> str:
        """One line for `lrdsl show --stage step`."""


@dataclass(frozen=True)
class LoadVector(StepOp):
    """q_t / k_t from key head h // (HV/H), v_t from value head h (a block of V columns)."""

    source: str  # "q", "k" or "v"

    def defines(self):
        return (self.source,)

    def describe(self):
        dim = "V" if self.source == "v" else "K"
        head = "value head" if self.source == "v" else "key head h // (HV/H)"
        return f"load     {self.source}: {dim}  ({head})"


@dataclass(frozen=True)
class LoadInput(StepOp):
    """A declared input: per token inside the body, per head in the prologue."""

    name: str
    role: InputRole

    def defines(self):
        return (self.name,)

    def describe(self):
        shape = "K" if self.role.per_key_channel else "V" if self.role.per_value_channel else "1"
        when = "per token" if self.role.per_token else "per head"
        return f"load     {self.name}: {shape}  ({self.role.value}, {when})"


@dataclass(frozen=True)
class NormalizeL2(StepOp):
    """x <- x / sqrt(sum(x^2) + 1e-6), only when use_qk_l2norm_in_kernel is set."""

    target: str

    def uses(self):
        return (self.target,)

    def defines(self):
        return (self.target,)

    def describe(self):
        return f"l2norm   {self.target} <- {self.target} / sqrt(sum {self.target}^2 + 1e-6)   [if use_qk_l2norm_in_kernel]"


@dataclass(frozen=True)
class Formula(StepOp):
    """target = expr, evaluated elementwise over its inputs (scalar, a K-vector or a V-vector)."""

    target: str  # "g_t", "beta_t", "a_t", "b_t", "r_t" or "x_t"
    expr: sympy.Expr
    per_key: bool
    per_value: bool = False  # a V-vector (write_value): it reads v

    def uses(self):
        return tuple(sorted(str(s) for s in self.expr.free_symbols if str(s) != "h"))

    def defines(self):
        return (self.target,)

    def describe(self):
        shape = "K" if self.per_key else "V" if self.per_value else "1"
        return f"formula  {self.target}: {shape} = {self.expr}"


@dataclass(frozen=True)
class DecayState(StepOp):
    """S <- exp(g_t) * S (scalar gate) or Diag(exp(g_t)) S (key-channel gate)."""

    per_key: bool

    def uses(self):
        return ("S", "g_t")

    def defines(self):
        return ("S",)

    def describe(self):
        return "decay    S <- Diag(exp(g_t)) S" if self.per_key else "decay    S <- exp(g_t) * S"


@dataclass(frozen=True)
class PredictValue(StepOp):
    """p = S^T k: what the state currently recalls for key k (delta rule); with a read vector
    (formulas.delta_read) p = S^T r_t, the state read along r_t instead of k."""

    read: str = "k"  # "k" or "r_t"

    def uses(self):
        return ("S", self.read)

    def defines(self):
        return ("p",)

    def describe(self):
        return f"predict  p = S^T {self.read}"


@dataclass(frozen=True)
class DeltaResidual(StepOp):
    """u = beta_t (v - p); with a written value (formulas.write_value) u = beta_t (x_t - p)."""

    with_beta: bool
    value: str = "v"  # "v" or "x_t"

    def uses(self):
        return (self.value, "p") + (("beta_t",) if self.with_beta else ())

    def defines(self):
        return ("u",)

    def describe(self):
        x = self.value
        return f"residual u = beta_t * ({x} - p)" if self.with_beta else f"residual u = {x} - p"


@dataclass(frozen=True)
class ScaleValue(StepOp):
    """u = beta_t v (plain update)."""

    with_beta: bool

    def uses(self):
        return ("v",) + (("beta_t",) if self.with_beta else ())

    def defines(self):
        return ("u",)

    def describe(self):
        return "value    u = beta_t * v" if self.with_beta else "value    u = v"


@dataclass(frozen=True)
class ReadLowRank(StepOp):
    """r = S^T a_t: what the dplr update's low-rank term reads, from the state before this step's
    decay (so it comes before DecayState)."""

    def uses(self):
        return ("S", "a_t")

    def defines(self):
        return ("r",)

    def describe(self):
        return "read     r = S^T a_t   (before the decay)"


@dataclass(frozen=True)
class WriteLowRank(StepOp):
    """S <- S + b_t r^T."""

    def uses(self):
        return ("S", "b_t", "r")

    def defines(self):
        return ("S",)

    def describe(self):
        return "write    S <- S + b_t r^T"


@dataclass(frozen=True)
class WriteState(StepOp):
    """S <- S + k u^T."""

    def uses(self):
        return ("S", "k", "u")

    def defines(self):
        return ("S",)

    def describe(self):
        return "write    S <- S + k u^T"


@dataclass(frozen=True)
class ReadOutput(StepOp):
    """o = scale * S^T q."""

    def uses(self):
        return ("S", "q")

    def defines(self):
        return ("o",)

    def describe(self):
        return "read     o = scale * S^T q"


@dataclass(frozen=True)
class StoreOutput(StepOp):
    def uses(self):
        return ("o",)

    def describe(self):
        return "store    o"


@dataclass(frozen=True)
class StepProgram:
    recurrence: Recurrence
    prologue: tuple[StepOp, ...]
    body: tuple[StepOp, ...]

    def describe(self) -> str:
        r = self.recurrence
        lines = [
            f"step program {r.name}   (per value head, per token t; state S: K x V fp32, from initial_state or 0)",
            "  prologue (once per program):",
        ]
        lines += [f"    {op.describe()}" for op in self.prologue] or ["    (nothing)"]
        lines.append("  body (each token):")
        lines += [f"    {op.describe()}" for op in self.body]
        lines.append("  epilogue: store S as the final state   [if output_final_state]")
        return "\n".join(lines)
