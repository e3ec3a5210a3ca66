"""Side-by-side benchmarks on a GPU: lrdsl's generated kernels vs fla-core (when installed).

    lrdsl bench specs/gdn.toml [--shapes training|family|decode] [--plans fused,split] [--backward] [--json FILE]

Protocol (DESIGN.md section 7): same process, same inputs; bf16 q, k, v; fp32 g;
use_qk_l2norm_in_kernel=True; median of triton.testing.do_bench; peak memory of one call (inputs
included); cold time = the first call in the process, kernel compilation included. TFLOP/s
convention: the recurrent form's 6 * B * T * HV * K * V floating-point operations for the forward
(predict, write, read: 2KV each per token and head), 3x that for forward + backward, the same
count for every implementation.
"""
from __future__ import annotations

import importlib
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
# the family's comparison shape (kda, gla against FLA's chunk_kda, chunk_gla): no GVA
FAMILY_SHAPES = (Shape(4, 4096, 16, 16, 128, 128),)

# The hand-written FLA function each recurrence is compared with, by (gate kind, update, beta);
# positional inputs line up with the spec's.
FLA_BASELINES = {
    ("scalar", "delta", True): ("fla.ops.gated_delta_rule", "chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"),
    ("none", "delta", True): ("fla.ops.delta_rule", "chunk_delta_rule", "fused_recurrent_delta_rule"),
    ("scalar", "plain", False): ("fla.ops.simple_gla", "chunk_simple_gla", "fused_recurrent_simple_gla"),
    ("key_channel", "delta", True): ("fla.ops.kda", "chunk_kda", "fused_recurrent_kda"),
    ("key_channel", "plain", False): ("fla.ops.gla", "chunk_gla", "fused_recurrent_gla"),
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


def fla_functions(rec):
    """FLA's (chunk, recurrent) functions for this recurrence, or None (not installed, no match,
    or the spec computes its gate/beta from other inputs, which FLA's functions do not take)."""
    key = (rec.gate.value, rec.update.value, rec.has_beta)
    direct = all(e is None or isinstance(e, sympy.Symbol) for e in (rec.log_decay, rec.beta))
    if key not in FLA_BASELINES or not direct:
        return None
    module_name, chunk_name, recurrent_name = FLA_BASELINES[key]
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        return None
    return getattr(module, chunk_name), getattr(module, recurrent_name)


def allow_fla_gated_backward_on_hopper() -> bool:
    """fla-core 0.6.0 refuses its gated backward on Hopper with triton < 3.7.1 (a miscompile it
    saw there). To time it side by side we lift that check, as DESIGN.md section 7 did; its
    gradients are compared with ours in the output (diff column)."""
    try:
        chunk_o = importlib.import_module("fla.ops.common.chunk_o")
    except ImportError:
        return False
    if getattr(chunk_o, "TRITON_ABOVE_3_7_1", True):
        return False
    chunk_o.TRITON_ABOVE_3_7_1 = True
    return True


def _measure(fn, flops: float):
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
    return ms, flops / (ms * 1e-3) / 1e12, peak, cold, out


def _max_difference(ours, theirs) -> float:
    return max(relative_error(a.float(), b.float()) for a, b in zip(ours, theirs))


def bench(module, rec, shapes, plans, kernel: str = "chunk", backward: bool = False, seed: int = 0,
          on_row=None) -> list[BenchRow]:
    """Rows for every shape: FLA's (where it has a baseline), then lrdsl's per plan. `on_row` is
    called with each row as soon as it is measured (a long run shows progress)."""
    rows = []

    def record(row: BenchRow) -> None:
        rows.append(row)
        if on_row is not None:
            on_row(row)

    fla = fla_functions(rec)
    generator = torch.Generator().manual_seed(seed)
    for shape in shapes:
        tensors = [t.cuda() for t in make_inputs(rec, shape, dtype=torch.bfloat16, generator=generator, normalize_keys=False)]
        leaves = [t.requires_grad_() for t in tensors] if backward else tensors
        d_o = torch.randn(shape.B, shape.T, shape.HV, shape.V, generator=generator).to("cuda", torch.bfloat16)
        flops = 6 * shape.B * shape.T * shape.HV * shape.K * shape.V * (3 if backward else 1)
        fla_fn = None if fla is None else (fla[0] if kernel == "chunk" else fla[1])
        common = dict(use_qk_l2norm_in_kernel=True, output_final_state=True)
        if fla_fn is not None and "use_qk_l2norm_in_kernel" not in inspect.signature(fla_fn).parameters:
            common = dict(output_final_state=True)  # the same work on both sides

        def runner(fn, **options):
            if backward:
                return lambda: _forward_backward(fn, leaves, d_o, common, options)
            return lambda: fn(*leaves, **common, **options)

        fla_out = None
        if fla_fn is not None:
            try:
                ms, tflops, peak, cold, fla_out = _measure(runner(fla_fn), flops)
                record(BenchRow("fla-core", kernel + ("+bwd" if backward else ""), str(shape), ms, tflops, peak, cold))
            except Exception as exc:  # FLA may refuse a shape or a GPU; record it and go on
                print(f"fla-core {kernel} {shape}: {type(exc).__name__}: {str(exc)[:160]}")
        for plan in plans if kernel == "chunk" else [None]:
            options = {"plan": plan} if plan else {}
            ms, tflops, peak, cold, out = _measure(runner(getattr(module, kernel), **options), flops)
            diff = _max_difference(_outputs(out, backward), _outputs(fla_out, backward)) if fla_out is not None else None
            label = f"{kernel}[{plan}]" if plan else kernel
            record(BenchRow("lrdsl", label + ("+bwd" if backward else ""), str(shape), ms, tflops, peak, cold, diff))
    return rows


def _forward_backward(fn, leaves, d_o, common, options):
    o, _ = fn(*leaves, **common, **options)
    return (o,) + torch.autograd.grad(o, leaves, d_o)


def _outputs(out, backward: bool):
    """The tensors compared with FLA's: o (and every gradient, for forward + backward)."""
    return out if backward else (out[0],)


HEADER = f"{'impl':<9} {'kernel':<19} {'shape':<38} {'ms':>8} {'TFLOP/s':>8} {'peak MiB':>9} {'cold s':>7} {'vs FLA':>8}"


def format_row(r: BenchRow) -> str:
    diff = f"{r.diff_vs_fla:.1e}" if r.diff_vs_fla is not None else "-"
    return f"{r.impl:<9} {r.kernel:<19} {r.shape:<38} {r.ms:>8.3f} {r.tflops:>8.1f} {r.peak_mib:>9.0f} {r.cold_s:>7.1f} {diff:>8}"


def to_json(rows: list[BenchRow]) -> str:
    return json.dumps([asdict(r) for r in rows], indent=1)
