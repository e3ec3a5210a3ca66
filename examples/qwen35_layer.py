"""Qwen3.5's Gated DeltaNet layer on lrdsl's kernels: forward, backward and decode.

    python examples/qwen35_layer.py              # tiny layer (CPU: Triton's interpreter; GPU: as is)
    python examples/qwen35_layer.py --released   # GPU: the released head geometry (16/32 heads, dims 128), bf16

With transformers installed, the same weights also run through its Qwen3_5GatedDeltaNet and the
relative differences are printed. Each is checked against the tolerance of the dtype (fp32 2e-3,
bf16 8e-3); the last line is the verdict, "ok" or "FAILED:" with the checks that failed (exit
status 1). --released needs a GPU: on a CPU its kernels would run in Triton's interpreter for
minutes (393 s measured) and the verdict would say nothing the tiny layer does not.
"""
from __future__ import annotations

import argparse
import sys
from types import SimpleNamespace

from lrdsl import config

config.use_interpreter_without_gpu()  # before anything imports triton

import torch  # noqa: E402

from lrdsl.layers import GatedDeltaNet, GatedDeltaNetCache  # noqa: E402
from lrdsl.verification.workloads import TOLERANCE  # noqa: E402


def relative(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--released", action="store_true", help="16 key / 32 value heads of dim 128, bf16 (GPU)")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.released and device == "cpu":
        print("qwen35_layer.py: --released needs a GPU (on a CPU Triton's interpreter takes minutes over the released "
              "geometry); run it without --released for the tiny layer", file=sys.stderr)
        return 2
    if args.released:
        geometry = dict(hidden_size=2048, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                        linear_value_head_dim=128)
        dtype, B, T = torch.bfloat16, 2, 512
    else:
        geometry = dict(hidden_size=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                        linear_value_head_dim=24)
        dtype, B, T = torch.float32, 2, 12
    layer_config = SimpleNamespace(**geometry, linear_conv_kernel_dim=4, hidden_act="silu", rms_norm_eps=1e-6)
    torch.manual_seed(0)
    layer = GatedDeltaNet(layer_config, layer_idx=0).to(device, dtype)
    x = torch.randn(B, T, layer.hidden_size, device=device, dtype=dtype, requires_grad=True)

    out = layer(x)  # prefill / training: chunk kernels
    out.float().square().mean().backward()
    print(f"forward {tuple(out.shape)} {out.dtype}; gradients of x and {sum(1 for _ in layer.parameters())} parameters")

    cache = GatedDeltaNetCache()  # decode: a prefill, then one token at a time
    with torch.no_grad():
        steps = [layer(x[:, : T - 3], cache=cache)] + [layer(x[:, t : t + 1], cache=cache) for t in range(T - 3, T)]
    limit, failed = TOLERANCE[dtype], []

    def check(what, error):
        print(f"{what}: relative difference {error:.2e}")
        if not error <= limit:  # NaN fails too
            failed.append(f"{what} {error:.2e} > {limit:.0e}")

    check(f"prefill of {T - 3} + 3 decode steps vs one prefill", relative(torch.cat(steps, 1), out))

    try:
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet
    except ImportError:
        print("transformers is not installed: no comparison")
        return verdict(failed)
    hf_config = SimpleNamespace(**vars(layer_config), layer_types=["linear_attention"])
    theirs = Qwen3_5GatedDeltaNet(hf_config, layer_idx=0).to(device, dtype)
    theirs.load_state_dict(layer.state_dict())
    x_theirs = x.detach().clone().requires_grad_(True)
    out_theirs = theirs(x_theirs)
    out_theirs.float().square().mean().backward()
    check("vs transformers: output", relative(out, out_theirs))
    check("vs transformers: d(input)", relative(x.grad, x_theirs.grad))
    worst = max(
        (relative(p.grad, dict(theirs.named_parameters())[n].grad), n) for n, p in layer.named_parameters()
    )
    check(f"vs transformers: worst parameter gradient ({worst[1]})", worst[0])
    return verdict(failed)


def verdict(failed) -> int:
    print("ok" if not failed else "FAILED: " + "; ".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
