"""Serving rows: a state pool, verify and commit (lrdsl only)."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from ... import reference
from ...ir.recurrence import Recurrence
from ...verification.workloads import TOLERANCE, Shape, make_inputs
from .shapes import (DECODE, DECODE_GRAPH, DRAFT_TOKENS, GRAPH, LRDSL, POOL, POOL_BF16, POOL_INT8, SERVING_CALLS, VERIFY,
                     VERIFY_COMMIT, shape_label)
from .timing import _first_line
from .gate import BenchRow, broken_outputs, worst_error

if TYPE_CHECKING:  # an annotation only: run imports this module
    from .run import SpecUnderTest


@dataclass(frozen=True)
class ServingCase:
    """The inputs of every serving row at one decode shape, and the oracle's results for them."""

    decode: tuple  # one token per sequence: q, k, v, the spec's inputs
    drafts: tuple  # DRAFT_TOKENS tokens per sequence
    indices: torch.Tensor  # [B] int32: B distinct rows of a pool of 2B, in random order
    accepted: torch.Tensor  # [B] int32 in 0 .. DRAFT_TOKENS, the first DRAFT_TOKENS
    start: dict  # state dtype -> the pool's start [2B, HV, K, V] (bf16: the fp32 start rounded; int8: packed)
    expected: dict  # call -> {output name: the oracle's float64 tensor}


def pool_values(module, pool):
    """A pool's rows as the kernels read them: an 8-bit pool's unpacked, any other's as they are."""
    return module.unpack_states(pool) if pool.dtype == torch.int8 else pool


def make_serving_case(module, rec: Recurrence, shape: Shape, dtype, device, generator) -> ServingCase:
    B, P = shape.B, 2 * shape.B
    decode = tuple(t.to(device) for t in make_inputs(rec, shape, dtype=dtype, generator=generator, normalize_keys=False))
    drafts = tuple(t.to(device) for t in make_inputs(rec, replace(shape, T=DRAFT_TOKENS), dtype=dtype, generator=generator,
                                                     normalize_keys=False))
    indices = torch.randperm(P, generator=generator)[:B].to(device, torch.int32)
    accepted = torch.randint(0, DRAFT_TOKENS + 1, (B,), generator=generator)
    # the first sequence accepts every draft token: with all counts 0 the pool rows would keep
    # their start, and a commit that writes nothing would pass the oracle gate
    accepted[0] = DRAFT_TOKENS
    accepted = accepted.to(device, torch.int32)
    start32 = (torch.randn(P, shape.HV, shape.K, shape.V, generator=generator) * 0.1).to(device)
    start = {torch.float32: start32, torch.bfloat16: start32.to(torch.bfloat16), torch.int8: module.pack_states(start32)}
    options = dict(output_final_state=True, use_qk_l2norm_in_kernel=True)
    expected = {}
    for call in (POOL, POOL_BF16, POOL_INT8):
        h0 = pool_values(module, start[SERVING_CALLS[call][0]]).double()[indices.long()]
        o, final = reference.run(rec, *decode, initial_state=h0, **options)
        expected[call] = {"o": o, "pool rows": final}
    h0 = start32.double()[indices.long()]
    o, _ = reference.run(rec, *drafts, initial_state=h0, **options)
    expected[VERIFY] = {"o": o}
    # commit: each sequence's accepted tokens, packed into one varlen call of the oracle
    counts = accepted.long().cpu()
    per_token = [True] * 3 + [i.role.per_token for i in rec.inputs]
    packed = [torch.cat([x[n, :counts[n]] for n in range(B)])[None] if p else x for x, p in zip(drafts, per_token)]
    bounds = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)])
    _, final = reference.run(rec, *packed, initial_state=h0, cu_seqlens=bounds, **options)
    expected[VERIFY_COMMIT] = {"o": o, "pool rows": final}
    return ServingCase(decode, drafts, indices, accepted, start, expected)


def serving_call(module, case: ServingCase, call: str, pool, validate: bool, buffers: dict):
    """One serving call on `pool`: returns its outputs by name (o; the pool's rows of the batch
    where the call writes the pool). `buffers` holds o's buffer and the Draft, made on the first
    call (a graph replays into them)."""
    common = dict(state_pool=pool, state_indices=case.indices, validate=validate, use_qk_l2norm_in_kernel=True)
    if call in (POOL, POOL_BF16, POOL_INT8):
        o, _ = module.recurrent(*case.decode, out=buffers.get("o"), **common)
        buffers["o"] = o
        return {"o": o}
    o, draft = module.verify(*case.drafts, out=buffers.get("o"), draft=buffers.get("draft"), **common)
    buffers.update(o=o, draft=draft)
    if call == VERIFY_COMMIT:
        module.commit(draft, case.accepted, validate=validate)
    return {"o": o}


