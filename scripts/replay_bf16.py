"""Replay a bf16 gradient case of the GPU tests on the CPU interpreter, computing as the GPU does,
and say where each gradient's error lies.

    python scripts/replay_bf16.py SPEC --seed N [--shape B,T,H,HV,K,V] [--chunk-size C] [--precision tf32]
                                       [--no-final-gradient] [--fp32-operands] [--truncate]
                                       [--after-forward]

The inputs are drawn as tests/test_gpu.py's `_gradients` draws its dense case from `--seed`
(default shape: its GRAD_DENSE, 2,257,2,4,128,128): q, k, v and the spec's inputs in bf16, the
initial state, the output's gradient, the final state's gradient. The generated module's chunk()
runs forward + backward on Triton's CPU interpreter, the float64 oracle beside it. Per gradient it
prints the relative error (as the tests measure it) and the token and value head holding the most
of its squared error, with that token's own relative error.

Two things make a plain bf16 run on the CPU unlike the GPU's, and this script undoes both:
- Triton 3.6's interpreter converts fp32 to bf16 (a `.to(tl.bfloat16)`, a store into a bf16
  tensor) by cutting the low mantissa bits off, where the GPU rounds to the nearest; truncation is
  biased, and the errors come out several times the GPU's. Here that conversion rounds to the
  nearest, ties to even (--truncate keeps the interpreter's own).
- On the CPU a module multiplies in fp32 (its `_exact_products`: the interpreter's dot would take
  bf16 tiles, stored as uint16, for integers). Here its dots get bf16 operands as on a GPU, which
  the interpreter's dot widens to fp32 exactly and sums in fp32, a tensor core's arithmetic
  (--fp32-operands keeps the CPU's). gdn_qwen35 at seed 95345326 replays d_a at 1.27e-2, the
  GPU's own figure for those inputs.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.getcwd())
from lrdsl import config  # noqa: E402  (must precede triton: the interpreter is chosen at import)

config.use_interpreter_without_gpu()

import torch  # noqa: E402

import lrdsl  # noqa: E402
from lrdsl import reference  # noqa: E402
from lrdsl.passes.pipeline import run_pipeline  # noqa: E402
from lrdsl.spec import load_spec  # noqa: E402
from lrdsl.verification.workloads import Shape, make_inputs, relative_error  # noqa: E402


def round_to_bfloat16_bits(values: np.ndarray) -> np.ndarray:
    """fp32 values as bf16 bit patterns, rounded to the nearest (ties to even), as the GPU and
    torch round: add 0x7FFF plus the kept part's lowest bit, then drop the low 16 bits (a carry
    out of the mantissa steps the exponent, as it should). NaN becomes bf16's quiet NaN."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    nan = np.isnan(values)
    rounded[nan] = 0x7FC0
    return rounded.astype(np.uint16)


def use_round_to_nearest() -> None:
    """Make the interpreter round fp32 -> bf16 to the nearest instead of truncating."""
    import triton.language as tl
    import triton.runtime.interpreter as interpreter

    convert = interpreter._convert_float

    def convert_rounding(data, source, target, rounding_mode):
        if source == tl.float32 and target == tl.bfloat16:
            return round_to_bfloat16_bits(data).reshape(data.shape)
        return convert(data, source, target, rounding_mode)

    interpreter._convert_float = convert_rounding


