"""Generated recurrent kernels against the float64 oracle (CPU interpreter, fresh inputs each run)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lrdsl.verification.workloads import Shape

from helpers import (
    ALL_SPECS,
    BETA_EXTREMES,
    CORE_SPECS,
    GATE_EXTREMES,
    SHAPE_CASES,
    direct_input,
    module,
    recurrence,
    run_case,
)


@pytest.mark.parametrize("case", sorted(SHAPE_CASES))
@pytest.mark.parametrize("name", CORE_SPECS)
def test_recurrent_shapes(name, case, generator, device):
    run_case(module(name), recurrence(name), "recurrent", SHAPE_CASES[case], generator, device)


@pytest.mark.parametrize("name", [n for n in ALL_SPECS if n not in CORE_SPECS])
@pytest.mark.parametrize("case", ["gva2_h0_scale", "varlen_empty_len1", "odd_T_gva3_fp16"])
def test_recurrent_other_specs(name, case, generator, device):
    run_case(module(name), recurrence(name), "recurrent", SHAPE_CASES[case], generator, device)


@pytest.mark.parametrize("gate", GATE_EXTREMES)
@pytest.mark.parametrize("name", [n for n in ALL_SPECS if direct_input(recurrence(n), recurrence(n).log_decay)])
def test_recurrent_gate_extremes(name, gate, generator, device):
    errors = run_case(module(name), recurrence(name), "recurrent", SHAPE_CASES["gva2_h0_scale"], generator, device, gate=gate)
    assert all(e == e for e in errors.values())


@pytest.mark.parametrize("beta", BETA_EXTREMES)
@pytest.mark.parametrize("name", [n for n in ALL_SPECS if direct_input(recurrence(n), recurrence(n).beta)])
def test_recurrent_beta_extremes(name, beta, generator, device):
    run_case(module(name), recurrence(name), "recurrent", SHAPE_CASES["varlen_empty_len1"], generator, device, beta=beta)


def test_recurrent_empty_sequences_keep_initial_state(generator, device):
    mod, rec = module("gdn"), recurrence("gdn")
    case = dict(shape=Shape(1, 0, 1, 2, 8, 8), dtype=torch.float32, h0=True, bounds=[0, 0, 0])
    run_case(mod, rec, "recurrent", case, generator, device)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    B=st.integers(1, 2),
    T=st.integers(1, 12),
    H=st.integers(1, 2),
    group=st.integers(1, 3),
    K=st.sampled_from([8, 20, 33]),
    V=st.sampled_from([8, 24, 40]),
    name=st.sampled_from(CORE_SPECS),
)
def test_recurrent_property_shapes(B, T, H, group, K, V, name, generator, device):
    case = dict(shape=Shape(B, T, H, H * group, K, V), dtype=torch.float32, h0=True)
    run_case(module(name), recurrence(name), "recurrent", case, generator, device)
