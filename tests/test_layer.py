"""lrdsl.layers.GatedDeltaNet against transformers' Qwen3_5GatedDeltaNet (its torch path, fp32) and
against a float64 oracle of the whole layer (projections, convolution and norm in float64 PyTorch,
the recurrence through lrdsl.reference); lrdsl.integrations.patch_qwen35 on a tiny random model."""
from __future__ import annotations

import copy
import inspect
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

# transformers before 5.24 is not a reference for decode: 5.17's own one-token steps after a
# prefill differ from its whole-sequence call (0.77 relative, while lrdsl's layer matches that
# call) and its cache holds no state after a padded prefill. pyproject's test extra pins 5.24.x:
# under pytest, 5.25.0's own layer fails on the CPU (its hub-kernel wrapper drops g and beta).
pytest.importorskip("transformers", minversion="5.24", reason="the layer tests compare with transformers >= 5.24")
from transformers import DynamicCache, Qwen3_5ForCausalLM, Qwen3_5TextConfig
from transformers.integrations.hub_kernels import use_kernel_func_from_hub_with_fallback
from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen3_5_modeling
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

from lrdsl import reference
from lrdsl.errors import LrdslError
from lrdsl.integrations import patch_qwen35, unpatch
from lrdsl.layers import GatedDeltaNet, GatedDeltaNetCache
from lrdsl.layers.gated_deltanet import CONFIG_ATTRIBUTES, RECURRENCE_SPEC, cached_state, recurrence_module
from lrdsl.layers.kernels import layer_kernels
from lrdsl.spec import resolve_spec
from lrdsl.verification.workloads import TOLERANCE, relative_error

TOL = TOLERANCE[torch.float32]


@pytest.fixture(autouse=True)
def transformers_torch_path(monkeypatch):
    """transformers' layer on its own torch recurrence, whatever is installed: transformers binds
    FLA's chunk_gated_delta_rule at import when fla-core is present (and fla-core 0.6.0 refuses its
    gated backward on Hopper with triton < 3.7.1), so the reference would depend on the machine.
    The torch function (the wrapper's __wrapped__) is wrapped again by transformers' own decorator
    with a package that does not exist: its torch fallback, keyword filtering included."""
    for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"):
        torch_function = inspect.unwrap(getattr(qwen3_5_modeling, name))
        assert torch_function.__module__ == qwen3_5_modeling.__name__, f"{name}: no torch function found"
        fallback = use_kernel_func_from_hub_with_fallback(name.removeprefix("torch_"), "lrdsl_no_such_package")
        monkeypatch.setattr(qwen3_5_modeling, name, fallback(torch_function))


def tiny_config(layer_types=("linear_attention",)):
    """GVA 2 (2 key heads, 4 value heads), head dims 16 and 24, convolution width 4."""
    return Qwen3_5TextConfig(
        hidden_size=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=24, linear_conv_kernel_dim=4, hidden_act="silu", rms_norm_eps=1e-6,
        num_hidden_layers=len(layer_types), layer_types=list(layer_types), vocab_size=64, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, intermediate_size=64, pad_token_id=0, bos_token_id=None,
        eos_token_id=None,
    )


def randomize(module, generator):
    """Fresh random weights at scales that keep the layer's activations O(1)."""
    with torch.no_grad():
        for name, parameter in module.named_parameters():
            if name.endswith("A_log"):
                parameter.copy_(torch.rand(parameter.shape, generator=generator) * 2 - 1)
            elif name.endswith("norm.weight"):
                parameter.copy_(1 + 0.2 * torch.randn(parameter.shape, generator=generator))
            else:
                fan_in = parameter.shape[-1] if parameter.dim() > 1 else 1
                parameter.copy_(torch.randn(parameter.shape, generator=generator) / fan_in**0.5)


def layer_pair(generator, device="cpu"):
    config = tiny_config()
    theirs = Qwen3_5GatedDeltaNet(config, layer_idx=0)
    randomize(theirs, generator)
    ours = GatedDeltaNet(config, layer_idx=0)
    ours.load_state_dict(theirs.state_dict())
    return ours.to(device), theirs.to(device)


