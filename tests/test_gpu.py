"""On a GPU: every plan and chunk size, and the recurrent kernel, in bf16 at real sizes against the
float64 oracle (run on the GPU too). Skipped without a CUDA device."""
from __future__ import annotations

import pytest
import torch

from lrdsl import reference
from lrdsl.workloads import Shape

from helpers import ALL_SPECS, assert_close, module, recurrence, sample

pytestmark = pytest.mark.gpu

CHUNKED = [n for n in ALL_SPECS if hasattr(module(n), "chunk")] if torch.cuda.is_available() else []
DENSE = Shape(2, 777, 2, 4, 128, 128)
VARLEN = dict(shape=Shape(1, 1500, 4, 8, 128, 96), bounds=[0, 0, 1, 700, 701, 1500])


def _run(name, kernel, shape, generator, bounds=None, **options):
    rec, mod = recurrence(name), module(name)
    tensors = [t.cuda() for t in sample(rec, shape, torch.bfloat16, generator, normalize_keys=False)]
    N = len(bounds) - 1 if bounds else shape.B
    h0 = torch.randn(N, shape.HV, shape.K, shape.V, generator=generator).cuda()
    kwargs = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True,
                  cu_seqlens=torch.tensor(bounds, dtype=torch.int32).cuda() if bounds else None)
    o, ht = getattr(mod, kernel)(*tensors, **kwargs, **options)
    ref_o, ref_ht = reference.run(rec, *tensors, **kwargs)
    assert_close(o, ref_o, torch.bfloat16, f"{name}.{kernel} {options} o")
    assert_close(ht, ref_ht, torch.bfloat16, f"{name}.{kernel} {options} final state")


@pytest.mark.parametrize("chunk_size", [16, 32, 64])
@pytest.mark.parametrize("plan", ["fused", "split"])
@pytest.mark.parametrize("name", CHUNKED)
def test_gpu_chunk_bf16(name, plan, chunk_size, generator):
    _run(name, "chunk", DENSE, generator, plan=plan, chunk_size=chunk_size)
    _run(name, "chunk", VARLEN["shape"], generator, bounds=VARLEN["bounds"], plan=plan, chunk_size=chunk_size)


@pytest.mark.parametrize("name", ALL_SPECS)
def test_gpu_recurrent_bf16(name, generator):
    _run(name, "recurrent", DENSE, generator)
    _run(name, "recurrent", VARLEN["shape"], generator, bounds=VARLEN["bounds"])
