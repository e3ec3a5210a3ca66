"""The `lrdsl` command line.

    lrdsl compile SPEC -o FILE        write one standalone module (imports torch and triton only)
    lrdsl show SPEC --stage NAME      print one compiler stage (recurrence, step, module, ...)
    lrdsl check SPEC                  run the generated kernels against the float64 oracle
    lrdsl demo [SPEC]                 the main job: compile, run, print errors and times

Any user error prints one line `lrdsl: error: ...` and exits with status 2; a failed check exits 1.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import config
from .errors import LrdslError


def _parse_shape(text: str):
    from .workloads import Shape

    try:
        values = [int(x) for x in text.split(",")]
        if len(values) != 6 or min(values) < 0:
            raise ValueError
    except ValueError:
        raise LrdslError(f"--shape takes six non-negative integers B,T,H,HV,K,V, got {text!r}") from None
    return Shape(*values)


def cmd_compile(args) -> int:
    from .runtime.cache import atomic_write
    from .runtime.loader import generate

    source, _ = generate(args.spec)
    out = Path(args.output)
    if out.exists() and out.is_dir():
        raise LrdslError(f"{out}: is a directory, expected a file path for the module")
    if not out.parent.exists():
        raise LrdslError(f"{out.parent}: directory does not exist")
    atomic_write(out, source)
    print(f"wrote {out} ({len(source.splitlines())} lines)")
    return 0


def cmd_show(args) -> int:
    from .codegen.module import emit_module
    from .passes.pipeline import STAGES, run_pipeline
    from .spec import load_spec

    known = STAGES + ("module",)
    if args.stage not in known:
        raise LrdslError(f"unknown stage {args.stage!r}; stages: {', '.join(known)}")
    spec = load_spec(args.spec)
    if args.stage == "module":
        print(emit_module(run_pipeline(spec), spec_path=args.spec), end="")
        return 0
    stage = run_pipeline(spec, until=args.stage)[args.stage]
    print(stage.describe() if hasattr(stage, "describe") else _describe_spec(stage))
    return 0


def _describe_spec(spec) -> str:
    lines = [f"spec {spec.name}   ({spec.path})", f"  update   {spec.update.value}", f"  gate     {spec.gate.value}"]
    lines += [f"  input    {name}: {role.value}" for name, role in spec.inputs]
    lines += [f"  formula  {key} = {f.text}" for key, f in spec.formulas.items()]
    return "\n".join(lines)


def _run_checks(spec_path: str, shape, seed, module=None, timed=True, plans=None, chunk_sizes=None, gradients=True):
    import torch

    from . import load
    from .check import check_module, format_rows
    from .passes.pipeline import run_pipeline
    from .spec import load_spec

    interpreted = config.use_interpreter_without_gpu()
    rec = run_pipeline(load_spec(spec_path), until="recurrence")["recurrence"]
    module = module if module is not None else load(spec_path)
    device = "cpu" if interpreted else "cuda"
    dtypes = [torch.float32, torch.float16] + ([] if interpreted else [torch.bfloat16])
    where = "CPU, Triton interpreter" if interpreted else torch.cuda.get_device_name()
    print(f"{rec.name}: generated kernels vs the float64 oracle ({where}; {shape}; seed {seed})")
    rows = check_module(module, rec, shape, dtypes=dtypes, device=device, seed=seed, timed=timed,
                        plans=plans, chunk_sizes=chunk_sizes, gradients=gradients)
    print(format_rows(rows))
    failed = [r for r in rows if not r.ok]
    print(f"{len(rows) - len(failed)}/{len(rows)} within tolerance")
    return 1 if failed else 0


def cmd_check(args) -> int:
    import torch

    if args.prove:
        return _prove(args.spec)
    seed = args.seed if args.seed is not None else int(torch.seed() % 2**31)
    plans = [args.plan] if args.plan else None
    chunk_sizes = [args.chunk_size] if args.chunk_size else None
    return _run_checks(args.spec, _parse_shape(args.shape), seed, timed=False, plans=plans, chunk_sizes=chunk_sizes,
                       gradients=not args.forward_only)


def _prove(spec_path: str) -> int:
    from .ir.chunk import NoChunkForm
    from .passes.pipeline import run_pipeline
    from .prove import prove, prove_backward
    from .spec import load_spec

    stages = run_pipeline(load_spec(spec_path), until="backward")
    prog = stages["chunk"]
    if isinstance(prog, NoChunkForm):
        raise LrdslError(prog.describe())
    failed = 0

    def report(results, what):
        nonlocal failed
        for result in results:
            status = "proved" if result.ok else "FAILED at " + ", ".join(result.failures)
            tail = " (last chunk of a sequence)" if result.rows < result.C else ""
            print(f"  C = {result.C}, {result.rows} rows{tail}: {result.entries} {what}: {status}")
            failed += not result.ok

    print(f"{prog.recurrence.name}: chunk program == unrolled recurrence, symbolically (K = V = 2)")
    report(prove(prog), "entries of O and the exit state")
    print(f"{prog.recurrence.name}: backward chunk program == sympy.diff of the unrolled recurrence")
    report(prove_backward(prog, stages["backward"]), "gradient entries")
    return 1 if failed else 0


def cmd_demo(args) -> int:
    interpreted = config.use_interpreter_without_gpu()  # before anything imports triton
    import torch

    from .runtime.cache import atomic_write
    from .runtime.loader import generate, import_file

    source, stages = generate(args.spec)
    out = Path(args.output_dir) / f"{stages['recurrence'].name}_ops.py"
    atomic_write(out, source)
    print(f"compiled {args.spec} -> {out} ({len(source.splitlines())} lines)")
    module = import_file(out, f"lrdsl_demo_{stages['recurrence'].name}")
    default = "2,40,2,4,32,48" if interpreted else "4,2048,16,32,128,128"
    shape = _parse_shape(args.shape or default)
    seed = args.seed if args.seed is not None else int(torch.seed() % 2**31)
    # the CPU interpreter is slow: there the demo runs the default chunk plan and size only
    if interpreted:
        return _run_checks(args.spec, shape, seed, module=module, plans=[module.DEFAULT_CHUNK_PLAN], chunk_sizes=[64])
    return _run_checks(args.spec, shape, seed, module=module)


def cmd_bench(args) -> int:
    import torch

    from . import load
    from .bench import (
        DECODE_SHAPES, FAMILY_SHAPES, HEADER, TRAINING_SHAPES, allow_fla_gated_backward_on_hopper, bench, format_row,
        to_json,
    )
    from .passes.pipeline import run_pipeline
    from .spec import load_spec

    if not torch.cuda.is_available():
        raise LrdslError("bench needs a CUDA GPU (timings on the CPU interpreter mean nothing)")
    rec = run_pipeline(load_spec(args.spec), until="recurrence")["recurrence"]
    module = load(args.spec)
    shapes = {"training": TRAINING_SHAPES, "family": FAMILY_SHAPES, "decode": DECODE_SHAPES}[args.shapes]
    kernel = "recurrent" if args.shapes == "decode" else "chunk"
    plans = args.plans.split(",") if args.plans else list(module.CHUNK_PLANS)
    import triton

    print(f"{rec.name}: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    if args.backward and allow_fla_gated_backward_on_hopper():
        print("note: fla-core's refusal of its gated backward on Hopper with triton < 3.7.1 is lifted to time it")
    print(f"{HEADER}\n{'-' * len(HEADER)}")
    rows = bench(module, rec, shapes, plans, kernel=kernel, backward=args.backward,
                 on_row=lambda row: print(format_row(row), flush=True))
    if args.json:
        Path(args.json).write_text(to_json(rows))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lrdsl", description="Compile linear-recurrence specs into Triton kernels.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("compile", help="write one standalone module for a spec")
    p.add_argument("spec")
    p.add_argument("-o", "--output", required=True, help="the .py file to write")
    p.set_defaults(run=cmd_compile)

    p = sub.add_parser("show", help="print one compiler stage")
    p.add_argument("spec")
    p.add_argument("--stage", default="recurrence", help="recurrence, step, chunk, stages, plan, module (default recurrence)")
    p.set_defaults(run=cmd_show)

    p = sub.add_parser("check", help="run the generated kernels against the float64 oracle")
    p.add_argument("spec")
    p.add_argument("--shape", default="2,19,2,4,24,40", help="B,T,H,HV,K,V (default 2,19,2,4,24,40)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--forward-only", action="store_true", help="skip the gradient checks")
    p.add_argument("--plan", default=None, help="check this chunk plan only (default: every plan)")
    p.add_argument("--chunk-size", type=int, default=None, help="check this chunk size only (default: every size)")
    p.add_argument("--prove", action="store_true", help="instead: prove the chunk form equal to the recurrence (sympy)")
    p.set_defaults(run=cmd_check)

    p = sub.add_parser("bench", help="time the generated kernels side by side with fla-core (GPU)")
    p.add_argument("spec")
    p.add_argument("--shapes", choices=["training", "family", "decode"], default="training",
                   help="training: the GDN shapes (GVA); family: 4 x 4096, H = HV = 16 (kda, gla vs FLA); decode")
    p.add_argument("--plans", default=None, help="comma-separated chunk plans (default: all)")
    p.add_argument("--backward", action="store_true", help="time forward + backward (training)")
    p.add_argument("--json", default=None, help="also write the rows to this JSON file")
    p.set_defaults(run=cmd_bench)

    p = sub.add_parser("demo", help="compile a spec to a file, run it against the oracle, print errors and times")
    p.add_argument("spec", nargs="?", default="specs/gdn.toml")
    p.add_argument("--output-dir", default="out", help="where the compiled module goes (default out/)")
    p.add_argument("--shape", default=None, help="B,T,H,HV,K,V")
    p.add_argument("--seed", type=int, default=None)
    p.set_defaults(run=cmd_demo)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except LrdslError as exc:
        print(f"lrdsl: error: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:
        # the generated module's InputError (a ValueError) for tensors the user's shape produced
        if type(exc).__name__ != "InputError":
            raise
        print(f"lrdsl: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