def oracle(layer, x, window=None, state=None):
    """The layer in float64: (output, final window, final state), differentiable in x and in the
    layer's parameters (pass a float64 copy: double_copy)."""
    p = dict(layer.named_parameters())
    B, T, _ = x.shape
    normed, final_window, final_state = oracle_mixing(
        layer, x @ p["in_proj_qkv.weight"].T, x @ p["in_proj_z.weight"].T, x @ p["in_proj_a.weight"].T,
        x @ p["in_proj_b.weight"].T, window, state)
    return normed.reshape(B, T, -1) @ p["out_proj.weight"].T, final_window, final_state


def oracle_mixing(layer, mixed, z, a, b, window=None, state=None):
    """What GatedDeltaNet.mix_projections computes, in float64: (gated norm output [B, T, HV, V],
    final window, final state); the recurrence through lrdsl.reference."""
    p = dict(layer.named_parameters())
    mixed, z, a, b = (t.double() for t in (mixed, z, a, b))
    B, T, _ = mixed.shape
    W = layer.conv_kernel_size
    if window is None:
        window = torch.zeros(B, layer.conv_dim, W, dtype=torch.float64)
    extended = torch.cat([window.double().transpose(1, 2), mixed], dim=1)  # the W inputs before the call, then the call's
    weight = p["conv1d.weight"][:, 0]
    pre = sum(weight[:, j] * extended[:, 1 + j : 1 + j + T] for j in range(W))
    q, k, v = torch.split(F.silu(pre), [layer.key_dim, layer.key_dim, layer.value_dim], dim=-1)
    o, final_state = reference.run(
        resolve_spec(RECURRENCE_SPEC), q.reshape(B, T, layer.num_k_heads, -1), k.reshape(B, T, layer.num_k_heads, -1),
        v.reshape(B, T, layer.num_v_heads, -1), a, b, p["A_log"], p["dt_bias"],
        initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True,
    )
    z = z.reshape(o.shape)
    normed = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + layer.layer_norm_epsilon) * p["norm.weight"] * F.silu(z)
    return normed, extended[:, -W:].transpose(1, 2), final_state


def double_copy(layer):
    """The layer's weights in float64 on the CPU, for the oracle."""
    return copy.deepcopy(layer).double().cpu()


def grads(module, x, out, seed):
    parameters = dict(module.named_parameters())
    values = torch.autograd.grad(out, [x] + list(parameters.values()), seed.to(out.device, out.dtype))
    return dict(zip(["input"] + list(parameters), values))


def test_parameters_are_transformers_names_and_shapes(generator):
    ours, theirs = layer_pair(generator)
    assert [(n, p.shape) for n, p in ours.named_parameters()] == [(n, p.shape) for n, p in theirs.named_parameters()]
    theirs.load_state_dict(ours.state_dict())  # and back: strict in both directions


@pytest.mark.parametrize("save_policy", [None, "save_states"])
def test_prefill_output_and_every_gradient(save_policy, generator, device, monkeypatch):
    """The layer's output and every gradient against the float64 oracle and transformers, under
    the module's default save policy and under the memory-lean one the layer may be given."""
    ours, theirs = layer_pair(generator, device)
    ours.save_policy = save_policy
    mod = recurrence_module()
    policies, backward = [], mod._chunk_backward
    monkeypatch.setattr(mod, "_chunk_backward", lambda c, plan, policy, *rest: policies.append(policy)
                        or backward(c, plan, policy, *rest))
    x = torch.randn(2, 13, 32, generator=generator)
    x_ours, x_theirs = x.to(device).requires_grad_(True), x.to(device).requires_grad_(True)
    x_oracle = x.double().requires_grad_(True)
    exact = double_copy(ours)
    out = ours(x_ours)
    out_theirs = theirs(x_theirs)
    out_oracle = oracle(exact, x_oracle)[0]
    assert relative_error(out, out_oracle) <= TOL
    assert relative_error(out, out_theirs) <= TOL
    seed = torch.randn(out.shape, generator=generator, dtype=torch.float64)
    got = grads(ours, x_ours, out, seed)
    expected = grads(exact, x_oracle, out_oracle, seed)
    transformers_grads = grads(theirs, x_theirs, out_theirs, seed)
    assert set(got) == set(expected) == set(transformers_grads)
    for name in got:
        assert relative_error(got[name], expected[name]) <= TOL, f"d{name} vs the oracle"
        assert relative_error(got[name], transformers_grads[name]) <= TOL, f"d{name} vs transformers"
    assert policies == [save_policy or mod.DEFAULT_SAVE_POLICY]


