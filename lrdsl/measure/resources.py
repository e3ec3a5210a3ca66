"""Ahead-of-time compilation of a generated module's kernels for an NVIDIA target, without a GPU.

Triton compiles for any target on any machine (its bundled ptxas assembles sm_90 code on a CPU
box). This runs a generated module's `chunk` (forward and backward, every plan) and `recurrent`
on meta tensors with every kernel launch intercepted: each launch's arguments give the kernel's
signature and constants, which are then compiled for the target. The report says, per kernel and
launch setting, what the GPU would give it: registers per thread, bytes spilled per thread and
shared memory per block, and whether it fits (a block gets at most 232,448 bytes of shared
memory on sm_90). So what only the GPU compiler rejects (a tl.dot dimension under 16, say),
register pressure and shared-memory overflows show up in CI, not on the GPU.

    lrdsl resources SPEC [SPEC ...] [--shape B,T,H,HV,K,V ...] [--dtype bf16] [--precision input]
                    [--chunk-size C|default] [--kernels TEXT] [--launch ROLE=BV,WARPS,STAGES[,MAXNREG] ...]
                    (or python -m lrdsl.measure.resources ...)

--launch replaces a kernel role's launch settings (the roles of the module's CHUNK_LAUNCH: system,
apply, scan, output, bwd_output, ...) after the module's own rules have chosen them; given several
times, it reports once per setting, so the spills of a kernel can be read per launch setting
before any GPU time is spent on it (`--launch "bwd_output=64,8,1" --launch "bwd_output=32,4,1"`;
several roles in one setting are separated by ';').

A chunk size over the module's largest for the shape (largest_chunk_size) is refused by chunk()
itself, as for any call.
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
from dataclasses import dataclass

SM90_SHARED_LIMIT = 232_448  # bytes of shared memory one block may use on sm_90
SM90_REGISTERS = 65_536  # 32-bit registers of one multiprocessor
SM90_THREAD_REGISTERS = 255  # the most one thread may use
SM90_MULTIPROCESSORS = 132  # of an H100 SXM or H200: the rules that weigh a call's programs against them


@dataclass(frozen=True)
class KernelResources:
    kernel: str
    launch: str  # "num_warps=4 num_stages=2 BV=64"
    registers: int
    spill_bytes: int  # spill stores per thread, bytes
    shared: int
    num_warps: int
    maxnreg: int | None = None  # the launch's register cap per thread, where it sets one
    calls: str = ""  # which calls launch it: "chunk[split]", "chunk[split,fused]", "recurrent", ...

    @property
    def fits(self) -> bool:
        return self.shared <= SM90_SHARED_LIMIT

    @property
    def register_cap(self) -> int:
        """The most registers a thread may use at this many warps (a multiprocessor has 65,536),
        or under the launch's own cap."""
        return min(SM90_THREAD_REGISTERS, SM90_REGISTERS // (32 * self.num_warps), self.maxnreg or SM90_THREAD_REGISTERS)

    @property
    def starved(self) -> bool:
        """ptxas gave the kernel under half the registers its threads may use and spilled anyway:
        what it does with some kernels too large for it (gdn's backward output kernel at K = 256
        with 32 value columns: 32 registers and 22 KB of spills per thread, 255 and 2 KB at 64
        columns). Such a launch setting costs far more than its spills elsewhere would."""
        return self.spill_bytes > 0 and 2 * self.registers < self.register_cap

    @property
    def verdict(self) -> str:
        """"ok", or each problem: over the shared memory a block may have, starved of registers."""
        problems = []
        if not self.fits:
            problems.append(f"OVER the {SM90_SHARED_LIMIT} B shared-memory limit")
        if self.starved:
            problems.append(f"STARVED: {self.registers} of {self.register_cap} registers, spilling")
        return "  ".join(problems) or "ok"

    def describe(self) -> str:
        return (f"{self.kernel:<34} {self.calls:<19} {self.launch:<38} regs {self.registers:>3}  "
                f"spills {self.spill_bytes:>6} B  shared {self.shared:>7} B  {self.verdict}")


def _signature_type(value) -> str:
    import torch

    if isinstance(value, torch.Tensor):
        names = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64",
                 torch.int32: "i32", torch.int64: "i64"}
        return "*" + names[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i64" if abs(value) >= 2**31 else "i32"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no signature type for {type(value).__name__}")


