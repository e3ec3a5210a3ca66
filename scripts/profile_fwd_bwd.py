"""Per-kernel CUDA time of forward + backward, lrdsl vs fla-core, on one GDN shape (BENCHMARKS.md,
"Where the time goes"). Run on a GPU machine with fla-core installed:

    python scripts/profile_fwd_bwd.py B T H HV      # e.g. 4 4096 16 32

Without a GPU, without fla-core or with bad arguments it says so in one line and exits with 2.
"""
import sys
from pathlib import Path

SPEC = str(Path(__file__).resolve().parent.parent / "specs" / "gdn.toml")
USAGE = "usage: python scripts/profile_fwd_bwd.py B T H HV   (e.g. 4 4096 16 32)"


def fail(message: str) -> int:
    print(f"profile_fwd_bwd.py: error: {message}", file=sys.stderr)
    return 2


def parse_shape(argv):
    """(B, T, H, HV) from the command line, or None."""
    try:
        values = [int(x) for x in argv]
    except ValueError:
        return None
    if len(values) != 4 or min(values) < 1 or values[3] % values[2] != 0:
        return None
    return values


def main(argv) -> int:
    dims = parse_shape(argv)
    if dims is None:
        return fail(f"expected four positive integers B T H HV with HV a multiple of H, got {' '.join(argv)!r}; {USAGE}")
    import torch

    if not torch.cuda.is_available():
        return fail("needs a CUDA GPU: it profiles CUDA kernels")

    import lrdsl
    from lrdsl.measure import bench as lb
    from lrdsl.passes.pipeline import run_pipeline
    from lrdsl.spec import load_spec

    rec = run_pipeline(load_spec(SPEC), until="recurrence")["recurrence"]
    lb.allow_fla_gated_backward_on_hopper()
    baseline = lb.fla_baseline(rec)
    resolved = lb.resolve_fla(baseline)
    if resolved is None:
        return fail("needs fla-core, the kernels it compares with (pip install fla-core)")
    fla_chunk = resolved[0]

    from torch.profiler import ProfilerActivity, profile

    from lrdsl.verification.workloads import Shape

    B, T, H, HV = dims
    shape = Shape(B, T, H, HV, 128, 128)
    mod = lrdsl.load(SPEC)
    contenders = [
        lb.lrdsl_contenders(mod, decode=False, plans=[mod.DEFAULT_CHUNK_PLAN])[0],
        lb.fla_contender(rec, baseline.chunk, fla_chunk, l2norm=True),  # called by keyword
    ]
    call = lb.make_call(rec, shape, torch.bfloat16, "cuda", torch.Generator().manual_seed(0), l2norm=True).requiring_grad()
    names = ["q", "k", "v"] + [i.name for i in rec.inputs]
    for contender in contenders:
        for _ in range(3):
            lb.run_mode(contender, call, lb.FORWARD_BACKWARD, names)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                lb.run_mode(contender, call, lb.FORWARD_BACKWARD, names)
            torch.cuda.synchronize()
        print(f"== {contender.impl} {contender.kernel} {shape} (5 calls)")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
