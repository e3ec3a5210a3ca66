"""Peak GPU memory of a chunk call's forward + backward, without a GPU.

The generated module is called on meta tensors (shapes and dtypes, no data) with its kernel
launches intercepted (lrdsl.measure.resources' launch recorder, which also shows the module an sm_90 GPU's
132 multiprocessors): the launchers allocate, keep and drop their buffers as they do on a GPU,
and autograd keeps what the save policy saved, so the bytes the call holds at each launch are
what a GPU's allocator holds then. The peak counts what the call allocates (its buffers, o, the
final state, the gradients), not the inputs and the output's gradient the caller made before it:
torch.cuda.max_memory_allocated() less memory_allocated() before the call, which is what
scripts/compare_modules.py reports. For gdn at the three training shapes it gave the 1963 /
3912 / 2002 MiB measured on the GPU before the backward's storage reuse, and with it 1835 MiB at
4 x 4096, as measured (BENCHMARKS.md rounds 22 and 23).

    lrdsl memory SPEC [SPEC ...] [--shape B,T,H,HV,K,V ...] [--dtype bf16]
                 [--save-policy P] [--chunk-size C] [--no-backward]     (or python -m lrdsl.measure.memory ...)
"""
from __future__ import annotations

import argparse
import sys
import weakref
from collections import Counter
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

MiB = 2**20


