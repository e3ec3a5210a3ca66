"""Side-by-side benchmarks on a GPU: lrdsl's generated kernels vs fla-core (when installed).

    lrdsl bench specs/gdn.toml [--shapes training|decode] [--plans fused,split] [--json FILE]

Protocol (DESIGN.md section 7): same process, same inputs; bf16 q, k, v; fp32 g;
use_qk_l2norm_in_kernel=True; median of triton.testing.do_bench; peak memory of one call; cold
time = the first call in a fresh Triton cache, compilation included. TFLOP/s convention: the
recurrent form's 6 * B * T * HV * K * V floating-point operations (predict, write, read: 2KV
each per token and head), the same count for every implementation.
"""
from __future__ import annotations

import inspect
import json
import time
from dataclasses import asdict, dataclass

import sympy
import torch

from .workloads import Shape, make_inputs, relative_error

TRAINING_SHAPES = (
    Shape(4, 4096, 16, 32, 128, 128),
    Shape(1, 32768, 16, 32, 128, 128),
    Shape(1, 65536, 2, 8, 128, 128),
)
DECODE_SHAPES = (Shape(256, 1, 16, 32, 128, 128), Shape(1, 1, 16, 32, 128, 128))

# The hand-written FLA function each spec is compared with, by the spec's recurrence
# (gate kind, update rule, beta); positional inputs line up with the spec's.
FLA_BASELINES = {
    ("scalar", "delta", True): ("fla.ops.gated_delta_rule", "chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"),
    ("none", "delta", True): ("fla.ops.delta_rule", "chunk_delta_rule", "fused_recurrent_delta_rule"),
    ("scalar", "plain", False): ("fla.ops.simple_gla", "chunk_simple_gla", "fused_recurrent_simple_gla"),
}


@dataclass
class BenchRow:
    impl: str
    kernel: str
    shape: str
    ms: float
    tflops: float
    peak_mib: float
    cold_s: float
    diff_vs_fla: float | None = None


def _fla_functions(rec):
    """FLA's (chunk, recurrent) functions for this recurrence, or None (not installed, no match,
    or the spec computes its gate/beta from other inputs, which FLA's functions do not take)."""
    key = (rec.gate.value, rec.update.value, rec.has_beta)
    direct = all(e is None or isinstance(e, sympy.Symbol) for e in (rec.log_decay, rec.beta))
    if key not in FLA_BASELINES or not direct:
        return None
    module_name, chunk_name, recurrent_name = FLA_BASELINES[key]
    try:
        import importlib

        module = importlib.import_module(module_name)
    except ImportError:
        return None
    return getattr(module, chunk_name), getattr(module, recurrent_name)


def _measure(fn, shape: Shape) -> tuple[float, float, float, object]:
    import triton.testing

    torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    cold = time.perf_counter() - start
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() / 2**20
    ms = float(triton.testing.do_bench(fn, warmup=50, rep=200, return_mode="median"))
    flops = 6 * shape.B * shape.T * shape.HV * shape.K * shape.V
    return ms, flops / (ms * 1e-3) / 1e12, peak, cold, out


def bench(module, rec, shapes, plans, kernel: str = "chunk", seed: int = 0) -> list[BenchRow]:
    rows = []
    fla = _fla_functions(rec)
    generator = torch.Generator().manual_seed(seed)
    for shape in shapes:
        tensors = [t.cuda() for t in make_inputs(rec, shape, dtype=torch.bfloat16, generator=generator, normalize_keys=False)]
        common = dict(use_qk_l2norm_in_kernel=True, output_final_state=True)
        fla_out = None
        if fla is not None:
            fla_fn = fla[0] if kernel == "chunk" else fla[1]
            if "use_qk_l2norm_in_kernel" not in inspect.signature(fla_fn).parameters:
                common = dict(output_final_state=True)  # compare the same work on both sides
            try:
                ms, tflops, peak, cold, fla_out = _measure(lambda: fla_fn(*tensors, **common), shape)
                rows.append(BenchRow("fla-core", kernel, str(shape), ms, tflops, peak, cold))
            except Exception as exc:  # FLA may refuse a shape (e.g. GVA); record it, keep going
                print(f"fla-core {kernel} {shape}: {type(exc).__name__}: {str(exc)[:120]}")
        for plan in plans if kernel == "chunk" else [None]:
            fn = getattr(module, kernel)
            extra = {"plan": plan} if plan else {}
            ms, tflops, peak, cold, out = _measure(lambda: fn(*tensors, **common, **extra), shape)
            diff = relative_error(out[0].float(), fla_out[0].float()) if fla_out is not None else None
            rows.append(BenchRow("lrdsl", f"{kernel}[{plan}]" if plan else kernel, str(shape), ms, tflops, peak, cold, diff))
    return rows


def format_rows(rows: list[BenchRow]) -> str:
    header = f"{'impl':<9} {'kernel':<15} {'shape':<38} {'ms':>8} {'TFLOP/s':>8} {'peak MiB':>9} {'cold s':>7} {'vs FLA':>8}"
    lines = [header, "-" * len(header)]
    for r in rows:
        diff = f"{r.diff_vs_fla:.1e}" if r.diff_vs_fla is not None else "-"
        lines.append(f"{r.impl:<9} {r.kernel:<15} {r.shape:<38} {r.ms:>8.3f} {r.tflops:>8.1f} {r.peak_mib:>9.0f} {r.cold_s:>7.1f} {diff:>8}")
    return "\n".join(lines)


def to_json(rows: list[BenchRow]) -> str:
    return json.dumps([asdict(r) for r in rows], indent=1)
