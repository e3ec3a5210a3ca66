"""canonicalize: Spec (forgiving, user-facing) -> Recurrence IR (strict, canonical).

Checks that the declared pieces make one sensible recurrence; each problem is a SpecError naming
the key and line. After this pass nothing downstream needs to look at the spec again.
"""
from __future__ import annotations

import sympy

from ..ir.formula import HEAD_INDEX, as_real, constant_beyond_float32, non_real_powers
from ..ir.recurrence import GateKind, Input, InputRole, Recurrence, UpdateRule
from ..spec import Spec


def canonicalize(spec: Spec) -> Recurrence:
    inputs = tuple(Input(name, role) for name, role in spec.inputs)
    roles = {i.name: i.role for i in inputs}
    log_decay = spec.formulas.get("log_decay")
    beta = spec.formulas.get("beta")
    low_rank = [spec.formulas.get(key) for key in ("low_rank_read", "low_rank_write")]
    delta_read, write_value = spec.formulas.get("delta_read"), spec.formulas.get("write_value")

    def reads(formula, predicate) -> list[str]:
        return sorted(str(s) for s in formula.expr.free_symbols if str(s) in roles and predicate(roles[str(s)]))

    _check_token_vectors(spec, roles, reads)

    if spec.gate is GateKind.NONE and log_decay is not None:
        raise spec.error("formulas.log_decay", "given, but recurrence.gate = 'none' has no decay; remove it or set a gate")
    if spec.gate is not GateKind.NONE and log_decay is None:
        raise spec.error(
            "recurrence.gate", f"gate = '{spec.gate.value}' needs formulas.log_decay (the natural-log decay)"
        )

    if log_decay is not None:
        per_token = reads(log_decay, lambda r: r.per_token)
        per_key = reads(log_decay, lambda r: r.per_key_channel)
        if spec.gate is GateKind.CONSTANT and per_token:
            raise spec.error(
                "formulas.log_decay",
                f"gate = 'constant' takes a formula of h and per-head inputs, but it reads per-token input {per_token[0]!r}",
            )
        if spec.gate is GateKind.CONSTANT and per_key:
            raise spec.error(
                "formulas.log_decay",
                f"gate = 'constant' is one decay per value head, but it reads per-key-channel input {per_key[0]!r}",
            )
        if spec.gate in (GateKind.SCALAR, GateKind.KEY_CHANNEL) and not per_token:
            raise spec.error(
                "formulas.log_decay",
                f"gate = '{spec.gate.value}' needs a decay per token, but the formula reads no per-token input "
                "(a decay fixed per head is gate = 'constant')",
            )
        if spec.gate is GateKind.SCALAR and per_key:
            raise spec.error(
                "formulas.log_decay",
                f"gate = 'scalar' is one decay per token and head, but it reads per-key-channel input {per_key[0]!r} "
                "(that is gate = 'key_channel')",
            )
        if spec.gate is GateKind.KEY_CHANNEL and not per_key:
            raise spec.error(
                "formulas.log_decay",
                "gate = 'key_channel' needs a decay per key channel, but the formula reads no token_key/head_key input",
            )
        if spec.gate is not GateKind.CONSTANT and HEAD_INDEX in log_decay.expr.free_symbols:
            raise spec.error("formulas.log_decay", "the head index h may only appear in a constant gate's formula")

    if beta is not None:
        per_key = reads(beta, lambda r: r.per_key_channel)
        if per_key:
            raise spec.error(
                "formulas.beta", f"beta is one number per token and head, but it reads per-key-channel input {per_key[0]!r}"
            )
        if HEAD_INDEX in beta.expr.free_symbols:
            raise spec.error("formulas.beta", "the head index h may only appear in a constant gate's formula")

    if spec.update is UpdateRule.DPLR:
        _check_low_rank(spec, low_rank, reads)
    else:
        for formula in low_rank:
            if formula is not None:
                raise spec.error(
                    f"formulas.{formula.key}",
                    f"given, but update = '{spec.update.value}' has no low-rank term (that is update = 'dplr')",
                )

    _check_delta_vectors(spec, delta_read, write_value, reads)

    formulas = [f for f in (log_decay, beta, *low_rank, delta_read, write_value) if f is not None]
    for formula in formulas:
        powers = non_real_powers(formula.expr)
        if powers:
            raise spec.error(
                f"formulas.{formula.key}",
                f"{powers[0]} raises a base that may be negative to a non-integer power, which has no real value "
                "there; use a base that cannot be negative (e.g. exp(x), sigmoid(x), softplus(x), x**2 + c)",
            )
        constant = constant_beyond_float32(formula.expr)
        if constant is not None:
            raise spec.error(
                f"formulas.{formula.key}",
                f"{formula.text!r} is the constant {constant:.3g}, which float32 cannot hold (nonzero magnitudes "
                "1.2e-38 to 3.4e38): the kernels would compute " + ("inf" if abs(constant) > 1 else "0"),
            )
    if log_decay is not None and _never_negative(log_decay.expr):
        raise spec.error(
            "formulas.log_decay",
            f"{log_decay.text!r} is never negative (and not always 0): the decay exp(g) >= 1 would grow the state "
            "(the log-decay must be <= 0)",
        )

    if spec.steps_per_token > 1:
        _check_steps(spec, log_decay, [f for f in formulas if f is not log_decay], reads)

    used = set()
    for formula in formulas:
        used |= {str(s) for s in formula.expr.free_symbols}
    for inp in inputs:
        if inp.name not in used:
            raise spec.error(f"inputs.{inp.name}", "declared but no formula reads it")

    return Recurrence(
        name=spec.name,
        update=UpdateRule(spec.update),
        gate=GateKind(spec.gate),
        log_decay=sympy.sympify(log_decay.expr) if log_decay is not None else None,
        beta=sympy.sympify(beta.expr) if beta is not None else None,
        inputs=inputs,
        summary=spec.summary,
        low_rank_read=sympy.sympify(low_rank[0].expr) if low_rank[0] is not None else None,
        low_rank_write=sympy.sympify(low_rank[1].expr) if low_rank[1] is not None else None,
        delta_read=sympy.sympify(delta_read.expr) if delta_read is not None else None,
        write_value=sympy.sympify(write_value.expr) if write_value is not None else None,
        steps_per_token=spec.steps_per_token,
    )


