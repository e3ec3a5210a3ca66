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
from lrdsl.workloads import Shape

B, T, H, HV = (int(x) for x in sys.argv[1:5])
shape = Shape(B, T, H, HV, 128, 128)
mod = lrdsl.load("specs/gdn.toml")
rec = run_pipeline(load_spec("specs/gdn.toml"), until="recurrence")["recurrence"]
lb.allow_fla_gated_backward_on_hopper()
baseline = lb.fla_baseline(rec)
fla_chunk, _ = lb.resolve_fla(baseline)
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
