"""Ahead-of-time compilation of a generated module's kernels for an NVIDIA target, without a GPU.

Triton compiles for any target on any machine (its bundled ptxas assembles sm_90 code on a CPU
box). This runs a generated module's `chunk` (forward and backward) and `recurrent` on small CPU
tensors with every kernel launch intercepted: each launch's arguments give the kernel's
signature and constants, which are then compiled for the target. The report says, per kernel and
launch setting, what the GPU would give it: registers per thread, bytes spilled per thread and
shared memory per block, and whether it fits (a block gets at most 232,448 bytes of shared
memory on sm_90). So register pressure and shared-memory overflows show up in CI, not on the GPU.

    python -m lrdsl.resources specs/gdn.toml [--shape B,T,H,HV,K,V] [--dtype bf16] [--precision input]
                              [--chunk-size C] [--kernels TEXT]

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


@dataclass(frozen=True)
class KernelResources:
    kernel: str
    launch: str  # "num_warps=4 num_stages=2 BV=64"
    registers: int
    spill_bytes: int  # spill stores per thread, bytes
    shared: int

    @property
    def fits(self) -> bool:
        return self.shared <= SM90_SHARED_LIMIT

    def describe(self) -> str:
        verdict = "ok" if self.fits else f"OVER the {SM90_SHARED_LIMIT} B shared-memory limit"
        return (f"{self.kernel:<34} {self.launch:<32} regs {self.registers:>3}  spills {self.spill_bytes:>6} B"
                f"  shared {self.shared:>7} B  {verdict}")


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
    tensors of the same shapes."""

    def __init__(self, module):
        self.module = module
        self.launches: list[tuple] = []

    def __enter__(self):
        import torch
        from triton.runtime.jit import JITFunction

        self._run, self._check = JITFunction.run, self.module._check_call
        recorder, check = self, self.module._check_call

        def run(fn, *args, grid, warmup, **kwargs):
            recorder.launches.append((fn, args, kwargs))

        def on_cpu(t):
            return None if t is None else torch.empty(t.shape, dtype=t.dtype)

        def check_shapes(fn, kernel, q, k, v, extras, scale, initial_state, cu_seqlens):
            interpreted = self.module._is_interpreted
            self.module._is_interpreted = lambda kernel: True
            try:
                return check(fn, kernel, on_cpu(q), on_cpu(k), on_cpu(v), tuple(map(on_cpu, extras)), scale,
                             on_cpu(initial_state), cu_seqlens)
            finally:
                self.module._is_interpreted = interpreted

        JITFunction.run = run
        self.module._check_call = check_shapes
        return self

    def __exit__(self, *exc):
        from triton.runtime.jit import JITFunction

        JITFunction.run, self.module._check_call = self._run, self._check


def _compile(fn, args, kwargs, arch: int):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    options = {key: kwargs.pop(key) for key in ("num_warps", "num_stages") if key in kwargs}
    bound = dict(zip(fn.arg_names, args), **kwargs)
    constexprs, signature = {}, {}
    for index, name in enumerate(fn.arg_names):
        value = bound.get(name)
        if index in fn.constexprs or value is None:
            constexprs[name] = value
            signature[name] = "constexpr"
        else:
            signature[name] = _signature_type(value)
    source = ASTSource(fn, signature, constexprs)
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 128), options=options)
    return compiled, options, {k: v for k, v in bound.items() if k in ("BV",)}


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


def kernel_resources(module, rec, shape, dtype, precision="input", chunk_size=None, only: str = "",
                     arch: int = 90) -> list[KernelResources]:
    """Compile every kernel a chunk call (forward and backward; chunk_size None: the module's
    default for this call) and a recurrent call launch, or those whose name contains `only`."""
    import torch

    from .workloads import make_inputs

    tensors = make_inputs(rec, shape, dtype=dtype, generator=torch.Generator().manual_seed(0))
    # meta tensors: shapes and dtypes without data or a device; the launches are only recorded
    tensors = [t.to("meta") for t in tensors]
    leaves = [t.requires_grad_() for t in tensors]
    with _LaunchRecorder(module) as recorder:
        o, _ = module.chunk(*leaves, use_qk_l2norm_in_kernel=True, output_final_state=True, precision=precision,
                            chunk_size=chunk_size)
        o.sum().backward()
        module.recurrent(*[t.detach() for t in tensors], use_qk_l2norm_in_kernel=True, output_final_state=True)
    seen, report = set(), []
    for fn, args, kwargs in recorder.launches:
        if only not in fn.__name__:
            continue
        compiled, options, extra = _compile(fn, args, dict(kwargs), arch)
        launch = " ".join(f"{k}={v}" for k, v in {**options, **extra}.items())
        if (fn.__name__, launch) in seen:
            continue
        seen.add((fn.__name__, launch))
        registers, spills = _ptxas_report(compiled.asm["ptx"], arch)
        report.append(KernelResources(fn.__name__, launch, registers, spills, compiled.metadata.shared))
    return report


def main(argv=None) -> int:
    import os

    os.environ.pop("TRITON_INTERPRET", None)  # compile for the target, never interpret
    import torch

    from . import load
    from .passes.pipeline import run_pipeline
    from .specs_registry import load_spec_by_name as load_spec
    from .workloads import Shape

    p = argparse.ArgumentParser(prog="python -m lrdsl.resources", description=__doc__.split("\n\n")[0])
    p.add_argument("spec")
    p.add_argument("--shape", default="1,256,2,4,128,128", help="B,T,H,HV,K,V")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    p.add_argument("--precision", default="input", choices=("input", "tf32"))
    p.add_argument("--chunk-size", type=int, default=None,
                   help="default: the module's for this shape and precision (largest_chunk_size)")
    p.add_argument("--kernels", default="", metavar="TEXT", help="only the kernels whose name contains TEXT")
    args = p.parse_args(argv)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    rec = run_pipeline(load_spec(args.spec), until="recurrence")["recurrence"]
    module = load(args.spec)
    shape = Shape(*map(int, args.shape.split(",")))
    chunk_size = args.chunk_size or module.largest_chunk_size(shape.K, args.precision)
    print(f"{rec.name}: {shape}, {args.dtype}, precision={args.precision}, chunk_size={chunk_size}, sm_90")
    report = kernel_resources(module, rec, shape, dtype, args.precision, chunk_size, args.kernels)
    for row in report:
        print(row.describe())
    return 0 if all(r.fits for r in report) else 1


if __name__ == "__main__":
    sys.exit(main())