class _LaunchRecorder:
    """Records each kernel launch (kernel, bound arguments, options) of a module called on meta
    tensors (shapes and dtypes, no data): JITFunction.run is replaced, and the module's input
    check, which accepts only CUDA tensors or CPU ones under the interpreter, is given CPU
    tensors of the same shapes. The module's rules that weigh a call's programs against the
    GPU's multiprocessors (segmented scans, few-program launch settings, the scan's chunk size)
    see an sm_90 GPU's count, so the recorded launches are those such a GPU runs."""

    def __init__(self, module, on_launch=None):
        self.module = module
        self.launches: list[tuple] = []
        # on_launch(kernel): called at each launch instead of recording it (the recorded arguments
        # would keep every buffer the call allocates alive: lrdsl.measure.memory counts what is held)
        self.on_launch = on_launch

    def __enter__(self):
        import torch
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction

        self._run, self._check = JITFunction.run, self.module._check_call
        self._interpreted_run = InterpretedFunction.run
        self._multiprocessors = getattr(self.module, "_multiprocessors", None)  # None: no chunk kernels
        recorder, check = self, self.module._check_call

        def run(fn, *args, grid, warmup, **kwargs):
            if recorder.on_launch is not None:
                recorder.on_launch(fn)
                return
            recorder.launches.append((fn, args, kwargs))

        def on_cpu(t):
            return None if t is None else torch.empty(t.shape, dtype=t.dtype)

        def check_shapes(fn, kernel, q, k, v, extras, scale, initial_state, cu_seqlens, **options):
            interpreted = self.module._is_interpreted
            self.module._is_interpreted = lambda kernel: True
            try:
                return check(fn, kernel, on_cpu(q), on_cpu(k), on_cpu(v), tuple(map(on_cpu, extras)), scale,
                             on_cpu(initial_state), cu_seqlens, **options)
            finally:
                self.module._is_interpreted = interpreted

        # a module loaded under the interpreter (a test process) launches InterpretedFunctions
        JITFunction.run = InterpretedFunction.run = run
        self.module._check_call = check_shapes
        if self._multiprocessors is not None:
            self.module._multiprocessors = lambda q: SM90_MULTIPROCESSORS
        return self

    def __exit__(self, *exc):
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction

        JITFunction.run, self.module._check_call = self._run, self._check
        InterpretedFunction.run = self._interpreted_run
        if self._multiprocessors is not None:
            self.module._multiprocessors = self._multiprocessors