class EarlierTransformersCache:
    """What transformers 5.17 / 5.18's DynamicCache offers a layer: update_conv_state and
    update_recurrent_state, has_previous_state, the states on cache.layers[i], and no
    get_conv_state / get_recurrent_state (a wrapper around today's DynamicCache hiding them)."""

    def __init__(self, cache):
        self._cache, self.layers = cache, cache.layers

    def has_previous_state(self, layer_idx=None):
        return self._cache.has_previous_state(layer_idx)

    def update_conv_state(self, *args, **kwargs):
        return self._cache.update_conv_state(*args, **kwargs)

    def update_recurrent_state(self, *args, **kwargs):
        return self._cache.update_recurrent_state(*args, **kwargs)


def test_prefill_then_decode_equals_one_prefill(generator, device):
    """Prefill 5 tokens, a second multi-token call of 3 against the cache, then 3 one-token steps
    == one call of all 11; with our cache and with transformers' DynamicCache, against transformers
    (fed a prefill of 8 and the same steps: transformers 5.17 restarts a multi-token call from zero
    state instead of continuing its cache)."""
    ours, theirs = layer_pair(generator, device)
    x = torch.randn(2, 11, 32, generator=generator)
    on_device = x.to(device)
    parts = [on_device[:, :5], on_device[:, 5:8]] + [on_device[:, t : t + 1] for t in range(8, 11)]
    exact = double_copy(ours)
    with torch.no_grad():
        whole, window_ref, state_ref = oracle(exact, x.double())
        ours_cache, hf_cache_ours, hf_cache_theirs = GatedDeltaNetCache(), DynamicCache(config=tiny_config()), DynamicCache(config=tiny_config())
        stepped = torch.cat([ours(part, cache=ours_cache) for part in parts], dim=1)
        stepped_hf_cache = torch.cat([ours(part, cache=hf_cache_ours) for part in parts], dim=1)
        earlier_cache = EarlierTransformersCache(DynamicCache(config=tiny_config()))
        stepped_earlier_cache = torch.cat([ours(part, cache=earlier_cache) for part in parts], dim=1)
        theirs_parts = [on_device[:, :8]] + parts[2:]
        stepped_theirs = torch.cat([theirs(part, cache=hf_cache_theirs) for part in theirs_parts], dim=1)
    assert relative_error(stepped, whole) <= TOL
    assert relative_error(stepped_hf_cache, whole) <= TOL
    assert relative_error(stepped_earlier_cache, whole) <= TOL
    assert relative_error(stepped, stepped_theirs) <= TOL
    for cache in (ours_cache, hf_cache_ours, earlier_cache):
        assert relative_error(cached_state(cache, 0, "conv"), window_ref) <= 1e-6
        assert relative_error(cached_state(cache, 0, "recurrent"), state_ref) <= TOL
    assert relative_error(cached_state(hf_cache_ours, 0, "recurrent"), cached_state(hf_cache_theirs, 0, "recurrent")) <= TOL


def test_decode_step_with_gradients_enabled(generator, device):
    """A one-token step under autograd takes the differentiable convolution path: same output."""
    ours, _ = layer_pair(generator, device)
    x = torch.randn(1, 6, 32, generator=generator).to(device)
    caches = GatedDeltaNetCache(), GatedDeltaNetCache()
    with torch.no_grad():
        ours(x[:, :5], cache=caches[0])
        ours(x[:, :5], cache=caches[1])
        without = ours(x[:, 5:], cache=caches[0])
    with_grad = ours(x[:, 5:].clone().requires_grad_(True), cache=caches[1])
    assert with_grad.requires_grad
    assert relative_error(with_grad, without) <= 1e-6
    assert torch.equal(cached_state(caches[0], 0, "conv"), cached_state(caches[1], 0, "conv"))


