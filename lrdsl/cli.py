"""The `lrdsl` command line.

    lrdsl compile SPEC -o FILE        write one standalone module (imports torch and triton only)
    lrdsl show SPEC --stage NAME      print one compiler stage (recurrence, step, module, ...)
    lrdsl check SPEC                  run the generated kernels against the float64 oracle
    lrdsl demo [SPEC]                 the main job: compile, run, print errors and times (default gdn)
    lrdsl specs                       list the shipped specs (their names work wherever SPEC is asked)
    lrdsl memory SPEC                 a chunk call's GPU memory at each launch and its peak, without a GPU
    lrdsl resources SPEC              registers, spills and shared memory per kernel for sm_90, without a GPU
    lrdsl cache info | prune | clear  the module cache: what it holds; remove what this lrdsl
                                      never serves; remove everything
    lrdsl --version

Every failure is one line on stderr, and the exit status says which kind it was:

    0    done (a check: every kernel within tolerance)
    1    a check failed: a kernel outside tolerance (bench: a row failed the oracle gate)
    2    a user error: a bad spec, option or shape (`lrdsl: error: ...`)
    73   an output cannot be written: no permission, a read-only or full file system, a missing
         directory, a parent that is a file (`lrdsl: error: cannot write ...`; nothing half-written)
    130  interrupted (Ctrl-C)
    141  stdout was closed (`lrdsl show ... | head`)
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

from . import config
from .errors import LrdslError, OutputError

EXIT_CHECK_FAILED = 1
EXIT_USER_ERROR = 2
EXIT_CANNOT_WRITE = 73  # sysexits.h's EX_CANTCREAT
EXIT_INTERRUPTED = 128 + signal.SIGINT


SHAPE_FIELDS = ("B", "T", "H", "HV", "K", "V")
SPEC_HELP = "a shipped spec's name (lrdsl specs lists them) or a spec file's path"


def _parse_shape(text: str):
    from .verification.workloads import Shape

    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        values = []
    if len(values) != len(SHAPE_FIELDS):
        raise LrdslError(f"--shape takes six positive integers B,T,H,HV,K,V, got {text!r}")
    for field, value in zip(SHAPE_FIELDS, values):
        if value < 1:  # an empty batch, sequence or head checks nothing
            raise LrdslError(f"--shape {text}: {field} must be at least 1, got {value}")
    return Shape(*values)


def _parse_chunk_sizes(text: str) -> list:
    """bench --chunk-sizes: comma-separated positive integers or "auto" (None: the module's choice)."""
    sizes = []
    for token in (t.strip() for t in text.split(",")):
        if token == "auto":
            sizes.append(None)
        elif token.isdigit() and int(token) > 0:
            sizes.append(int(token))
        else:
            raise LrdslError(f"--chunk-sizes takes chunk sizes or 'auto', comma-separated, got {token!r} in {text!r}")
    return sizes


def write_output(path: Path, text: str) -> None:
    """Write a file the user asked for, whole or not at all (a temporary file renamed into place);
    any reason it cannot be written is one OutputError line naming the file."""
    from .runtime.cache import atomic_write

    try:
        atomic_write(path, text)
    except OSError as exc:
        raise OutputError(f"cannot write {path} ({exc.strerror or type(exc).__name__})") from None


def cmd_compile(args) -> int:
    from .runtime.loader import generate

    source, _ = generate(args.spec)
    out = Path(args.output)
    if out.exists() and out.is_dir():
        raise OutputError(f"{out}: is a directory, expected a file path for the module")
    if not out.parent.exists():
        raise OutputError(f"{out.parent}: directory does not exist")
    write_output(out, source)
    print(f"wrote {out} ({len(source.splitlines())} lines)")
    return 0


def show_stages() -> tuple[str, ...]:
    """Every stage `lrdsl show` prints: the pipeline's stages, then the generated module."""
    from .passes.pipeline import STAGES

    return STAGES + ("module",)


def cmd_show(args) -> int:
    from .codegen.module import emit_module
    from .passes.pipeline import run_pipeline
    from .spec import load_spec_by_name as load_spec

    stage = args.stage.replace("-", "_")  # backward-plan reads as well as backward_plan
    if stage not in show_stages():
        raise LrdslError(f"unknown stage {args.stage!r}; stages: {', '.join(show_stages())}")
    spec = load_spec(args.spec)
    if stage == "module":
        print(emit_module(run_pipeline(spec), spec_path=args.spec), end="")
        return 0
    result = run_pipeline(spec, until=stage)[stage]
    print(result.describe() if hasattr(result, "describe") else _describe_spec(result))
    return 0


def _describe_spec(spec) -> str:
    lines = [f"spec {spec.name}   ({spec.path})", f"  update   {spec.update.value}", f"  gate     {spec.gate.value}"]
    if spec.steps_per_token > 1:
        lines.append(f"  steps    {spec.steps_per_token} per token")
    lines += [f"  input    {name}: {role.value}" for name, role in spec.inputs]
    lines += [f"  formula  {key} = {f.text}" for key, f in spec.formulas.items()]
    return "\n".join(lines)


def _run_checks(spec_path: str, shape, seed, module=None, timed=True, plans=None, chunk_sizes=None, gradients=True):
    import torch

    from . import load
    from .verification.check import check_module, format_header, format_row
    from .passes.pipeline import run_pipeline
    from .spec import load_spec_by_name as load_spec

    interpreted = config.use_interpreter_without_gpu()
    rec = run_pipeline(load_spec(spec_path), until="recurrence")["recurrence"]
    module = module if module is not None else load(spec_path)
    device = "cpu" if interpreted else "cuda"
    dtypes = [torch.float32, torch.float16] + ([] if interpreted else [torch.bfloat16])
    where = "CPU, Triton interpreter" if interpreted else torch.cuda.get_device_name()
    print(f"{rec.name}: generated kernels vs the float64 oracle ({where}; {shape}; seed {seed})")
    if interpreted:
        print("note: on the CPU the kernels run in Triton's interpreter: slow, and any time it shows "
              "measures the interpreter, not the kernels' speed")
    print(format_header(), flush=True)
    start = time.perf_counter()

    def show_progress(row, done: int, total: int) -> None:
        elapsed = time.perf_counter() - start
        if done < total:
            progress = f"{done}/{total}, about {_duration(elapsed / done * (total - done))} left"
        else:
            progress = f"{done}/{total}, {_duration(elapsed)} in all"
        print(f"{format_row(row)}  [{progress}]", flush=True)

    rows = check_module(module, rec, shape, dtypes=dtypes, device=device, seed=seed, timed=timed,
                        plans=plans, chunk_sizes=chunk_sizes, gradients=gradients, on_row=show_progress)
    failed = [r for r in rows if not r.ok]
    print(f"{len(rows) - len(failed)}/{len(rows)} within tolerance")
    return 1 if failed else 0


def _duration(seconds: float) -> str:
    seconds = round(seconds)
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


def cmd_check(args) -> int:
    import torch

    if args.prove:
        return _prove(args.spec, backward=not args.forward_only)
    seed = args.seed if args.seed is not None else int(torch.seed() % 2**31)
    shape = _parse_shape(args.shape)
    _check_plan_and_chunk_size(args.spec, args.plan, args.chunk_size)  # before the header prints
    plans = [args.plan] if args.plan else None
    chunk_sizes = [args.chunk_size] if args.chunk_size else None
    return _run_checks(args.spec, shape, seed, timed=False, plans=plans, chunk_sizes=chunk_sizes,
                       gradients=not args.forward_only)


def _check_plan_and_chunk_size(spec_path: str, plan, chunk_size) -> None:
    """check --plan and --chunk-size against the spec's module, in one line each."""
    if plan is None and chunk_size is None:
        return
    from . import load

    module = load(spec_path)
    plans, sizes = getattr(module, "CHUNK_PLANS", ()), getattr(module, "CHUNK_SIZES", ())
    if plan is not None and plan not in plans:
        raise LrdslError(f"--plan: {module.SPEC_NAME} has no chunk plan {plan!r}; plans: {', '.join(plans) or 'none'}")
    if chunk_size is not None and chunk_size not in sizes:
        raise LrdslError(f"--chunk-size: {chunk_size} is not one of {module.SPEC_NAME}'s chunk sizes {sizes}")


def cmd_specs(args) -> int:
    from .spec import load_spec_by_name, shipped_spec_dir, shipped_spec_names

    names = shipped_spec_names()
    width = max(map(len, names), default=0)
    print(f"shipped specs ({shipped_spec_dir()}); each name works wherever a spec file is asked:")
    for name in names:
        print(f"  {name:<{width}}  {load_spec_by_name(name).summary}")
    return 0


def cmd_memory(args) -> int:
    from .measure.memory import run

    return run(args)


def cmd_resources(args) -> int:
    from .measure.resources import run

    return run(args)


def run_tool(run, args) -> int:
    """`python -m lrdsl.measure.memory` and `python -m lrdsl.measure.resources`: the CLI's one-line errors and exit statuses."""
    args.run = run
    return run_command(args)


def _prove(spec_path: str, backward: bool = True) -> int:
    from .ir.chunk import NoChunkForm
    from .passes.pipeline import run_pipeline
    from .verification.prove import prove, prove_backward
    from .spec import load_spec_by_name as load_spec

    stages = run_pipeline(load_spec(spec_path), until="backward_factored")
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
    if backward:
        print(f"{prog.recurrence.name}: backward chunk program == sympy.diff of the unrolled recurrence")
        report(prove_backward(prog, stages["backward_factored"]), "gradient entries")
    return 1 if failed else 0


def cmd_demo(args) -> int:
    interpreted = config.use_interpreter_without_gpu()  # before anything imports triton
    import torch

    from .runtime.loader import generate, import_file

    source, stages = generate(args.spec)
    out = Path(args.output_dir) / f"{stages['recurrence'].name}_ops.py"
    write_output(out, source)
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
    from .measure.bench import parse_shapes, require_matplotlib

    # everything that can be wrong with the command is said before any GPU time is spent
    for option, target in (("--json", args.json), ("--plot", args.plot)):
        if target and not Path(target).resolve().parent.is_dir():
            raise LrdslError(f"{option} {target}: directory {Path(target).parent} does not exist")
    if args.plot:
        require_matplotlib()
    if args.from_json:
        return _bench_report_from_json(args)
    spec_paths = _bench_spec_paths(args)
    shapes = parse_shapes(args.shapes)
    plans = [p.strip() for p in args.plans.split(",")] if args.plans else None
    chunk_sizes = _parse_chunk_sizes(args.chunk_sizes) if args.chunk_sizes else None

    specs = _bench_specs(spec_paths, plans, chunk_sizes)

    import torch

    if not torch.cuda.is_available():
        raise LrdslError("bench needs a CUDA GPU (timings on the CPU interpreter mean nothing)")
    return _bench_on_gpu(args, specs, shapes, plans, chunk_sizes)


def _bench_report_from_json(args) -> int:
    """Table, summary, JSON and plot of rows measured earlier (no GPU needed)."""
    from .measure.bench import rows_from_json

    if args.specs or args.all:
        raise LrdslError("bench --from-json reports rows measured earlier: give no spec files or --all")
    return _bench_report([row for path in args.from_json for row in rows_from_json(path)], args, print_rows=True)


def _bench_report(rows, args, print_rows: bool) -> int:
    """The ratio summary, --json, --plot; exit status 1 when an lrdsl row FAILED the gate."""
    from .measure.bench import HEADER, LRDSL, format_row, format_summary, plot_ratios, to_json

    if print_rows:
        print(f"{HEADER}\n{'-' * len(HEADER)}")
        for row in rows:
            print(format_row(row))
    print()
    print(format_summary(rows))
    if args.json:
        write_output(Path(args.json), to_json(rows))
        print(f"wrote {args.json}")
    if args.plot:
        plot_ratios(rows, args.plot)
        print(f"wrote {args.plot}")
    failed = [r for r in rows if r.impl == LRDSL and not r.ok]
    if failed:
        print(f"{len(failed)} lrdsl row(s) FAILED the correctness gate")
    return 1 if failed else 0


def _bench_spec_paths(args) -> list[str]:
    """The specs named, or with --all every spec in ./specs that has an FLA counterpart."""
    from .measure.bench import fla_baseline
    from .passes.pipeline import run_pipeline
    from .spec import load_spec_by_name as load_spec

    if args.all and args.specs:
        raise LrdslError("bench: give spec files or --all, not both")
    if not args.all:
        if not args.specs:
            raise LrdslError("bench: give one or more spec files, or --all")
        return args.specs
    found = sorted(Path("specs").glob("*.toml"))
    chosen = [str(p) for p in found
              if fla_baseline(run_pipeline(load_spec(p), until="recurrence")["recurrence"]) is not None]
    if not chosen:
        raise LrdslError("bench --all: no spec in ./specs has an FLA counterpart (run it from the repository root)")
    return chosen


def _bench_specs(spec_paths, plans, chunk_sizes) -> list:
    """Compile each spec (no GPU needed) and check --plans and --chunk-sizes against its module."""
    from . import load
    from .measure.bench import SpecUnderTest
    from .passes.pipeline import run_pipeline
    from .spec import load_spec_by_name as load_spec

    specs = []
    for path in spec_paths:
        rec = run_pipeline(load_spec(path), until="recurrence")["recurrence"]
        module = load(path)
        for plan in plans or ():
            if plan not in module.CHUNK_PLANS:
                raise LrdslError(f"--plans: {rec.name} has no plan {plan!r}; plans: {', '.join(module.CHUNK_PLANS)}")
        for size in chunk_sizes or ():
            if size is not None and size not in module.CHUNK_SIZES:  # None is "auto"
                raise LrdslError(f"--chunk-sizes: {size} is not one of {rec.name}'s chunk sizes {module.CHUNK_SIZES}")
        specs.append(SpecUnderTest(rec.name, rec, module))
    return specs


def _bench_on_gpu(args, specs, shapes, plans, chunk_sizes) -> int:
    import torch
    import triton

    from .measure.bench import HEADER, allow_fla_gated_backward_on_hopper, bench, fla_baseline, format_row, resolve_fla

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
          f"fla-core {_installed_version('fla-core')}, flash-qla {_installed_version('flash-qla')}; seed {args.seed}")
    for spec in specs:
        if fla_baseline(spec.rec) is None:
            print(f"note: {spec.name} has no FLA counterpart: lrdsl rows only, no ratio")
        elif resolve_fla(fla_baseline(spec.rec)) is None:
            print(f"note: fla-core is not importable: {spec.name} gets lrdsl rows only, no ratio")
    if args.backward and allow_fla_gated_backward_on_hopper():
        print("note: fla-core's refusal of its gated backward on Hopper with triton < 3.7.1 is lifted to time it")
    print(f"{HEADER}\n{'-' * len(HEADER)}")

    def show(group):
        for row in group:
            print(format_row(row), flush=True)

    rows = bench(specs, shapes, plans=plans, backward=args.backward, seed=args.seed, on_rows=show, chunk_sizes=chunk_sizes,
                 on_note=lambda text: print(f"note: {text}", flush=True), serving=args.serving)
    return _bench_report(rows, args, print_rows=False)  # the rows were printed as they came