def _compile(fn, args, kwargs, arch: int):
    """Compile one recorded launch as a real launch would: Triton's own argument binder gives the
    signature, the constants and the specialisation attributes (pointers aligned to 16 bytes,
    integers divisible by 16 or equal to 1), which decide vectorised and pipelined loads. Without
    them every load would be compiled as unaligned scalar loads, and the registers, spills and
    software pipelining reported would not be the GPU's."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", arch, 128)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)
    launch = {key: kwargs[key] for key in ("num_warps", "num_stages", "maxnreg") if key in kwargs}
    # the chunk size (one kernel may run at two: a training forward at the backward's), the value
    # block, and the serving variants that are on
    shown = {k: bound[k] for k in ("BV", "BT") if k in bound}
    shown.update({k: v for k, v in bound.items() if k in SERVING_FLAGS and v})
    # what a launch writes for a backward beside its outputs (another compilation than the same
    # launch without it): the narrowed copies of kept buffers, a re-run scan's segment entry states
    written = [k for k, v in bound.items() if (k.startswith("narrowed_") or k == "segment_states") and v is not None]
    if written:
        shown["writes"] = ",".join(written)
    if bound.get("CC_BT", bound.get("BT")) != bound.get("BT"):  # the forward's solved systems, read by blocks
        shown["CC_BT"] = bound["CC_BT"]
    return compiled, launch, shown


# The recurrent kernel's serving variants, each its own compilation (shown in the report when on)
SERVING_FLAGS = ("USE_POOL", "STATE_V_FIRST", "SAVE_DRAFT")


def _ptxas_report(ptx: str, arch: int) -> tuple[int, int]:
    """(registers, spill-store bytes) per thread, as the bundled ptxas reports them."""
    import tempfile
    from pathlib import Path

    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(arch).path
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        out = subprocess.run([ptxas, "-v", f"--gpu-name=sm_{arch}a", str(src), "-o", str(Path(tmp) / "k.o")],
                             capture_output=True, text=True)
    text = out.stdout + out.stderr
    registers = int(re.search(r"Used (\d+) registers", text).group(1))
    spills = re.search(r"(\d+) bytes spill stores", text)
    return registers, int(spills.group(1)) if spills else 0


def parse_launch(text: str, roles) -> dict[str, dict[str, int]]:
    """'ROLE=BV,WARPS,STAGES[,MAXNREG][;ROLE=...]' -> {role: {"BV": .., "num_warps": ..,
    "num_stages": ..[, "maxnreg": ..]}} (MAXNREG: a cap on each thread's registers, which ptxas
    meets by spilling: fewer registers, more programs resident per multiprocessor); a role not in
    `roles` or a malformed setting is a one-line ValueError."""
    settings = {}
    for part in filter(None, (p.strip() for p in text.split(";"))):
        role, _, numbers = part.partition("=")
        role = role.strip()
        if role not in roles:
            raise ValueError(f"--launch {text!r}: unknown kernel role {role!r}; roles: {', '.join(sorted(roles))}")
        values = numbers.split(",")
        if len(values) not in (3, 4) or not all(v.strip().isdigit() and int(v) > 0 for v in values):
            raise ValueError(f"--launch {text!r}: {role} needs BV,WARPS,STAGES[,MAXNREG] (positive integers), got {numbers!r}")
        if len(values) == 4 and not 24 <= int(values[3]) <= SM90_THREAD_REGISTERS:
            raise ValueError(f"--launch {text!r}: {role}'s MAXNREG must be 24..{SM90_THREAD_REGISTERS} registers, got {values[3].strip()}")
        settings[role] = dict(zip(("BV", "num_warps", "num_stages", "maxnreg"), map(int, values)))
    if not settings:
        raise ValueError(f"--launch {text!r}: no ROLE=BV,WARPS,STAGES in it")
    return settings


class _LaunchOverride:
    """Replaces the launch settings the module's _launch picks for some roles: they go to the
    module's own launch rule as its last overlay (`replaced`), which clamps BV as for any launch."""

    def __init__(self, module, settings: dict[str, dict[str, int]] | None):
        self.module, self.settings = module, settings or {}

    def __enter__(self):
        module, settings = self.module, self.settings
        self._launch = chosen = module._launch

        def launch(role, c, *args, **kwargs):
            return chosen(role, c, *args, replaced=settings.get(role), **kwargs)

        module._launch = launch
        return self

    def __exit__(self, *exc):
        self.module._launch = self._launch