def use_16_bit_operands(module) -> None:
    """Make the module multiply bf16 operands as on a GPU. On the CPU it multiplies in fp32
    (`_exact_products`: the interpreter's dot takes bf16 tiles, stored as uint16, for integers);
    here its dots get bf16 operands, which the interpreter's dot now widens to fp32 exactly before
    multiplying, accumulating in fp32: a tensor core's products and sums."""
    import numpy as np
    import triton.language as tl
    import triton.runtime.interpreter as interpreter

    dot = interpreter.InterpreterBuilder.create_dot

    def widen(handle):
        if handle.dtype.scalar != tl.bfloat16:
            return handle
        data = interpreter._convert_float(handle.data, tl.bfloat16, tl.float32, None).view(np.float32)
        return interpreter.TensorHandle(data.reshape(handle.data.shape), tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    interpreter.InterpreterBuilder.create_dot = create_dot
    module._exact_products = lambda q: q.dtype in (torch.float32, torch.float64)


def draw(rec, shape: Shape, seed: int, after_forward: bool = False):
    """tests/test_gpu.py's dense gradient case: inputs, h0, d_o, d_ht in its order of draws;
    `after_forward`: after a forward case's inputs and h0 (tests that call _forward first with
    the same generator, as test_gpu_large_and_odd_head_dims does)."""
    generator = torch.Generator().manual_seed(seed)
    if after_forward:
        make_inputs(rec, shape, dtype=torch.bfloat16, generator=generator, normalize_keys=False)
        torch.randn(shape.B, shape.HV, shape.K, shape.V, generator=generator)
    tensors = make_inputs(rec, shape, dtype=torch.bfloat16, generator=generator, normalize_keys=False)
    h0 = torch.randn(shape.B, shape.HV, shape.K, shape.V, generator=generator)
    d_o = torch.randn(shape.B, shape.T, shape.HV, shape.V, generator=generator)
    d_ht = torch.randn(h0.shape, generator=generator)
    return tensors, h0, d_o, d_ht


def where_the_error_lies(got: torch.Tensor, expected: torch.Tensor, T: int) -> str:
    """The token and head of a per-token gradient ([B, T, heads] or [B, T, heads, width]) holding
    the most squared error, its share of the whole and that token's own relative error; "" for
    the others (per-head parameters, the initial state)."""
    if got.dim() < 3 or got.shape[1] != T:
        return ""
    def per_token(x):  # [T, heads]: summed over batch and (for [B, T, heads, width]) width
        return (x.sum(-1) if x.dim() == 4 else x).sum(0)

    error = per_token((got.double() - expected.double()).pow(2))
    share = error / error.sum()
    t, h = divmod(int(share.argmax()), share.shape[1])
    own = (error[t, h] / per_token(expected.double().pow(2))[t, h]).sqrt()
    return f"  most at token {t}, head {h}: {float(share[t, h]):.0%} of it, {float(own):.1e} there"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("spec")
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--shape", default="2,257,2,4,128,128", help="B,T,H,HV,K,V")
    p.add_argument("--chunk-size", type=int, default=None)
    p.add_argument("--precision", default="input", choices=("input", "tf32"), help="chunk()'s precision=")
    p.add_argument("--after-forward", action="store_true",
                   help="draw as a test that runs a forward case first (test_gpu_large_and_odd_head_dims)")
    p.add_argument("--no-final-gradient", action="store_true", help="d_ht = 0")
    p.add_argument("--truncate", action="store_true", help="keep the interpreter's truncating conversion")
    p.add_argument("--fp32-operands", action="store_true", help="keep the CPU module's fp32 matmul operands")
    args = p.parse_args(argv)
    if not config.interpreting():
        sys.exit("replay_bf16.py replays on the CPU interpreter: run it where there is no GPU (or TRITON_INTERPRET=1)")
    if not args.truncate:
        use_round_to_nearest()

    rec = run_pipeline(load_spec(args.spec), until="recurrence")["recurrence"]
    shape = Shape(*map(int, args.shape.split(",")))
    tensors, h0, d_o, d_ht = draw(rec, shape, args.seed, args.after_forward)
    if args.no_final_gradient:
        d_ht.zero_()
    kwargs = dict(output_final_state=True, use_qk_l2norm_in_kernel=True)
    leaves = [t.clone().requires_grad_() for t in (*tensors, h0)]
    module = lrdsl.load(args.spec)
    if not args.fp32_operands:
        use_16_bit_operands(module)
    o, ht = module.chunk(*leaves[:-1], initial_state=leaves[-1], chunk_size=args.chunk_size,
                         precision=args.precision, **kwargs)
    got = torch.autograd.grad((o, ht), leaves, (d_o.to(o.dtype), d_ht))
    refs = [t.double().requires_grad_() for t in (*tensors, h0)]
    ref_o, ref_ht = reference.run(rec, *refs[:-1], initial_state=refs[-1], **kwargs)
    expected = torch.autograd.grad((ref_o, ref_ht), refs, (d_o.double(), d_ht.double()))
    rounding = "truncated" if args.truncate else "rounded to nearest"
    operands = "fp32" if args.fp32_operands else "bf16"
    print(f"{rec.name} seed {args.seed} shape {args.shape}: bf16 {rounding}, {operands} operands, precision {args.precision}, "
          f"o {relative_error(o, ref_o):.2e}, final state {relative_error(ht, ref_ht):.2e}")
    for name, a, b in zip(["q", "k", "v", *(i.name for i in rec.inputs)], got, expected):
        print(f"d_{name:<8} {relative_error(a, b):.2e}{where_the_error_lies(a, b, shape.T)}")
    print(f"d_h0       {relative_error(got[-1], expected[-1]):.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
