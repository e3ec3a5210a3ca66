"""Time Qwen3.5's Gated DeltaNet layer: lrdsl.layers.GatedDeltaNet vs transformers' Qwen3_5GatedDeltaNet.

    python scripts/bench_qwen35_layer.py                      # 4 x 4096, released head geometry, bf16
    python scripts/bench_qwen35_layer.py --batch 1 --seq 32768 --json out.json

GPU only. transformers picks its kernels when it is imported: FLA's chunk_gated_delta_rule when
fla-core is installed (else its torch loop), causal-conv1d's convolution when that is installed
(else PyTorch's conv1d). The script prints which it found. Both layers hold the same bf16 weights
and take the same input; each figure is the median of triton.testing.do_bench, forward alone
(under no_grad) and forward + backward (gradients of the input and every parameter), with the
peak memory of one forward + backward and the first call's time (lrdsl's includes compiling its
kernels when its module cache is cold). Before timing, the two layers' outputs and every
gradient are compared: where they differ by more than twice bf16's tolerance, nothing is timed.
fla-core 0.6.0 refuses its gated backward on Hopper with triton < 3.7.1; as in `lrdsl bench`,
the refusal is lifted (and said so) and that comparison is the gate.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import time

import torch
import triton
from transformers import Qwen3_5TextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

from lrdsl.measure.bench import allow_fla_gated_backward_on_hopper
from lrdsl.layers import GatedDeltaNet
from lrdsl.verification.workloads import TOLERANCE, relative_error

# Two bf16 computations of one layer, each within bf16's tolerance of the exact result, differ by
# at most twice it: beyond that one of them is wrong and neither is timed.
AGREEMENT = 2 * TOLERANCE[torch.bfloat16]


def transformers_paths() -> str:
    recurrence = "FLA" if importlib.util.find_spec("fla") else "torch loop"
    convolution = "causal-conv1d" if importlib.util.find_spec("causal_conv1d") else "PyTorch conv1d"
    return f"recurrence: {recurrence}, convolution: {convolution}"


def measure(layer, x, seed):
    """(forward ms, forward+backward ms, peak MiB of one forward+backward, first call s) or an error line."""
    parameters = list(layer.parameters())

    def forward():
        with torch.no_grad():
            return layer(x)

    def forward_backward():
        out = layer(x)
        return torch.autograd.grad(out, [x] + parameters, seed)

    try:
        torch.cuda.synchronize()
        start = time.perf_counter()
        forward_backward()
        torch.cuda.synchronize()
        cold = time.perf_counter() - start
        fwd = triton.testing.do_bench(forward, return_mode="median")
        fwd_bwd = triton.testing.do_bench(forward_backward, return_mode="median")
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        forward_backward()
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    except Exception as exc:  # e.g. FLA refusing its gated backward on this triton: report, go on
        return f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    return fwd, fwd_bwd, peak, cold


def compare(ours, theirs, x, seed) -> dict:
    """Relative differences of the output and of every gradient (input and parameters) between the
    two layers, or {"failed": inf} when transformers' layer raises."""
    results = {}
    try:
        for label, layer in (("lrdsl", ours), ("transformers", theirs)):
            x_leaf = x.detach().requires_grad_(True)
            out = layer(x_leaf)
            names = ["x"] + [name for name, _ in layer.named_parameters()]
            grads = torch.autograd.grad(out, [x_leaf] + list(layer.parameters()), seed)
            results[label] = {"output": out.float(), **{f"d{n}": g.float() for n, g in zip(names, grads)}}
    except Exception as exc:  # e.g. FLA refusing its gated backward on this triton
        print(f"transformers' layer failed: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
        return {"failed": float("inf")}
    mine, theirs_ = results["lrdsl"], results["transformers"]
    return {name: relative_error(mine[name], theirs_[name]) for name in mine}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=4096, help="hidden size (Qwen3_5TextConfig's default)")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_qwen35_layer: needs a CUDA GPU")

    # Qwen3.5's released linear-attention geometry: 16 key heads, 32 value heads, head dims 128, width-4 convolution
    config = Qwen3_5TextConfig(hidden_size=args.hidden, layer_types=["linear_attention"], num_hidden_layers=1)
    torch.manual_seed(0)
    ours = GatedDeltaNet(config, layer_idx=0).cuda().bfloat16()
    with torch.no_grad():
        for name, parameter in ours.named_parameters():
            if parameter.dim() > 1:
                parameter.normal_(0, parameter.shape[-1] ** -0.5)
    theirs = Qwen3_5GatedDeltaNet(config, layer_idx=0).cuda().bfloat16()
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(args.batch, args.seq, args.hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    seed = torch.randn_like(x)

    lifted = allow_fla_gated_backward_on_hopper()
    differences = compare(ours, theirs, x, seed)
    worst = max(differences.values()) if differences else float("nan")
    shape = f"{args.batch} x {args.seq}, hidden {args.hidden}, heads 16/32, dims 128, bf16"
    print(f"Qwen3.5 Gated DeltaNet layer, {shape}")
    print(f"transformers' kernels: {transformers_paths()}")
    if lifted:
        print("note: fla-core's refusal of its gated backward on Hopper with triton < 3.7.1 is lifted to time it")
    worst_name = max(differences, key=differences.get) if differences else "none"
    print(f"lrdsl vs transformers, relative difference: output {differences.get('output', float('nan')):.2e}, "
          f"worst of output and gradients {worst:.2e} ({worst_name}); agreement needs <= {AGREEMENT:.1e}")
    if not worst <= AGREEMENT:
        print("FAILED: the layers disagree, nothing is timed")
        raise SystemExit(1)
    print("| layer | fwd ms | fwd+bwd ms | peak fwd+bwd MiB | first fwd+bwd s |")
    print("|---|---|---|---|---|")
    results = {"shape": shape, "transformers_paths": transformers_paths(), "relative_differences": differences}
    for label, layer in (("lrdsl", ours), ("transformers", theirs)):
        result = measure(layer, x, seed)
        results[label] = result
        if isinstance(result, str):
            print(f"| {label} | {result} | | | |")
        else:
            print(f"| {label} | {result[0]:.3f} | {result[1]:.3f} | {result[2]:.0f} | {result[3]:.1f} |")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=2)


if __name__ == "__main__":
    main()