def test_padded_batch(generator, device):
    """Left padding (what generate uses) matches transformers, outputs and gradients; with right
    padding, the padded positions leave no trace: each row's output and cache equal the row alone,
    and equal the rows packed into one (transformers' cu_seq_lens_q)."""
    ours, theirs = layer_pair(generator, device)
    x = torch.randn(3, 9, 32, generator=generator)
    lengths = [9, 4, 1]
    left = torch.zeros(3, 9, dtype=torch.long)
    right = torch.zeros(3, 9, dtype=torch.long)
    for row, n in enumerate(lengths):
        left[row, 9 - n :] = 1
        right[row, :n] = 1
    left, right = left.to(device), right.to(device)
    x_ours, x_theirs = x.to(device).requires_grad_(True), x.to(device).requires_grad_(True)
    ours_cache, theirs_cache = DynamicCache(config=tiny_config()), DynamicCache(config=tiny_config())
    out = ours(x_ours, cache=ours_cache, attention_mask=left)
    out_theirs = theirs(x_theirs, cache=theirs_cache, attention_mask=left)
    assert relative_error(out, out_theirs) <= TOL
    assert torch.count_nonzero(out[left == 0]) == 0
    seed = torch.randn(out.shape, generator=generator)
    got, expected = grads(ours, x_ours, out, seed), grads(theirs, x_theirs, out_theirs, seed)
    for name in got:
        assert relative_error(got[name], expected[name]) <= TOL, f"d{name}"
    assert relative_error(cached_state(ours_cache, 0, "recurrent"), cached_state(theirs_cache, 0, "recurrent")) <= TOL
    assert relative_error(cached_state(ours_cache, 0, "conv"), cached_state(theirs_cache, 0, "conv")) <= 1e-6

    exact = double_copy(ours)
    cache = GatedDeltaNetCache()
    with torch.no_grad():
        out = ours(x.to(device), cache=cache, attention_mask=right)
        for row, n in enumerate(lengths):
            alone, window, state = oracle(exact, x[row : row + 1, :n].double())
            assert relative_error(out[row, :n], alone[0]) <= TOL
            assert torch.count_nonzero(out[row, n:]) == 0
            assert relative_error(cached_state(cache, 0, "conv")[row], window[0]) <= 1e-6
            assert relative_error(cached_state(cache, 0, "recurrent")[row], state[0]) <= TOL
        # the same rows packed into one batch row, as transformers passes packed sequences
        packed = torch.cat([x[row, :n] for row, n in enumerate(lengths)])[None].to(device)
        cu_seqlens = torch.tensor([0, 9, 13, 14], dtype=torch.int32, device=device)
        out_packed = ours(packed, cu_seq_lens_q=cu_seqlens)
        assert relative_error(out_packed[0], out[right.bool()]) <= 1e-6


def test_bad_config_and_inputs_get_one_line_errors(generator):
    config = SimpleNamespace(**{name: getattr(tiny_config(), name) for name in CONFIG_ATTRIBUTES})
    del config.linear_conv_kernel_dim
    with pytest.raises(LrdslError, match="the config lacks linear_conv_kernel_dim"):
        GatedDeltaNet(config)
    config = tiny_config()
    config.hidden_act = "gelu"
    with pytest.raises(LrdslError, match="hidden_act 'gelu' is not supported"):
        GatedDeltaNet(config)
    layer, _ = layer_pair(generator)
    with pytest.raises(LrdslError, match=r"hidden_states must be \[B, T, 32\], got \[2, 5, 31\]"):
        layer(torch.randn(2, 5, 31))
    with pytest.raises(LrdslError, match=r"attention_mask must be a 2-D padding mask \[B, T\] = \[2, 5\]"):
        layer(torch.randn(2, 5, 32), attention_mask=torch.ones(2, 1, 5, 5))
    with pytest.raises(LrdslError, match="lacks get_/update_conv_state"):
        layer(torch.randn(2, 5, 32), cache=object())


def tiny_model(generator, layer_types=("linear_attention", "full_attention")):
    """A random Qwen3.5 text model with weights at O(1) activation scales (transformers' own
    initialisation makes every gradient tiny and the comparison meaningless)."""
    model = Qwen3_5ForCausalLM(tiny_config(layer_types)).eval()
    randomize(model, generator)
    return model


