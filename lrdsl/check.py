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


def kernels_of(module) -> list[str]:
    return [name for name in ("recurrent", "chunk") if hasattr(module, name)]


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
    kernels: list[str] | None = None,
) -> list[CheckRow]:
    generator = torch.Generator().manual_seed(seed if seed is not None else torch.seed() % 2**31)
    rows = []
    cases = {
        "dense+h0+l2norm": dict(varlen=False),
        "varlen+h0": dict(varlen=True),
    }
    for kernel in kernels or kernels_of(module):
        fn = getattr(module, kernel)
        for case, config in cases.items():
            if config["varlen"]:
                case_shape = Shape(1, shape.B * shape.T, shape.H, shape.HV, shape.K, shape.V)
                bounds = varlen_bounds(case_shape.T)
                cu = torch.tensor(bounds, dtype=torch.int32)
                N = len(bounds) - 1
                l2norm = False
            else:
                case_shape, cu, N, l2norm = shape, None, shape.B, True
            for dtype in dtypes:
                tensors = make_inputs(rec, case_shape, dtype=dtype, generator=generator)
                h0 = torch.randn(N, shape.HV, shape.K, shape.V, generator=generator)
                dev = [t.to(device) for t in tensors]
                kwargs = dict(
                    initial_state=h0.to(device),
                    output_final_state=True,
                    cu_seqlens=cu.to(device) if cu is not None else None,
                    use_qk_l2norm_in_kernel=l2norm,
                )
                o, ht = fn(*dev, **kwargs)  # first: the module validates the tensors
                ref_o, ref_h = reference.run(
                    rec, *tensors, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                    use_qk_l2norm_in_kernel=l2norm,
                )
                ms = _time(lambda: fn(*dev, **kwargs), device, timed)
                rows.append(
                    CheckRow(
                        kernel=kernel,
                        case=case,
                        dtype=str(dtype).replace("torch.", ""),
                        out_error=relative_error(o, ref_o),
                        state_error=relative_error(ht, ref_h),
                        limit=TOLERANCE[dtype],
                        ms=ms,
                    )
                )
    return rows


def format_rows(rows: list[CheckRow]) -> str:
    header = f"{'kernel':<10} {'case':<16} {'dtype':<9} {'o rel.err':>10} {'state rel.err':>13} {'limit':>7} {'ms':>9}  ok"
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(
            f"{r.kernel:<10} {r.case:<16} {r.dtype:<9} {r.out_error:>10.2e} {r.state_error:>13.2e} "
            f"{r.limit:>7.0e} {_ms(r.ms):>9}  {'ok' if r.ok else 'FAIL'}"
        )
    return "\n".join(lines)


def _ms(value: float) -> str:
    return "-" if value != value else f"{value:.3f}"
