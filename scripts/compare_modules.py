"""Time several generated modules of one spec (gdn unless --spec) side by side, with fla-core's
gdn for gdn, in one process (GPU).

Each module is a file written by `lrdsl compile specs/SPEC.toml -o NAME.py` (from different
commits or codegen choices); every one runs on the same inputs, and its outputs (and with
--backward its gradients) are compared with the first implementation's. BENCHMARKS.md's
"how we got here" table came from this:

    python scripts/compare_modules.py --mods 'mods/*.py' --fla [--backward | --both] [--profile 4x4096x16x32]
        [--rounds 3]       # each contender timed 3 times, in turn once all are warm (median)
        [--oracle NAME]    # also: every plan and chunk size of module NAME vs the float64 oracle
        [--sweep 'NAME@4x4096x16x32:scan=32,4,3;apply=128,4,2,168;...']   # launch settings of one
                                                 # role (BV,warps,stages[,register cap]), one at a time
        [--vary 'NAME@1x65536x2x8:SCAN_PROGRAMS_PER_MULTIPROCESSOR=8&SCAN_COMBINE_BV=16;...']
                                                 # module constants of one module (Python literals,
                                                 # joined by &), one variant per item
        [--autotune-cache DIR]   # FLA's autotuning results kept between runs, per GPU model
                                 # (scripts/autotune_cache.py): a fresh machine skips re-tuning

Results go to $OUT/perf.json (or /tmp) and a summary table.
"""
import argparse, ast, importlib.util, json, os, sys, time, glob
from pathlib import Path
import torch, triton, triton.testing

sys.path.insert(0, os.getcwd())
from lrdsl.verification.workloads import Shape, make_inputs, relative_error
from lrdsl import reference
from lrdsl.passes.pipeline import run_pipeline
from lrdsl.spec import load_spec

OUT = os.environ.get("OUT", "/tmp")
UNSTEADY_SPREAD = 1.10  # rounds of one contender further apart than this are flagged in the summary
p = argparse.ArgumentParser()
p.add_argument("--mods", default="mods/*.py")
p.add_argument("--spec", default="specs/gdn.toml")  # the spec every module was compiled from
p.add_argument("--shapes", default="4x4096x16x32,1x32768x16x32,1x65536x2x8")  # BxTxHxHV[xKxV]
p.add_argument("--backward", action="store_true")
p.add_argument("--fla", action="store_true")
p.add_argument("--both", action="store_true")  # forward, then forward + backward (one process)
p.add_argument("--profile", default="")
p.add_argument("--sweep", default="")  # role=BV,warps,stages;... variants on the first module
p.add_argument("--vary", default="")  # NAME@SHAPE:CONST=VALUE&...;... module-constant variants
p.add_argument("--oracle", default="")  # comma list of module names
p.add_argument("--rounds", type=int, default=1)  # timings per contender, in turn after all are warm (median)
p.add_argument("--precision", default="input")  # lrdsl modules' precision= (FLA has none)
# DIR: FLA's autotuning results from earlier runs on this GPU model, seeded into Triton's cache
# before FLA is imported and collected back after each shape (scripts/autotune_cache.py)
p.add_argument("--autotune-cache", default="")
args = p.parse_args()

rec = run_pipeline(load_spec(args.spec), until="recurrence")["recurrence"]
if args.fla and rec.name not in ("gdn", "gdn_qwen35"):
    sys.exit(f"--fla compares with FLA's gated delta rule; {args.spec} is not gdn")

def load(path):
    name = os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); return m

mods = {os.path.splitext(os.path.basename(f))[0]: load(f) for f in sorted(glob.glob(args.mods))}
fla = None
def keep_autotuning():
    """With --autotune-cache: copy the tuning results Triton's cache holds out to DIR."""
    if args.autotune_cache:
        autotune_cache.collect(Path(args.autotune_cache), torch.cuda.get_device_name(), Path(triton.knobs.cache.dir))

if args.autotune_cache:
    import autotune_cache  # scripts/, this script's folder
    triton.knobs.autotuning.cache = True  # read when FLA's kernels are decorated, at its import
    seeded = autotune_cache.seed(Path(args.autotune_cache), torch.cuda.get_device_name(), Path(triton.knobs.cache.dir))
    print(f"autotune cache: {seeded} tuning results seeded from {args.autotune_cache}", flush=True)
if args.fla:
    import fla.ops.common.chunk_o as co
    co.TRITON_ABOVE_3_7_1 = True
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    fla = lambda q, k, v, g, beta, **kw: chunk_gated_delta_rule(q=q, k=k, v=v, g=g, beta=beta, **kw)

results = []
lost_context = ""  # the sweep row whose kernel fault lost the CUDA context, if one did
def rec_row(**kw):
    results.append(kw); print(json.dumps(kw), flush=True)

