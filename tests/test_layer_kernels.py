"""The generated layer kernels (short convolution, gated RMSNorm) against float64 PyTorch references."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lrdsl.codegen.layer_kernels import emit_layer_kernels
from lrdsl.errors import CompileError
from lrdsl.layers.kernels import layer_kernels
from lrdsl.verification.workloads import TOLERANCE, relative_error

TOL = TOLERANCE[torch.float32]


@pytest.fixture(scope="module")
def kernels():
    return layer_kernels()


def conv_reference(x, weight, bias, window):
    """One sequence: x [L, D], weight [D, W], window [D, W] (the W inputs before x) -> (y, final window), float64."""
    W = weight.shape[1]
    extended = torch.cat([window.T, x], dim=0).double()  # [W + L, D]
    L = x.shape[0]
    pre = torch.zeros(L, x.shape[1], dtype=torch.float64)
    for j in range(W):
        # tap j reads the input W - 1 - j tokens back: extended row W + t - (W - 1 - j)
        pre = pre + weight[:, j].double() * extended[1 + j : 1 + j + L]
    if bias is not None:
        pre = pre + bias.double()
    return F.silu(pre), extended[-W:].T


def sequences_reference(x, weight, bias, windows, cu_seqlens):
    """Packed sequences [T, D] with per-sequence windows [N, D, W] -> (y [T, D], final windows [N, D, W])."""
    ys, finals = [], []
    for n, (start, end) in enumerate(zip(cu_seqlens[:-1], cu_seqlens[1:])):
        y, final = conv_reference(x[start:end], weight, bias, windows[n])
        ys.append(y)
        finals.append(final)
    return torch.cat(ys), torch.stack(finals)


def check_grads(outputs, references, inputs, reference_inputs, generator):
    seed = [torch.randn(o.shape, generator=generator, dtype=torch.float64) for o in references]
    grads = torch.autograd.grad(outputs, inputs, [s.to(o.device, o.dtype) for s, o in zip(seed, outputs)])
    expected = torch.autograd.grad(references, reference_inputs, seed)
    for name, got, want in zip(("x", "weight", "bias"), grads, expected):
        err = relative_error(got, want)
        assert err <= TOL, f"d{name}: relative error {err:.2e}"


def leaf(t, device="cpu"):
    return t.detach().to(device).clone().requires_grad_(True)


@pytest.mark.parametrize("B,T,D,W,with_bias", [(2, 70, 20, 4, True), (1, 9, 130, 3, False), (3, 1, 24, 4, True)])
def test_short_conv_forward_backward(kernels, generator, device, B, T, D, W, with_bias):
    x = torch.randn(B, T, D, generator=generator)
    weight = torch.randn(D, W, generator=generator)
    bias = torch.randn(D, generator=generator) if with_bias else None
    inputs = [leaf(x, device), leaf(weight, device)] + ([leaf(bias, device)] if with_bias else [])
    y, final = kernels.short_conv(inputs[0], inputs[1], inputs[2] if with_bias else None, output_final_window=True)
    reference_inputs = [leaf(x.double()), leaf(weight.double())] + ([leaf(bias.double())] if with_bias else [])
    zero = torch.zeros(D, W, dtype=torch.float64)
    pairs = [conv_reference(reference_inputs[0][b], reference_inputs[1], reference_inputs[2] if with_bias else None, zero)
             for b in range(B)]
    y_ref = torch.stack([p[0] for p in pairs])
    assert relative_error(y, y_ref) <= TOL
    assert torch.equal(final.cpu().double(), torch.stack([p[1] for p in pairs]).detach())
    check_grads([y], [y_ref], inputs, reference_inputs, generator)


def test_short_conv_varlen_never_crosses_sequences(kernels, generator, device):
    """Packed sequences of lengths 0, 1, 5, 66, 3, each with its own initial window."""
    lengths = [0, 1, 5, 66, 3]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    T, D, W = int(cu[-1]), 40, 4
    x = torch.randn(1, T, D, generator=generator)
    weight = torch.randn(D, W, generator=generator)
    bias = torch.randn(D, generator=generator)
    windows = torch.randn(len(lengths), D, W, generator=generator)
    inputs = [leaf(x, device), leaf(weight, device), leaf(bias, device)]
    y, final = kernels.short_conv(*inputs, initial_window=windows.to(device), output_final_window=True,
                                  cu_seqlens=cu.to(device))
    reference_inputs = [leaf(x.double()), leaf(weight.double()), leaf(bias.double())]
    y_ref, final_ref = sequences_reference(reference_inputs[0][0], reference_inputs[1], reference_inputs[2],
                                           windows.double(), cu.tolist())
    assert relative_error(y[0], y_ref) <= TOL
    # the window of the empty sequence is its old one; of the 1- and 3-token ones, old slots shifted in
    assert torch.equal(final.cpu().double(), final_ref.detach())
    check_grads([y[0]], [y_ref], inputs, reference_inputs, generator)


@pytest.mark.parametrize("T1,T2", [(7, 2), (3, 9), (0, 5)])
def test_short_conv_split_with_window_equals_whole(kernels, generator, device, T1, T2):
    B, D, W = 2, 24, 4
    x = torch.randn(B, T1 + T2, D, generator=generator).to(device)
    weight = torch.randn(D, W, generator=generator).to(device)
    bias = torch.randn(D, generator=generator).to(device)
    whole, whole_window = kernels.short_conv(x, weight, bias, output_final_window=True)
    first, window = kernels.short_conv(x[:, :T1], weight, bias, output_final_window=True)
    second, final = kernels.short_conv(x[:, T1:], weight, bias, initial_window=window, output_final_window=True)
    assert relative_error(torch.cat([first, second], dim=1), whole) <= 1e-6
    assert torch.equal(final, whole_window)


def test_short_conv_update_steps_equal_whole_sequence(kernels, generator, device):
    B, T, D, W = 2, 6, 36, 4
    x = torch.randn(B, T, D, generator=generator)
    weight = torch.randn(D, 1, W, generator=generator)  # nn.Conv1d's layout is accepted too
    prefill, window = kernels.short_conv(x[:, :2].to(device), weight.to(device), None, output_final_window=True)
    steps = []
    with torch.no_grad():
        for t in range(2, T):
            steps.append(kernels.short_conv_update(x[:, t : t + 1].to(device), window, weight.to(device)))
    zero = torch.zeros(D, W, dtype=torch.float64)
    pairs = [conv_reference(x[b], weight[:, 0], None, zero) for b in range(B)]
    y_ref = torch.stack([p[0] for p in pairs])
    assert relative_error(torch.cat([prefill] + steps, dim=1), y_ref) <= TOL
    assert torch.equal(window.cpu().double(), torch.stack([p[1] for p in pairs]))


def norm_reference(x, gate, weight, eps):
    x, gate, weight = x.double(), gate.double(), weight.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight * F.silu(gate)


# rows of 3 elements, not 1: with one element the norm is sign(x) and its x-gradient
# eps / (x^2 + eps)^1.5 (about 1e-6) is a difference of nearly equal fp32 terms in any fp32 code
@pytest.mark.parametrize("shape", [(3, 7, 2, 24), (37, 128), (5, 3)])
def test_gated_rms_norm_forward_backward(kernels, generator, device, shape):
    x = torch.randn(shape, generator=generator)
    gate = torch.randn(shape, generator=generator)
    weight = torch.randn(shape[-1], generator=generator)
    eps = 1e-6
    inputs = [leaf(x, device), leaf(gate, device), leaf(weight, device)]
    out = kernels.gated_rms_norm(*inputs, eps)
    reference_inputs = [leaf(x.double()), leaf(gate.double()), leaf(weight.double())]
    ref = norm_reference(*reference_inputs, eps)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert relative_error(out, ref) <= TOL
    seed = torch.randn(shape, generator=generator, dtype=torch.float64)
    grads = torch.autograd.grad(out, inputs, seed.to(device, torch.float32))
    expected = torch.autograd.grad(ref, reference_inputs, seed)
    for name, got, want in zip(("x", "gate", "weight"), grads, expected):
        assert relative_error(got, want) <= TOL, name


def test_bad_inputs_get_one_line_errors(kernels, device):
    def t(*shape, **options):
        return torch.randn(*shape, device=device, **options)

    x = t(1, 5, 8)
    weight = t(8, 4)
    cases = [
        (lambda: kernels.short_conv(x[0], weight), "x must be [B, T, D]"),
        (lambda: kernels.short_conv(x, t(7, 4)), "weight must be [D, W] = [8, W]"),
        (lambda: kernels.short_conv(x, weight, initial_window=t(2, 8, 4)), "initial_window must be [N, D, W] = [1, 8, 4]"),
        (lambda: kernels.short_conv(x, weight, initial_window=t(1, 8, 4, requires_grad=True)), "pass it detached"),
        (lambda: kernels.short_conv(t(2, 5, 8), weight, cu_seqlens=torch.tensor([0, 5], device=device)), "the batch must be 1"),
        (lambda: kernels.short_conv_update(x, torch.zeros(1, 8, 4, device=device), weight), "one token"),
        (lambda: kernels.short_conv_update(x[:, :1].requires_grad_(), torch.zeros(1, 8, 4, device=device), weight), "not differentiable"),
        (lambda: kernels.gated_rms_norm(x, t(1, 5, 7), torch.ones(8, device=device)), "gate must have x's shape [1, 5, 8]"),
        (lambda: kernels.gated_rms_norm(x, x, torch.ones(7, device=device)), "weight must be [V] = [8]"),
    ]
    if device == "cpu":  # boundary values are read only where that costs no device synchronisation
        cases.append((lambda: kernels.short_conv(x, weight, cu_seqlens=torch.tensor([0, 6])), "must rise from 0 to T=5"))
    for call, message in cases:
        with pytest.raises(kernels.InputError, match=message.replace("[", r"\[").replace("]", r"\]")) as caught:
            call()
        assert "\n" not in str(caught.value)


def test_unknown_activation_is_a_compile_error():
    with pytest.raises(CompileError, match="unknown activation 'gelu_tanh'"):
        emit_layer_kernels(conv_activation="gelu_tanh")
