"""Launch settings of a spec's forward kernels at its own chunk size, on a GPU: each role's settings
varied one at a time, the whole forward timed (median, triton do_bench) and its output compared
with the default settings' (a row that differs beyond 5e-3 is FAILED).

    python scripts/sweep_forward_launch.py SPEC HV [OUT_DIR]   # 4 x 4096, H = 16, K = V = 128, bf16

Rows are printed and written to OUT_DIR/sweep_SPEC.jsonl (default: the current directory)."""
import json, os, sys
import torch, triton
import lrdsl
from lrdsl.measure.bench import make_call
from lrdsl.passes.pipeline import run_pipeline
from lrdsl.spec import load_spec_by_name
from lrdsl.verification.workloads import Shape, relative_error

name, HV = sys.argv[1], int(sys.argv[2])
out_dir = sys.argv[3] if len(sys.argv) > 3 else "."
path = f"specs/{name}.toml"
m = lrdsl.load(path)
rec = run_pipeline(load_spec_by_name(path), until="recurrence")["recurrence"]
call = make_call(rec, Shape(4, 4096, 16, HV, 128, 128), torch.bfloat16, "cuda", torch.Generator().manual_seed(0), True)
f = lambda: m.chunk(*call.tensors, scale=call.scale, use_qk_l2norm_in_kernel=True, output_final_state=True)
base_o, base_h = f()
base_ms = triton.testing.do_bench(f, warmup=30, rep=150, return_mode="median")
out = open(os.path.join(out_dir, f"sweep_{name}.jsonl"), "w")
def row(**kw):
    print(json.dumps(kw), flush=True); out.write(json.dumps(kw) + "\n")
plan = m.DEFAULT_CHUNK_PLAN
row(kind="base", spec=name, C=m.FORWARD_CHUNK_SIZE[plan, "input"], ms=round(base_ms, 4), launch={k: v for k, v in m.CHUNK_LAUNCH.items() if not k.startswith("bwd")})
CANDIDATES = [(64, 4, 3), (64, 8, 2), (128, 4, 2), (128, 8, 2), (32, 4, 2), (32, 4, 3), (64, 4, 1), (64, 2, 2)]
SCAN = [(32, 4, 3), (64, 4, 2), (64, 8, 2), (16, 4, 2), (32, 8, 2), (32, 2, 2), (64, 4, 3)]
roles = [r for r in m.CHUNK_LAUNCH if not r.startswith("bwd") and r != "solve"]
for role in roles:
    saved = dict(m.CHUNK_LAUNCH[role])
    for BV, w, st in (SCAN if role == "scan" else CANDIDATES):
        cfg = {"BV": BV, "num_warps": w, "num_stages": st}
        if cfg == saved:
            continue
        m.CHUNK_LAUNCH[role] = cfg
        try:
            o, h = f()
            err = max(relative_error(o.float(), base_o.float()), relative_error(h, base_h))
            ms = triton.testing.do_bench(f, warmup=20, rep=100, return_mode="median")
            row(spec=name, role=role, cfg=cfg, ms=round(ms, 4), vs_base=round(base_ms / ms, 3), err=err,
                status="ok" if err <= 5e-3 else "FAILED")
        except Exception as e:
            row(spec=name, role=role, cfg=cfg, error=str(e).splitlines()[0][:200])
    m.CHUNK_LAUNCH[role] = saved