def test_patched_model_generates_the_same_20_tokens(generator, device):
    model = tiny_model(generator).to(device)
    prompt = torch.randint(1, 64, (2, 6), generator=generator).to(device)
    mask = torch.ones_like(prompt)
    mask[1, :2] = 0  # the second prompt is left-padded
    options = dict(attention_mask=mask, max_new_tokens=20, min_new_tokens=20, do_sample=False)
    expected = model.generate(prompt, **options)
    patch_qwen35(model)
    assert isinstance(model.model.layers[0].linear_attn, GatedDeltaNet)
    got = model.generate(prompt, **options)
    unpatch(model)
    assert type(model.model.layers[0].linear_attn) is Qwen3_5GatedDeltaNet
    assert got.shape == (2, 26)
    assert torch.equal(got, expected), f"tokens differ:\n{got[:, 6:]}\n{expected[:, 6:]}"


def test_patched_model_loss_and_gradients(generator, device):
    model = tiny_model(generator).to(device).train()
    ids = torch.randint(1, 64, (2, 10), generator=generator).to(device)
    loss = model(ids, labels=ids).loss
    expected = dict(zip([n for n, _ in model.named_parameters()], torch.autograd.grad(loss, list(model.parameters()))))
    patch_qwen35(model)
    names = [n for n, _ in model.named_parameters()]
    assert names == list(expected)  # the same parameters, shared, not copied
    patched_loss = model(ids, labels=ids).loss
    got = dict(zip(names, torch.autograd.grad(patched_loss, list(model.parameters()))))
    assert relative_error(patched_loss, loss) <= TOL
    for name in names:
        assert relative_error(got[name], expected[name]) <= TOL, name
    unpatch(model)


def test_patch_needs_a_qwen35_model():
    with pytest.raises(LrdslError, match="has no 'linear_attn' layers"):
        patch_qwen35(torch.nn.Linear(2, 2))


# ---------------------------------------------------------------------------------------------
# GPU, at Qwen3.5's released head geometry (16 key heads, 32 value heads, head dims 128).
# Run: pytest -m gpu tests/test_layer.py -s   (prints every error it checks)
#
# A whole layer in bf16 cannot meet 8e-3 against float64 for anyone: torch's own bf16 rounding of
# the four projections' outputs and of their summed input gradient already costs about that (at a
# small geometry on the CPU, transformers' bf16 layer measured 6.7e-3 on the output and 1.4e-2 on
# the input gradient; ours 6.7e-3 and 1.05e-2). So bf16 is checked where lrdsl's kernels are the
# whole computation, kernel by kernel (chained, the convolution, the recurrence and the gated norm
# already reach about 7e-3 on the output), the whole layer in fp32, and the whole bf16 layer
# against transformers' bf16 layer on the same oracle: the two errors differ by a few percent of
# noise, so ours must stay within 8e-3 or within 10% of transformers' own.
# ---------------------------------------------------------------------------------------------

BF16_TOL = TOLERANCE[torch.bfloat16]


def released_config():
    config = tiny_config()
    config.hidden_size = 2048
    config.linear_num_key_heads, config.linear_num_value_heads = 16, 32
    config.linear_key_head_dim = config.linear_value_head_dim = 128
    return config


def released_layers(generator, device, dtype):
    """(ours in dtype, transformers' layer holding the same weights)."""
    config = released_config()
    ours = GatedDeltaNet(config, layer_idx=0)
    randomize(ours, generator)
    ours = ours.to(device, dtype)
    theirs = Qwen3_5GatedDeltaNet(config, layer_idx=0).to(device, dtype)
    theirs.load_state_dict(ours.state_dict())
    return ours, theirs


def report(what, error):
    print(f"  {what}: relative error {error:.2e}")
    return error


def check_bf16_stage(what, function, oracle_function, inputs, generator, device):
    """One stage of the layer in bf16 (inputs rounded to bf16 first) vs float64: output and the
    gradient of every input."""
    x = {name: t.bfloat16().to(device).requires_grad_(True) for name, t in inputs.items()}
    x_oracle = {name: t.bfloat16().double().requires_grad_(True) for name, t in inputs.items()}
    out, out_oracle = function(**x), oracle_function(**x_oracle)
    assert report(f"bf16 {what}: output vs oracle", relative_error(out, out_oracle)) <= BF16_TOL
    seed = torch.randn(out.shape, generator=generator, dtype=torch.float64)
    got = torch.autograd.grad(out, list(x.values()), seed.to(device, out.dtype))
    expected = torch.autograd.grad(out_oracle, list(x_oracle.values()), seed)
    for name, value, exact in zip(x, got, expected):
        assert report(f"bf16 {what}: d{name} vs oracle", relative_error(value, exact)) <= BF16_TOL, name


