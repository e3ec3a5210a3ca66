"""The launchers free each buffer after the last kernel that reads it: at every kernel launch of a
forward + backward call, each array the call allocated and still holds is an argument of that
launch or a later one, or something the call returns (o, the final state, the gradients).
Holding a buffer past its last reader (the backward's prepare buffers during its output kernel,
the system once solved) raised the GPU memory peak by one tile-sized buffer per such array.
What autograd saved for the backward (the inputs and the buffers the save policy keeps) it holds
until the backward returns, whatever the launchers drop: those count as needed throughout (a
kept buffer outside autograd's saved tensors would escape activation checkpointing's hooks)."""
from __future__ import annotations

import inspect
import weakref

import pytest
import torch

from lrdsl import config, reference
from lrdsl.verification.workloads import Shape, relative_error

from helpers import module, recurrence, sample


class _TrackAllocations(torch.utils._python_dispatch.TorchDispatchMode):
    """Weak references to every tensor a factory (empty, zeros, ...) creates while active."""

    FACTORIES = ("empty", "empty_strided", "empty_like", "zeros", "zeros_like", "new_empty", "new_zeros", "full")

    def __init__(self):
        super().__init__()
        self.allocated = []  # (weakref, shape)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ in self.FACTORIES and out.numel() > 0:
            self.allocated.append((weakref.ref(out), tuple(out.shape)))
        return out

    def live(self) -> dict[int, tuple]:
        """data_ptr -> shape of each allocated tensor still alive."""
        return {t.data_ptr(): shape for ref, shape in self.allocated if (t := ref()) is not None}