def run(fn, leaves, d_o, backward):
    if backward:
        o, ht = fn(*leaves, use_qk_l2norm_in_kernel=True, output_final_state=True)
        return (o, ht) + torch.autograd.grad(o, leaves, d_o)
    return fn(*leaves, use_qk_l2norm_in_kernel=True, output_final_state=True)

def timeit(f):
    """(median ms, peak MiB the call allocates above what was allocated before it, cold s, outputs)."""
    torch.cuda.synchronize(); t = time.perf_counter(); f(); torch.cuda.synchronize(); cold = time.perf_counter() - t
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats(); out = f(); torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    ms = triton.testing.do_bench(f, warmup=30, rep=150, return_mode="median")
    return ms, peak, cold, out

if args.oracle:
    # forward + gradients vs the float64 oracle on a small slice, every module
    g = torch.Generator().manual_seed(1)
    shape = Shape(2, 300, 2, 4, 128, 128)
    ts = [t.cuda() for t in make_inputs(rec, shape, dtype=torch.bfloat16, generator=g, normalize_keys=False)]
    d_o = torch.randn(2, 300, 4, 128, generator=g).cuda()
    leaves64 = [t.double().requires_grad_() for t in ts]
    o_ref, ht_ref = reference.run(rec, *leaves64, scale=128 ** -0.5, output_final_state=True, use_qk_l2norm_in_kernel=True)
    grads_ref = torch.autograd.grad(o_ref, leaves64, d_o.double())
    for name, m in mods.items():
        if name not in args.oracle.split(','):
            continue
        for plan in m.CHUNK_PLANS:
            for C in ((16, 64) if plan == "split" else (64,)):
                leaves = [t.clone().requires_grad_() for t in ts]
                o, ht = m.chunk(*leaves, use_qk_l2norm_in_kernel=True, output_final_state=True, plan=plan, chunk_size=C)
                grads = torch.autograd.grad(o, leaves, d_o.to(o.dtype))
                errs = [relative_error(o, o_ref), relative_error(ht, ht_ref)] + [relative_error(a, b) for a, b in zip(grads, grads_ref)]
                rec_row(kind="oracle", mod=name, plan=plan, C=C, worst=max(errs), errs=[round(e, 5) for e in errs])

