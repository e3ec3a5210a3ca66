"""Run a generated module against the float64 oracle: the engine of `lrdsl check` and `lrdsl demo`."""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from . import reference
from .ir.recurrence import Recurrence
from .workloads import TOLERANCE, Shape, make_inputs, relative_error


@dataclass(frozen=True)
class CheckRow:
    kernel: str
    case: str
    dtype: str
    out_error: float
    state_error: float
    limit: float
    ms: float

    @property
    def ok(self) -> bool:
        return self.out_error <= self.limit and self.state_error <= self.limit


def varlen_bounds(T: int) -> list[int]:
    """Sequence boundaries over T tokens that include a length-0 and a length-1 sequence."""
    if T < 2:
        return [0, 0, T]
    first = (T - 1) // 2
    return [0, 0, 1, 1 + first, 1 + first, T]


def kernel_configs(module, all_chunk_configs: bool = True) -> list[tuple[str, str, dict]]:
    """(label, function, options) for the recurrent kernel and each chunk plan x chunk size."""
    configs = [("recurrent", "recurrent", {})]
    if hasattr(module, "chunk"):
        plans = module.CHUNK_PLANS if all_chunk_configs else (module.DEFAULT_CHUNK_PLAN,)
        sizes = module.CHUNK_SIZES if all_chunk_configs else (64,)
        configs += [(f"chunk[{p},{c}]", "chunk", {"plan": p, "chunk_size": c}) for p in plans for c in sizes]
    return configs


def _time(fn, device: str, timed: bool) -> float:
    if not timed:
        return float("nan")
    if device == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def check_module(
    module,
    rec: Recurrence,
    shape: Shape,
    dtypes=(torch.float32,),
    device: str = "cpu",
    seed: int | None = None,
    timed: bool = True,
    all_chunk_configs: bool = True,
) -> list[CheckRow]:
    """Every kernel config on two cases (dense with initial state and in-kernel L2 norm; varlen
    with empty and length-1 sequences) per dtype, each against one oracle run on the same inputs."""
    generator = torch.Generator().manual_seed(seed if seed is not None else torch.seed() % 2**31)
    configs = kernel_configs(module, all_chunk_configs)
    rows = []
    for case in ("dense+h0+l2norm", "varlen+h0"):
        if case.startswith("varlen"):
            case_shape = Shape(1, shape.B * shape.T, shape.H, shape.HV, shape.K, shape.V)
            bounds = varlen_bounds(case_shape.T)
            cu, N, l2norm = torch.tensor(bounds, dtype=torch.int32), len(bounds) - 1, False
        else:
            case_shape, cu, N, l2norm = shape, None, shape.B, True
        for dtype in dtypes:
            tensors = make_inputs(rec, case_shape, dtype=dtype, generator=generator)
            h0 = torch.randn(N, shape.HV, shape.K, shape.V, generator=generator)
            kwargs = dict(
                initial_state=h0.to(device),
                output_final_state=True,
                cu_seqlens=cu.to(device) if cu is not None else None,
                use_qk_l2norm_in_kernel=l2norm,
            )
            dev = [t.to(device) for t in tensors]
            reference_out = None
            for label, function, options in configs:
                fn = getattr(module, function)
                o, ht = fn(*dev, **kwargs, **options)  # before the oracle: the module validates the tensors
                if reference_out is None:
                    reference_out = reference.run(
                        rec, *tensors, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                        use_qk_l2norm_in_kernel=l2norm,
                    )
                ms = _time(lambda: fn(*dev, **kwargs, **options), device, timed)
                rows.append(
                    CheckRow(
                        kernel=label,
                        case=case,
                        dtype=str(dtype).replace("torch.", ""),
                        out_error=relative_error(o, reference_out[0]),
                        state_error=relative_error(ht, reference_out[1]),
                        limit=TOLERANCE[dtype],
                        ms=ms,
                    )
                )
    return rows


def format_rows(rows: list[CheckRow]) -> str:
    header = f"{'kernel':<17} {'case':<16} {'dtype':<9} {'o rel.err':>10} {'state rel.err':>13} {'limit':>7} {'ms':>9}  ok"
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(
            f"{r.kernel:<17} {r.case:<16} {r.dtype:<9} {r.out_error:>10.2e} {r.state_error:>13.2e} "
            f"{r.limit:>7.0e} {_ms(r.ms):>9}  {'ok' if r.ok else 'FAIL'}"
        )
    return "\n".join(lines)


def _ms(value: float) -> str:
    return "-" if value != value else f"{value:.3f}"