def kernel_resources(module, rec, shape, dtype, precision="input", arch: int = 90, chunk_size=None,
                     only: str = "", launch: dict[str, dict[str, int]] | None = None) -> list[KernelResources]:
    """Compile every kernel that chunk calls (forward and backward, every plan, and the forward
    of a call without gradients; chunk_size None: the default for the precision, which may differ
    between a training forward and the other), a recurrent call and the serving calls (decode on a bf16 pool
    kept [P, HV, V, K], verify and commit on an fp32 pool) launch, each once per distinct
    specialisation, or only those whose name contains `only`. The chunk and recurrent calls take
    an initial state and both outputs' gradients: the kernels' longest variants. `launch`: launch
    settings per kernel role that replace the module's (parse_launch)."""
    import torch

    from ..verification.workloads import make_inputs

    tensors = make_inputs(rec, shape, dtype=dtype, generator=torch.Generator().manual_seed(0))
    # meta tensors: shapes and dtypes without data or a device; the launches are only recorded
    tensors = [t.to("meta") for t in tensors]
    h0 = torch.empty(shape.B, shape.HV, shape.K, shape.V, device="meta")
    options = dict(use_qk_l2norm_in_kernel=True, output_final_state=True)
    calls = []  # (launches recorded so far, the call that made them)
    with _LaunchRecorder(module) as recorder, _LaunchOverride(module, launch):
        for plan in getattr(module, "CHUNK_PLANS", ()):
            leaves = [t.detach().requires_grad_() for t in (*tensors, h0)]
            o, ht = module.chunk(*leaves[:-1], initial_state=leaves[-1], plan=plan, precision=precision,
                                 chunk_size=chunk_size, **options)
            (o.sum() + ht.sum()).backward()
            # without gradients too: a training call may run its forward at another chunk size
            module.chunk(*tensors, initial_state=h0, plan=plan, precision=precision, chunk_size=chunk_size, **options)
            calls.append((len(recorder.launches), f"chunk[{plan}]"))
        module.recurrent(*tensors, initial_state=h0, **options)
        calls.append((len(recorder.launches), "recurrent"))
        plain = [t.detach() for t in tensors]
        rows = (shape.B, shape.HV, shape.K, shape.V)
        indices = torch.empty(shape.B, dtype=torch.int32, device="meta")
        pool = torch.empty(rows[0], rows[1], rows[3], rows[2], dtype=torch.bfloat16, device="meta")
        module.recurrent(*plain, use_qk_l2norm_in_kernel=True, state_pool=pool, state_indices=indices, state_v_first=True,
                         validate=False)
        _, draft = module.verify(*plain, use_qk_l2norm_in_kernel=True, state_pool=torch.empty(rows, device="meta"),
                                 state_indices=indices, validate=False)
        module.commit(draft, indices, validate=False)
        calls.append((len(recorder.launches), "serving"))
    # each distinct compilation once, with every call that launches it
    launches: dict[tuple, tuple] = {}
    callers: dict[tuple, list[str]] = {}
    for index, (fn, args, kwargs) in enumerate(recorder.launches):
        key = (fn.__name__, _launch_key(args), _launch_key(sorted(kwargs.items())))
        if only not in fn.__name__:
            continue
        launches.setdefault(key, (fn, args, kwargs))
        call = next(name for end, name in calls if index < end)
        if call not in callers.setdefault(key, []):
            callers[key].append(call)
    report = []
    for key, (fn, args, kwargs) in launches.items():
        compiled, launch_options, extra = _compile(fn, args, dict(kwargs), arch)
        launch = " ".join(f"{k}={v}" for k, v in {**launch_options, **extra}.items())
        registers, spills = _ptxas_report(compiled.asm["ptx"], arch)
        report.append(KernelResources(fn.__name__, launch, registers, spills, compiled.metadata.shared,
                                      launch_options.get("num_warps", 4), launch_options.get("maxnreg"),
                                      _calls_shown(callers[key])))
    return report


def _launch_key(values) -> str:
    """What decides a launch's compilation, as text: a tensor by its shape, strides and dtype only
    (its repr would also show requires_grad, which splits a training forward's launch from the
    same launch without gradients)."""
    def describe(value):
        if hasattr(value, "stride"):
            return f"tensor{tuple(value.shape)}/{value.stride()}/{value.dtype}"
        if isinstance(value, tuple):
            return tuple(describe(v) for v in value)
        return repr(value)
    return repr([describe(v) for v in values])


def _calls_shown(calls: list[str]) -> str:
    """["chunk[split]", "chunk[fused]"] -> "chunk[split,fused]"."""
    plans = [c[len("chunk["):-1] for c in calls if c.startswith("chunk[")]
    others = [c for c in calls if not c.startswith("chunk[")]
    return " ".join(([f"chunk[{','.join(plans)}]"] if plans else []) + others)


