"""lrdsl.ops: fla-core 0.6.0's signatures, and every flag combination against the float64 oracle.

fla-core is not installed here (it is never a dependency): its parameter lists are recorded below
from its source (fla/ops/gated_delta_rule/chunk.py and fused_recurrent.py of fla-core 0.6.0).
The oracle applies FLA's documented formulas in float64, then runs the plain gated delta rule
(specs/gdn.toml, or specs/deltanet.toml without decay) through lrdsl.reference.
"""
from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F

from lrdsl import ops, reference
from lrdsl.spec import resolve_spec
from lrdsl.verification.workloads import TOLERANCE, relative_error

TOL = TOLERANCE[torch.float32]
REQUIRED = "<required>"

# (name, default as source text) in order; both functions also take **kwargs.
FLA_CHUNK_GATED_DELTA_RULE = [
    ("q", REQUIRED), ("k", REQUIRED), ("v", REQUIRED), ("g", REQUIRED), ("beta", REQUIRED), ("scale", "None"),
    ("initial_state", "None"), ("output_final_state", "False"), ("use_qk_l2norm_in_kernel", "False"),
    ("use_beta_sigmoid_in_kernel", "False"), ("allow_neg_eigval", "False"), ("state_v_first", "False"),
    ("cu_seqlens", "None"), ("cu_seqlens_cpu", "None"), ("chunk_indices", "None"), ("cp_context", "None"),
]
FLA_FUSED_RECURRENT_GATED_DELTA_RULE = [
    ("q", REQUIRED), ("k", REQUIRED), ("v", REQUIRED), ("g", "None"), ("gk", "None"), ("gv", "None"),
    ("beta", "None"), ("scale", "None"), ("initial_state", "None"), ("output_final_state", "False"),
    ("use_qk_l2norm_in_kernel", "False"), ("use_gate_in_kernel", "False"), ("A_log", "None"), ("dt_bias", "None"),
    ("use_beta_sigmoid_in_kernel", "False"), ("allow_neg_eigval", "False"), ("state_v_first", "False"),
    ("cu_seqlens", "None"),
]
# Options FLA's chunk_gated_delta_rule reads from **kwargs.
FLA_CHUNK_KEYWORDS = ("chunk_size", "use_gate_in_kernel", "A_log", "dt_bias")

GATES = ("log", "in_kernel", "in_kernel_dt_bias", "none")
BETAS = ("given", "sigmoid", "2sigmoid")


def parameter_list(fn):
    parameters = inspect.signature(fn).parameters.values()
    listed = [(p.name, REQUIRED if p.default is inspect.Parameter.empty else repr(p.default))
              for p in parameters if p.kind is not inspect.Parameter.VAR_KEYWORD]
    has_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)
    positional = all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in parameters
                     if p.kind is not inspect.Parameter.VAR_KEYWORD)
    return listed, has_kwargs, positional


@pytest.mark.parametrize("fn,expected", [
    (ops.chunk_gated_delta_rule, FLA_CHUNK_GATED_DELTA_RULE),
    (ops.fused_recurrent_gated_delta_rule, FLA_FUSED_RECURRENT_GATED_DELTA_RULE),
])
def test_signatures_are_fla_core_060(fn, expected):
    listed, has_kwargs, positional = parameter_list(fn)
    assert listed == expected
    assert has_kwargs and positional
    assert ops._CHUNK_KEYWORDS == FLA_CHUNK_KEYWORDS


def make_inputs(generator, gate, beta, B=1, T=20, H=1, HV=2, K=16, V=8, N=None):
    """FLA-style inputs for one flag combination: g is a log decay for gate 'log', a raw gate for
    'in_kernel'; beta is in (0, 1) when given, raw logits for the sigmoid kinds."""
    tensors = dict(
        q=torch.randn(B, T, H, K, generator=generator), k=torch.randn(B, T, H, K, generator=generator),
        v=torch.randn(B, T, HV, V, generator=generator),
        beta=torch.rand(B, T, HV, generator=generator) if beta == "given" else torch.randn(B, T, HV, generator=generator),
        initial_state=torch.randn(N or B, HV, K, V, generator=generator) * 0.1,
    )
    if gate == "log":
        tensors["g"] = F.logsigmoid(torch.randn(B, T, HV, generator=generator) + 2)
    elif gate.startswith("in_kernel"):
        tensors["g"] = torch.randn(B, T, HV, generator=generator)
        tensors["A_log"] = torch.rand(HV, generator=generator) * 2 - 1
        if gate == "in_kernel_dt_bias":
            tensors["dt_bias"] = torch.randn(HV, generator=generator)
    return tensors