# --both: the forward rows first, then forward + backward, in one process (FLA autotunes once)
for args.backward in ([False, True] if args.both else [args.backward]):
    for s in args.shapes.split(","):
        B, T, H, HV, *head_dims = map(int, s.split("x"))  # BxTxHxHV, or BxTxHxHVxKxV (K = V = 128 if not given)
        K, V = head_dims or (128, 128)
        shape = Shape(B, T, H, HV, K, V)
        g = torch.Generator().manual_seed(0)
        ts = [t.cuda() for t in make_inputs(rec, shape, dtype=torch.bfloat16, generator=g, normalize_keys=False)]
        leaves = [t.requires_grad_() for t in ts] if args.backward else ts
        d_o = torch.randn(B, T, HV, V, generator=g).to("cuda", torch.bfloat16)
        impls = ([("fla", fla)] if fla else []) + [(n, (lambda m: lambda *a, **kw: m.chunk(*a, precision=args.precision, **kw))(m))
                                                      for n, m in mods.items()]
        ref_out, rows = None, []
        for name, fn in impls:
            out = None  # the last contender's outputs would count in this one's peak
            ms, peak, cold, out = timeit(lambda: run(fn, leaves, d_o, args.backward))
            diff = None
            if ref_out is None:
                ref_out = out
            else:
                diff = max(relative_error(a.float(), b.float()) for a, b in zip(out, ref_out))
            rows.append(dict(kind="time", shape=s, impl=name, bwd=args.backward, ms=round(ms, 4), peak=round(peak), cold=round(cold, 1),
                             diff=diff, finite=all(torch.isfinite(x).all().item() for x in out), rounds=[round(ms, 4)]))
        # --rounds: every contender timed again, in turn, once all are warm: the card's drift (its
        # clocks after a long autotune, say) then falls on each of them alike; ms is the median
        for _ in range(args.rounds - 1):
            for (name, fn), row in zip(impls, rows):
                row["rounds"].append(round(triton.testing.do_bench(lambda: run(fn, leaves, d_o, args.backward), warmup=30, rep=150, return_mode="median"), 4))
        for row in rows:
            row["ms"] = sorted(row["rounds"])[len(row["rounds"]) // 2]
            rec_row(**row)
        if args.sweep:
            for item in filter(None, args.sweep.split(";")):
                where, rest = item.split(":")
                name, shape_sel = where.split("@")
                if shape_sel != s:
                    continue
                m = mods[name]
                role, cfg = rest.split("=")
                BV, w, st, *cap = map(int, cfg.split(","))  # a fourth number: a register cap (maxnreg)
                saved = dict(m.CHUNK_LAUNCH[role])
                m.CHUNK_LAUNCH[role] = {**saved, "BV": BV, "num_warps": w, "num_stages": st, **({"maxnreg": cap[0]} if cap else {})}
                # the variant is the whole setting: no shape-dependent override replaces part of it
                overrides = [table for table in (m.CHUNK_LAUNCH_SMALL_CHUNK, m.CHUNK_LAUNCH_FEW_PROGRAMS, getattr(m, "CHUNK_LAUNCH_FEWER_PROGRAMS", {})) if role in table]
                popped = [table.pop(role) for table in overrides]
                try:
                    if lost_context:
                        raise RuntimeError(f"not run: the CUDA context was lost at {lost_context}")
                    ms, peak, cold, out = timeit(lambda: run(m.chunk, leaves, d_o, args.backward))
                    diff = max(relative_error(a.float(), b.float()) for a, b in zip(out, ref_out))
                    rec_row(kind="sweep", shape=s, mod=name, role=role, cfg=cfg, ms=round(ms, 4), diff=diff)
                except Exception as e:
                    # A fault in a kernel (an illegal address) poisons the process's CUDA context: every
                    # later launch fails too, so only the first such row is about its own setting.
                    if "CUDA error" in str(e) and not lost_context:
                        lost_context = f"{name} {role}={cfg}"
                    rec_row(kind="sweep", shape=s, mod=name, role=role, cfg=cfg, error=str(e)[:200])
                m.CHUNK_LAUNCH[role] = saved
                for table, setting in zip(overrides, popped):
                    table[role] = setting
        for item in filter(None, args.vary.split(";")):
            where, assignments = item.split(":", 1)
            name, shape_sel = where.split("@")
            if shape_sel != s or lost_context:
                continue
            m = mods[name]
            values = {key: ast.literal_eval(value) for key, value in (a.split("=", 1) for a in assignments.split("&"))}
            saved = {key: getattr(m, key) for key in values}  # an unknown constant is an AttributeError here
            for key, value in values.items():
                setattr(m, key, value)
            try:
                ms, peak, cold, out = timeit(lambda: run(m.chunk, leaves, d_o, args.backward))
                diff = max(relative_error(a.float(), b.float()) for a, b in zip(out, ref_out))
                rec_row(kind="vary", shape=s, mod=name, set=assignments, ms=round(ms, 4), peak=round(peak), diff=diff)
            except Exception as e:
                if "CUDA error" in str(e):
                    lost_context = f"{name} {assignments}"
                rec_row(kind="vary", shape=s, mod=name, set=assignments, error=str(e)[:200])
            for key, value in saved.items():
                setattr(m, key, value)
        if lost_context:
            break
        if args.profile and s in args.profile.split("+"):
            from torch.profiler import profile, ProfilerActivity
            for name, fn in impls:
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(3):
                        run(fn, leaves, d_o, args.backward)
                    torch.cuda.synchronize()
                table = {}
                for e in prof.key_averages():
                    if e.device_type.name == "CUDA" or getattr(e, "cuda_time_total", 0):
                        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
                        if t > 0:
                            table[e.key[:60]] = round(t / 3 / 1000, 4)
                top = sorted(table.items(), key=lambda kv: -kv[1])[:14]
                # the last call's kernels in launch order, to tell a kernel's forward run from its re-run
                kernels = sorted((e for e in prof.events() if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start)
                calls = [(e.name[:40], round(e.time_range.elapsed_us() / 1000, 4)) for e in kernels[len(kernels) * 2 // 3:]]
                rec_row(kind="profile", shape=s, impl=name, kernels_ms=top, calls=calls)
        keep_autotuning()
        torch.cuda.empty_cache()


json.dump(results, open(os.path.join(OUT, "perf.json"), "w"), indent=1)
if lost_context:
    print(f"CUDA context lost at {lost_context}: later shapes and the profile did not run")
print("=== summary ===")
for r in results:
    if r["kind"] == "time":
        spread = f' rounds {min(r["rounds"]):.3f}-{max(r["rounds"]):.3f}' if len(r["rounds"]) > 1 else ""
        # a contender whose rounds disagree (FLA's first rounds after its autotuning, session 28:
        # 0.915 / 1.252 / 1.368 ms) has no steady median to take a ratio of
        unsteady = max(r["rounds"]) > UNSTEADY_SPREAD * min(r["rounds"])
        flag = f'  UNSTEADY: rounds {100 * (max(r["rounds"]) / min(r["rounds"]) - 1):.0f} % apart, time again' if unsteady else ""
        print(f'{r["shape"]:<16} {r["impl"]:<14} bwd={r["bwd"]} {r["ms"]:>8.3f} ms{spread} peak {r["peak"]:>6} cold {r["cold"]:>5} diff {r["diff"]} finite {r["finite"]}{flag}')
    elif r["kind"] == "sweep":
        print(f'sweep {r["shape"]:<16} {r["role"]} {r["cfg"]} {r.get("ms")} {r.get("error", "")[:80]} diff {r.get("diff")}')
    elif r["kind"] == "oracle":
        print(f'oracle {r["mod"]} {r["plan"]} C={r["C"]} worst {r["worst"]:.2e}')