def _installed_version(distribution: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "absent"


def _size(size: int) -> str:
    if size < 1024:
        return f"{size} B"
    if size < 1024**2:
        return f"{size / 1024:.1f} KiB"
    return f"{size / 1024**2:.1f} MiB"


def _summary(files) -> str:
    return f"{len(files)} file{'s' if len(files) != 1 else ''}, {_size(sum(f.size for f in files))}"


def cmd_cache(args) -> int:
    from .runtime import cache

    directory = config.cache_dir()
    if args.action == "info":
        files = cache.survey(directory)
        print(f"module cache {directory}" + ("" if directory.is_dir() else " (not created yet)"))
        width = max((len(f.path.name) for f in files), default=0)
        for file in files:
            why = f": {file.why}" if file.why else ""
            print(f"  {file.path.name:<{width}}  {_size(file.size):>10}  {file.state}{why}")
        entries = [f for f in files if f.is_entry]
        prunable = [f for f in files if f.state in cache.PRUNED]
        print(f"entries: {_summary(entries)}; served by this lrdsl: "
              f"{_summary([f for f in entries if f.state == cache.SERVED])}")
        print(f"stale (other builds' and damaged entries, temporary files of writers that stopped): "
              f"{_summary(prunable)}" + ("; `lrdsl cache prune` removes them" if prunable else ""))
        return 0
    removed = cache.prune(directory) if args.action == "prune" else cache.clear(directory)
    print(f"removed {_summary(removed)} from {directory}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from . import __version__
    from .measure.memory import add_arguments as memory_arguments
    from .measure.resources import add_arguments as resources_arguments

    parser = argparse.ArgumentParser(prog="lrdsl", description="Compile linear-recurrence specs into Triton kernels.")
    parser.add_argument("--version", action="version", version=f"lrdsl {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("compile", help="write one standalone module for a spec")
    p.add_argument("spec", help=SPEC_HELP)
    p.add_argument("-o", "--output", required=True, help="the .py file to write")
    p.set_defaults(run=cmd_compile)

    p = sub.add_parser("show", help="print one compiler stage")
    p.add_argument("spec", help=SPEC_HELP)
    p.add_argument("--stage", default="recurrence",
                   help=f"one of {', '.join(show_stages())} ('-' may replace '_'; default recurrence)")
    p.set_defaults(run=cmd_show)

    p = sub.add_parser("check", help="run the generated kernels against the float64 oracle")
    p.add_argument("spec", help=SPEC_HELP)
    # the default crosses a chunk boundary (T = 20 > 16) with two value heads per key head and a
    # value dim that is not a power of two, and stays small: on a CPU every kernel runs interpreted
    p.add_argument("--shape", default="1,20,1,2,16,24", help="B,T,H,HV,K,V (default 1,20,1,2,16,24)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--forward-only", action="store_true", help="skip the gradient checks (with --prove: the backward's proof)")
    p.add_argument("--plan", default=None, help="check this chunk plan only (default: every plan)")
    p.add_argument("--chunk-size", type=int, default=None, help="check this chunk size only (default: every size)")
    p.add_argument("--prove", action="store_true",
                   help="instead: prove the chunk form and its backward equal to the recurrence (sympy)")
    p.set_defaults(run=cmd_check)

    p = sub.add_parser("bench", help="time the generated kernels side by side with FLA and FlashQLA (GPU)")
    p.add_argument("specs", nargs="*", metavar="SPEC", help="spec files (or --all)")
    p.add_argument("--all", action="store_true", help="every spec in ./specs with an FLA counterpart")
    p.add_argument("--shapes", default="training",
                   help="comma-separated: training, family (4 x 4096, H = HV = 16: every spec with an FLA counterpart), decode, "
                        "a known shape by BxT (4x4096, 256x1) or BxTxHxHV[xKxV]; T = 1 is decode (default training)")
    p.add_argument("--plans", default=None, help="comma-separated chunk plans (default: the module's default plan)")
    p.add_argument("--chunk-sizes", default=None, metavar="C[,C...]",
                   help="also time lrdsl's chunk kernels at these chunk sizes (\"auto\": the module's choice; default: auto "
                        "only); a size pins the backward's chunk size to it too")
    p.add_argument("--backward", action="store_true", help="also time forward + backward (training shapes)")
    p.add_argument("--serving", action="store_true",
                   help="also time, at decode shapes, decode on a state pool (fp32, bf16 and 8-bit state), verify of 4 draft "
                        "tokens and verify + commit, eager and as CUDA-graph replays (lrdsl only)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the rows to this JSON file")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="write a PNG of peer / lrdsl per shape (needs matplotlib)")
    p.add_argument("--from-json", nargs="+", default=None, metavar="FILE",
                   help="instead of measuring: report (and --plot, --json) rows that earlier --json runs wrote")
    p.set_defaults(run=cmd_bench)

    p = sub.add_parser("demo", help="compile a spec to a file, run it against the oracle, print errors and times")
    p.add_argument("spec", nargs="?", default="gdn", help=SPEC_HELP + " (default gdn)")
    p.add_argument("--output-dir", default="out", help="where the compiled module goes (default out/)")
    p.add_argument("--shape", default=None, help="B,T,H,HV,K,V")
    p.add_argument("--seed", type=int, default=None)
    p.set_defaults(run=cmd_demo)

    p = sub.add_parser("specs", help="list the shipped specs, whose names work wherever a spec file is asked")
    p.set_defaults(run=cmd_specs)

    p = sub.add_parser("memory", help="a chunk call's GPU memory at each launch and at its peak, without a GPU")
    memory_arguments(p)
    p.set_defaults(run=cmd_memory)

    p = sub.add_parser("resources", help="registers, spills and shared memory of every kernel for sm_90, without a GPU")
    resources_arguments(p)
    p.set_defaults(run=cmd_resources)

    p = sub.add_parser("cache", help="show or trim the module cache (LRDSL_CACHE_DIR)")
    p.add_argument("action", choices=("info", "prune", "clear"),
                   help="info: the directory, its entries, their sizes and which are stale; prune: remove "
                        "entries this lrdsl never serves (other builds', damaged) and temporary files of "
                        "writers that stopped; clear: remove every entry")
    p.set_defaults(run=cmd_cache)
    return parser


def main(argv=None) -> int:
    return run_command(build_parser().parse_args(argv))


def run_command(args) -> int:
    """args.run(args), each failure one line on stderr with its exit status."""
    try:
        status = args.run(args)
        sys.stdout.flush()  # here, not at exit: a closed pipe must raise where it is handled
        return status
    except BrokenPipeError:
        # the reader went away (`lrdsl show ... | head`): stop quietly, as cat does; stdout goes to
        # /dev/null so the interpreter's final flush does not fail again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except KeyboardInterrupt:
        print("lrdsl: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except OutputError as exc:
        print(f"lrdsl: error: {exc}", file=sys.stderr)
        return EXIT_CANNOT_WRITE
    except LrdslError as exc:
        print(f"lrdsl: error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    except ValueError as exc:
        # the generated module's InputError (a ValueError) for tensors the user's shape produced
        if type(exc).__name__ != "InputError":
            raise
        print(f"lrdsl: error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR


if __name__ == "__main__":
    sys.exit(main())