@pytest.mark.parametrize("name, plan", [("gdn", "split"), ("gdn", "fused"), ("kda", "split"), ("rwkv7", "split")])
def test_no_buffer_outlives_its_last_kernel(name, plan, generator, monkeypatch):
    if not config.interpreting():
        pytest.skip("records the launches through Triton's CPU interpreter (the launchers are the same on a GPU)")
    from triton.runtime.interpreter import InterpretedFunction

    rec, mod = recurrence(name), module(name)
    tracker, launches = _TrackAllocations(), []
    launch = InterpretedFunction.run

    def recorded(kernel, *args, **kwargs):
        pointers = {a.data_ptr() for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)}
        launches.append((kernel.fn.__name__, tracker.live(), pointers))
        return launch(kernel, *args, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", recorded)
    shape = Shape(1, 40, 1, 2, 16, 16)
    leaves = [t.requires_grad_() for t in sample(rec, shape, torch.float32, generator)]
    d_o = torch.randn(1, 40, 2, 16, generator=generator)
    with tracker:
        o, ht = mod.chunk(*leaves, chunk_size=16, plan=plan, output_final_state=True, save_policy="save")
        saved = {t.data_ptr() for t in o.grad_fn.saved_tensors if t is not None}
        grads = torch.autograd.grad((o * d_o).sum() + ht.sum(), leaves)
    returned = {t.data_ptr() for t in (o, ht, *grads)}
    assert launches, "no chunk kernel ran"
    assert len(saved) > len(leaves), "save keeps forward buffers for the backward"
    for i, (kernel, live, _) in enumerate(launches):
        needed = set().union(*(args for _, _, args in launches[i:])) | returned | saved
        held = {shape for pointer, shape in live.items() if pointer not in needed}
        assert not held, f"{name} {plan}: at {kernel} the call still holds arrays of shapes {sorted(held)} no later kernel reads"


def test_a_store_may_share_storage_only_after_the_last_load():
    """storage_reuses' source check: every load through the read buffer before the first store
    through the written array; a load after it (a reload), or no load or store, refuses."""
    from lrdsl.codegen.chunk import _stores_after_last_load

    source = "\n".join(["    b_x = tl.load(buf_x + offsets)", "    b_y = b_x * 2", "    tl.store(buf_y + offsets, b_y)"])
    assert _stores_after_last_load(source, "buf_x", "buf_y")
    reload = source + "\n    b_z = tl.load(buf_x + offsets)"
    assert not _stores_after_last_load(reload, "buf_x", "buf_y")
    assert not _stores_after_last_load(source, "buf_w", "buf_y") and not _stores_after_last_load(source, "buf_x", "buf_w")


@pytest.mark.parametrize("name, reuses", [("gdn", {"buf_d_Vn": "buf_d_Vn_via_QKtVn", "d_v": "buf_d_Vn"}),
                                          ("rwkv7", {"buf_d_U": "buf_d_U_via_QBtU", "d_v": "buf_d_U"}),
                                          ("gla", {})])
def test_backward_arrays_take_the_storage_of_buffers_read_for_the_last_time(name, reuses, generator, monkeypatch):
    """The backward kernels get one storage for each reusing pair (the launch arguments share
    it), and the gradients stay the oracle's (tests/test_backward.py for every spec)."""
    if not config.interpreting():
        pytest.skip("records the launches through Triton's CPU interpreter (the launchers are the same on a GPU)")
    from triton.runtime.interpreter import InterpretedFunction

    rec, mod = recurrence(name), module(name)
    shared, launch = {}, InterpretedFunction.run

    def recorded(kernel, *args, **kwargs):
        bound = dict(zip(inspect.signature(kernel.fn).parameters, args))
        for array, buffer in reuses.items():
            if isinstance(bound.get(array), torch.Tensor) and isinstance(bound.get(buffer), torch.Tensor):
                shared[array] = bound[array].data_ptr() == bound[buffer].data_ptr()
        return launch(kernel, *args, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", recorded)
    shape = Shape(1, 40, 1, 2, 16, 16)
    leaves = [t.requires_grad_() for t in sample(rec, shape, torch.bfloat16, generator)]
    o, _ = mod.chunk(*leaves, chunk_size=16)
    torch.autograd.grad(o.float().sum(), leaves)
    assert shared == {array: True for array in reuses}
    source = open(mod.__file__).read()
    backward = source[source.index("def _chunk_backward("):]
    backward = backward[:backward.index("\ndef ", 1)]
    assert backward.count("in the storage of") == len(reuses)


@pytest.mark.parametrize("name, written, read, output_in", [("gdn", "buf_Vn", "buf_U", "buf_Vn"),
                                                            ("rwkv7", "buf_U", "buf_U_base", "buf_U"),
                                                            ("gla", None, None, None)])
@pytest.mark.parametrize("policy", ["save_states", "save", "save_prepare"])
def test_forward_arrays_take_the_storage_of_buffers_read_for_the_last_time(name, written, read, output_in, policy,
                                                                           generator, monkeypatch):
    """gdn's scan reads U for the last time, each tile before it writes Vn's at the same place,
    and its output kernel so reads Vn before it writes o: Vn takes U's storage and o Vn's (gdn's
    forward without gradients at 4 x 4096, 32 value heads, bf16: 904 -> 648 MiB at its peak, lrdsl
    memory --no-backward), in the forward without gradients, in a training forward and in the
    backward's re-run of the scan; never where the call keeps the buffer for the backward (save
    keeps Vn, save_prepare U) or got it from an earlier call. Outputs and gradients stay the
    oracle's, and a second backward over the same graph (retain_graph) gives the same gradients."""
    if not config.interpreting():
        pytest.skip("records the launches through Triton's CPU interpreter (the launchers are the same on a GPU)")
    from triton.runtime.interpreter import InterpretedFunction

    rec, mod = recurrence(name), module(name)
    scans, outputs, launch = [], [], InterpretedFunction.run

    def recorded(kernel, *args, **kwargs):
        bound = dict(zip(inspect.signature(kernel.fn).parameters, args))
        if kernel.fn.__name__.endswith("_chunk_scan_kernel") and isinstance(bound.get(written), torch.Tensor):
            scans.append(bound[written].data_ptr() == bound[read].data_ptr())
        if kernel.fn.__name__.endswith("_chunk_output_kernel") and output_in:
            outputs.append(bound["o"].data_ptr() == bound[output_in].data_ptr())
        return launch(kernel, *args, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", recorded)
    shape = Shape(1, 40, 1, 2, 16, 16)
    inputs = sample(rec, shape, torch.float32, generator)
    with torch.no_grad():
        mod.chunk(*inputs, chunk_size=16)
    leaves = [t.clone().requires_grad_() for t in inputs]
    o, ht = mod.chunk(*leaves, chunk_size=16, output_final_state=True, save_policy=policy)
    d_o = torch.randn_like(o)
    first = torch.autograd.grad((o * d_o).sum(), leaves, retain_graph=True)
    second = torch.autograd.grad((o * d_o).sum(), leaves)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    exact = [t.detach().double().requires_grad_() for t in inputs]
    ro, rht = reference.run(rec, *exact, output_final_state=True)
    expected = torch.autograd.grad((ro * d_o.double()).sum(), exact)
    for got, want in zip((o, ht, *first), (ro, rht, *expected)):
        assert relative_error(got, want) < 1e-4
    if written is None:
        assert scans == [] and outputs == []
        return
    kept = mod.SAVE_POLICIES[policy]["kept"][mod.DEFAULT_CHUNK_PLAN]
    keeps_read, keeps_written = read[len("buf_"):] in kept, written[len("buf_"):] in kept
    reruns_scan = "scan" in mod.SAVE_POLICIES[policy]["rerun"][mod.DEFAULT_CHUNK_PLAN]
    # no gradients, the training forward, each backward's re-run of the scan where it re-runs it
    # (from the buffer its forward kept under save_prepare: read, never overwritten)
    assert scans == [True, not keeps_read] + [not keeps_read] * (2 * reruns_scan), scans
    assert outputs == [True, not keeps_written], outputs
