"""Per-kernel CUDA time of forward + backward, lrdsl vs fla-core, on one GDN shape (BENCHMARKS.md,
"Where the time goes"). Run on a GPU machine with fla-core installed:

    python scripts/profile_fwd_bwd.py B T H HV      # e.g. 4 4096 16 32
"""
import sys

import torch
from torch.profiler import ProfilerActivity, profile

import lrdsl
from lrdsl import bench as lb
from lrdsl.spec import load_spec
from lrdsl.passes.pipeline import run_pipeline
from lrdsl.workloads import Shape, make_inputs

B, T, H, HV = (int(x) for x in sys.argv[1:5])
shape = Shape(B, T, H, HV, 128, 128)
mod = lrdsl.load("specs/gdn.toml")
rec = run_pipeline(load_spec("specs/gdn.toml"), until="recurrence")["recurrence"]
lb.allow_fla_gated_backward_on_hopper()
fla = lb.fla_functions(rec)
gen = torch.Generator().manual_seed(0)
leaves = [t.cuda().requires_grad_() for t in make_inputs(rec, shape, dtype=torch.bfloat16, generator=gen, normalize_keys=False)]
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