def add_arguments(p) -> None:
    """The options of `lrdsl resources` and `python -m lrdsl.measure.resources`."""
    p.add_argument("specs", nargs="+", metavar="spec", help="shipped spec names (lrdsl specs lists them) or spec files")
    p.add_argument("--shape", action="append", help="B,T,H,HV,K,V (repeat for several; default 1,256,2,4,128,128)")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32", "fp64"))
    p.add_argument("--precision", default="input", choices=("input", "tf32"))
    p.add_argument("--chunk-size", default=None, metavar="C",
                   help="a chunk size for forward and backward alike (default: the module's largest for the "
                        "shape and precision, largest_chunk_size), or 'default': what a call without chunk_size "
                        "runs (the forward's FORWARD_CHUNK_SIZE, the backward's own BACKWARD_CHUNK_SIZE)")
    p.add_argument("--kernels", default="", metavar="TEXT", help="only the kernels whose name contains TEXT")
    p.add_argument("--launch", action="append", metavar="ROLE=BV,WARPS,STAGES[,MAXNREG]",
                   help="launch settings replacing the module's for a kernel role ('ROLE=..;ROLE=..' for several); "
                        "repeat for one report per setting")


def run(args) -> int:
    """Print the report; exit status 1 where a kernel does not fit. Bad input is an LrdslError (one line)."""
    from .. import config

    config.never_interpret()  # compile for the target
    import torch

    from .. import load
    from ..cli import _parse_shape
    from ..codegen.launch import CHUNK_LAUNCH
    from ..errors import LrdslError
    from ..passes.pipeline import run_pipeline
    from ..spec import load_spec_by_name as load_spec

    # every setting checked before the first (slow) compile; the roles are every module's
    try:
        launches = [(f"  launch {text}", parse_launch(text, CHUNK_LAUNCH)) for text in args.launch or []]
    except ValueError as error:
        raise LrdslError(str(error)) from None
    shapes = [_parse_shape(text) for text in args.shape or ["1,256,2,4,128,128"]]
    if args.chunk_size not in (None, "default") and not args.chunk_size.isdigit():
        raise LrdslError(f"--chunk-size takes a chunk size or 'default', got {args.chunk_size!r}")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64}[args.dtype]
    fits = True
    for spec in args.specs:
        rec = run_pipeline(load_spec(spec), until="recurrence")["recurrence"]
        module = load(spec)
        sizes = getattr(module, "CHUNK_SIZES", ())
        if args.chunk_size not in (None, "default") and int(args.chunk_size) not in sizes:
            raise LrdslError(f"--chunk-size: {args.chunk_size} is not one of {rec.name}'s chunk sizes {sizes}")
        for shape in shapes:
            chunk_size, shown = _chunk_size_shown(module, shape, args.precision, dtype, args.chunk_size)
            for setting, launch in launches or [("", None)]:
                print(f"{rec.name}  {shape}  {args.dtype}  precision={args.precision}  chunk_size={shown}  sm_90{setting}")
                report = kernel_resources(module, rec, shape, dtype, args.precision, chunk_size=chunk_size,
                                          only=args.kernels, launch=launch)
                for row in report:
                    print(row.describe())
                fits = fits and all(r.fits for r in report)
    return 0 if fits else 1


def _chunk_size_shown(module, shape, precision, dtype, asked):
    """(chunk_size for chunk(), how the header shows it) for --chunk-size `asked`."""
    if not hasattr(module, "largest_chunk_size"):  # no chunk form: the recurrent and serving kernels only
        return None, "-"
    largest = module.largest_chunk_size(shape.K, precision, dtype, shape.V)
    if asked == "default":
        # the module's own rules (chunk() takes these with no chunk_size; the backward is free to
        # choose: no chunk_indices here)
        forward = min(module.FORWARD_CHUNK_SIZE[module.DEFAULT_CHUNK_PLAN, precision], largest)
        backward = module._backward_chunk_size(forward, precision, True)
        # under a policy whose kept buffers hold only at the chunk size they were made at, a
        # training forward runs at the backward's
        policy = module.SAVE_POLICIES[module.DEFAULT_SAVE_POLICY]
        if policy["any_chunk_size"][module.DEFAULT_CHUNK_PLAN]:
            return None, f"default (forward {forward}, backward {backward})"
        return None, f"default (forward {forward}, backward and the training forward {backward})"
    chunk_size = int(asked) if asked else largest
    return chunk_size, chunk_size


def main(argv=None) -> int:
    from ..cli import run_tool

    p = argparse.ArgumentParser(prog="python -m lrdsl.measure.resources", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return run_tool(run, p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
