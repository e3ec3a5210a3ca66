"""Rows and the correctness gate: every output against the float64 oracle and against the other
implementations; ratios per peer."""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field, replace

import torch

from ...ir.recurrence import Recurrence
from ...verification.workloads import Shape
from .shapes import DECODE, DECODE_GRAPH, FORWARD_BACKWARD, LRDSL, is_decode, shape_label
from .contenders import Call, Contender, run_mode
from .timing import Measurement, _first_line, held_between_passes


@dataclass(frozen=True)
class BenchRow:
    spec: str
    mode: str  # fwd, fwd+bwd, decode, decode graph
    shape: str  # shape_label
    impl: str  # lrdsl or a peer's column: fla-triton, flashqla (FLA's dispatch), flashqla-direct
    kernel: str
    path: str  # the code that ran: lrdsl, fla-triton, flashqla
    status: str = "ok"  # ok or FAILED
    reason: str = ""  # why FAILED
    ms: float | None = None
    tflops: float | None = None  # training modes
    state_tbps: float | None = None  # decode modes: fp32 state read + written per second
    peak_mib: float | None = None
    kept_mib: float | None = None  # forward + backward on a GPU: what the forward leaves for the backward
    cold_s: float | None = None
    err_vs_oracle: float | None = None  # the worst relative error of any output vs the float64 oracle
    worst_vs_oracle: str = ""  # which output that is
    diff_vs_other: float | None = None  # the worst relative difference from the other side (lrdsl vs peers)
    ratios: dict = field(default_factory=dict)  # lrdsl rows that are ok: {peer: peer ms / this row's ms}, ok peers
    vs_pool: float | None = None  # serving rows: this row's ms / the fp32 pool decode's (same timing kind)
    copy_tbps: float | None = None  # rows with state_tbps, on a GPU: the card's copy bandwidth (read + written)
    of_copy: float | None = None  # state_tbps / copy_tbps

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def relative_error(out: torch.Tensor | None, ref: torch.Tensor | None) -> float:
    """||out - ref|| / ||ref|| in float64 on the tensors' own device (a full-shape gradient is a
    GiB in float64: copying it to the host would cost more than the kernels); inf when out is
    missing or not finite, so it never passes."""
    if out is None or ref is None:
        return math.inf
    out = out.detach().to(torch.float64)
    ref = ref.detach().to(out.device, torch.float64)
    if out.shape != ref.shape or not torch.isfinite(out).all():
        return math.inf
    denominator = ref.norm().item()
    difference = (out - ref).norm().item()
    return difference / denominator if denominator > 0 else difference


def worst_error(outputs: dict, references: dict, prefix=None) -> tuple[float, str]:
    """(worst relative error, its output's name) over the outputs `references` has; with
    `prefix` = (sequences, tokens), o is cut to that prefix first (a full-shape run's o)."""
    errors = {}
    for name, ref in references.items():
        out = outputs.get(name)
        if prefix is not None:
            if name != "o":
                continue
            out, name = out[: prefix[0], : prefix[1]], "o (full run, prefix)"
        errors[name] = relative_error(out, ref)
    worst = max(errors, key=errors.get)
    return errors[worst], worst


def broken_outputs(outputs: dict) -> list[str]:
    """Outputs that are missing (a gradient an implementation did not produce) or not finite."""
    missing = [f"{name} missing" for name, t in outputs.items() if t is None]
    return missing + [f"{name} not finite" for name, t in outputs.items() if t is not None and not torch.isfinite(t).all()]


@dataclass(eq=False)  # compared by identity: fields hold tensors
class _Result:
    """What one contender gave in one group, before the rows are made."""

    contender: Contender
    path: str
    measurement: Measurement | None = None
    error: str = ""  # it raised, or cannot run
    oracle_error: float | None = None
    oracle_worst: str = ""
    kept_mib: float | None = None
    failures: list = field(default_factory=list)


def run_group(spec: str, rec: Recurrence, contenders, call: Call, shape: Shape, mode: str, oracle: dict,
              measure, prefix: tuple[int, int], tolerance: float) -> list[BenchRow]:
    """Every contender in one (spec, shape, mode): measured, gated, then compared with each other."""
    names = ["q", "k", "v"] + [i.name for i in rec.inputs]
    mode_call = call.requiring_grad() if mode == FORWARD_BACKWARD else call
    full = prefix == (shape.B, shape.T)
    prefix_call = None if full else call.prefix(rec, *prefix)
    if prefix_call is not None and mode == FORWARD_BACKWARD:
        prefix_call = prefix_call.requiring_grad()
    # a graph replay runs the eager call's kernels, so the prefix re-run is the eager call
    prefix_mode = DECODE if mode == DECODE_GRAPH else mode
    wanted = {name: ref for name, ref in oracle.items() if mode == FORWARD_BACKWARD or not name.startswith("grad ")}

    results = []
    for contender in contenders:
        result = _Result(contender, path="-")
        results.append(result)
        if contender.problem:
            result.error = contender.problem
            continue
        try:
            with contender.scope():  # every call of it, the backward and the prefix re-run included
                with torch.set_grad_enabled(mode == FORWARD_BACKWARD):  # as its calls run: a backend may care
                    result.path = contender.path(mode_call)
                if contender.expects is not None and result.path != contender.expects:
                    result.error = f"ran {result.path}, not {contender.expects}"
                    continue
                result.measurement = measure(lambda: run_mode(contender, mode_call, mode, names), mode_call.nbytes())
                if mode == FORWARD_BACKWARD and mode_call.tensors[0].is_cuda:
                    result.kept_mib = held_between_passes(lambda: contender.forward(mode_call))
                outputs = result.measurement.outputs
                if full:
                    result.oracle_error, result.oracle_worst = worst_error(outputs, wanted)
                else:
                    prefix_outputs = run_mode(contender, prefix_call, prefix_mode, names)
                    checks = [worst_error(prefix_outputs, wanted), worst_error(outputs, wanted, prefix)]
                    result.oracle_error, result.oracle_worst = max(checks)
        except Exception as exc:  # a refused shape, a crash, an uncapturable call: a FAILED row, not a lost run
            result.measurement = None
            result.error = f"{type(exc).__name__}: {_first_line(exc)}"
            continue
        result.failures += broken_outputs(outputs)
        if result.oracle_error > tolerance:
            result.failures.append(f"{result.oracle_worst} differs from the float64 oracle by {result.oracle_error:.1e}")

    return _rows(spec, shape, mode, results, tolerance)


