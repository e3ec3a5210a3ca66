"""Timing one call: on a GPU (do_bench medians, peak memory, cold time, CUDA-graph replay) or once on the CPU."""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .shapes import DECODE, DECODE_GRAPH, FORWARD, FORWARD_BACKWARD, MODES


@dataclass(frozen=True)
class Measurement:
    outputs: dict
    ms: float
    peak_mib: float | None = None
    cold_s: float | None = None


class NotCapturable(Exception):
    """A function could not be captured in a CUDA graph (a host sync, an unsupported call)."""


def measure_on_gpu(fn, input_bytes: int) -> Measurement:
    import triton.testing

    torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = fn()
    torch.cuda.synchronize()
    cold = time.perf_counter() - start
    # peak of one call alone: what the process already holds (other rows' outputs) is excluded,
    # the call's inputs are counted
    baseline = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - baseline + input_bytes) / 2**20
    ms = float(triton.testing.do_bench(fn, warmup=50, rep=200, return_mode="median"))
    return Measurement(outputs, ms, peak, cold)


def held_between_passes(forward) -> float:
    """MiB a forward call that needs gradients leaves allocated for its backward: the memory
    allocated while its outputs are alive, less the outputs themselves (what autograd keeps: the
    tensors the implementation saved, copies and casts of its inputs included; inputs it keeps as
    they are cost nothing more). A deep model holds this once per layer until the backward.
    One call runs first, unmeasured: what an implementation builds on its first call and keeps
    across calls (autotuning, a cached workspace) is not held per layer. (Measured without that
    call on an H100, FLA's forward at 2 x 256 tokens showed 525 MiB, lrdsl's under 1; whether
    the first call explains FLA's figure is not measured yet.)"""
    forward()  # its outputs are dropped at once
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    outputs = [t for t in forward() if t is not None]
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before - sum(t.untyped_storage().nbytes() for t in outputs)
    del outputs
    return held / 2**20


def measure_graph_replay(fn, input_bytes: int) -> Measurement:
    """Capture one call in a CUDA graph over the same (static) input buffers, replay it, time the
    replays. The outputs returned are the replay's, so the gate checks what the graph computed."""
    import triton.testing

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # capture needs compiled kernels and a warm allocator, on a stream other than the default
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            static_outputs = fn()
    except Exception as exc:
        torch.cuda.synchronize()
        raise NotCapturable(f"not capturable in a CUDA graph: {type(exc).__name__}: {_first_line(exc)}") from None
    graph.replay()
    torch.cuda.synchronize()
    outputs = {name: t.clone() for name, t in static_outputs.items()}
    ms = float(triton.testing.do_bench(graph.replay, warmup=50, rep=200, return_mode="median"))
    return Measurement(outputs, ms)


def measure_once(fn, input_bytes: int) -> Measurement:
    """One call, wall clock: the CPU smoke test's stand-in (timings there mean nothing)."""
    start = time.perf_counter()
    outputs = fn()
    elapsed = time.perf_counter() - start
    return Measurement(outputs, elapsed * 1e3, None, elapsed)


def measurers(device: str) -> dict:
    if device != "cuda":
        return {mode: measure_once for mode in MODES}
    return {FORWARD: measure_on_gpu, FORWARD_BACKWARD: measure_on_gpu, DECODE: measure_on_gpu,
            DECODE_GRAPH: measure_graph_replay}


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else ""
