"""Run a generated module against the float64 oracle: the engine of `lrdsl check` and `lrdsl demo`."""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .. import reference
from ..errors import LrdslError
from ..ir.recurrence import Recurrence
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
    grad_error: float | None = None  # the worst gradient's error (None: gradients not checked)
    grad_worst: str = ""  # which input's gradient that is

    @property
    def ok(self) -> bool:
        errors = [self.out_error, self.state_error] + ([self.grad_error] if self.grad_error is not None else [])
        return all(e <= self.limit for e in errors)


def varlen_bounds(T: int) -> list[int]:
    """Sequence boundaries over T tokens that include a length-0 and a length-1 sequence."""
    if T < 2:
        return [0, 0, T]
    first = (T - 1) // 2
    return [0, 0, 1, 1 + first, 1 + first, T]


def kernel_configs(module, plans=None, chunk_sizes=None, K: int | None = None) -> list[tuple[str, str, dict]]:
    """(label, function, options) for the recurrent kernel and each chunk plan x chunk size (all
    of the module's that fit a GPU block at K key channels, or the ones named)."""
    largest = module.largest_chunk_size(K) if K is not None else max(module.CHUNK_SIZES)
    plans = tuple(plans or module.CHUNK_PLANS)
    chunk_sizes = tuple(chunk_sizes or (c for c in module.CHUNK_SIZES if c <= largest))
    unknown = [p for p in plans if p not in module.CHUNK_PLANS] + [c for c in chunk_sizes if c not in module.CHUNK_SIZES]
    if unknown:
        raise LrdslError(f"no chunk plan or size {unknown[0]!r}; plans: {', '.join(module.CHUNK_PLANS)}; "
                         f"sizes: {', '.join(str(c) for c in module.CHUNK_SIZES)}")
    too_large = [c for c in chunk_sizes if c > largest]
    if too_large:
        raise LrdslError(f"chunk size {too_large[0]} at K={K} needs more shared memory than a GPU block has; "
                         f"this spec's largest there is {largest}")
    configs = [("recurrent", "recurrent", {})]
    configs += [(f"chunk[{p},{c}]", "chunk", {"plan": p, "chunk_size": c}) for p in plans for c in chunk_sizes]
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
    plans=None,
    chunk_sizes=None,
    gradients: bool = True,
    on_row=None,
) -> list[CheckRow]:
    """Every kernel config (or the chunk plans and sizes named) on two cases (dense with initial state and in-kernel L2 norm; varlen
    with empty and length-1 sequences) per dtype, each against one oracle run on the same inputs.
    With `gradients` also the gradients of every input and the initial state, for the loss
    <o, dO> + <final state, dS>, against autograd through the oracle. `on_row(row, done, total)`
    is called as each row finishes (a long run shows progress)."""
    generator = torch.Generator().manual_seed(seed if seed is not None else torch.seed() % 2**31)
    configs = kernel_configs(module, plans, chunk_sizes, shape.K)
    names = ["q", "k", "v"] + [i.name for i in rec.inputs] + ["initial_state"]
    cases = ("dense+h0+l2norm", "varlen+h0")
    total = len(cases) * len(dtypes) * len(configs)
    rows = []
    for case in cases:
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
            d_o = torch.randn(case_shape.B, case_shape.T, shape.HV, shape.V, generator=generator)
            d_state = torch.randn(N, shape.HV, shape.K, shape.V, generator=generator)
            oracle_kwargs = dict(output_final_state=True, cu_seqlens=cu, use_qk_l2norm_in_kernel=l2norm)
            reference_out = reference_grads = None
            for label, function, options in configs:
                fn = getattr(module, function)
                o, ht = fn(*dev, **kwargs, **options)  # before the oracle: the module validates the tensors
                if reference_out is None:
                    reference_out = reference.run(rec, *tensors, initial_state=h0, **oracle_kwargs)
                ms = _time(lambda: fn(*dev, **kwargs, **options), device, timed)
                grad_error, grad_worst = None, ""
                if gradients:
                    if reference_grads is None:
                        reference_grads = _gradients(
                            lambda *leaves: reference.run(rec, *leaves[:-1], initial_state=leaves[-1], **oracle_kwargs),
                            [t.double() for t in tensors] + [h0.double()], d_o.double(), d_state.double(),
                        )
                    call_kwargs = {**kwargs, **options}
                    grads = _gradients(
                        lambda *leaves: fn(*leaves[:-1], **{**call_kwargs, "initial_state": leaves[-1]}),
                        dev + [h0.to(device)], d_o.to(device), d_state.to(device),
                    )
                    errors = {n: relative_error(a, b) for n, a, b in zip(names, grads, reference_grads)}
                    grad_worst = max(errors, key=errors.get)  # NaN/Inf count as inf
                    grad_error = errors[grad_worst]
                rows.append(
                    CheckRow(
                        kernel=label,
                        case=case,
                        dtype=str(dtype).replace("torch.", ""),
                        out_error=relative_error(o, reference_out[0]),
                        state_error=relative_error(ht, reference_out[1]),
                        limit=TOLERANCE[dtype],
                        ms=ms,
                        grad_error=grad_error,
                        grad_worst=grad_worst,
                    )
                )
                if on_row is not None:
                    on_row(rows[-1], len(rows), total)
    return rows


def _gradients(run, inputs, d_o, d_state):
    """Gradients of <o, d_o> + <final state, d_state> w.r.t. `inputs` (the last one: the initial
    state), where run(*leaves) returns (o, final state)."""
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    o, final_state = run(*leaves)
    loss = (o * d_o).sum() + (final_state * d_state).sum()
    return torch.autograd.grad(loss, leaves)


def format_header() -> str:
    header = (f"{'kernel':<17} {'case':<16} {'dtype':<9} {'o rel.err':>10} {'state rel.err':>13} "
              f"{'worst grad rel.err':>24} {'limit':>7} {'ms':>9}  ok")
    return header + "\n" + "-" * len(header)


def format_row(r: CheckRow) -> str:
    grad = "-" if r.grad_error is None else f"{r.grad_error:.2e} ({r.grad_worst})"
    return (f"{r.kernel:<17} {r.case:<16} {r.dtype:<9} {r.out_error:>10.2e} {r.state_error:>13.2e} "
            f"{grad:>24} {r.limit:>7.0e} {_ms(r.ms):>9}  {'ok' if r.ok else 'FAIL'}")


def _ms(value: float) -> str:
    return "-" if value != value else f"{value:.3f}"