def serving_gate(module, case: ServingCase, call: str, tolerance: float) -> tuple[float, str, list[str]]:
    """(worst error vs the oracle, its name, failures) of one call on a fresh pool."""
    state_dtype = SERVING_CALLS[call][0]
    pool = case.start[state_dtype].clone()
    with torch.no_grad():
        outputs = serving_call(module, case, call, pool, validate=True, buffers={})
    if call != VERIFY:
        outputs["pool rows"] = pool_values(module, pool[case.indices.long()])
        others = torch.ones(pool.shape[0], dtype=torch.bool, device=pool.device)
        others[case.indices.long()] = False
        if not torch.equal(pool[others], case.start[state_dtype][others]):
            return math.inf, "pool rows", ["a pool row no sequence uses changed"]
    error, worst = worst_error(outputs, case.expected[call])
    failures = broken_outputs(outputs)
    if state_dtype == torch.bfloat16:  # the rows are rounded to bf16 whatever the inputs' dtype
        tolerance = max(tolerance, TOLERANCE[torch.bfloat16])
    if state_dtype == torch.int8:
        # a store rounds each column to within m / 254 of its K values (m its largest): a relative
        # error of at most sqrt(K) / 254 (the rows, once stored; o reads the start exactly)
        tolerance = max(tolerance, case.start[torch.float32].shape[-2] ** 0.5 / 254)
    if error > tolerance:
        failures.append(f"{worst} differs from the float64 oracle by {error:.1e}")
    return error, worst, failures


def serving_state_bytes(shape: Shape, call: str) -> int:
    state_dtype, passes = SERVING_CALLS[call]
    if state_dtype == torch.int8:  # a byte a value and each column's 4-byte scale
        return passes * shape.B * shape.HV * (shape.K + 4) * shape.V
    element = 2 if state_dtype == torch.bfloat16 else 4
    return passes * shape.B * shape.HV * shape.K * shape.V * element


def serving_rows(spec: SpecUnderTest, shape: Shape, device: str, dtype, generator, measure: dict,
                 tolerance: float) -> list[BenchRow]:
    """Every serving call at one decode shape, eager and (on a GPU) as a graph replay, each gated
    on one run against the oracle, then timed on a pool of its own."""
    case = make_serving_case(spec.module, spec.rec, shape, dtype, device, generator)
    timings = [(DECODE, "")] + ([(DECODE_GRAPH, GRAPH)] if device == "cuda" else [])
    rows, pool_ms = [], {}
    for call in SERVING_CALLS:
        try:
            error, worst, failures = serving_gate(spec.module, case, call, tolerance)
        except Exception as exc:
            error, worst, failures = None, "", [f"{type(exc).__name__}: {_first_line(exc)}"]
        for timing, suffix in timings:
            pool = case.start[SERVING_CALLS[call][0]].clone()
            buffers: dict = {}
            reasons = list(failures)
            ms = None
            if not reasons:
                try:
                    with torch.no_grad():
                        serving_call(spec.module, case, call, pool, validate=False, buffers=buffers)  # buffers, compiled kernels
                        ms = measure[timing](lambda: serving_call(spec.module, case, call, pool, False, buffers), 0).ms
                except Exception as exc:
                    reasons.append(f"{type(exc).__name__}: {_first_line(exc)}")
            if call == POOL and ms is not None:
                pool_ms[timing] = ms
            rows.append(BenchRow(
                spec=spec.name, mode=call + suffix, shape=shape_label(shape), impl=LRDSL,
                kernel="verify+commit" if call == VERIFY_COMMIT else ("verify" if call == VERIFY else "recurrent[pool]"),
                path=LRDSL, status="FAILED" if reasons else "ok", reason="; ".join(reasons), ms=ms,
                state_tbps=serving_state_bytes(shape, call) / (ms * 1e-3) / 1e12 if ms else None,
                err_vs_oracle=error, worst_vs_oracle=worst,
                vs_pool=ms / pool_ms[timing] if ms and pool_ms.get(timing) else None,
            ))
    return rows