class LiveAllocations(TorchDispatchMode):
    """Weak references to every tensor an op allocates on `device` while active (an output that
    is not a view or an in-place result of its op's inputs), so that what is still held can be
    listed. Tensors on other devices are not the call's (the launch recorder's input check makes
    CPU stand-ins of meta inputs)."""

    def __init__(self, device: str):
        super().__init__()
        self.device = torch.device(device)
        self._allocated: list[tuple[weakref.ref, tuple[int, ...], torch.dtype, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outputs = out if isinstance(out, (tuple, list)) else (out,)
        for result, tensor in zip(func._schema.returns, outputs):
            if (isinstance(tensor, torch.Tensor) and result.alias_info is None and tensor.numel() > 0
                    and tensor.device == self.device):
                size = tensor.untyped_storage().nbytes()
                self._allocated.append((weakref.ref(tensor), tuple(tensor.shape), tensor.dtype, size))
        return out

    def held(self, besides=()) -> tuple[tuple[tuple[int, ...], str, int], ...]:
        """(shape, dtype, bytes) of each allocated tensor still alive, largest first, `besides`
        (tensors the caller holds: a call's outputs) left out."""
        alive = [(shape, str(dtype).removeprefix("torch."), size)
                 for ref, shape, dtype, size in self._allocated
                 if ref() is not None and not any(ref() is t for t in besides)]
        return tuple(sorted(alive, key=lambda row: -row[2]))


@dataclass(frozen=True)
class HeldAtLaunch:
    kernel: str  # the kernel about to run ("returned": after the call)
    buffers: tuple[tuple[tuple[int, ...], str, int], ...]  # (shape, dtype, bytes), largest first

    @property
    def held_bytes(self) -> int:
        return sum(size for _, _, size in self.buffers)

    def describe_buffers(self) -> str:
        """The buffers grouped by shape and dtype: '2 x (512, 32, 128, 128) bfloat16 (1024 MiB)'."""
        groups = Counter((shape, dtype, size) for shape, dtype, size in self.buffers)
        return ", ".join(f"{count} x {shape} {dtype} ({count * size / MiB:.0f} MiB)"
                         for (shape, dtype, size), count in sorted(groups.items(), key=lambda g: -g[0][2] * g[1]))


def _meta_call(rec, shape, dtype, precision, save_policy, chunk_size, requires_grad):
    """The meta inputs and chunk() options of the call both measurements make: q/k L2 norm in the
    kernel, the final state out, the module's save policy unless one is given."""
    from ..verification.workloads import make_inputs

    tensors = make_inputs(rec, shape, dtype=dtype, generator=torch.Generator().manual_seed(0), normalize_keys=False)
    leaves = [t.to("meta").requires_grad_(requires_grad) for t in tensors]
    options = dict(use_qk_l2norm_in_kernel=True, output_final_state=True, precision=precision, chunk_size=chunk_size)
    if save_policy is not None:
        options["save_policy"] = save_policy
    return leaves, options


def call_memory(module, rec, shape, dtype=torch.bfloat16, precision="input", save_policy=None, chunk_size=None,
                backward=True) -> list[HeldAtLaunch]:
    """What a chunk call (q/k L2 norm in the kernel, the final state out; with `backward`, then
    the gradients of o) holds at each kernel launch, and after it ("returned", its outputs and
    gradients still held by the caller)."""
    from .resources import _LaunchRecorder

    leaves, options = _meta_call(rec, shape, dtype, precision, save_policy, chunk_size, backward)
    d_o = torch.empty(shape.B, shape.T, shape.HV, shape.V, dtype=dtype, device="meta")
    tracker, held = LiveAllocations("meta"), []
    with _LaunchRecorder(module, on_launch=lambda fn: held.append(HeldAtLaunch(fn.__name__, tracker.held()))):
        with tracker:
            o, final_state = module.chunk(*leaves, **options)
            gradients = torch.autograd.grad(o, leaves, d_o) if backward else ()
            held.append(HeldAtLaunch("returned", tracker.held()))
    del o, final_state, gradients
    return held


def kept_for_backward(module, rec, shape, dtype=torch.bfloat16, precision="input", save_policy=None,
                      chunk_size=None) -> HeldAtLaunch:
    """What a chunk call that needs gradients keeps from its forward until its backward runs:
    what autograd saved, o and the final state (the caller's) left out. A model holds this once
    per layer between its forward and its backward."""
    from .resources import _LaunchRecorder

    leaves, options = _meta_call(rec, shape, dtype, precision, save_policy, chunk_size, requires_grad=True)
    tracker = LiveAllocations("meta")
    with _LaunchRecorder(module, on_launch=lambda fn: None):
        with tracker:
            o, final_state = module.chunk(*leaves, **options)
            kept = HeldAtLaunch("kept for the backward", tracker.held(besides=(o, final_state)))
    del o, final_state
    return kept


def peak(held: list[HeldAtLaunch]) -> HeldAtLaunch:
    return max(held, key=lambda h: h.held_bytes)


def add_arguments(p) -> None:
    """The options of `lrdsl memory` and `python -m lrdsl.measure.memory`."""
    p.add_argument("specs", nargs="+", metavar="spec", help="shipped spec names (lrdsl specs lists them) or spec files")
    p.add_argument("--shape", action="append", help="B,T,H,HV,K,V (repeat for several; default 4,4096,16,32,128,128)")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    p.add_argument("--precision", default="input", choices=("input", "tf32"))
    p.add_argument("--save-policy", default=None, help="chunk()'s save_policy (default: the module's)")
    p.add_argument("--chunk-size", type=int, default=None, help="chunk()'s chunk_size (default: the module's rules)")
    p.add_argument("--no-backward", action="store_true", help="the forward alone, without gradients")


def run(args) -> int:
    """Print each call's memory at every launch and its peak; bad input is an LrdslError (one line)."""
    from .. import config

    config.never_interpret()  # nothing runs: the launches are only counted

    from .. import load
    from ..cli import _parse_shape
    from ..errors import LrdslError
    from ..passes.pipeline import run_pipeline
    from ..spec import load_spec_by_name as load_spec

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    shapes = [_parse_shape(text) for text in args.shape or ["4,4096,16,32,128,128"]]  # all checked before any work
    for spec in args.specs:
        rec = run_pipeline(load_spec(spec), until="recurrence")["recurrence"]
        module = load(spec)
        if not hasattr(module, "chunk"):
            raise LrdslError(f"{spec}: {rec.name} has no chunk form: lrdsl memory measures chunk calls")
        if args.save_policy is not None and args.save_policy not in module.SAVE_POLICIES:
            raise LrdslError(f"--save-policy: {rec.name} has no save policy {args.save_policy!r}; "
                             f"policies: {', '.join(module.SAVE_POLICIES)}")
        if args.chunk_size is not None and args.chunk_size not in module.CHUNK_SIZES:
            raise LrdslError(f"--chunk-size: {args.chunk_size} is not one of {rec.name}'s chunk sizes {module.CHUNK_SIZES}")
        for shape in shapes:
            held = call_memory(module, rec, shape, dtype, args.precision, args.save_policy, args.chunk_size,
                               backward=not args.no_backward)
            call = "forward" if args.no_backward else "forward + backward"
            print(f"{rec.name}  {shape}  {args.dtype}  precision={args.precision}  "
                  f"save_policy={args.save_policy or module.DEFAULT_SAVE_POLICY}  {call}")
            for at in held:
                print(f"  {at.kernel:<40} {at.held_bytes / MiB:9.1f} MiB")
            top = peak(held)
            print(f"  peak {top.held_bytes / MiB:.1f} MiB at {top.kernel}: {top.describe_buffers()}")
            if not args.no_backward:
                kept = kept_for_backward(module, rec, shape, dtype, args.precision, args.save_policy, args.chunk_size)
                per_token = kept.held_bytes / (shape.B * shape.T) / 1024
                print(f"  kept from the forward for the backward {kept.held_bytes / MiB:.1f} MiB ({per_token:.1f} KiB "
                      f"per token): {kept.describe_buffers() or 'nothing'}")
    return 0


def main(argv=None) -> int:
    from ..cli import run_tool

    p = argparse.ArgumentParser(prog="python -m lrdsl.measure.memory", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return run_tool(run, p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