def flags(gate, beta):
    options = dict(use_beta_sigmoid_in_kernel=beta != "given", allow_neg_eigval=beta == "2sigmoid")
    if gate.startswith("in_kernel"):
        options["use_gate_in_kernel"] = True
    return options


def oracle(tensors, gate, beta, **options):
    """FLA's formulas in float64, then the plain gated delta rule through lrdsl.reference."""
    t = {name: x.double() for name, x in tensors.items()}
    beta_value = {"given": t["beta"], "sigmoid": torch.sigmoid(t["beta"]), "2sigmoid": 2 * torch.sigmoid(t["beta"])}[beta]
    if gate == "log":
        g = t["g"]
    elif gate.startswith("in_kernel"):
        g = -torch.exp(t["A_log"]) * F.softplus(t["g"] + t.get("dt_bias", 0.0))
    else:
        return reference.run(resolve_spec("deltanet"), t["q"], t["k"], t["v"], beta_value,
                             initial_state=t["initial_state"], **options), t
    return reference.run(resolve_spec("gdn"), t["q"], t["k"], t["v"], g, beta_value,
                         initial_state=t["initial_state"], **options), t


def leaves(tensors, device="cpu"):
    return {name: x.detach().to(device).clone().requires_grad_(True) for name, x in tensors.items()}


def on(device, tensors):
    return {name: x.to(device) for name, x in tensors.items()}


def call_chunk(x, gate, beta, **options):
    """Call by keyword, as code written against FLA does."""
    heads = {name: x[name] for name in ("A_log", "dt_bias") if name in x}
    return ops.chunk_gated_delta_rule(q=x["q"], k=x["k"], v=x["v"], g=x.get("g"), beta=x["beta"],
                                      initial_state=x["initial_state"], output_final_state=True,
                                      use_qk_l2norm_in_kernel=True, **flags(gate, beta), **heads, **options)


