"""The run: every spec x shape x mode, its peers beside lrdsl, each group gated; the card's copy bandwidth."""
from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass, replace

import torch

from ...ir.recurrence import Recurrence
from ...verification.workloads import TOLERANCE
from .shapes import FORWARD_BACKWARD, ORACLE_TOKENS, is_decode, modes_for, oracle_prefix
from .peers import fla_baseline, resolve_fla
from .contenders import direct_peers, fla_peers, lrdsl_contenders, make_call, oracle_outputs
from .timing import measurers
from .gate import BenchRow, run_group
from .serving import serving_rows


@dataclass(frozen=True)
class SpecUnderTest:
    name: str
    rec: Recurrence
    module: object  # the generated module (or anything with chunk / recurrent of its signature)


def bench(specs, shapes, plans=None, backward: bool = False, device: str = "cuda", dtype=torch.bfloat16,
          seed: int = 0, importer=importlib.import_module, oracle_tokens: int = ORACLE_TOKENS,
          on_rows=None, on_note=None, serving: bool = False, chunk_sizes=None,
          copy_tbps: float | None = None) -> list[BenchRow]:
    """Rows for every spec x shape x mode: the peers' (FLA's Triton kernels and the backend its
    dispatcher picks, where it has a counterpart and is installed; FlashQLA called directly,
    where it applies), then lrdsl's per plan (None: the module's default plan) and chunk size
    (None: the module's choice), each gated on correctness; with `serving`, the serving rows at
    each decode shape after its decode rows. Rows with a state TB/s carry the card's copy
    bandwidth, measured once (on a GPU; `copy_tbps`: measured already, by a caller that runs
    bench() piece by piece).
    `on_rows` gets each group's rows as soon as they exist (a long run shows progress), `on_note`
    one-line notes (a skipped shape)."""
    rows: list[BenchRow] = []
    generator = torch.Generator().manual_seed(seed)
    measure = measurers(device)
    tolerance = TOLERANCE[dtype]
    if copy_tbps is None and any(is_decode(s) for s in shapes):
        copy_tbps = measure_copy_tbps(device)
        if copy_tbps is not None and on_note is not None:
            on_note(f"this card copies {copy_tbps:.2f} TB/s ({COPY_BYTES >> 30} GiB device to device, bytes read + written)")

    def emit(group):
        group = with_copy_bandwidth(group, copy_tbps)
        rows.extend(group)
        if on_rows is not None:
            on_rows(group)

    for spec in specs:
        baseline = fla_baseline(spec.rec)
        fla = resolve_fla(baseline, importer)
        for shape in shapes:
            decode = is_decode(shape)
            function = None if baseline is None else (baseline.recurrent if decode else baseline.chunk)
            l2norm = function is None or function.l2norm
            if decode:
                ours = lrdsl_contenders(spec.module, decode=True, plans=())
            else:
                ours = lrdsl_contenders(spec.module, decode=False, plans=plans or [spec.module.DEFAULT_CHUNK_PLAN],
                                        chunk_sizes=chunk_sizes or (None,))
            direct = direct_peers(spec.rec, baseline, shape, dtype, l2norm, importer, on_note)

            modes = modes_for(shape, backward, device)
            call = make_call(spec.rec, shape, dtype, device, generator, l2norm)
            prefix = oracle_prefix(shape, oracle_tokens)
            names = ["q", "k", "v"] + [i.name for i in spec.rec.inputs]
            oracle = oracle_outputs(spec.rec, call.prefix(spec.rec, *prefix), names,
                                    gradients=FORWARD_BACKWARD in modes)
            for mode in modes:
                peers = [] if fla is None or function is None else fla_peers(spec.rec, function, fla[1 if decode else 0], l2norm, call, mode,
                                                         importer)
                emit(run_group(spec.name, spec.rec, peers + direct + ours, call, shape, mode, oracle, measure[mode],
                               prefix, tolerance))
            del call, oracle
            if serving and decode:
                emit(serving_rows(spec, shape, device, dtype, generator, measure, tolerance))
            if device == "cuda":
                torch.cuda.empty_cache()
    return rows


# One device-to-device copy this large gives the card's copy bandwidth (far above its L2)
COPY_BYTES = 1 << 30


def measure_copy_tbps(device: str, nbytes: int = COPY_BYTES) -> float | None:
    """The card's measured copy bandwidth in TB/s (bytes read + written per second, median of
    do_bench over one copy of `nbytes`): what a decode step's state traffic is held against.
    None off a GPU."""
    if device != "cuda":
        return None
    import triton.testing

    source = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda").normal_()
    target = torch.empty_like(source)
    ms = float(triton.testing.do_bench(lambda: target.copy_(source), warmup=25, rep=100, return_mode="median"))
    del source, target
    torch.cuda.empty_cache()
    return 2 * nbytes / (ms * 1e-3) / 1e12


def with_copy_bandwidth(rows: list[BenchRow], copy_tbps: float | None) -> list[BenchRow]:
    """Rows with a state TB/s get the card's copy bandwidth and their fraction of it."""
    if copy_tbps is None:
        return rows
    return [replace(r, copy_tbps=copy_tbps, of_copy=r.state_tbps / copy_tbps) if r.state_tbps is not None else r
            for r in rows]
