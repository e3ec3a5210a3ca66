"""lrdsl.ops' KDA functions: fla-core 0.6.0's signatures, and every flag combination against the
float64 oracle.

fla-core is not installed here (it is never a dependency): the parameter lists below are recorded
from its source (fla/ops/kda/chunk.py and fused_recurrent.py of fla-core 0.6.0). The oracle
applies FLA's documented formulas in float64 (the gate -exp(A_log) * softplus(g + dt_bias.view(HV,
K)), beta = sigmoid(beta) or 2 * sigmoid(beta)), then runs the plain key-channel delta rule
(specs/kda.toml) through lrdsl.reference. Shapes are tiny: every case is a few interpreter calls.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lrdsl import ops, reference
from lrdsl.spec import resolve_spec
from lrdsl.verification.workloads import TOLERANCE, relative_error
from test_ops import REQUIRED, leaves, on, parameter_list, transposed

TOL = TOLERANCE[torch.float32]

# (name, default as source text) in order; both functions also take **kwargs.
FLA_CHUNK_KDA = [
    ("q", REQUIRED), ("k", REQUIRED), ("v", REQUIRED), ("g", REQUIRED), ("beta", REQUIRED), ("scale", "None"),
    ("initial_state", "None"), ("output_final_state", "False"), ("use_qk_l2norm_in_kernel", "False"),
    ("use_gate_in_kernel", "False"), ("use_beta_sigmoid_in_kernel", "False"), ("allow_neg_eigval", "False"),
    ("safe_gate", "False"), ("lower_bound", "None"), ("disable_recompute", "False"),
    ("return_intermediate_states", "False"), ("state_v_first", "False"), ("cu_seqlens", "None"),
    ("cu_seqlens_cpu", "None"), ("cp_context", "None"), ("use_graph", "False"), ("max_num_seqs", "None"),
]
FLA_FUSED_RECURRENT_KDA = [
    ("q", REQUIRED), ("k", REQUIRED), ("v", REQUIRED), ("g", REQUIRED), ("beta", REQUIRED), ("A_log", "None"),
    ("dt_bias", "None"), ("scale", "None"), ("initial_state", "None"), ("output_final_state", "False"),
    ("use_qk_l2norm_in_kernel", "False"), ("use_gate_in_kernel", "False"), ("use_beta_sigmoid_in_kernel", "False"),
    ("allow_neg_eigval", "False"), ("lower_bound", "None"), ("state_v_first", "False"), ("cu_seqlens", "None"),
]
# Options FLA's chunk_kda reads from **kwargs (A_log and dt_bias only with use_gate_in_kernel=True).
FLA_CHUNK_KDA_KEYWORDS = ("chunk_size", "A_log", "dt_bias")

GATES = ("log", "in_kernel", "in_kernel_dt_bias")
BETAS = ("given", "sigmoid", "2sigmoid")


@pytest.mark.parametrize("fn,expected", [(ops.chunk_kda, FLA_CHUNK_KDA), (ops.fused_recurrent_kda, FLA_FUSED_RECURRENT_KDA)])
def test_signatures_are_fla_core_060(fn, expected):
    listed, has_kwargs, positional = parameter_list(fn)
    assert listed == expected
    assert has_kwargs and positional
    assert ops._KDA_CHUNK_KEYWORDS == FLA_CHUNK_KDA_KEYWORDS


def make_inputs(generator, gate, beta, B=1, T=18, H=1, HV=1, K=16, V=8, N=None):
    """FLA-style KDA inputs: g [B, T, HV, K] is a log decay for gate 'log', the raw gate for
    'in_kernel' (dt_bias flat [HV * K], as FLA takes it); beta in (0, 1) when given, raw logits
    for the sigmoid kinds."""
    tensors = dict(
        q=torch.randn(B, T, H, K, generator=generator), k=torch.randn(B, T, H, K, generator=generator),
        v=torch.randn(B, T, HV, V, generator=generator),
        beta=torch.rand(B, T, HV, generator=generator) if beta == "given" else torch.randn(B, T, HV, generator=generator),
        initial_state=torch.randn(N or B, HV, K, V, generator=generator) * 0.1,
    )
    if gate == "log":
        tensors["g"] = F.logsigmoid(torch.randn(B, T, HV, K, generator=generator) + 2)
    else:
        tensors["g"] = torch.randn(B, T, HV, K, generator=generator)
        tensors["A_log"] = torch.rand(HV, generator=generator) * 2 - 1
        if gate == "in_kernel_dt_bias":
            tensors["dt_bias"] = torch.randn(HV * K, generator=generator)
    return tensors


def flags(gate, beta):
    return dict(use_gate_in_kernel=gate != "log", use_beta_sigmoid_in_kernel=beta != "given",
                allow_neg_eigval=beta == "2sigmoid")


def oracle(tensors, gate, beta, lower_bound=None, **options):
    """FLA's formulas in float64, then the plain key-channel delta rule through lrdsl.reference.
    lower_bound: FLA's bounded gate lower_bound * sigmoid(exp(A_log) * (g + dt_bias)) (without
    A_log: lower_bound * sigmoid(g + dt_bias))."""
    t = {name: x.double() for name, x in tensors.items()}
    beta_value = {"given": t["beta"], "sigmoid": torch.sigmoid(t["beta"]), "2sigmoid": 2 * torch.sigmoid(t["beta"])}[beta]
    g = t["g"]
    if gate != "log":
        HV, K = g.shape[2], g.shape[3]
        bias = t["dt_bias"].reshape(HV, K) if "dt_bias" in t else 0.0
        A = torch.exp(t["A_log"]).reshape(HV, 1) if "A_log" in t else 1.0
        if lower_bound is None:
            g = -A * F.softplus(g + bias)
        else:
            g = lower_bound * torch.sigmoid(A * (g + bias))
    return reference.run(resolve_spec("kda"), t["q"], t["k"], t["v"], g, beta_value,
                         initial_state=t["initial_state"], **options)


def heads_of(x):
    return {name: x[name] for name in ("A_log", "dt_bias") if name in x}


def call_chunk(x, gate, beta, **options):
    """Call by keyword, as code written against FLA does."""
    return ops.chunk_kda(q=x["q"], k=x["k"], v=x["v"], g=x["g"], beta=x["beta"], initial_state=x["initial_state"],
                         output_final_state=True, use_qk_l2norm_in_kernel=True, **flags(gate, beta), **heads_of(x),
                         **options)


def call_recurrent(x, gate, beta, **options):
    return ops.fused_recurrent_kda(q=x["q"], k=x["k"], v=x["v"], g=x["g"], beta=x["beta"],
                                   initial_state=x["initial_state"], output_final_state=True,
                                   use_qk_l2norm_in_kernel=True, **flags(gate, beta), **heads_of(x), **options)


def assert_gradients(generator, device, x, x_ref, outputs, outputs_ref):
    """Every input's gradient (raw g and beta, A_log, flat dt_bias, the initial state) against
    autograd through the oracle, for random output and final-state cotangents."""
    (o, ht), (o_ref, ht_ref) = outputs, outputs_ref
    do = torch.randn(o.shape, generator=generator, dtype=torch.float64)
    dht = torch.randn(ht.shape, generator=generator, dtype=torch.float64)
    got = torch.autograd.grad((o, ht), list(x.values()), (do.to(device, torch.float32), dht.to(device, torch.float32)))
    expected = torch.autograd.grad((o_ref, ht_ref), list(x_ref.values()), (do, dht))
    for name, a, b in zip(x, got, expected):
        assert a.shape == b.shape, f"d{name}"
        assert relative_error(a, b) <= TOL, f"d{name}"


@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("beta", BETAS)
def test_chunk_every_flag_combination(generator, device, gate, beta):
    """Outputs, final state and every gradient against the oracle; 18 tokens in chunks of 16."""
    tensors = make_inputs(generator, gate, beta)
    x = leaves(tensors, device)
    o, ht = call_chunk(x, gate, beta, chunk_size=16)
    x_ref = leaves(tensors)
    o_ref, ht_ref = oracle(x_ref, gate, beta, output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert relative_error(o, o_ref) <= TOL
    assert relative_error(ht, ht_ref) <= TOL
    assert_gradients(generator, device, x, x_ref, (o, ht), (o_ref, ht_ref))


@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("beta", BETAS)
def test_fused_recurrent_every_flag_combination(generator, device, gate, beta):
    tensors = make_inputs(generator, gate, beta, B=2, T=5)
    with torch.no_grad():
        o, ht = call_recurrent(on(device, tensors), gate, beta)
    o_ref, ht_ref = oracle(tensors, gate, beta, output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert relative_error(o, o_ref) <= TOL
    assert relative_error(ht, ht_ref) <= TOL


def test_varlen_cu_seqlens_and_cu_seqlens_cpu(generator, device):
    """Packed sequences of lengths 0, 1, 17, 5 with GVA (H 1, HV 2) and K, V not powers of two:
    chunk with cu_seqlens alone (its chunk size chosen as chunk() would), with cu_seqlens_cpu and
    chunk_size=32, and fused_recurrent, all against the oracle."""
    lengths = [0, 1, 17, 5]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int64)
    gate, beta = "in_kernel_dt_bias", "sigmoid"
    tensors = make_inputs(generator, gate, beta, T=int(cu[-1]), H=1, HV=2, K=24, V=20, N=len(lengths))
    o_ref, ht_ref = oracle(tensors, gate, beta, output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
    x = on(device, tensors)
    with torch.no_grad():
        results = [
            call_chunk(x, gate, beta, cu_seqlens=cu.to(device)),
            call_chunk(x, gate, beta, chunk_size=32, cu_seqlens=cu.to(device), cu_seqlens_cpu=cu),
            call_recurrent(x, gate, beta, cu_seqlens=cu.to(device)),
        ]
    for o, ht in results:
        assert relative_error(o, o_ref) <= TOL
        assert relative_error(ht, ht_ref) <= TOL


@pytest.mark.parametrize("packed", [False, True], ids=["dense", "varlen"])
def test_disable_recompute_keeps_what_the_backward_reads(packed, generator, device, monkeypatch):
    """FLA's disable_recompute=True (keep every activation the backward reads) is chunk()'s
    save_policy "save": the backward re-runs no forward kernel, at the forward's chunk size, and
    its gradients still match the oracle; False is the default, "save_states" (the solved systems
    kept, the rest recomputed, the re-run scan perhaps resumed from a few kept states)."""
    lengths = [5, 0, 30]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int64)
    gate, beta = "in_kernel_dt_bias", "sigmoid"
    packing = dict(cu_seqlens=cu) if packed else {}
    tensors = make_inputs(generator, gate, beta, T=35, HV=2, N=len(lengths) if packed else None)
    module = ops.spec_module("in_kernel", "sigmoid", True, decay="key_channel")
    calls, backward = [], module._chunk_backward
    monkeypatch.setattr(module, "_chunk_backward",
                        lambda c, plan, policy, kept, *rest: calls.append((c["BT"], policy, sorted(kept)))
                        or backward(c, plan, policy, kept, *rest))
    x_ref = leaves(tensors)
    outputs_ref = oracle(x_ref, gate, beta, output_final_state=True, use_qk_l2norm_in_kernel=True, **packing)
    x = leaves(tensors, device)
    outputs = call_chunk(x, gate, beta, chunk_size=32, disable_recompute=True, **on(device, packing))
    assert_gradients(generator, device, x, x_ref, outputs, outputs_ref)
    plan = module.DEFAULT_CHUNK_PLAN
    assert module.SAVE_POLICIES["save"]["rerun"][plan] == ()  # nothing recomputed
    assert calls == [(32, "save", sorted(module.SAVE_POLICIES["save"]["kept"][plan]))]
    calls.clear()
    o, ht = call_chunk(leaves(tensors, device), gate, beta, chunk_size=32, disable_recompute=False, **on(device, packing))
    (o.sum() + ht.sum()).backward()
    assert calls == [(32, "save_states", sorted(module.SAVE_POLICIES["save_states"]["kept"][plan]))]


def test_chunk_state_v_first_against_the_oracle(generator, device):
    """state_v_first=True: the kernels read the initial state and write the final one [N, HV, V,
    K]; outputs, final state and every gradient (the initial state's in that layout) against the
    oracle."""
    gate, beta = "in_kernel_dt_bias", "2sigmoid"
    tensors = make_inputs(generator, gate, beta, HV=2)
    tensors["initial_state"] = transposed(tensors["initial_state"])
    x = leaves(tensors, device)
    o, ht = call_chunk(x, gate, beta, chunk_size=16, state_v_first=True)
    assert ht.shape == (1, 2, 8, 16) and ht.is_contiguous()
    x_ref = leaves(tensors)
    k_first = dict(x_ref, initial_state=x_ref["initial_state"].transpose(-1, -2))
    o_ref, ht_ref = oracle(k_first, gate, beta, output_final_state=True, use_qk_l2norm_in_kernel=True)
    ht_ref = ht_ref.transpose(-1, -2)
    assert relative_error(o, o_ref) <= TOL
    assert relative_error(ht, ht_ref) <= TOL
    assert_gradients(generator, device, x, x_ref, (o, ht), (o_ref, ht_ref))


def test_fused_recurrent_state_v_first_and_its_deprecated_name(generator, device):
    tensors = make_inputs(generator, "log", "given", B=2, T=5, HV=2)
    tensors["initial_state"] = transposed(tensors["initial_state"])
    x = on(device, tensors)
    with torch.no_grad():
        o, ht = call_recurrent(x, "log", "given", state_v_first=True)
        with pytest.warns(DeprecationWarning, match="transpose_state_layout"):
            o2, ht2 = call_recurrent(x, "log", "given", transpose_state_layout=True)
    k_first = dict(tensors, initial_state=tensors["initial_state"].transpose(-1, -2))
    o_ref, ht_ref = oracle(k_first, "log", "given", output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert ht.shape == (2, 2, 8, 16)
    for out, final in ((o, ht), (o2, ht2)):
        assert relative_error(out, o_ref) <= TOL
        assert relative_error(final, ht_ref.transpose(-1, -2)) <= TOL


def test_key_channel_spec_per_flag_combination_is_written_and_cached():
    name, text = ops.spec_text("in_kernel", "2sigmoid", has_dt_bias=True, decay="key_channel")
    assert name == "fla_kda_gate_in_kernel_dt_bias_beta_2sigmoid"
    assert 'gate = "key_channel"' in text
    assert 'g = "token_key"' in text and 'dt_bias = "head_key"' in text and 'A_log = "head"' in text
    assert 'log_decay = "-exp(A_log) * softplus(g + dt_bias)"' in text
    assert ops.spec_module("log", "given", decay="key_channel") is ops.spec_module("log", "given", decay="key_channel")
    with pytest.raises(ValueError, match="needs g"):
        ops.spec_text("none", "given", decay="key_channel")


def test_unsupported_options_raise(generator, device):
    tensors = make_inputs(generator, "log", "given", T=3, HV=2)
    x = on(device, tensors)
    q, k, v, g, beta = x["q"], x["k"], x["v"], x["g"], x["beta"]
    chunk, recurrent = ops.chunk_kda, ops.fused_recurrent_kda
    gated = dict(use_gate_in_kernel=True, A_log=torch.zeros(2))
    cases = [
        (lambda: chunk(q, k, v, g, beta, safe_gate=True, **gated), r"safe_gate=True .* needs lower_bound \(as in FLA\)"),
        (lambda: chunk(q, k, v, g, beta, safe_gate=True, lower_bound=-6.0, **gated),
         r"safe_gate=True needs lower_bound in \[-5, 0\) \(as in FLA\), got -6.0"),
        (lambda: chunk(q, k, v, g, beta, lower_bound=0.5, **gated), "lower_bound must be a finite negative number"),
        (lambda: chunk(q, k, v, g, beta, safe_gate="yes"), "safe_gate must be True or False"),
        (lambda: chunk(q, k, v, g, beta, disable_recompute="yes"), "disable_recompute must be True or False, got 'yes'"),
        (lambda: chunk(q, k, v, g, beta, cp_context=object()), "cp_context must be what lrdsl.distributed.build_cp_context returns"),
        (lambda: chunk(q, k, v, g, beta, use_graph=True), "use_graph .* is not supported"),
        (lambda: chunk(q, k, v, g, beta, max_num_seqs=8), "max_num_seqs .* is not supported"),
        (lambda: chunk(q, k, v, g, beta, chunk_indices=None), "option 'chunk_indices' is not supported"),
        (lambda: chunk(q, k, v, g, beta, output_attentions=True), "option 'output_attentions' is not supported"),
        (lambda: chunk(q, k, v, g, beta, chunk_size=128), "chunk_size must be 16, 32 or 64, got 128"),
        (lambda: chunk(q, k, v, g, beta, state_v_first="yes"), "state_v_first must be True or False"),
        (lambda: chunk(q, k, v, g, beta, allow_neg_eigval=True), "allow_neg_eigval=True requires use_beta_sigmoid"),
        (lambda: chunk(q, k, v, g, beta, use_gate_in_kernel=True), "use_gate_in_kernel=True needs A_log"),
        (lambda: chunk(q, k, v, None, beta), r"g \[B, T, HV, K\] is required"),
        (lambda: chunk(q, k, v, g, beta, use_gate_in_kernel=True, A_log=torch.zeros(2), dt_bias=torch.zeros(5)),
         r"dt_bias must be \[HV \* K\] = \[32\]"),
        (lambda: recurrent(q, k, v, g, beta, lower_bound="low", **gated), "lower_bound must be a finite negative number"),
        (lambda: recurrent(q, k, v, g, beta, chunk_size=16), "option 'chunk_size' is not supported"),
        (lambda: recurrent(q, k, v, g, beta, allow_neg_eigval=True), "allow_neg_eigval=True requires"),
        (lambda: recurrent(q, k, v, g, beta, state_v_first=True, transpose_state_layout=True), "not both"),
    ]
    for call, message in cases:
        with pytest.raises(ops.OptionError, match=message) as caught:
            call()
        assert "\n" not in str(caught.value)
    # the defaults of the unsupported options are what lrdsl computes: accepted; so are safe_gate
    # and lower_bound without use_gate_in_kernel, which FLA reads only with it
    o, _ = chunk(q, k, v, g, beta, initial_state=x["initial_state"], safe_gate=False, lower_bound=None, disable_recompute=False,
                 return_intermediate_states=False, cp_context=None, use_graph=False, max_num_seqs=None, chunk_size=16)
    assert relative_error(o, oracle(tensors, "log", "given")[0]) <= TOL
    o, _ = chunk(q, k, v, g, beta, initial_state=x["initial_state"], safe_gate=True, lower_bound=-5.0, chunk_size=16)
    assert relative_error(o, oracle(tensors, "log", "given")[0]) <= TOL
    with pytest.raises(ValueError, match=r"g must be \[B, T, HV, K\]"):
        chunk(q, k, v, g[..., 0], beta)


# FLA's bounded gate: (A_log given, dt_bias given) per case
LOWER_BOUND_CASES = {"A_log_dt_bias": (True, True), "A_log": (True, False), "dt_bias_only": (False, True)}


@pytest.mark.parametrize("safe_gate", [False, True])
@pytest.mark.parametrize("case", LOWER_BOUND_CASES)
def test_chunk_lower_bound_gate(case, safe_gate, generator, device):
    """chunk_kda's lower_bound (before: refused, `lower_bound ... is not supported`): the gate
    lower_bound * sigmoid(exp(A_log) * (g + dt_bias)), A_log optional, safe_gate the same result;
    outputs, final state and every gradient against the oracle."""
    has_A_log, has_dt_bias = LOWER_BOUND_CASES[case]
    tensors = make_inputs(generator, "in_kernel_dt_bias", "sigmoid", HV=2)
    if not has_A_log:
        del tensors["A_log"]
    if not has_dt_bias:
        del tensors["dt_bias"]
    x = leaves(tensors, device)
    o, ht = call_chunk(x, "in_kernel", "sigmoid", chunk_size=16, lower_bound=-5.0, safe_gate=safe_gate)
    x_ref = leaves(tensors)
    o_ref, ht_ref = oracle(x_ref, "in_kernel", "sigmoid", lower_bound=-5.0, output_final_state=True,
                           use_qk_l2norm_in_kernel=True)
    assert relative_error(o, o_ref) <= TOL
    assert relative_error(ht, ht_ref) <= TOL
    assert_gradients(generator, device, x, x_ref, (o, ht), (o_ref, ht_ref))


def test_fused_recurrent_lower_bound_gate(generator, device):
    tensors = make_inputs(generator, "in_kernel_dt_bias", "given", B=2, T=5, HV=2)
    with torch.no_grad():
        o, ht = call_recurrent(on(device, tensors), "in_kernel", "given", lower_bound=-2.5)
    o_ref, ht_ref = oracle(tensors, "in_kernel", "given", lower_bound=-2.5, output_final_state=True,
                           use_qk_l2norm_in_kernel=True)
    assert relative_error(o, o_ref) <= TOL
    assert relative_error(ht, ht_ref) <= TOL


def test_lower_bound_spec_is_a_formula():
    name, text = ops.spec_text("in_kernel", "given", has_dt_bias=True, decay="key_channel", lower_bound=-5.0,
                               has_A_log=False)
    assert name == "fla_kda_gate_lower_bound_m5p0_dt_bias_no_A_log"
    assert 'log_decay = "-5.0 * sigmoid(g + dt_bias)"' in text and "A_log" not in text.split("[inputs]")[1]


@pytest.mark.parametrize("fn", ["chunk_kda", "fused_recurrent_kda"])
def test_head_parameters_in_any_shape_with_their_elements(fn, generator, device):
    """A_log as [1, 1, HV, 1] and dt_bias as [HV, K] (FLA reads both flat; before: `A_log must be
    [HV]`): outputs against the oracle, and gradients in the shapes given."""
    tensors = make_inputs(generator, "in_kernel_dt_bias", "sigmoid", HV=3, T=9)
    tensors["A_log"] = tensors["A_log"].reshape(1, 1, 3, 1)
    tensors["dt_bias"] = tensors["dt_bias"].reshape(3, 16)
    x = leaves(tensors, device)
    call = call_chunk if fn == "chunk_kda" else call_recurrent
    o, ht = call(x, "in_kernel", "sigmoid")
    x_ref = leaves(tensors)
    o_ref, ht_ref = oracle(x_ref, "in_kernel", "sigmoid", output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert relative_error(o, o_ref) <= TOL
    assert relative_error(ht, ht_ref) <= TOL
    assert_gradients(generator, device, x, x_ref, (o, ht), (o_ref, ht_ref))