def _check_steps(spec: Spec, log_decay, step_formulas, reads) -> None:
    """steps_per_token > 1: a token decays once and steps n times, so a per-token input lives at one
    rate, one row per token (read by the gate) or one per step (read by beta or the low-rank
    vectors), never both; a constant gate has no per-token rate to give its decay to step 0."""
    if spec.gate is GateKind.CONSTANT:
        raise spec.error(
            "recurrence.steps_per_token",
            "a constant gate decays at every step, but a token with several steps decays once; "
            "use gate = 'scalar' with a per-token input, or steps_per_token = 1",
        )
    if log_decay is None:
        return
    gate_inputs = set(reads(log_decay, lambda r: r.per_token))
    for formula in step_formulas:
        shared = sorted(gate_inputs & set(reads(formula, lambda r: r.per_token)))
        if shared:
            raise spec.error(
                f"inputs.{shared[0]}",
                f"read by formulas.log_decay (one row per token) and formulas.{formula.key} (one row per step, "
                f"steps_per_token = {spec.steps_per_token}); declare one input for each",
            )


# Which formula may read the token vectors k and v, and token_value inputs: the delta update's
# read vector r_t is per key channel (it may read k), its written value x_t per value channel (it
# may read v and token_value inputs). Everywhere else they have no meaning: a decay or beta per
# value channel does not exist, and a formula of k elsewhere is no recurrence this IR describes.
_READS_K = ("delta_read",)
_READS_V = ("write_value",)


def _check_token_vectors(spec: Spec, roles, reads) -> None:
    for key, formula in spec.formulas.items():
        used = {str(s) for s in formula.expr.free_symbols}
        for name, allowed in (("k", _READS_K), ("v", _READS_V)):
            if name in used and key not in allowed:
                where = " or ".join(f"formulas.{a}" for a in allowed)
                raise spec.error(f"formulas.{key}", f"reads {name}, which only {where} may read")
        per_value = reads(formula, lambda r: r is InputRole.TOKEN_VALUE)
        if per_value and key not in _READS_V:
            raise spec.error(
                f"formulas.{key}",
                f"reads token_value input {per_value[0]!r} (a V-vector per token), which only formulas.write_value may read",
            )


def _check_delta_vectors(spec: Spec, delta_read, write_value, reads) -> None:
    """delta_read and write_value: the delta update's read vector r_t (per key channel) and
    written value x_t (per value channel), u_t = beta_t (x_t - S'^T r_t)."""
    for formula in (delta_read, write_value):
        if formula is None:
            continue
        if spec.update is not UpdateRule.DELTA:
            raise spec.error(
                f"formulas.{formula.key}",
                f"given, but update = '{spec.update.value}' has no delta residual (that is update = 'delta')",
            )
        if HEAD_INDEX in formula.expr.free_symbols:
            raise spec.error(f"formulas.{formula.key}", "the head index h may only appear in a constant gate's formula")
    if delta_read is not None:
        per_key = "k" in {str(s) for s in delta_read.expr.free_symbols} or reads(delta_read, lambda r: r.per_key_channel)
        if not per_key:
            raise spec.error(
                "formulas.delta_read",
                "is a vector per key channel, but the formula reads neither k nor a token_key/head_key input",
            )
    if write_value is not None:
        if "v" not in {str(s) for s in write_value.expr.free_symbols}:
            raise spec.error("formulas.write_value", "is the value written per value channel; it must read v")
        per_key = reads(write_value, lambda r: r.per_key_channel)
        if per_key:
            raise spec.error(
                "formulas.write_value",
                f"is a vector per value channel, but it reads per-key-channel input {per_key[0]!r}",
            )


def _check_low_rank(spec: Spec, low_rank, reads) -> None:
    """dplr: both vectors given, per key channel, and a per-key-channel decay beside them (the
    chunk form decays the low-rank term's rows channel by channel)."""
    for key, formula in zip(("low_rank_read", "low_rank_write"), low_rank):
        if formula is None:
            raise spec.error("recurrence.update", f"update = 'dplr' needs formulas.{key} (a K-vector per token)")
        if not reads(formula, lambda r: r.per_key_channel):
            raise spec.error(
                f"formulas.{key}", "is a vector per key channel, but the formula reads no token_key/head_key input"
            )
        if HEAD_INDEX in formula.expr.free_symbols:
            raise spec.error(f"formulas.{key}", "the head index h may only appear in a constant gate's formula")
    if spec.gate is not GateKind.KEY_CHANNEL:
        raise spec.error(
            "recurrence.gate",
            f"update = 'dplr' takes gate = 'key_channel' (its decay is per key channel), got '{spec.gate.value}'; "
            "a decay per token is a token_key input with one value repeated over the key channels",
        )


def _never_negative(expr) -> bool:
    """Whether sympy can show `expr` >= 0 for every (real) input while not being 0 throughout."""
    known = as_real(expr)
    return known.is_nonnegative is True and known.is_zero is not True
