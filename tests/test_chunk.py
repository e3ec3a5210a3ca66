"""Generated chunk kernels against the float64 oracle, the recurrent kernel and themselves
(CPU interpreter at small sizes; fresh inputs every run)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings

from lrdsl import reference
from lrdsl.verification.workloads import Shape, relative_error

from helpers import (
    BETA_EXTREMES,
    CORE_SPECS,
    GATE_EXTREMES,
    SHAPE_CASES,
    SHAPE_STRATEGIES,
    assert_close,
    direct_input,
    force_segments,
    module,
    recurrence,
    run_case,
    sample,
)

# chunk sizes rotate over the shape cases so every size meets short, odd and varlen sequences
CASE_CHUNK_SIZE = {case: (16, 32, 64)[i % 3] for i, case in enumerate(sorted(SHAPE_CASES))}


@pytest.mark.parametrize("case", sorted(SHAPE_CASES))
@pytest.mark.parametrize("name", CORE_SPECS)
def test_chunk_shapes(name, case, generator, device):
    run_case(module(name), recurrence(name), "chunk", SHAPE_CASES[case], generator, device,
             chunk_size=CASE_CHUNK_SIZE[case])


@pytest.mark.parametrize("name", ["gdn_qwen35", "retnet", "kda_fused_gate", "kda_neg_eigval"])
@pytest.mark.parametrize("case", ["gva2_h0_scale", "varlen_empty_len1"])
def test_chunk_in_kernel_formulas(name, case, generator, device):
    run_case(module(name), recurrence(name), "chunk", SHAPE_CASES[case], generator, device, chunk_size=16)


GATED = [n for n in CORE_SPECS if direct_input(recurrence(n), recurrence(n).log_decay)]
WITH_BETA = [n for n in CORE_SPECS if direct_input(recurrence(n), recurrence(n).beta)]


@pytest.mark.parametrize("gate", GATE_EXTREMES)
@pytest.mark.parametrize("name", GATED)
def test_chunk_gate_extremes(name, gate, generator, device):
    """g = 0 exactly, -1e-6, -30 (everything forgotten at once) and half -30 / half 0: no NaN/Inf."""
    case = dict(shape=Shape(1, 40, 1, 2, 16, 16), dtype=torch.float32, h0=True)
    run_case(module(name), recurrence(name), "chunk", case, generator, device, gate=gate, chunk_size=16)


KEY_CHANNEL = [n for n in CORE_SPECS if recurrence(n).gate.value == "key_channel"]


@pytest.mark.parametrize("gate", [0.0, -30.0, "half"])
@pytest.mark.parametrize("name", KEY_CHANNEL)
def test_key_channel_gate_extremes_in_long_chunks(name, gate, generator, device):
    """Per-channel decay over 64-row chunks (and a 6-row tail): at g = -30 per step a decay
    factored over the chunk would reach 2^(-43 * 63); the kernels stay finite and accurate."""
    case = dict(shape=Shape(1, 70, 1, 2, 16, 16), dtype=torch.float32, h0=True)
    run_case(module(name), recurrence(name), "chunk", case, generator, device, gate=gate, chunk_size=64)


@pytest.mark.parametrize("beta", BETA_EXTREMES)
@pytest.mark.parametrize("name", WITH_BETA)
def test_chunk_beta_extremes(name, beta, generator, device):
    case = dict(shape=Shape(1, 35, 1, 2, 16, 16), dtype=torch.float32, h0=True, bounds=[0, 0, 1, 35])
    run_case(module(name), recurrence(name), "chunk", case, generator, device, beta=beta, chunk_size=16)


def _call(mod, kernel, tensors, device, **kwargs):
    kwargs = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}
    o, ht = getattr(mod, kernel)(*[t.to(device) for t in tensors], **kwargs)
    return o.cpu(), (ht.cpu() if ht is not None else None)


@pytest.mark.parametrize("name", CORE_SPECS)
def test_chunk_equals_recurrent(name, generator, device):
    rec, mod = recurrence(name), module(name)
    tensors = sample(rec, Shape(2, 37, 2, 4, 24, 40), torch.float32, generator)
    kwargs = dict(output_final_state=True, use_qk_l2norm_in_kernel=True)
    o_c, h_c = _call(mod, "chunk", tensors, device, chunk_size=16, **kwargs)
    o_r, h_r = _call(mod, "recurrent", tensors, device, **kwargs)
    assert relative_error(o_c, o_r) < 1e-5 and relative_error(h_c, h_r) < 1e-5


@pytest.mark.parametrize("name", CORE_SPECS)
def test_split_prefill_equals_one_prefill(name, generator, device):
    """chunk(T1), then chunk(T2) from its final state == chunk(T1 + T2)."""
    rec, mod = recurrence(name), module(name)
    T1, T2 = 23, 26
    tensors = sample(rec, Shape(2, T1 + T2, 2, 4, 16, 24), torch.float32, generator)
    h0 = torch.randn(2, 4, 16, 24, generator=generator)
    o_all, h_all = _call(mod, "chunk", tensors, device, initial_state=h0, output_final_state=True, chunk_size=16)
    first = [t[:, :T1] for t in tensors[:3]] + [t[:, :T1] if t.dim() >= 3 else t for t in tensors[3:]]
    second = [t[:, T1:] for t in tensors[:3]] + [t[:, T1:] if t.dim() >= 3 else t for t in tensors[3:]]
    o1, h1 = _call(mod, "chunk", first, device, initial_state=h0, output_final_state=True, chunk_size=16)
    o2, h2 = _call(mod, "chunk", second, device, initial_state=h1, output_final_state=True, chunk_size=16)
    assert relative_error(torch.cat([o1, o2], 1), o_all) < 1e-5
    assert relative_error(h2, h_all) < 1e-5


@pytest.mark.parametrize("name", CORE_SPECS)
def test_prefill_then_decode_equals_one_prefill(name, generator, device):
    rec, mod = recurrence(name), module(name)
    T = 21
    tensors = sample(rec, Shape(1, T, 1, 2, 16, 16), torch.float32, generator)
    o_all, h_all = _call(mod, "chunk", tensors, device, output_final_state=True, chunk_size=16)
    prefix = [t[:, : T - 2] if t.dim() >= 3 else t for t in tensors]
    o_pre, state = _call(mod, "chunk", prefix, device, output_final_state=True, chunk_size=16)
    outputs = [o_pre]
    for t in (T - 2, T - 1):  # two decode steps, one token each
        step = [x[:, t : t + 1] if x.dim() >= 3 else x for x in tensors]
        o_t, state = _call(mod, "recurrent", step, device, initial_state=state, output_final_state=True)
        outputs.append(o_t)
    assert relative_error(torch.cat(outputs, 1), o_all) < 1e-5
    assert relative_error(state, h_all) < 1e-5


@pytest.mark.parametrize("name", CORE_SPECS)
def test_every_chunk_size_and_plan_agree(name, generator, device):
    rec, mod = recurrence(name), module(name)
    tensors = sample(rec, Shape(1, 70, 2, 2, 24, 24), torch.float32, generator)
    h0 = torch.randn(3, 2, 24, 24, generator=generator)
    cu = torch.tensor([0, 5, 5, 70], dtype=torch.int32)
    results = {}
    for plan in mod.CHUNK_PLANS:
        for size in mod.CHUNK_SIZES:
            results[plan, size] = _call(mod, "chunk", tensors, device, initial_state=h0, output_final_state=True,
                                        cu_seqlens=cu, plan=plan, chunk_size=size)
    base_o, base_h = results["fused", 64]
    ref_o, ref_h = reference.run(rec, *tensors, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    assert_close(base_o, ref_o, torch.float32, "fused/64 o")
    for key, (o, h) in results.items():
        assert relative_error(o, base_o) < 1e-5, key
        assert relative_error(h, base_h) < 1e-5, key


def test_precomputed_chunk_indices_skip_preparation(generator, device, monkeypatch):
    rec, mod = recurrence("gdn"), module("gdn")
    tensors = sample(rec, Shape(1, 40, 1, 2, 16, 16), torch.float32, generator)
    cu = torch.tensor([0, 17, 17, 40], dtype=torch.int32, device=device)
    chunks = mod.prepare_varlen(cu, 16)
    assert chunks.indices.tolist() == [[0, 0], [0, 1], [2, 0], [2, 1]] and chunks.offsets.tolist() == [0, 2, 2, 4]
    expected = _call(mod, "chunk", tensors, device, cu_seqlens=cu, chunk_size=16, output_final_state=True)

    def refuse(*args, **kwargs):
        raise AssertionError("prepare_varlen must not run when chunk_indices is given")

    monkeypatch.setattr(mod, "prepare_varlen", refuse)
    got = _call(mod, "chunk", tensors, device, cu_seqlens=cu, chunk_size=16, output_final_state=True,
                chunk_indices=chunks)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


@pytest.mark.parametrize("name", ["gdn", "linear_attn"])
def test_head_dim_256(name, generator, device):
    case = dict(shape=Shape(1, 18, 1, 1, 256, 256), dtype=torch.float32, h0=True)
    run_case(module(name), recurrence(name), "chunk", case, generator, device, chunk_size=16)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(**SHAPE_STRATEGIES)
def test_chunk_property_shapes(B, T, H, group, K, V, chunk_size, name, generator, device):
    case = dict(shape=Shape(B, T, H, H * group, K, V), dtype=torch.float32, h0=True)
    run_case(module(name), recurrence(name), "chunk", case, generator, device, chunk_size=chunk_size)


# -- plan rule 6: a forward call without gradients or chunk size runs its kernels up to the scan
#    at half the output kernel's chunk size (in the interpreter wherever the plan allows it)

SPLIT_CASES = {
    # 5 chunks of 32 per sequence, 3 of 64: the last output chunk has one scan chunk
    "dense": dict(shape=Shape(2, 150, 1, 2, 16, 16), dtype=torch.float32, h0=True, l2norm=True),
    # lengths 33, 0, 67, 71: each sequence's entry-state slots start at its own output chunk
    "varlen": dict(shape=Shape(1, 171, 2, 4, 16, 24), dtype=torch.float32, h0=True, bounds=[0, 33, 33, 100, 171]),
}
SPLIT_SPECS = ("gdn", "deltanet", "gdn_qwen35", "simple_gla")


def record_forward_sizes(monkeypatch, mod) -> list[tuple[int, int]]:
    """Collects (chunk size up to the scan, the output kernel's) of every forward launcher call."""
    sizes = []
    for plan, launcher in list(mod._CHUNK_LAUNCHERS.items()):
        def recording(c, o, final_state, *args, _launcher=launcher, **kwargs):
            sizes.append((c["BT"], (kwargs.get("output_c") or c)["BT"]))
            return _launcher(c, o, final_state, *args, **kwargs)
        monkeypatch.setitem(mod._CHUNK_LAUNCHERS, plan, recording)
    return sizes


@pytest.mark.parametrize("case", sorted(SPLIT_CASES))
@pytest.mark.parametrize("plan", ["split", "fused"])
@pytest.mark.parametrize("name", SPLIT_SPECS)
def test_scan_at_half_the_output_chunk_size(name, plan, case, generator, device, monkeypatch):
    """Delta-rule specs run system, solve, apply and scan at 32 and the output at 64 (the scan
    keeping one entry state per output chunk); simple_gla, with no system to solve, keeps 64."""
    mod = module(name)
    sizes = record_forward_sizes(monkeypatch, mod)
    with torch.no_grad():
        run_case(mod, recurrence(name), "chunk", SPLIT_CASES[case], generator, device, plan=plan)
    assert sizes == [(64, 64) if name == "simple_gla" else (32, 64)]


def test_scan_at_half_the_output_chunk_size_in_segments(generator, device, monkeypatch):
    """The split with the scan in segments of 2 chunks: the stored pass keeps every other state."""
    mod = module("gdn")
    chosen = force_segments(monkeypatch, mod)
    monkeypatch.setattr(mod, "_scan_chunk_size", lambda c, plan: c["BT"] // 2)
    sizes = record_forward_sizes(monkeypatch, mod)
    case = dict(shape=Shape(2, 300, 1, 2, 16, 16), dtype=torch.float32, h0=True)
    with torch.no_grad():
        run_case(mod, recurrence("gdn"), "chunk", case, generator, device, chunk_size=None)
    assert sizes == [(32, 64)] and chosen and all(chosen), (sizes, chosen)


def test_scan_at_half_the_output_chunk_size_needs_host_counted_chunks(generator, device, monkeypatch):
    """A chunk size or device-counted chunk_indices fix every kernel's chunk size; chunk_indices
    counted on the host are counted again at the scan's."""
    mod, rec = module("gdn"), recurrence("gdn")
    sizes = record_forward_sizes(monkeypatch, mod)
    bounds = [0, 33, 100, 171]
    tensors = sample(rec, Shape(1, 171, 1, 2, 16, 16), torch.float32, generator)
    cu = torch.tensor(bounds, dtype=torch.int32)
    ref_o, _ = reference.run(rec, *tensors, cu_seqlens=cu)
    on_device = [t.to(device) for t in tensors]
    cu_device = cu.to(device)
    for options in (dict(chunk_size=64), dict(chunk_indices=mod.prepare_varlen(cu_device, 64)),
                    dict(chunk_indices=mod.prepare_varlen(cu_device, 64, cu))):
        with torch.no_grad():
            o, _ = mod.chunk(*on_device, cu_seqlens=cu_device, **options)
        assert_close(o.cpu(), ref_o, torch.float32, f"gdn.chunk {sorted(options)}")
    assert sizes == [(64, 64), (64, 64), (32, 64)]


def test_scan_at_half_the_output_chunk_size_into_a_pool(generator, device, monkeypatch):
    """A prefill into pool rows (one padding slot) takes the split too: rows and o match the oracle."""
    mod, rec = module("gdn"), recurrence("gdn")
    sizes = record_forward_sizes(monkeypatch, mod)
    shape = Shape(3, 100, 1, 2, 16, 16)
    tensors = sample(rec, shape, torch.float32, generator)
    pool = torch.randn(5, shape.HV, shape.K, shape.V, generator=generator)
    slots = [3, -1, 0]
    expected = pool.clone()
    ref_o, ref_ht = reference.run(rec, *tensors, initial_state=pool[[3, 0, 0]], output_final_state=True)
    expected[3], expected[0] = ref_ht[0], ref_ht[2]
    ref_o[1] = 0  # the padding slot's outputs are zeros
    pool = pool.to(device)
    with torch.no_grad():
        o, _ = mod.chunk(*[t.to(device) for t in tensors], state_pool=pool, state_indices=torch.tensor(slots, device=device))
    assert sizes == [(32, 64)]
    assert_close(o.cpu(), ref_o, torch.float32, "gdn prefill o")
    assert_close(pool.cpu(), expected, torch.float32, "gdn prefill pool rows")


# -- bad arguments -------------------------------------------------------------------------------

def _error(mod, *args, **kwargs) -> str:
    with pytest.raises(mod.InputError) as info:
        mod.chunk(*args, **kwargs)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"{mod.SPEC_NAME}.chunk: ")
    return message


def test_chunk_bad_arguments(generator):
    rec, mod = recurrence("gdn"), module("gdn")
    q, k, v, g, beta = sample(rec, Shape(1, 8, 2, 4, 8, 8), torch.float32, generator)
    assert "chunk_size must be one of (16, 32, 64), got 48" in _error(mod, q, k, v, g, beta, chunk_size=48)
    assert "plan must be one of" in _error(mod, q, k, v, g, beta, plan="fastest")
    assert "HV=3 must be a positive multiple" in _error(mod, q, k, v[:, :, :3], g[..., :3], beta[..., :3])
    assert "beta must be [B, T, HV] = [1, 8, 4], got [1, 8]" in _error(mod, q, k, v, g, beta[..., 0])
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    bad_indices = torch.zeros(3, 2, dtype=torch.int64)
    assert "chunk_indices must be what prepare_varlen(cu_seqlens, chunk_size) returns, got a torch.int64 tensor [3, 2]" in _error(
        mod, q, k, v, g, beta, cu_seqlens=cu, chunk_indices=bad_indices)
    q2, k2, v2, g2, b2 = sample(rec, Shape(2, 8, 2, 4, 8, 8), torch.float32, generator)
    assert "with cu_seqlens the batch must be 1" in _error(mod, q2, k2, v2, g2, b2, cu_seqlens=cu)