@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("beta", BETAS)
def test_chunk_every_flag_combination(generator, device, gate, beta):
    """Outputs, final state and the gradient of every input (the raw g and beta, A_log, dt_bias,
    the initial state) against autograd through the oracle; 20 tokens in chunks of 16."""
    tensors = make_inputs(generator, gate, beta)
    x = leaves(tensors, device)
    o, ht = call_chunk(x, gate, beta, chunk_size=16)
    x_ref = leaves(tensors)
    (o_ref, ht_ref), t = oracle(x_ref, gate, beta, output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert relative_error(o, o_ref) <= TOL
    assert relative_error(ht, ht_ref) <= TOL
    do = torch.randn(o.shape, generator=generator, dtype=torch.float64)
    dht = torch.randn(ht.shape, generator=generator, dtype=torch.float64)
    got = torch.autograd.grad((o, ht), list(x.values()), (do.to(device, torch.float32), dht.to(device, torch.float32)))
    expected = torch.autograd.grad((o_ref, ht_ref), list(x_ref.values()), (do, dht))
    for name, a, b in zip(x, got, expected):
        assert relative_error(a, b) <= TOL, f"d{name}"


@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("beta", BETAS + (None,))
def test_fused_recurrent_every_flag_combination(generator, device, gate, beta):
    """Forward against the oracle; beta=None means beta = 1, as in FLA."""
    tensors = make_inputs(generator, gate, beta or "given", B=2, T=5)
    if beta is None:
        tensors["beta"] = torch.ones_like(tensors["beta"])
    x = on(device, tensors)
    heads = {name: x[name] for name in ("A_log", "dt_bias") if name in x}
    with torch.no_grad():
        o, ht = ops.fused_recurrent_gated_delta_rule(
            x["q"], x["k"], x["v"], g=x.get("g"), beta=None if beta is None else x["beta"],
            initial_state=x["initial_state"], output_final_state=True, use_qk_l2norm_in_kernel=True,
            **flags(gate, beta or "given"), **heads)
    (o_ref, ht_ref), _ = oracle(tensors, gate, beta or "given", output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert relative_error(o, o_ref) <= TOL
    assert relative_error(ht, ht_ref) <= TOL


def test_varlen_cu_seqlens_cpu_chunk_size_and_fla_chunk_indices(generator, device):
    """Packed sequences of lengths 0, 1, 17, 5 in chunks of 32: chunk indices from cu_seqlens_cpu,
    or FLA's own int64 chunk indices, give the oracle's result."""
    lengths = [0, 1, 17, 5]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int64)
    tensors = make_inputs(generator, "in_kernel_dt_bias", "sigmoid", T=int(cu[-1]), H=2, HV=4, K=24, V=20, N=len(lengths))
    (o_ref, ht_ref), _ = oracle(tensors, "in_kernel_dt_bias", "sigmoid", output_final_state=True,
                                use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
    x = on(device, tensors)
    with torch.no_grad():
        o, ht = call_chunk(x, "in_kernel_dt_bias", "sigmoid", chunk_size=32, cu_seqlens=cu.to(device), cu_seqlens_cpu=cu)
        fla_indices = torch.tensor([[1, 0], [2, 0], [3, 0]], dtype=torch.int64)  # (sequence, chunk) of every chunk
        o2, ht2 = call_chunk(x, "in_kernel_dt_bias", "sigmoid", chunk_size=32, cu_seqlens=cu.to(device),
                             chunk_indices=fla_indices.to(device))
    for out, final in ((o, ht), (o2, ht2)):
        assert relative_error(out, o_ref) <= TOL
        assert relative_error(final, ht_ref) <= TOL
    with pytest.raises(ValueError, match="prepared for another chunk size"):  # FLA's table for chunk size 16
        call_chunk(x, "in_kernel_dt_bias", "sigmoid", chunk_size=32, cu_seqlens=cu.to(device),
                   chunk_indices=torch.tensor([[1, 0], [2, 0], [2, 1], [3, 0]], device=device))



@pytest.mark.parametrize("packed", [False, True], ids=["dense", "varlen"])
def test_default_chunk_size_is_lrdsl_s_and_the_backward_chooses_its_own(packed, generator, device, monkeypatch):
    """Without chunk_size (FLA takes 64 always) chunk() picks its own: the largest that fits, and a
    backward recomputing at BACKWARD_CHUNK_SIZE (what its kernels' registers hold), with cu_seqlens
    alone too; like FLA's, it keeps only the solved systems (save_states), not the module's
    default. Gradients match the oracle."""
    lengths = [3, 70, 27]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int64)
    tensors = make_inputs(generator, "log", "given", T=100, N=len(lengths) if packed else None)
    module = ops.spec_module("log", "given")
    sizes, backward = [], module._chunk_backward
    monkeypatch.setattr(module, "_chunk_backward", lambda c, plan, policy, *rest: sizes.append((c["BT"], policy))
                        or backward(c, plan, policy, *rest))
    packing = dict(cu_seqlens=cu) if packed else {}
    (o_ref, ht_ref), t = oracle(tensors, "log", "given", output_final_state=True, use_qk_l2norm_in_kernel=True, **packing)
    x = leaves(tensors, device)
    o, ht = call_chunk(x, "log", "given", **on(device, packing))
    ((o.float() * 0.5).sum() + ht.sum()).backward()
    assert sizes == [(module.BACKWARD_CHUNK_SIZE["input"], "save_states")]
    assert sizes[0][0] < module.largest_chunk_size(16)
    assert relative_error(o, o_ref) <= TOL and relative_error(ht, ht_ref) <= TOL
    ref = leaves({n: v.double() for n, v in tensors.items()})
    (o2, ht2), _ = oracle(ref, "log", "given", output_final_state=True, use_qk_l2norm_in_kernel=True, **packing)
    ((o2 * 0.5).sum() + ht2.sum()).backward()
    for name in x:
        assert relative_error(x[name].grad, ref[name].grad) <= TOL, name


@pytest.mark.parametrize("host", ["cu_seqlens_cpu", "fla_chunk_indices"])
def test_host_counted_chunks_leave_the_backward_its_own_chunk_size(host, generator, device, monkeypatch):
    """With cu_seqlens_cpu (or FLA's chunk_indices, counted on one host copy of cu_seqlens) and no
    chunk_size, the forward runs at its own (FORWARD_CHUNK_SIZE, here the largest) and the backward at BACKWARD_CHUNK_SIZE,
    every chunk of both counted on the host copy; gradients match the oracle. With chunk_size the
    backward keeps it."""
    lengths = [3, 70, 0, 27]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int64)
    tensors = make_inputs(generator, "log", "given", T=100, N=len(lengths))
    module = ops.spec_module("log", "given")
    largest, backward_size = module.largest_chunk_size(16), module.BACKWARD_CHUNK_SIZE["input"]
    assert backward_size < largest == module.FORWARD_CHUNK_SIZE[module.DEFAULT_CHUNK_PLAN, "input"]
    sizes, backward = [], module._chunk_backward
    monkeypatch.setattr(module, "_chunk_backward", lambda c, *rest: sizes.append(c["BT"]) or backward(c, *rest))
    counted, count = [], module._count_chunks
    monkeypatch.setattr(module, "_count_chunks", lambda cu_seqlens, size: counted.append((cu_seqlens.device.type, size))
                        or count(cu_seqlens, size))
    cu_device = cu.to(device)
    if host == "cu_seqlens_cpu":
        packing = dict(cu_seqlens=cu_device, cu_seqlens_cpu=cu)
    else:  # FLA's table of (sequence, chunk) pairs at the largest chunk size
        fla_indices = module.prepare_varlen(cu, largest).indices.long()
        packing = dict(cu_seqlens=cu_device, chunk_indices=fla_indices.to(device))
        counted.clear()
    x = leaves(tensors, device)
    o, ht = call_chunk(x, "log", "given", **packing)
    ((o * 0.5).sum() + ht.sum()).backward()
    assert sizes == [backward_size]
    assert counted == [("cpu", largest), ("cpu", backward_size)]
    ref = leaves({n: v.double() for n, v in tensors.items()})
    (o_ref, ht_ref), _ = oracle(ref, "log", "given", output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
    ((o_ref * 0.5).sum() + ht_ref.sum()).backward()
    assert relative_error(o, o_ref) <= TOL and relative_error(ht, ht_ref) <= TOL
    for name in x:
        assert relative_error(x[name].grad, ref[name].grad) <= TOL, name
    sizes.clear()
    o, ht = call_chunk(leaves(tensors, device), "log", "given", chunk_size=largest, **packing)
    (o.sum() + ht.sum()).backward()
    assert sizes == [largest]


def test_host_copy_of_cu_seqlens_is_checked(generator, device):
    """A cu_seqlens_cpu that cannot be cu_seqlens's host copy is refused in one line, by ops and by
    the module's prepare_varlen; one that is gives the chunks counted on the device."""
    module = ops.spec_module("log", "given")
    cu = torch.tensor([0, 3, 3, 40], dtype=torch.int64)
    counted, on_device = module.prepare_varlen(cu, 16, cu), module.prepare_varlen(cu.to(device), 16)
    for chunks in (counted, on_device):
        assert (chunks.indices.tolist(), chunks.offsets.tolist()) == ([[0, 0], [2, 0], [2, 1], [2, 2]], [0, 1, 1, 4])
        assert (chunks.chunk_size, chunks.num_tokens) == (16, 40)
    assert counted.cu_seqlens_cpu is cu and on_device.cu_seqlens_cpu is None
    with pytest.raises(module.InputError, match=r"^fla_gdn.prepare_varlen: cu_seqlens_cpu must be the host copy of cu_seqlens: "
                                                r"a CPU tensor \[4\], got a cpu tensor \[3\]$"):
        module.prepare_varlen(cu.to(device), 16, cu[:3])
    with pytest.raises(module.InputError, match=r"^fla_gdn.prepare_varlen: cu_seqlens_cpu must be int32 or int64, got torch.float32$"):
        module.prepare_varlen(cu.to(device), 16, cu.float())
    tensors = on(device, make_inputs(generator, "log", "given", T=40, N=3))
    with pytest.raises(ops.OptionError, match=r"cu_seqlens_cpu must have cu_seqlens's shape \[4\], got \[3\]$"):
        call_chunk(tensors, "log", "given", cu_seqlens=cu.to(device), cu_seqlens_cpu=cu[:3])


def test_spec_per_flag_combination_is_written_and_cached():
    name, text = ops.spec_text("in_kernel", "2sigmoid", has_dt_bias=True)
    assert name == "fla_gdn_gate_in_kernel_dt_bias_beta_2sigmoid"
    assert 'log_decay = "-exp(A_log) * softplus(g + dt_bias)"' in text
    assert 'beta = "2 * sigmoid(beta)"' in text
    assert ops.spec_module("log", "given") is ops.spec_module("log", "given")


def test_unsupported_options_raise(generator, device):
    x = on(device, make_inputs(generator, "log", "given", T=3))
    q, k, v, g, beta = x["q"], x["k"], x["v"], x["g"], x["beta"]
    chunk, recurrent = ops.chunk_gated_delta_rule, ops.fused_recurrent_gated_delta_rule
    cases = [
        (lambda: chunk(q, k, v, g, beta, state_v_first="yes"), "state_v_first must be True or False"),
        (lambda: chunk(q, k, v, g, beta, cp_context=object()), "cp_context must be what lrdsl.distributed.build_cp_context returns"),
        (lambda: chunk(q, k, v, g, beta, chunk_size=128), "chunk_size must be 16, 32 or 64, got 128"),
        (lambda: chunk(q, k, v, g, beta, head_first=False), "head_first was removed"),
        (lambda: chunk(q, k, v, g, beta, output_attentions=True), "option 'output_attentions' is not supported"),
        (lambda: recurrent(q, k, v, g, beta=beta, chunk_size=16), "option 'chunk_size' is not supported"),
        (lambda: chunk(q, k, v, g, beta, allow_neg_eigval=True), "allow_neg_eigval=True requires use_beta_sigmoid"),
        (lambda: chunk(q, k, v, g, beta, use_gate_in_kernel=True), "use_gate_in_kernel=True needs A_log"),
        (lambda: recurrent(q, k, v, None, beta=beta, use_gate_in_kernel=True, A_log=torch.zeros(2)), "needs g"),
        (lambda: recurrent(q, k, v, gk=torch.zeros(1, 3, 2, 16), beta=beta), "gk and gv .* are not supported"),
        (lambda: chunk(q, k, v, g, beta, state_v_first=True, transpose_state_layout=True), "not both"),
    ]
    for call, message in cases:
        with pytest.raises(ops.OptionError, match=message) as caught:
            call()
        assert "\n" not in str(caught.value)
    with pytest.raises(ValueError, match=r"initial_state must be \[N, HV, V, K\] = \[1, 2, 8, 16\]"):
        chunk(q, k, v, g, beta, initial_state=x["initial_state"], state_v_first=True)  # [N, HV, K, V] given
    with pytest.raises(ValueError, match=r"v must be \[B, T, HV, V\]"):
        chunk(q, k, v[:, :2], g, beta)


def transposed(state):
    return state.transpose(-1, -2).contiguous()


@pytest.mark.parametrize("deprecated_name", [False, True])
def test_chunk_state_v_first_against_the_oracle(generator, device, deprecated_name):
    """state_v_first=True: the initial state is read and the final state written [N, HV, V, K]
    by the kernels themselves; outputs, final state and every gradient (the initial state's in
    that layout too) against the oracle. FLA's deprecated transpose_state_layout is the same,
    with a warning."""
    gate, beta = "in_kernel_dt_bias", "sigmoid"
    tensors = make_inputs(generator, gate, beta, T=20, H=1, HV=2, K=16, V=8)
    tensors["initial_state"] = transposed(tensors["initial_state"])
    x = leaves(tensors, device)
    layout = {"transpose_state_layout": True} if deprecated_name else {"state_v_first": True}
    if deprecated_name:
        with pytest.warns(DeprecationWarning, match="transpose_state_layout"):
            o, ht = call_chunk(x, gate, beta, chunk_size=16, **layout)
    else:
        o, ht = call_chunk(x, gate, beta, chunk_size=16, **layout)
    assert ht.shape == (1, 2, 8, 16) and ht.is_contiguous()
    x_ref = leaves(tensors)
    x_ref_k_first = dict(x_ref, initial_state=x_ref["initial_state"].transpose(-1, -2))
    (o_ref, ht_ref), _ = oracle(x_ref_k_first, gate, beta, output_final_state=True, use_qk_l2norm_in_kernel=True)
    ht_ref = ht_ref.transpose(-1, -2)
    assert relative_error(o, o_ref) <= TOL
    assert relative_error(ht, ht_ref) <= TOL
    do = torch.randn(o.shape, generator=generator, dtype=torch.float64)
    dht = torch.randn(ht.shape, generator=generator, dtype=torch.float64)
    got = torch.autograd.grad((o, ht), list(x.values()), (do.to(device, torch.float32), dht.to(device, torch.float32)))
    expected = torch.autograd.grad((o_ref, ht_ref), list(x_ref.values()), (do, dht))
    for name, a, b in zip(x, got, expected):
        assert a.shape == b.shape, f"d{name}"
        assert relative_error(a, b) <= TOL, f"d{name}"


@pytest.mark.parametrize("gate", ["log", "none"])
def test_fused_recurrent_state_v_first_against_the_oracle(generator, device, gate):
    tensors = make_inputs(generator, gate, "given", B=2, T=5)
    tensors["initial_state"] = transposed(tensors["initial_state"])
    x = on(device, tensors)
    with torch.no_grad():
        o, ht = ops.fused_recurrent_gated_delta_rule(
            x["q"], x["k"], x["v"], g=x.get("g"), beta=x["beta"], initial_state=x["initial_state"],
            output_final_state=True, use_qk_l2norm_in_kernel=True, state_v_first=True)
    k_first = dict(tensors, initial_state=tensors["initial_state"].transpose(-1, -2))
    (o_ref, ht_ref), _ = oracle(k_first, gate, "given", output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert ht.shape == (2, 2, 8, 16)
    assert relative_error(o, o_ref) <= TOL
    assert relative_error(ht, ht_ref.transpose(-1, -2)) <= TOL


def test_A_log_in_any_shape_with_HV_elements(generator, device):
    """chunk_gated_delta_rule with A_log [1, 1, HV, 1] and dt_bias [HV, 1] (FLA reads both flat):
    outputs against the oracle, gradients in the shapes given."""
    tensors = make_inputs(generator, "in_kernel_dt_bias", "sigmoid")
    tensors["A_log"], tensors["dt_bias"] = tensors["A_log"].reshape(1, 1, 2, 1), tensors["dt_bias"].reshape(2, 1)
    x = leaves(tensors, device)
    o, ht = call_chunk(x, "in_kernel_dt_bias", "sigmoid", chunk_size=16)
    x_ref = leaves(tensors)
    flat = dict(x_ref, A_log=x_ref["A_log"].reshape(2), dt_bias=x_ref["dt_bias"].reshape(2))
    (o_ref, ht_ref), _ = oracle(flat, "in_kernel_dt_bias", "sigmoid", output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert relative_error(o, o_ref) <= TOL and relative_error(ht, ht_ref) <= TOL
    do = torch.randn(o.shape, generator=generator, dtype=torch.float64)
    got = torch.autograd.grad(o, [x["A_log"], x["dt_bias"]], do.to(device, torch.float32))
    expected = torch.autograd.grad(o_ref, [x_ref["A_log"], x_ref["dt_bias"]], do)
    for a, b in zip(got, expected):
        assert a.shape == b.shape and relative_error(a, b) <= TOL
