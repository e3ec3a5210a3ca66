"""Batch invariance (issue 48 item 5): with `module.BATCH_INVARIANT = True` a sequence's outputs,
final state and input gradients are bit for bit the same alone, in a dense batch beside others and
packed with others (cu_seqlens). Without it they need not be: the choices that weigh a call's
programs against the GPU's multiprocessors (the scan at half the chunk size, segmented scans,
resumed re-runs, launch settings) depend on the batch. On the CPU the interpreter has no
multiprocessors, so these tests lend the module a GPU's count (`_device_multiprocessors`) to make
it choose as on a GPU."""
from __future__ import annotations

import pytest
import torch

from lrdsl import reference
from lrdsl.verification.workloads import TOLERANCE, Shape, make_inputs, relative_error

from helpers import module, recurrence, rows_per_token

T, K = 70, 16
# few enough that a batch of one leaves most of them idle and a batch of three does not: the
# default mode then runs the scan at two chunk sizes for the same sequence
MULTIPROCESSORS = 4
SPECS = ["gdn", "kda", "rwkv7", "simple_gla", "gated_deltaproduct"]


def _inputs(rec, seed):
    g = torch.Generator().manual_seed(seed)
    tensors = make_inputs(rec, Shape(3, T, 1, 2, K, K), generator=g)
    return tensors, torch.randn(3, 2, K, K, generator=g)


def _run(mod, tensors, h0, gradients, **options):
    leaves = [t.clone().requires_grad_(gradients) for t in tensors]
    h = h0.clone().requires_grad_(gradients)
    with torch.set_grad_enabled(gradients):
        o, ht = mod.chunk(*leaves, initial_state=h, output_final_state=True, **options)
        if gradients:
            (o.pow(2).sum() + ht.pow(2).sum()).backward()
    grads = [t.grad for t in leaves] + [h.grad] if gradients else []
    return o.detach(), ht.detach(), grads


@pytest.fixture
def lent_multiprocessors(monkeypatch):
    def lend(mod, invariant):
        monkeypatch.setattr(mod, "_device_multiprocessors", lambda q: MULTIPROCESSORS)
        monkeypatch.setattr(mod, "BATCH_INVARIANT", invariant)
        sizes = []
        at = mod._at_scan_chunk_size
        monkeypatch.setattr(mod, "_at_scan_chunk_size", lambda fn, c, size, idx: sizes.append(size) or at(fn, c, size, idx))
        return sizes
    return lend


@pytest.mark.parametrize("gradients", [False, True], ids=["forward", "backward"])
@pytest.mark.parametrize("name", SPECS)
def test_a_sequence_is_bit_for_bit_the_same_alone_and_in_any_batch(name, gradients, lent_multiprocessors, generator):
    mod, rec = module(name), recurrence(name)
    lent_multiprocessors(mod, invariant=True)
    tensors, h0 = _inputs(rec, int(generator.initial_seed() % 2**31))
    rows = rows_per_token(rec)  # 0: a per-head input
    alone = _run(mod, [t[:1] if r else t for t, r in zip(tensors, rows)], h0[:1], gradients)
    batch = _run(mod, tensors, h0, gradients)
    packed = _run(mod, [torch.cat(list(t.split(1)), dim=1) if r else t for t, r in zip(tensors, rows)], h0, gradients,
                  cu_seqlens=torch.tensor([0, T, 2 * T, 3 * T]))
    assert torch.equal(alone[0], batch[0][:1]) and torch.equal(alone[0], packed[0][:, :T])
    assert torch.equal(alone[1], batch[1][:1]) and torch.equal(alone[1], packed[1][:1])
    if gradients:  # its inputs' and initial state's (a per-head input's sums over the whole batch)
        for mine, dense, flat, r in zip(alone[2], batch[2], packed[2], rows + [1]):
            if r:
                assert torch.equal(mine, dense[:1])
                assert torch.equal(mine, flat[:1] if flat.dim() == 4 and flat.shape[0] == 3 else flat[:, :T * r])
    # and right: against the float64 oracle
    o, ht = reference.run(rec, *[t[:1].double() if r else t.double() for t, r in zip(tensors, rows)],
                          initial_state=h0[:1].double(), output_final_state=True)
    assert relative_error(alone[0], o) <= TOLERANCE[torch.float32] and relative_error(alone[1], ht) <= TOLERANCE[torch.float32]


def test_without_it_the_scan_s_chunk_size_depends_on_the_batch(lent_multiprocessors, generator):
    """What the mode is for: by default a forward without gradients runs its scan at half the chunk
    size only where the batch has programs enough for the GPU (plan rule 6), so the same sequence
    takes two paths; with BATCH_INVARIANT it always takes the large batch's."""
    mod, rec = module("gdn"), recurrence("gdn")
    tensors, h0 = _inputs(rec, int(generator.initial_seed() % 2**31))
    for invariant, expected in ((False, ([], [32])), (True, ([32], [32]))):
        sizes = lent_multiprocessors(mod, invariant)
        seen = []
        for batch in (1, 3):
            sizes.clear()
            with torch.no_grad():
                mod.chunk(*[t[:batch] for t in tensors], initial_state=h0[:batch], output_final_state=True)
            seen.append(list(sizes))
        assert tuple(seen) == expected, (invariant, seen)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("name", ["gdn", "kda"])
def test_gpu_bf16_batch_invariance(name, monkeypatch, generator):
    """On the GPU in bf16 at real sizes: sequence 0 alone, in a dense batch of 8 and packed with 7
    others, forward and backward, bit for bit, with BATCH_INVARIANT."""
    mod, rec = module(name), recurrence(name)
    monkeypatch.setattr(mod, "BATCH_INVARIANT", True)
    g = torch.Generator().manual_seed(int(generator.initial_seed() % 2**31))
    L = 777
    tensors = [t.cuda() for t in make_inputs(rec, Shape(8, L, 2, 4, 128, 128), dtype=torch.bfloat16, generator=g)]
    h0 = torch.randn(8, 4, 128, 128, generator=g).cuda()
    rows = rows_per_token(rec)
    alone = _run(mod, [t[:1] if r else t for t, r in zip(tensors, rows)], h0[:1], True)
    batch = _run(mod, tensors, h0, True)
    packed = _run(mod, [torch.cat(list(t.split(1)), dim=1) if r else t for t, r in zip(tensors, rows)], h0, True,
                  cu_seqlens=torch.arange(0, 8 * L + 1, L, device="cuda"))
    assert torch.equal(alone[0], batch[0][:1]) and torch.equal(alone[0], packed[0][:, :L])
    assert torch.equal(alone[1], batch[1][:1]) and torch.equal(alone[1], packed[1][:1])
    for mine, dense, flat in zip(alone[2][:3], batch[2][:3], packed[2][:3]):  # q, k, v
        assert torch.equal(mine, dense[:1]) and torch.equal(mine, flat[:, :L])