@pytest.mark.gpu
def test_gpu_bf16_layer_kernels(generator, device):
    """The layer's own kernels in bf16 at its shapes: the short convolution (8192 channels) and the
    gated RMSNorm (32 heads of 128); output and every gradient vs float64. (The recurrence's
    kernels, gdn_qwen35's among every spec's, are checked in bf16 by tests/test_gpu.py.)"""
    config = released_config()
    layer = GatedDeltaNet(config)
    kernels = layer_kernels()
    B, T, HV, V = 2, 200, layer.num_v_heads, layer.head_v_dim
    W, D = layer.conv_kernel_size, layer.conv_dim

    def conv_oracle(x, weight):
        pre = sum(weight[:, j] * F.pad(x, (0, 0, W - 1 - j, 0))[:, :T] for j in range(W))
        return F.silu(pre)

    check_bf16_stage("short convolution", lambda x, weight: kernels.short_conv(x, weight)[0], conv_oracle,
                     dict(x=torch.randn(B, T, D, generator=generator), weight=torch.randn(D, W, generator=generator) / 2),
                     generator, device)
    eps = layer.layer_norm_epsilon
    check_bf16_stage(
        "gated RMSNorm", lambda o, z, weight: kernels.gated_rms_norm(o, z, weight, eps),
        lambda o, z, weight: o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + eps) * weight * F.silu(z),
        dict(o=torch.randn(B, T, HV, V, generator=generator), z=torch.randn(B, T, HV, V, generator=generator),
             weight=1 + 0.2 * torch.randn(V, generator=generator)),
        generator, device)


@pytest.mark.gpu
def test_gpu_fp32_whole_layer(generator, device):
    """The whole layer in fp32: output and every gradient vs the oracle and vs transformers; prefill
    of 130 then 3 steps vs one prefill; a left-padded batch and its cache vs transformers."""
    ours, theirs = released_layers(generator, device, torch.float32)
    x = torch.randn(2, 133, ours.hidden_size, generator=generator)
    x_ours, x_theirs = x.to(device).requires_grad_(True), x.to(device).requires_grad_(True)
    x_oracle = x.double().requires_grad_(True)
    exact = double_copy(ours)
    out, out_theirs, out_oracle = ours(x_ours), theirs(x_theirs), oracle(exact, x_oracle)[0]
    assert report("fp32 layer: output vs oracle", relative_error(out, out_oracle)) <= TOL
    assert report("fp32 layer: output vs transformers", relative_error(out, out_theirs)) <= TOL
    seed = torch.randn(out.shape, generator=generator, dtype=torch.float64)
    got, expected = grads(ours, x_ours, out, seed), grads(exact, x_oracle, out_oracle, seed)
    transformers_grads = grads(theirs, x_theirs, out_theirs, seed)
    for name in got:
        assert report(f"fp32 layer: d{name} vs oracle", relative_error(got[name], expected[name])) <= TOL, name
        assert report(f"fp32 layer: d{name} vs transformers", relative_error(got[name], transformers_grads[name])) <= TOL, name

    on_device = x.to(device)
    cache = DynamicCache(config=released_config())
    with torch.no_grad():
        stepped = torch.cat([ours(on_device[:, :130], cache=cache)]
                            + [ours(on_device[:, t : t + 1], cache=cache) for t in range(130, 133)], dim=1)
    assert report("fp32 layer: prefill + decode vs oracle", relative_error(stepped, out_oracle)) <= TOL

    mask = torch.ones(2, 133, dtype=torch.long, device=device)
    mask[1, :50] = 0
    caches = DynamicCache(config=released_config()), DynamicCache(config=released_config())
    with torch.no_grad():
        padded = ours(on_device, cache=caches[0], attention_mask=mask)
        padded_theirs = theirs(on_device, cache=caches[1], attention_mask=mask)
    assert report("fp32 layer: left-padded batch vs transformers", relative_error(padded, padded_theirs)) <= TOL
    assert report("fp32 layer: left-padded cached state vs transformers",
                  relative_error(cached_state(caches[0], 0, "recurrent"), cached_state(caches[1], 0, "recurrent"))) <= TOL


