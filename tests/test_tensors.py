"""Tensors and arguments as users pass them: strided views, scale of any numeric kind, varlen
chunk indices prepared for a call, gradients autograd asks for (and only those), no second
derivatives, and one-line errors for what cannot work."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from lrdsl import reference
from lrdsl.verification.workloads import TOLERANCE, Shape, make_inputs, relative_error

from helpers import module, recurrence, sample
from oracle_checks import Call, assert_errors, oracle_errors

LIMIT = TOLERANCE[torch.float32]


def strided(t: torch.Tensor) -> torch.Tensor:
    """The same values in a layout no kernel may assume: for [B, T, X, Y] tensors the middle dims
    swapped in memory (v = x.transpose(1, 2) of an [B, HV, T, V] x, as in the issue), for the
    others every other element of a twice larger tensor."""
    if t.dim() == 4:
        return t.transpose(1, 2).contiguous().transpose(1, 2)
    spread = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=t.device)
    spread[..., ::2] = t
    return spread[..., ::2]


STRIDED_CALLS = {
    "dense": Call(Shape(2, 21, 1, 2, 16, 24), h0=True, dht=True),
    "varlen": Call(Shape(1, 30, 2, 4, 8, 16), bounds=(0, 7, 7, 30), h0=True, dht=True, l2norm=True),
}


@pytest.mark.parametrize("call", sorted(STRIDED_CALLS))
@pytest.mark.parametrize("kernel", ["recurrent", "chunk"])
@pytest.mark.parametrize("name", ["gdn", "gdn_qwen35"])
def test_strided_inputs(name, kernel, call, generator, device):
    """Every input a strided view (q, k, v, the spec's inputs, the initial state, cu_seqlens):
    outputs and gradients match the oracle, outputs are contiguous. (Finding 2 of issue 8: a
    strided v scrambled chunk's output.)"""
    options = {"chunk_size": 16} if kernel == "chunk" else {}
    errors = oracle_errors(recurrence(name), module(name), STRIDED_CALLS[call], generator, kernel, device=device,
                           layout=strided, **options)
    assert_errors(errors, LIMIT, f"{name}.{kernel} {call}, strided inputs")


def test_strided_v_as_the_issue_made_it(generator, device):
    rec, mod = recurrence("gdn"), module("gdn")
    q, k, v, g, beta = sample(rec, Shape(1, 20, 1, 2, 8, 16), torch.float32, generator)
    x = v.transpose(1, 2).contiguous()  # [B, HV, T, V], as a projection might leave it
    ref_o, _ = reference.run(rec, q, k, v, g, beta)
    args = [t.to(device) for t in (q, k, x.transpose(1, 2), g, beta)]
    o, _ = mod.chunk(*args, chunk_size=16)
    assert o.is_contiguous() and relative_error(o, ref_o) <= LIMIT


# -- varlen chunk indices ------------------------------------------------------------------------

def _varlen(generator, device, T=40):
    rec, mod = recurrence("gdn"), module("gdn")
    tensors = [t.to(device) for t in sample(rec, Shape(1, T, 1, 2, 8, 8), torch.float32, generator)]
    cu_seqlens = torch.tensor([0, 17, 17, T], dtype=torch.int32, device=device)
    return rec, mod, tensors, cu_seqlens


def test_readme_varlen_recipe(generator, device):
    """README: chunk(..., cu_seqlens=cu_seqlens, chunk_indices=mod.prepare_varlen(cu_seqlens, chunk_size))."""
    rec, mod, tensors, cu_seqlens = _varlen(generator, device)
    chunk_size = 16
    o, ht = mod.chunk(*tensors, cu_seqlens=cu_seqlens, chunk_size=chunk_size, output_final_state=True,
                      chunk_indices=mod.prepare_varlen(cu_seqlens, chunk_size))
    ref_o, ref_ht = reference.run(rec, *[t.cpu() for t in tensors], cu_seqlens=cu_seqlens.cpu(), output_final_state=True)
    assert relative_error(o, ref_o) <= LIMIT and relative_error(ht, ref_ht) <= LIMIT


def _chunk_error(mod, tensors, **kwargs) -> str:
    with pytest.raises(mod.InputError) as info:
        mod.chunk(*tensors, **kwargs)
    message = str(info.value)
    assert "\n" not in message and message.startswith("gdn.chunk: ") and "tensor([" not in message
    return message


def test_chunk_indices_of_another_chunk_size_are_refused(generator, device):
    """Finding 4 of issue 8: prepare_varlen(cu, 64) passed with chunk_size=16 corrupted memory."""
    _, mod, tensors, cu_seqlens = _varlen(generator, device)
    message = _chunk_error(mod, tensors, cu_seqlens=cu_seqlens, chunk_size=16, chunk_indices=mod.prepare_varlen(cu_seqlens, 64))
    assert "prepared for chunk_size=64 but the call has chunk_size=16" in message
    # the issue's call: the bare indices tensor, which carries no chunk size, is refused too
    message = _chunk_error(mod, tensors, cu_seqlens=cu_seqlens, chunk_size=16,
                           chunk_indices=mod.prepare_varlen(cu_seqlens, 64).indices)
    assert "chunk_indices must be what prepare_varlen(cu_seqlens, chunk_size) returns" in message


def test_chunk_indices_checks(generator, device):
    _, mod, tensors, cu_seqlens = _varlen(generator, device)
    chunks = mod.prepare_varlen(cu_seqlens, 16)
    assert "returns, got a torch.int32 tensor [4, 2]" in _error_of(mod, tensors, cu_seqlens, chunks.indices)
    other = cu_seqlens.clone()
    assert "prepared from another cu_seqlens" in _error_of(mod, tensors, other, chunks)
    cu_seqlens[1] = 16  # changed in place after prepare_varlen
    assert "prepared from another cu_seqlens (or it changed since)" in _error_of(mod, tensors, cu_seqlens, chunks)
    message = _chunk_error(mod, tensors, chunk_size=16, chunk_indices=chunks)
    assert "chunk_indices given without cu_seqlens" in message


def _error_of(mod, tensors, cu_seqlens, chunk_indices):
    return _chunk_error(mod, tensors, cu_seqlens=cu_seqlens, chunk_size=16, chunk_indices=chunk_indices)


def test_one_prepare_varlen_serves_every_spec(generator, device):
    """What prepare_varlen returns is recognised by its fields: another spec's module takes it."""
    _, _, tensors, cu_seqlens = _varlen(generator, device)
    chunks = module("gdn").prepare_varlen(cu_seqlens, 32)
    rec = recurrence("deltanet")
    q, k, v, _, beta = tensors
    o, _ = module("deltanet").chunk(q, k, v, beta, cu_seqlens=cu_seqlens, chunk_size=32, chunk_indices=chunks)
    ref_o, _ = reference.run(rec, q.cpu(), k.cpu(), v.cpu(), beta.cpu(), cu_seqlens=cu_seqlens.cpu())
    assert relative_error(o, ref_o) <= LIMIT


# -- autograd ------------------------------------------------------------------------------------

@pytest.mark.parametrize("kernel", ["chunk", "recurrent"])
def test_second_derivatives_are_refused(kernel, generator, device):
    """Finding 5 of issue 8: double backward silently dropped the kernels' term (10 % off). The
    backward with create_graph=True is refused itself, in one line (tests/test_edges_host.py has
    every path and constant cotangents)."""
    rec, mod = recurrence("gdn"), module("gdn")
    q, k, v, g, beta = [t.to(device).requires_grad_() for t in sample(rec, Shape(1, 9, 1, 1, 8, 8), torch.float32, generator)]
    o, _ = getattr(mod, kernel)(q, k, v, g, beta)
    with pytest.raises(RuntimeError, match="second derivatives are not supported"):
        torch.autograd.grad((o * o).sum(), v, create_graph=True)


WANTED = {"v": ("v",), "g": ("g",), "h0": ("h0",), "q_beta": ("q", "beta"), "k_h0": ("k", "h0")}


@pytest.mark.parametrize("wanted", sorted(WANTED))
@pytest.mark.parametrize("kernel", ["chunk", "recurrent"])
def test_backward_computes_what_autograd_asks_for(kernel, wanted, generator, device, monkeypatch):
    """Only some inputs require gradients: those are right, the rest get none, and the backward's
    output kernel (which writes only gradients of inputs) does not run when none of them is asked
    for."""
    rec, mod = recurrence("gdn"), module("gdn")
    names = ["q", "k", "v", "g", "beta", "h0"]
    tensors = sample(rec, Shape(1, 20, 1, 2, 8, 8), torch.float32, generator)
    tensors.append(torch.randn(1, 2, 8, 8, generator=generator))
    leaves = [t.clone().to(device).requires_grad_(n in WANTED[wanted]) for n, t in zip(names, tensors)]
    refs = [t.double().requires_grad_(n in WANTED[wanted]) for n, t in zip(names, tensors)]
    launches = []
    output_kernel = getattr(mod, "gdn_chunk_bwd_output_kernel")

    class Recorder:
        def __getitem__(self, grid):
            launches.append(grid)
            return output_kernel[grid]

    monkeypatch.setattr(mod, "gdn_chunk_bwd_output_kernel", Recorder())
    options = {"chunk_size": 16} if kernel == "chunk" else {}
    o, ht = getattr(mod, kernel)(*leaves[:5], initial_state=leaves[5], output_final_state=True, **options)
    ref_o, ref_ht = reference.run(rec, *refs[:5], initial_state=refs[5], output_final_state=True)
    d_o = torch.randn(o.shape, generator=generator)
    ((o * d_o.to(device)).sum() + ht.sum()).backward()
    ((ref_o * d_o.double()).sum() + ref_ht.sum()).backward()
    for name, leaf, ref in zip(names, leaves, refs):
        if name in WANTED[wanted]:
            assert relative_error(leaf.grad, ref.grad) <= LIMIT, name
        else:
            assert leaf.grad is None, name
    assert bool(launches) == (wanted != "h0")


# -- scale -----------------------------------------------------------------------------------------

SCALES = {
    "int": 1,
    "float": 0.3,
    "numpy_float32": np.float32(0.3),
    "numpy_float64": np.float64(0.3),
    "numpy_int64": np.int64(1),
    "numpy_0d_array": np.array(0.3),
    "tensor_0d": torch.tensor(0.3),
    "tensor_0d_float64": torch.tensor(0.3, dtype=torch.float64),
}


@pytest.mark.parametrize("kind", sorted(SCALES))
def test_scale_of_any_numeric_kind(kind, generator, device):
    """Finding 6 of issue 8: a 0-d tensor scale was refused as "not a finite number"."""
    rec, mod = recurrence("gdn"), module("gdn")
    tensors = sample(rec, Shape(1, 6, 1, 1, 8, 8), torch.float32, generator)
    scale = SCALES[kind]
    ref_o, _ = reference.run(rec, *tensors, scale=float(scale))
    for kernel in ("recurrent", "chunk"):
        o, _ = getattr(mod, kernel)(*[t.to(device) for t in tensors], scale=scale)
        assert relative_error(o, ref_o) <= LIMIT, kernel


@pytest.mark.parametrize("scale", [True, "0.3", float("nan"), torch.tensor([0.3]), torch.tensor(0.3j), [0.3]])
def test_scale_refused(scale, generator):
    rec, mod = recurrence("gdn"), module("gdn")
    tensors = sample(rec, Shape(1, 4, 1, 1, 8, 8), torch.float32, generator)
    with pytest.raises(mod.InputError, match="gdn.recurrent: scale must be a") as info:
        mod.recurrent(*tensors, scale=scale)
    assert "\n" not in str(info.value)


# -- calls that cannot work ---------------------------------------------------------------------------

@pytest.mark.parametrize("kernel", ["recurrent", "chunk"])
def test_one_positional_tensor_too_many(kernel, generator):
    """Issue 14: the extra tensor lands in scale; say how many tensors the spec takes and which
    were given, without printing a tensor."""
    rec, mod = recurrence("gdn"), module("gdn")
    tensors = make_inputs(rec, Shape(1, 5, 2, 4, 8, 8), generator=generator)
    with pytest.raises(mod.InputError) as info:
        getattr(mod, kernel)(*tensors, tensors[-1])
    message = str(info.value)
    assert "\n" not in message and "tensor(" not in message
    assert f"gdn.{kernel}: scale must be a number, got a tensor [1, 5, 4]: one tensor too many?" in message
    assert "takes 5 tensors (q, k, v, g, beta), given q [1, 5, 2, 8], k [1, 5, 2, 8], v [1, 5, 4, 8], g [1, 5, 4], beta [1, 5, 4]" in message
