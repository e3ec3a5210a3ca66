"""Shared helpers of the numeric tests: specs, inputs with controlled gates/beta, comparisons."""
from __future__ import annotations

import sympy
import torch
from hypothesis import strategies as st

import lrdsl
from lrdsl import reference
from lrdsl.passes.pipeline import run_pipeline
from lrdsl.spec import load_spec
from lrdsl.verification.workloads import TOLERANCE, Shape, make_inputs, relative_error

from conftest import SPECS

# the four update x gate families of the shipped specs: delta / plain x none / scalar / key-channel
CORE_SPECS = ("gdn", "deltanet", "simple_gla", "linear_attn", "kda", "gla")
ALL_SPECS = tuple(sorted(p.stem for p in SPECS.glob("*.toml")))

# hypothesis strategies of the property tests: shapes (HV = H * group; K and V not powers of two
# too), a chunk size, a core spec
SHAPE_STRATEGIES = dict(
    B=st.integers(1, 2),
    T=st.integers(1, 40),
    H=st.integers(1, 2),
    group=st.integers(1, 3),
    K=st.sampled_from([8, 20, 33]),
    V=st.sampled_from([8, 24, 40]),
    chunk_size=st.sampled_from([16, 32, 64]),
    name=st.sampled_from(CORE_SPECS),
)


def spec_path(name: str) -> str:
    return str(SPECS / f"{name}.toml")


def recurrence(name: str):
    return run_pipeline(load_spec(spec_path(name)), until="recurrence")["recurrence"]


def module(name: str):
    return lrdsl.load(spec_path(name))


def rows_per_token(rec) -> list[int]:
    """Rows per token of q, k, v and each input (0: a per-head input): with steps_per_token = n,
    k, v and the inputs of the steps hold n rows per token, q and the gate's inputs one."""
    n = rec.steps_per_token
    return [1, n, n] + [rec.rows_per_token(i) if i.role.per_token else 0 for i in rec.inputs]


def direct_input(rec, formula):
    """The input a formula merely names (formula `g` -> input g), else None."""
    if formula is not None and isinstance(formula, sympy.Symbol):
        return str(formula)
    return None


def sample(rec, shape: Shape, dtype, generator, gate=None, beta=None, normalize_keys=None):
    """make_inputs, then optionally force the gate input (a value, or 'half' = half -30, half 0)
    and the beta input to extremes."""
    tensors = make_inputs(rec, shape, dtype=dtype, generator=generator, normalize_keys=normalize_keys)
    names = ["q", "k", "v"] + [i.name for i in rec.inputs]
    gate_name, beta_name = direct_input(rec, rec.log_decay), direct_input(rec, rec.beta)
    if gate is not None:
        index = names.index(gate_name)
        g = tensors[index]
        if gate == "half":
            mask = torch.rand(g.shape, generator=generator) < 0.5
            forced = torch.where(mask, torch.full_like(g, -30.0), torch.zeros_like(g))
        else:
            forced = torch.full_like(g, float(gate))
        tensors[index] = forced
    if beta is not None:
        index = names.index(beta_name)
        tensors[index] = torch.full_like(tensors[index], float(beta))
    return tensors


def run_both(mod, rec, kernel, tensors, device, **kwargs):
    """Run `mod.<kernel>` on `device` and the oracle on the CPU; returns ((o, ht), (ref_o, ref_ht))."""
    fn = getattr(mod, kernel)
    dev = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}
    out = fn(*[t.to(device) for t in tensors], **dev)
    ref = reference.run(rec, *tensors, **kwargs)
    return out, ref


def assert_close(out, ref, dtype, what: str, limit: float | None = None):
    limit = TOLERANCE[dtype] if limit is None else limit
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
    err = relative_error(out, ref)
    assert err <= limit, f"{what}: relative error {err:.3e} > {limit:.0e}"
    return err


# The shape list of docs/design.md §6, shared by the recurrent and chunk tests.
# Each case: shape (B, T, H, HV, K, V), dtype, and options of the call.
SHAPE_CASES = {
    "T1": dict(shape=Shape(2, 1, 2, 2, 24, 48), dtype=torch.float32),
    "odd_T_gva3_fp16": dict(shape=Shape(1, 13, 1, 3, 48, 80), dtype=torch.float16),
    "K80_V24_gva4_l2norm": dict(shape=Shape(1, 9, 1, 4, 80, 24), dtype=torch.float32, l2norm=True),
    "gva2_h0_scale": dict(shape=Shape(2, 21, 2, 4, 24, 24), dtype=torch.float32, h0=True, scale=0.3),
    "gva1_h0_fp16": dict(shape=Shape(1, 17, 2, 2, 32, 32), dtype=torch.float16, h0=True),
    "varlen_empty_len1": dict(shape=Shape(1, 20, 2, 4, 24, 40), dtype=torch.float32, h0=True, bounds=[0, 0, 1, 7, 7, 20]),
    "varlen_fp16": dict(shape=Shape(1, 19, 1, 2, 48, 24), dtype=torch.float16, bounds=[0, 1, 1, 19], l2norm=True),
    "no_final_state": dict(shape=Shape(1, 6, 1, 1, 16, 16), dtype=torch.float32, final=False),
}
GATE_EXTREMES = (0.0, -1e-6, -30.0, "half")
BETA_EXTREMES = (0.0, 1.0)


def run_case(mod, rec, kernel, case: dict, generator, device, gate=None, beta=None, **extra_kwargs):
    """Run one case through `mod.<kernel>` and the oracle; assert o and the final state are close."""
    shape, dtype = case["shape"], case["dtype"]
    bounds = case.get("bounds")
    N = len(bounds) - 1 if bounds else shape.B
    tensors = sample(rec, shape, dtype, generator, gate=gate, beta=beta)
    h0 = torch.randn(N, shape.HV, shape.K, shape.V, generator=generator) if case.get("h0") else None
    final = case.get("final", True)
    kwargs = dict(
        scale=case.get("scale"),
        initial_state=h0,
        output_final_state=final,
        cu_seqlens=torch.tensor(bounds, dtype=torch.int32) if bounds else None,
        use_qk_l2norm_in_kernel=case.get("l2norm", False),
    )
    fn = getattr(mod, kernel)
    dev_kwargs = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}
    o, ht = fn(*[t.to(device) for t in tensors], **dev_kwargs, **extra_kwargs)
    ref_o, ref_ht = reference.run(rec, *tensors, **kwargs)
    assert o.dtype == tensors[2].dtype, "o comes back in v's dtype"
    errors = {"o": assert_close(o, ref_o, dtype, f"{rec.name}.{kernel} o")}
    if final:
        assert ht.dtype == torch.float32
        errors["ht"] = assert_close(ht, ref_ht, dtype, f"{rec.name}.{kernel} final state")
    else:
        assert ht is None
    return errors


def force_segments(monkeypatch, mod, multiprocessors=132):
    """A module's scans in segments of 2 chunks wherever its rule allows them, with as many
    multiprocessors as an H200 (the interpreter reports none); returns the list that collects
    every scan's choice (chunks per segment, 0: not segmented)."""
    chosen = []
    choose = mod._scan_segments
    monkeypatch.setattr(mod, "_multiprocessors", lambda q: multiprocessors)
    monkeypatch.setattr(mod, "SCAN_SEGMENT_MIN_CHUNKS", 2)
    monkeypatch.setattr(mod, "_scan_segments", lambda c, BV: chosen.append(choose(c, BV)) or chosen[-1])
    return chosen
