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
    from lrdsl import bench as lb
    from lrdsl.passes.pipeline import run_pipeline
    from lrdsl.spec import load_spec
    from lrdsl.workloads import Shape, make_inputs

    rec = run_pipeline(load_spec(SPEC), until="recurrence")["recurrence"]
    lb.allow_fla_gated_backward_on_hopper()
    fla = lb.fla_functions(rec)
    if fla is None:
        return fail("needs fla-core, the kernels it compares with (pip install fla-core)")

    from torch.profiler import ProfilerActivity, profile

    B, T, H, HV = dims
    shape = Shape(B, T, H, HV, 128, 128)
    mod = lrdsl.load(SPEC)
    gen = torch.Generator().manual_seed(0)
    leaves = [t.cuda().requires_grad_()
              for t in make_inputs(rec, shape, dtype=torch.bfloat16, generator=gen, normalize_keys=False)]
    d_o = torch.randn(B, T, HV, 128, generator=gen).to("cuda", torch.bfloat16)
    common = dict(use_qk_l2norm_in_kernel=True, output_final_state=True)
    for name, fn in [("lrdsl", mod.chunk), ("fla", fla[0])]:
        for _ in range(3):
            lb._forward_backward(fn, leaves, d_o, common, {})
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                lb._forward_backward(fn, leaves, d_o, common, {})
            torch.cuda.synchronize()
        print(f"== {name} {shape} (5 calls)")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
