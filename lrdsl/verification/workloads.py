"""Random inputs for any recurrence, and the error measure every check uses.

Used by `lrdsl check`, `lrdsl demo`, the benchmarks and the tests, so all of them exercise the
kernels on the same kind of data: fresh random tensors, never zeros.
"""
from __future__ import annotations

from dataclasses import dataclass

import sympy
import torch
import torch.nn.functional as F

from ..ir.recurrence import InputRole, Recurrence

TOLERANCE = {torch.float32: 2e-3, torch.float16: 8e-3, torch.bfloat16: 8e-3}


@dataclass(frozen=True)
class Shape:
    B: int
    T: int
    H: int
    HV: int
    K: int
    V: int

    def __str__(self) -> str:
        return f"B={self.B} T={self.T} H={self.H} HV={self.HV} K={self.K} V={self.V}"


def make_inputs(
    rec: Recurrence,
    shape: Shape,
    dtype=torch.float32,
    device="cpu",
    generator: torch.Generator | None = None,
    normalize_keys: bool | None = None,
    gate_low: float = -0.5,
):
    """q, k, v and the spec's inputs, as a list in positional order (with steps_per_token = n,
    k, v and the inputs of the steps hold T * n rows).

    Keys are unit-normalised for delta rules (unless told otherwise) so the recurrence stays
    stable without in-kernel L2 norm. An input that *is* the log-decay (formula `g`) is drawn in
    [gate_low, 0]; one that *is* beta in (0, 1); inputs of other formulas are standard normal.
    A dplr update whose low-rank vectors are inputs themselves gets them as RWKV-7 forms them,
    a = -eta u and b = u for a unit vector u and eta in (0, 1), so that I + b a^T contracts
    (independent normal vectors would grow the state token by token). A delta rule's read vector
    that is an input itself is a unit vector like k, so I - beta k r^T keeps its one eigenvalue
    other than 1 in (-1, 2) instead of drifting with |r|.
    """
    B, T, H, HV, K, V = shape.B, shape.T, shape.H, shape.HV, shape.K, shape.V

    def randn(*size):
        return torch.randn(*size, generator=generator, dtype=torch.float32)

    def rand(*size):
        return torch.rand(*size, generator=generator, dtype=torch.float32)

    if normalize_keys is None:
        normalize_keys = rec.is_delta
    rows = T * rec.steps_per_token  # k, v and the inputs of the steps: one row per step
    q = randn(B, T, H, K)
    k = randn(B, rows, H, K)
    if normalize_keys:
        k = F.normalize(k, dim=-1)
    v = randn(B, rows, HV, V)
    sizes = {"B": B, "HV": HV, "K": K, "V": V}
    pair = _low_rank_pair(rec)
    direction = F.normalize(randn(B, rows, HV, K), dim=-1) if pair else None
    extras = []
    for inp in rec.inputs:
        size = [T * rec.rows_per_token(inp) if d == "T" else sizes[d] for d in inp.role.shape]
        symbol = sympy.Symbol(inp.name)
        if rec.log_decay == symbol:
            x = gate_low * rand(*size)
        elif rec.beta == symbol:
            x = rand(*size)
        elif rec.delta_read == symbol and inp.role is InputRole.TOKEN_KEY:  # a unit vector, like k
            x = F.normalize(randn(*size), dim=-1)
        elif pair and inp.name == pair[0]:  # a = -eta u
            x = -rand(B, rows, HV, 1) * direction
        elif pair and inp.name == pair[1]:  # b = u
            x = direction.clone()
        else:
            x = randn(*size)
        extras.append(x)
    tensors = [q.to(dtype), k.to(dtype), v.to(dtype)]
    # gates and per-head parameters stay fp32, as callers pass them
    tensors += [x if inp.role in (InputRole.HEAD, InputRole.HEAD_KEY) or inp.name in _gate_names(rec) else x.to(dtype)
                for inp, x in zip(rec.inputs, extras)]
    return [t.to(device) for t in tensors]


def _low_rank_pair(rec: Recurrence) -> tuple[str, str] | None:
    """(a, b) input names when the dplr vectors are per-token inputs themselves, else None."""
    names = [str(e) for e in (rec.low_rank_read, rec.low_rank_write) if isinstance(e, sympy.Symbol)]
    if len(names) != 2 or any(rec.input(n).role is not InputRole.TOKEN_KEY for n in names):
        return None
    return names[0], names[1]


def _gate_names(rec: Recurrence) -> set[str]:
    return {i.name for i in rec.formula_inputs(rec.log_decay)}


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; inf when out has NaN or Inf (so it never passes)."""
    out = out.detach().to("cpu", torch.float64)
    ref = ref.detach().to("cpu", torch.float64)
    if not torch.isfinite(out).all():
        return float("inf")
    denominator = ref.norm().item()
    difference = (out - ref).norm().item()
    return difference / denominator if denominator > 0 else difference