@pytest.mark.gpu
def test_gpu_bf16_whole_layer_no_less_accurate_than_transformers(generator, device):
    """Both layers in bf16 on the same weights and input, against the float64 oracle: ours is
    within 8e-3, or (where bf16 rounding outside lrdsl's kernels dominates, see above) within 10%
    of transformers' own bf16 layer's error; output, every gradient, prefill + decode."""
    ours, theirs = released_layers(generator, device, torch.bfloat16)
    x = torch.randn(2, 200, ours.hidden_size, generator=generator).bfloat16()
    x_ours, x_theirs = x.to(device).requires_grad_(True), x.to(device).requires_grad_(True)
    x_oracle = x.double().requires_grad_(True)
    exact = double_copy(ours)
    out, out_theirs, out_oracle = ours(x_ours), theirs(x_theirs), oracle(exact, x_oracle)[0]
    seed = torch.randn(out.shape, generator=generator, dtype=torch.float64)
    got, expected = grads(ours, x_ours, out, seed), grads(exact, x_oracle, out_oracle, seed)
    transformers_grads = grads(theirs, x_theirs, out_theirs, seed)
    pairs = [("output", out, out_theirs, out_oracle)] + [(f"d{n}", got[n], transformers_grads[n], expected[n]) for n in got]
    for name, mine, transformers_value, exact_value in pairs:
        error = report(f"bf16 layer: {name} vs oracle (lrdsl)", relative_error(mine, exact_value))
        bound = report(f"bf16 layer: {name} vs oracle (transformers)", relative_error(transformers_value, exact_value))
        assert error <= max(BF16_TOL, 1.1 * bound), name

    on_device = x.to(device)
    caches = DynamicCache(config=released_config()), DynamicCache(config=released_config())
    with torch.no_grad():
        stepped = [torch.cat([layer(on_device[:, :130], cache=cache)]
                             + [layer(on_device[:, t : t + 1], cache=cache) for t in range(130, 133)], dim=1)
                   for layer, cache in ((ours, caches[0]), (theirs, caches[1]))]
        whole, _, state = oracle(exact, x[:, :133].double())
    error = report("bf16 layer: prefill + decode vs oracle (lrdsl)", relative_error(stepped[0], whole))
    bound = report("bf16 layer: prefill + decode vs oracle (transformers)", relative_error(stepped[1], whole))
    assert error <= max(BF16_TOL, 1.1 * bound)
    error = report("bf16 layer: cached state vs oracle (lrdsl)", relative_error(cached_state(caches[0], 0, "recurrent"), state))
    bound = report("bf16 layer: cached state vs oracle (transformers)", relative_error(cached_state(caches[1], 0, "recurrent"), state))
    assert error <= max(BF16_TOL, 1.1 * bound)


def test_torch_compile_of_a_new_layer_breaks_no_graph_to_load_kernels(monkeypatch, generator):
    """A GatedDeltaNet loads its kernels' modules when it is built. They were loaded at its first
    forward, which under torch.compile ran inside the trace: the code generator and the module
    cache broke the graph there (printer.py's sympy calls, cache.py's fingerprint), and the
    compiled model kept those breaks for every later step (12 breaks in a 20-step training run on
    an H100). On the CPU the kernels themselves run on Triton's interpreter, which dynamo cannot
    trace; it is kept out of the trace here, so the breaks left are those of the launches only."""
    import torch._dynamo
    import triton.runtime.interpreter as interpreter

    from lrdsl.layers import gated_deltanet, kernels

    monkeypatch.setattr(gated_deltanet, "_recurrence_modules", {})  # as in a fresh process
    monkeypatch.setattr(kernels, "_loaded", {})
    monkeypatch.setattr(interpreter.InterpretedFunction, "run", torch._dynamo.disable(interpreter.InterpretedFunction.run))
    layer = GatedDeltaNet(tiny_config(), layer_idx=0)
    x = torch.randn(1, 12, layer.hidden_size, generator=generator)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(layer)(x)
    loading = [b.reason.splitlines()[0] for b in explained.break_reasons
               if any("/lrdsl/codegen/" in f.filename or "/lrdsl/runtime/" in f.filename or "/lrdsl/passes/" in f.filename
                      for f in b.user_stack)]
    assert explained.graph_count >= 1
    assert loading == [], f"graph breaks while loading lrdsl's kernels: {loading}"
    torch._dynamo.reset()
