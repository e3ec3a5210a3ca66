"""Run a generated gdn module's forward + backward a few times on the GPU (a target for ncu).

    python scripts/run_once.py gdn_ops.py 4x4096x16x32 [CALLS]      # BxTxHxHV, K = V = 128, bf16

`call` is the call itself; scripts/ncu_stalls.py makes it on meta tensors to record the launches.
"""
import importlib.util, os, sys

import torch

sys.path.insert(0, os.getcwd())
from lrdsl.passes.pipeline import run_pipeline
from lrdsl.spec import load_spec
from lrdsl.verification.workloads import Shape, make_inputs


def load_module(path):
    spec = importlib.util.spec_from_file_location("module", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def call(module, shape: str, device: str, calls: int = 1) -> None:
    """`calls` forward + backward calls of gdn's chunk at BxTxHxHV (K = V = 128, bf16, q/k L2 norm
    in the kernel, the final state out, the loss on o)."""
    rec = run_pipeline(load_spec("specs/gdn.toml"), until="recurrence")["recurrence"]
    B, T, H, HV = map(int, shape.split("x"))
    generator = torch.Generator().manual_seed(0)
    inputs = [t.to(device).requires_grad_() for t in make_inputs(rec, Shape(B, T, H, HV, 128, 128), dtype=torch.bfloat16,
                                                                  generator=generator, normalize_keys=False)]
    d_o = torch.randn(B, T, HV, 128, generator=generator).to(device, torch.bfloat16)
    for _ in range(calls):
        o, _ = module.chunk(*inputs, use_qk_l2norm_in_kernel=True, output_final_state=True)
        torch.autograd.grad(o, inputs, d_o)


if __name__ == "__main__":
    call(load_module(sys.argv[1]), sys.argv[2], "cuda", int(sys.argv[3]) if len(sys.argv) > 3 else 1)
    torch.cuda.synchronize()
