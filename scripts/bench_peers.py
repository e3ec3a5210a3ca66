"""lrdsl beside its peers on one GPU, in phases that each fit one device call (GPU).

    bash scripts/bench_peers.sh PHASE [PHASE ...]     # installs the carried wheels, then runs this
    python3 scripts/bench_peers.py PHASE [PHASE ...]  # the peers already installed

Phases (what `lrdsl bench` would time, with --backward on training shapes):

    training   gdn at the training shapes: 4x4096 16/32, 1x32768 16/32, 1x65536 2/8
    flashqla   gdn at FlashQLA's published shapes: 1x32768 16/64, 4x8192 16/64
    family-a   gdn, gdn_qwen35, deltanet, simple_gla at the family shape (4x4096, H = HV = 16)
    family-b   kda, gla, rwkv7 at the family shape
    decode     gdn at B = 1, 64, 256, 1024 (eager and CUDA-graph replay), beside the card's copy bandwidth

Each (spec, shape) is one lrdsl.measure.bench.bench() call with every peer column (FLA's Triton kernels,
the backend FLA dispatches to, FlashQLA directly) and the oracle gate on every row, as `lrdsl
bench` runs it. After each group the phase's rows are written to $OUT/PHASE.json, so a run cut
off by the device's 10-minute limit keeps what it measured. A (spec, shape) is not started once
--deadline seconds have passed since the process started (default 420: FLA's first call
autotunes for minutes, FlashQLA compiles 49-110 s per shape); the ones left are named at the end.
Last: $OUT/PHASE.png (where matplotlib is installed) and a short ratio table per phase.
Combine phases from separate calls on any machine: lrdsl bench --from-json A.json B.json --plot all.png
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

STARTED = time.monotonic()
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# FLA's autotuning results kept in Triton's on-disk cache (read when FLA's kernels are
# decorated): a later process on the same machine, while it is still warm, does not tune again
os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")

FAMILY = "family"
PHASES = {
    "training": (["gdn"], "training"),
    "flashqla": (["gdn"], "1x32768x16x64,4x8192x16x64"),
    "family-a": (["gdn", "gdn_qwen35", "deltanet", "simple_gla"], FAMILY),
    "family-b": (["kda", "gla", "rwkv7"], FAMILY),
    # FLA's hand-written delta-rule variants (its compile of their backward takes minutes: a phase
    # of their own)
    "family-c": (["gdn2", "gated_deltaproduct"], FAMILY),
    "decode": (["gdn"], "decode"),
}


def main(argv) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("phases", nargs="+", choices=list(PHASES))
    parser.add_argument("--deadline", type=float, default=float(os.environ.get("BENCH_DEADLINE_S", 420)),
                        help="seconds after which no new (spec, shape) is started (default 420)")
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    import torch
    import triton

    import lrdsl
    from lrdsl.measure import bench as lb
    from lrdsl.passes.pipeline import run_pipeline
    from lrdsl.spec import load_spec_by_name

    if not torch.cuda.is_available():
        print("bench_peers: needs a CUDA GPU", file=sys.stderr)
        return 2
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
          f"fla-core {_installed_version('fla-core')}, flash-qla {_installed_version('flash-qla')}, "
          f"tilelang {_installed_version('tilelang')}; seed {args.seed}", flush=True)
    if lb.allow_fla_gated_backward_on_hopper():
        print("note: fla-core's refusal of its gated backward on Hopper with triton < 3.7.1 is lifted to time it")
    out = Path(args.out)
    copy_tbps = None
    left = []
    summaries = []
    for phase in args.phases:
        names, shapes_text = PHASES[phase]
        shapes = lb.parse_shapes(shapes_text)
        if copy_tbps is None and any(lb.is_decode(s) for s in shapes):
            copy_tbps = lb.measure_copy_tbps("cuda")
            print(f"note: this card copies {copy_tbps:.2f} TB/s (1 GiB device to device, bytes read + written)", flush=True)
        rows = []
        print(f"\n=== {phase}: {', '.join(names)} at {shapes_text} ===\n{lb.HEADER}\n{'-' * len(lb.HEADER)}", flush=True)

        def keep(group):
            rows.extend(group)
            for row in group:
                print(lb.format_row(row), flush=True)
            (out / f"{phase}.json").write_text(lb.to_json(rows))

        for name in names:
            path = ROOT / "specs" / f"{name}.toml"
            rec = run_pipeline(load_spec_by_name(path), until="recurrence")["recurrence"]
            spec = lb.SpecUnderTest(rec.name, rec, lrdsl.load(path))
            for shape in shapes:
                if time.monotonic() - STARTED > args.deadline:
                    left.append(f"{phase}: {name} {lb.shape_label(shape)}")
                    continue
                lb.bench([spec], [shape], backward=not lb.is_decode(shape), seed=args.seed, on_rows=keep,
                         on_note=lambda text: print(f"note: {text}", flush=True), copy_tbps=copy_tbps)
                torch.cuda.empty_cache()
        if rows:
            _plot(lb, rows, out / f"{phase}.png")
            summaries.append((phase, lb.format_summary(rows), sum(1 for r in rows if not r.ok)))

    print(f"\n=== summary ({time.monotonic() - STARTED:.0f} s) ===")
    for phase, text, failed in summaries:
        print(f"[{phase}] {failed} FAILED row(s)\n{text}\n")
    if left:
        print(f"not run (past --deadline {args.deadline:.0f} s): " + "; ".join(left))
    return 0


def _installed_version(distribution: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "absent"


def _plot(lb, rows, path) -> None:
    from lrdsl.errors import LrdslError

    try:
        lb.plot_ratios(rows, path)
    except LrdslError as exc:  # matplotlib absent: plot later with lrdsl bench --from-json --plot
        print(f"note: no plot: {exc}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
