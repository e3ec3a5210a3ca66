"""Launch settings of the recurrent kernel (value columns per program BV, warps) timed on a GPU:
decode on a state pool (fp32 and bf16 state) and verify of 4 draft tokens, 16/32 heads of 128.

    python scripts/sweep_decode.py [SPEC] [--batch 256] [--blocks 16,32,64,128] [--warps 1,2,4,8]

Each setting is a module generated with lrdsl.codegen.module's RECURRENT_BLOCK_V and
RECURRENT_STATE_VALUES_PER_THREAD set so that the K = 128 state launches with those warps (the
shipped setting is what those two constants give at K = 128); each setting's
outputs must equal the shipped setting's to 1e-5 (the state update is the same arithmetic).
Prints µs per call and TB/s of state traffic (decode: each row read and written once; verify:
read once), best first per call.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

from lrdsl.codegen import module as module_emitter
from lrdsl.passes.pipeline import run_pipeline
from lrdsl.runtime.loader import import_file
from lrdsl.spec import load_spec_by_name
from lrdsl.verification.workloads import Shape, make_inputs, relative_error

PROG = "sweep_decode.py"


def fail(message: str) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return 2


def numbers(text: str, option: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise ValueError(f"{option} must be comma-separated positive integers, got {text!r}")
    return values


HEAD_DIM = 128  # K = V of the swept shapes


def shipped_setting() -> tuple[int, int]:
    """(BV, warps) the shipped rule gives the K = 128 state."""
    block_v = module_emitter.RECURRENT_BLOCK_V
    values = HEAD_DIM * block_v // (32 * module_emitter.RECURRENT_STATE_VALUES_PER_THREAD)
    return block_v, min(8, max(1, values))


def generate(spec: str, block_v: int, warps: int, directory: Path):
    """The spec's module with the recurrent kernel launched at (block_v, warps) for K = 128: the
    rule's values per thread set to what `warps` warps hold of a 128 x block_v tile."""
    shipped = module_emitter.RECURRENT_BLOCK_V, module_emitter.RECURRENT_STATE_VALUES_PER_THREAD
    values_per_thread = max(1, HEAD_DIM * block_v // (32 * warps))
    module_emitter.RECURRENT_BLOCK_V, module_emitter.RECURRENT_STATE_VALUES_PER_THREAD = block_v, values_per_thread
    try:
        source = module_emitter.emit_module(run_pipeline(load_spec_by_name(spec)), spec_path=spec)
    finally:
        module_emitter.RECURRENT_BLOCK_V, module_emitter.RECURRENT_STATE_VALUES_PER_THREAD = shipped
    file = directory / f"sweep_{block_v}_{warps}.py"
    file.write_text(source)
    return import_file(file, f"lrdsl_sweep_{block_v}_{warps}", source)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("spec", nargs="?", default="gdn")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--blocks", default="16,32,64,128")
    parser.add_argument("--warps", default="1,2,4,8")
    args = parser.parse_args(argv)
    try:
        blocks, warps = numbers(args.blocks, "--blocks"), numbers(args.warps, "--warps")
    except ValueError as exc:
        return fail(str(exc))
    if not torch.cuda.is_available():
        return fail("needs a CUDA GPU (timings on the CPU interpreter mean nothing)")
    import triton.testing

    rec = run_pipeline(load_spec_by_name(args.spec), until="recurrence")["recurrence"]
    generator = torch.Generator().manual_seed(0)
    shape = Shape(args.batch, 1, 16, 32, 128, 128)
    decode = [t.cuda() for t in make_inputs(rec, shape, dtype=torch.bfloat16, generator=generator, normalize_keys=False)]
    drafts = [t.cuda() for t in make_inputs(rec, Shape(args.batch, 4, 16, 32, 128, 128), dtype=torch.bfloat16,
                                            generator=generator, normalize_keys=False)]
    rows = torch.randperm(2 * args.batch, generator=generator)[: args.batch].to("cuda", torch.int32)
    start = (torch.randn(2 * args.batch, 32, 128, 128, generator=generator) * 0.1).cuda()
    row_bytes = args.batch * 32 * 128 * 128
    calls = {"pool fp32": (torch.float32, 2), "pool bf16": (torch.bfloat16, 2), "verify": (torch.float32, 1)}
    results, reference_outputs = [], {}
    shipped = shipped_setting()
    settings = [shipped] + [(b, w) for b in blocks for w in warps if (b, w) != shipped]
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        for block_v, warp_count in settings:
            mod = generate(args.spec, block_v, warp_count, Path(tmp))
            for call, (state_dtype, passes) in calls.items():
                pool = start.to(state_dtype, copy=True)

                def run():
                    options = dict(state_pool=pool, state_indices=rows, validate=False, use_qk_l2norm_in_kernel=True)
                    if call == "verify":
                        return mod.verify(*drafts, **options)[0]
                    return mod.recurrent(*decode, **options)[0]

                first = run()  # compiles; the outputs of a fresh pool
                if call not in reference_outputs:
                    reference_outputs[call] = first
                difference = relative_error(first, reference_outputs[call])
                us = 1e3 * float(triton.testing.do_bench(run, warmup=50, rep=200, return_mode="median"))
                tbps = passes * row_bytes * (2 if state_dtype == torch.bfloat16 else 4) / (us * 1e-6) / 1e12
                results.append((call, us, tbps, block_v, warp_count, difference))
                print(f"{call:<10} BV={block_v:<4} warps={warp_count}  {us:8.1f} us  {tbps:5.2f} TB/s  "
                      f"vs shipped {difference:.1e}", flush=True)
    print(f"\nbest per call (shipped: BV={shipped[0]}, warps={shipped[1]}):")
    for call in calls:
        ranked = sorted((r for r in results if r[0] == call and r[5] <= 1e-5), key=lambda r: r[1])
        for name, us, tbps, block_v, warp_count, _ in ranked[:3]:
            print(f"  {name:<10} BV={block_v:<4} warps={warp_count}  {us:8.1f} us  {tbps:5.2f} TB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