def _difference(a: _Result, b: _Result) -> float:
    """The worst relative difference between two implementations' outputs (a's names)."""
    return max(relative_error(t, b.measurement.outputs.get(name)) for name, t in a.measurement.outputs.items())


def _rows(spec: str, shape: Shape, mode: str, results: list[_Result], tolerance: float) -> list[BenchRow]:
    """Cross-check the implementations against each other at the full shape, then make the rows.

    Every two rows of different implementations that each pass the oracle are compared (lrdsl's
    rows with each other are not: one compiler). A difference beyond the tolerance fails both,
    since the check alone cannot say which is wrong, unless one of them agrees with a third
    implementation that also differs from the other: then only the odd one out fails. A row that
    already failed fails no other. "vs other" is each lrdsl row's worst difference from the
    peers, and each peer's from lrdsl's rows."""
    measured = [r for r in results if r.measurement is not None]
    passed = [r for r in measured if not r.error and not r.failures]
    diffs = {}
    for a, b in itertools.combinations(measured, 2):
        if a.contender.impl != b.contender.impl:  # each relative to the other's norm
            diffs[(id(a), id(b))], diffs[(id(b), id(a))] = _difference(a, b), _difference(b, a)

    def agree(a, b) -> bool:
        return diffs.get((id(a), id(b)), math.inf) <= tolerance

    for r in passed:
        for other in passed:
            if (id(r), id(other)) not in diffs or agree(r, other):
                continue
            third_sides_with_r = any(t is not r and t is not other and t.contender.impl not in (r.contender.impl, other.contender.impl)
                                     and agree(r, t) and (id(t), id(other)) in diffs and not agree(t, other) for t in passed)
            if not third_sides_with_r:
                r.failures.append(f"differs from {other.contender.impl} {other.contender.kernel} by "
                                  f"{diffs[(id(r), id(other))]:.1e}")

    rows = []
    for r in results:
        m = r.measurement
        reasons = ([r.error] if r.error else []) + r.failures
        counterparts = [o for o in measured if (id(r), id(o)) in diffs and LRDSL in (r.contender.impl, o.contender.impl)]
        rows.append(BenchRow(
            spec=spec, mode=mode, shape=shape_label(shape), impl=r.contender.impl, kernel=r.contender.kernel,
            path=r.path, status="FAILED" if reasons else "ok", reason="; ".join(reasons),
            ms=m.ms if m else None,
            tflops=_tflops(shape, mode, m.ms) if m and not is_decode(shape) else None,
            state_tbps=_state_tbps(shape, m.ms) if m and is_decode(shape) else None,
            peak_mib=m.peak_mib if m else None, kept_mib=r.kept_mib if m else None, cold_s=m.cold_s if m else None,
            err_vs_oracle=r.oracle_error, worst_vs_oracle=r.oracle_worst,
            diff_vs_other=max((diffs[(id(r), id(o))] for o in counterparts), default=None),
        ))
    return with_ratios(rows)


def with_ratios(rows: list[BenchRow]) -> list[BenchRow]:
    """On each lrdsl row that is ok: {peer: peer ms / lrdsl ms} for every peer row of its group
    that is ok (a FAILED peer gets no number)."""
    peers: dict = {}
    for r in rows:
        if r.impl != LRDSL and r.ok:
            peers.setdefault((r.spec, r.shape, r.mode), []).append(r)
    out = []
    for r in rows:
        if r.impl == LRDSL and r.ok:
            r = replace(r, ratios={p.impl: p.ms / r.ms for p in peers.get((r.spec, r.shape, r.mode), ())})
        out.append(r)
    return out


def _tflops(shape: Shape, mode: str, ms: float) -> float:
    flops = 6 * shape.B * shape.T * shape.HV * shape.K * shape.V * (3 if mode == FORWARD_BACKWARD else 1)
    return flops / (ms * 1e-3) / 1e12


def state_bytes(shape: Shape) -> int:
    """The fp32 state read (initial) and written (final) once per decode step."""
    return 2 * shape.B * shape.HV * shape.K * shape.V * 4


def _state_tbps(shape: Shape, ms: float) -> float:
    return state_bytes(shape) / (ms * 1e-3) / 1e12
