"""The benchmark harness (lrdsl.measure.bench) without a GPU and without fla-core: row building, the
correctness gate, FLA's keyword mapping, ratios, JSON and the plot, at tiny shapes on the CPU.

fla-core is replaced by a fake package whose functions have fla-core 0.6.0's exact signatures,
compute what the real ones compute (through the float64 oracle) and record how they were called.
"""
from __future__ import annotations

import functools
import importlib.util
import json
import os
import types
from dataclasses import replace

import pytest
import torch

from lrdsl.measure import bench
from lrdsl import cli, reference
from lrdsl.errors import LrdslError
from lrdsl.verification.workloads import Shape

from conftest import HAS_GPU, ROOT
from helpers import module, recurrence

# Comba as fla-core 0.6.0's comba kernels compute it: the state read along p before the token's
# decay, i.e. along p exp(-g) after it (not specs/comba.toml's, which reads along p after it)
COMBA_AS_FLA = """
name = "comba_fla"
[recurrence]
update = "delta"
gate = "scalar"
[inputs]
p = "token_key"
beta = "token"
g = "token"
[formulas]
log_decay = "g"
beta = "beta"
delta_read = "p * exp(-g)"
"""


@functools.lru_cache(maxsize=None)
def comba_as_fla():
    from lrdsl.passes.pipeline import run_pipeline
    from lrdsl.spec import parse_spec

    return run_pipeline(parse_spec(COMBA_AS_FLA, "comba_fla"), until="recurrence")["recurrence"]


def any_recurrence(name):
    """A shipped spec's recurrence, or "comba_fla": COMBA_AS_FLA's."""
    return comba_as_fla() if name == "comba_fla" else recurrence(name)
from test_cli import _script_module, assert_one_line_error, run

TINY_TRAINING = Shape(2, 20, 1, 2, 16, 16)
TINY_DECODE = Shape(2, 1, 1, 2, 16, 16)


# ---------------------------------------------------------------------------------------------
# A fake fla-core: fla-core 0.6.0's signatures, the oracle's numbers, a record of every call
# ---------------------------------------------------------------------------------------------


class FakeFla:
    """Modules fla.ops.{gated_delta_rule, delta_rule, simple_gla, kda, gla, rwkv7}, with fla-core's
    parameter names; `calls` records (function, positional args, keyword args) of every call."""

    def __init__(self):
        self.calls = []
        record = self._record
        gdn, deltanet, simple_gla = recurrence("gdn"), recurrence("deltanet"), recurrence("simple_gla")
        kda, gla, rwkv7 = recurrence("kda"), recurrence("gla"), recurrence("rwkv7")
        comba, gdn2, deltaproduct = comba_as_fla(), recurrence("gdn2"), recurrence("gated_deltaproduct")

        def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                                   use_qk_l2norm_in_kernel=False, use_beta_sigmoid_in_kernel=False,
                                   allow_neg_eigval=False, state_v_first=False, cu_seqlens=None,
                                   cu_seqlens_cpu=None, chunk_indices=None, cp_context=None, **kwargs):
            record("chunk_gated_delta_rule", locals())
            # fla-core 0.6.0 reads the in-kernel gate's keywords out of **kwargs
            g, beta = _in_kernel_gate(g, beta, kwargs.get("use_gate_in_kernel", False), kwargs.get("A_log"),
                                      kwargs.get("dt_bias"), use_beta_sigmoid_in_kernel)
            return _as_fla(gdn, q, k, v, [g, beta], scale, initial_state, output_final_state, use_qk_l2norm_in_kernel)

        def fused_recurrent_gated_delta_rule(q, k, v, g=None, gk=None, gv=None, beta=None, scale=None,
                                             initial_state=None, output_final_state=False,
                                             use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, A_log=None,
                                             dt_bias=None, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
                                             state_v_first=False, cu_seqlens=None, **kwargs):
            record("fused_recurrent_gated_delta_rule", locals())
            if gk is not None or gv is not None:
                raise ValueError("this fake has no key- or value-channel gates (gk, gv)")
            g, beta = _in_kernel_gate(g, beta, use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel)
            return _as_fla(gdn, q, k, v, [g, beta], scale, initial_state, output_final_state, use_qk_l2norm_in_kernel)

        def chunk_delta_rule(q, k, v, beta, scale=None, initial_state=None, output_final_state=False,
                             use_qk_l2norm_in_kernel=False, cu_seqlens=None, cu_seqlens_cpu=None, **kwargs):
            record("chunk_delta_rule", locals())
            return _as_fla(deltanet, q, k, v, [beta], scale, initial_state, output_final_state, use_qk_l2norm_in_kernel)

        def fused_recurrent_delta_rule(q, k, v, beta=None, scale=None, initial_state=None, output_final_state=False,
                                       use_qk_l2norm_in_kernel=False, cu_seqlens=None):
            record("fused_recurrent_delta_rule", locals())
            return _as_fla(deltanet, q, k, v, [beta], scale, initial_state, output_final_state, use_qk_l2norm_in_kernel)

        def chunk_simple_gla(q, k, v, g=None, g_gamma=None, scale=None, initial_state=None, output_final_state=False,
                             state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None, **kwargs):
            record("chunk_simple_gla", locals())
            return _as_fla(simple_gla, q, k, v, [g], scale, initial_state, output_final_state, False)

        def fused_recurrent_simple_gla(q, k, v, g=None, g_gamma=None, scale=None, initial_state=None,
                                       output_final_state=False, reverse=False, state_v_first=False, cu_seqlens=None,
                                       **kwargs):
            record("fused_recurrent_simple_gla", locals())
            return _as_fla(simple_gla, q, k, v, [g], scale, initial_state, output_final_state, False)

        def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                      use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, cu_seqlens=None, cu_seqlens_cpu=None,
                      chunk_indices=None, **kwargs):
            record("chunk_kda", locals())
            return _as_fla(kda, q, k, v, [g, beta], scale, initial_state, output_final_state, use_qk_l2norm_in_kernel)

        def fused_recurrent_kda(q, k, v, g, beta, A_log=None, dt_bias=None, scale=None, initial_state=None,
                                output_final_state=False, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
                                use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, lower_bound=None,
                                state_v_first=False, cu_seqlens=None, **kwargs):
            record("fused_recurrent_kda", locals())
            return _as_fla(kda, q, k, v, [g, beta], scale, initial_state, output_final_state, use_qk_l2norm_in_kernel)

        def chunk_gla(q, k, v, g=None, g_cumsum=None, scale=None, initial_state=None, output_final_state=False,
                      cu_seqlens=None, **kwargs):
            record("chunk_gla", locals())
            return _as_fla(gla, q, k, v, [g], scale, initial_state, output_final_state, False)

        def fused_recurrent_gla(q, k, v, gk=None, gv=None, scale=None, initial_state=None, output_final_state=False,
                                reverse=False, state_v_first=False, cu_seqlens=None, **kwargs):
            record("fused_recurrent_gla", locals())
            if gv is not None:
                raise ValueError("this fake has no value-channel gate (gv)")
            return _as_fla(gla, q, k, v, [gk], scale, initial_state, output_final_state, False)

        def chunk_rwkv7(r, w, k, v, a, b, scale=1.0, initial_state=None, output_final_state=False, cu_seqlens=None,
                        cu_seqlens_cpu=None, safe_gate=False, chunk_size=None, disable_recompute=False,
                        cp_context=None, lower_bound=None, **kwargs):
            record("chunk_rwkv7", locals())
            return _as_fla(rwkv7, r, k, v, [w, a, b], scale, initial_state, output_final_state, False)

        def fused_recurrent_rwkv7(r, w, k, v, a, b, scale=None, initial_state=None, output_final_state=True,
                                  cu_seqlens=None, **kwargs):
            record("fused_recurrent_rwkv7", locals())
            return _as_fla(rwkv7, r, k, v, [w, a, b], scale, initial_state, output_final_state, False)

        # fla-core 0.6.0's comba, gdn2 and gated_delta_product signatures (fused_recurrent_comba
        # takes p third, chunk_comba fourth; FLA's gated_delta_product has no recurrent form)
        def chunk_comba(q, k, v, p, g, beta=None, scale=None, initial_state=None, output_final_state=False,
                        use_qk_l2norm_in_kernel=False, cu_seqlens=None, cu_seqlens_cpu=None):
            record("chunk_comba", locals())
            return _as_fla(comba, q, k, v, [p, beta, g], scale, initial_state, output_final_state, use_qk_l2norm_in_kernel)

        def fused_recurrent_comba(q, k, p, v, g, beta=None, scale=None, initial_state=None, output_final_state=False,
                                  use_qk_l2norm_in_kernel=False, cu_seqlens=None):
            record("fused_recurrent_comba", locals())
            return _as_fla(comba, q, k, v, [p, beta, g], scale, initial_state, output_final_state, use_qk_l2norm_in_kernel)

        def chunk_gdn2(q, k, v, g, b, w, scale=None, initial_state=None, output_final_state=False,
                       use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, cu_seqlens=None, cu_seqlens_cpu=None,
                       safe_gate=False, lower_bound=None, disable_recompute=False, return_intermediate_states=False,
                       state_v_first=False, **kwargs):
            record("chunk_gdn2", locals())
            return _as_fla(gdn2, q, k, v, [g, b, w], scale, initial_state, output_final_state, use_qk_l2norm_in_kernel)

        def fused_recurrent_gdn2(q, k, v, g, b, w, A_log=None, dt_bias=None, scale=None, initial_state=None,
                                 output_final_state=False, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
                                 lower_bound=None, state_v_first=False, cu_seqlens=None, **kwargs):
            record("fused_recurrent_gdn2", locals())
            return _as_fla(gdn2, q, k, v, [g, b, w], scale, initial_state, output_final_state, use_qk_l2norm_in_kernel)

        def chunk_gated_delta_product(q, k, v, g, beta, num_householder, scale=None, initial_state=None,
                                      output_final_state=False, use_qk_l2norm_in_kernel=False, cu_seqlens=None,
                                      cu_seqlens_cpu=None, cp_context=None):
            record("chunk_gated_delta_product", locals())
            if num_householder != deltaproduct.steps_per_token:
                raise ValueError(f"this fake computes {deltaproduct.steps_per_token} steps per token")
            return _as_fla(deltaproduct, q, k, v, [g, beta], scale, initial_state, output_final_state,
                           use_qk_l2norm_in_kernel)

        self.modules = {}
        for package, functions in {
            "fla.ops.gated_delta_rule": (chunk_gated_delta_rule, fused_recurrent_gated_delta_rule),
            "fla.ops.delta_rule": (chunk_delta_rule, fused_recurrent_delta_rule),
            "fla.ops.simple_gla": (chunk_simple_gla, fused_recurrent_simple_gla),
            "fla.ops.kda": (chunk_kda, fused_recurrent_kda),
            "fla.ops.gla": (chunk_gla, fused_recurrent_gla),
            "fla.ops.rwkv7": (chunk_rwkv7, fused_recurrent_rwkv7),
            "fla.ops.comba": (chunk_comba, fused_recurrent_comba),
            "fla.ops.gdn2": (chunk_gdn2, fused_recurrent_gdn2),
            "fla.ops.gated_delta_product": (chunk_gated_delta_product,),
        }.items():
            fake = types.ModuleType(package)
            for function in functions:
                function.__module__ = f"{package}.{'chunk' if function.__name__.startswith('chunk') else 'fused_recurrent'}"
                setattr(fake, function.__name__, function)
            self.modules[package] = fake

    def _record(self, name, local_variables):
        self.calls.append((name, dict(local_variables)))

    def importer(self, name):
        if name not in self.modules:
            raise ModuleNotFoundError(f"No module named {name!r} (fake fla-core)")
        return self.modules[name]


def _in_kernel_gate(g, beta, use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel):
    """FLA's in-kernel forms (its docstring): g = -exp(A_log) softplus(g + dt_bias), beta = sigmoid(beta)."""
    if use_gate_in_kernel:
        g = -A_log.double().exp() * torch.nn.functional.softplus(g.double() + dt_bias.double())
    if use_beta_sigmoid_in_kernel:
        beta = beta.double().sigmoid()
    return g, beta


def _as_fla(rec, q, k, v, extras, scale, initial_state, output_final_state, l2norm):
    """What an FLA function returns: o in v's dtype, an fp32 final state (or None)."""
    o, final_state = reference.run(rec, q, k, v, *extras, scale=scale, initial_state=initial_state,
                                   output_final_state=output_final_state, use_qk_l2norm_in_kernel=l2norm)
    return o.to(v.dtype), None if final_state is None else final_state.float()


@pytest.fixture
def fake_fla():
    return FakeFla()


def tiny_call(rec, shape, generator, l2norm=True, dtype=torch.float32):
    return bench.make_call(rec, shape, dtype, "cpu", generator, l2norm)


# ---------------------------------------------------------------------------------------------
# Keyword mapping
# ---------------------------------------------------------------------------------------------


# Each spec input's FLA parameter (fused_recurrent_gla names its key-channel gate gk; RWKV-7's
# functions take w, and a, b for the low rank; gdn_qwen35's raw projections go to g and beta with
# the in-kernel gate and beta switched on)
EXPECTED_PARAMETERS = {
    "gdn": {"g": "g", "beta": "beta"},
    "gdn_qwen35": {"a": "g", "b": "beta", "A_log": "A_log", "dt_bias": "dt_bias"},
    "deltanet": {"beta": "beta"},
    "simple_gla": {"g": "g"},
    "kda": {"g": "g", "beta": "beta"},
    "gla": {"g": "g"},
    "rwkv7": {"w": "w", "a": "a", "b": "b"},
    # comba's read vector p goes to p (fused_recurrent_comba takes it third, chunk_comba fourth);
    # gdn2's b and w, which its functions multiply into b * k and w * v themselves, to b and w
    "comba_fla": {"p": "p", "beta": "beta", "g": "g"},
    "gdn2": {"g": "g", "b": "b", "w": "w"},
    "gated_deltaproduct": {"g": "g", "beta": "beta"},
}
# FLA ships no recurrent form of these (no decode-row peer)
NO_FLA_RECURRENT = {"gated_deltaproduct"}


@pytest.mark.parametrize("name", list(EXPECTED_PARAMETERS))
@pytest.mark.parametrize("decode", [False, True], ids=["chunk", "recurrent"])
def test_fla_functions_are_called_by_keyword_with_each_input_by_role(name, decode, fake_fla, generator):
    rec = any_recurrence(name)
    baseline = bench.fla_baseline(rec)
    if decode and name in NO_FLA_RECURRENT:
        assert baseline.recurrent is None and bench.resolve_fla(baseline, fake_fla.importer)[1] is None
        return
    fla_chunk, fla_recurrent = bench.resolve_fla(baseline, fake_fla.importer)
    function, fla_function = (baseline.recurrent, fla_recurrent) if decode else (baseline.chunk, fla_chunk)
    l2norm = function.l2norm
    assert l2norm == (name not in ("simple_gla", "gla", "rwkv7"))  # FLA's (simple) GLA, RWKV-7: no in-kernel L2 norm
    contender = bench.fla_contender(rec, function, fla_function, l2norm, fake_fla.importer)
    assert contender.problem is None
    call = tiny_call(rec, TINY_DECODE if decode else TINY_TRAINING, generator, l2norm)

    o, final_state = contender.forward(call)

    (called, arguments), = fake_fla.calls
    assert called == function.name
    q, k, v, *extras = call.tensors
    query = "r" if name == "rwkv7" else "q"  # RWKV-7's functions call q r
    assert arguments[query] is q and arguments["k"] is k and arguments["v"] is v
    expected = dict(EXPECTED_PARAMETERS[name])
    if called == "fused_recurrent_gla":
        expected["g"] = "gk"
    passed = {**arguments, **arguments.get("kwargs", {})}
    for inp, tensor in zip(rec.inputs, extras):
        assert passed[expected[inp.name]] is tensor, f"{inp.name} not passed as {expected[inp.name]}"
    if "gk" in arguments and called != "fused_recurrent_gla":  # beta must not land in gk (5th parameter)
        assert arguments["gk"] is None and arguments["gv"] is None
    assert arguments["initial_state"] is call.initial_state and arguments["output_final_state"] is True
    assert arguments["scale"] == call.scale
    assert arguments["use_qk_l2norm_in_kernel"] is l2norm if "use_qk_l2norm_in_kernel" in arguments else not l2norm
    in_kernel = name == "gdn_qwen35"
    assert passed.get("use_gate_in_kernel", False) is in_kernel and passed.get("use_beta_sigmoid_in_kernel", False) is in_kernel
    # nothing fell into **kwargs but what fla-core 0.6.0's chunk_gated_delta_rule reads from there
    assert set(arguments.get("kwargs", {})) == ({"use_gate_in_kernel", "A_log", "dt_bias"} if in_kernel and not decode else set())
    assert arguments.get("num_householder", 1) == rec.steps_per_token

    ref_o, ref_state = reference.run(rec, *call.tensors, scale=call.scale, initial_state=call.initial_state,
                                     output_final_state=True, use_qk_l2norm_in_kernel=l2norm)
    assert bench.relative_error(o, ref_o) <= 2e-3
    assert bench.relative_error(final_state, ref_state) <= 2e-3
    assert bench.fla_dispatch_path(fla_function, bench.fla_keywords(rec, function, call), fake_fla.importer) == "fla-triton"


def test_an_fla_function_without_a_needed_parameter_is_a_failed_row_not_a_silent_call(fake_fla, generator):
    rec = recurrence("gdn")
    baseline = bench.fla_baseline(rec)

    def chunk_gated_delta_rule(q, k, v, g, scale=None, initial_state=None, output_final_state=False, **kwargs):
        raise AssertionError("must not be called: beta would vanish into **kwargs")

    contender = bench.fla_contender(rec, baseline.chunk, chunk_gated_delta_rule, l2norm=False)
    assert contender.problem == ("fla-core's chunk_gated_delta_rule has no parameter beta "
                                 "(this harness expects fla-core 0.6.0)")
    shape = Shape(1, 6, 1, 1, 8, 8)
    call = tiny_call(rec, shape, generator, l2norm=False)
    oracle = bench.oracle_outputs(rec, call, ["q", "k", "v", "g", "beta"], gradients=False)
    rows = bench.run_group("gdn", rec, [contender], call, shape, bench.FORWARD, oracle, bench.measure_once,
                           (1, 6), 2e-3)
    assert [(r.status, r.reason, r.ms, r.ratios) for r in rows] == [("FAILED", contender.problem, None, {})]


def test_comba_as_fla_computes_it_reads_the_state_before_the_decay(generator):
    """COMBA_AS_FLA's recurrence (read along p exp(-g) after the decay) is, in float64 token by
    token, u_t = beta_t (v_t - S_{t-1}^T p_t), S_t = exp(g_t) S_{t-1} + k_t u_t^T: what fla-core
    0.6.0's comba kernels compute (checked on the CPU against its naive chunk_comba, 3e-16, and
    its fused_recurrent_comba under Triton's interpreter, 1.3e-7); specs/comba.toml's differs."""
    B, T, H, K, V = 1, 40, 2, 8, 6
    d = torch.float64
    q, k, p = (torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=generator, dtype=d), dim=-1)
               for _ in range(3))
    v = torch.randn(B, T, H, V, generator=generator, dtype=d)
    beta, g = torch.rand(B, T, H, generator=generator, dtype=d), -torch.rand(B, T, H, generator=generator, dtype=d)
    S, rows = torch.zeros(B, H, K, V, dtype=d), []
    for t in range(T):
        u = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhkv,bhk->bhv", S, p[:, t]))
        S = g[:, t].exp()[..., None, None] * S + torch.einsum("bhk,bhv->bhkv", k[:, t], u)
        rows.append(K ** -0.5 * torch.einsum("bhkv,bhk->bhv", S, q[:, t]))
    before_decay = torch.stack(rows, dim=1)
    o, _ = reference.run(comba_as_fla(), q, k, v, p, beta, g)
    assert torch.allclose(o, before_decay, rtol=1e-12, atol=1e-12)
    o, _ = reference.run(recurrence("comba"), q, k, v, p, beta, g)
    assert (o - before_decay).norm() > 1e-2 * before_decay.norm()


def test_specs_without_an_fla_counterpart_are_recognised():
    assert bench.fla_baseline(recurrence("linear_attn")) is None
    assert bench.fla_baseline(recurrence("kda_neg_eigval")) is None  # beta = 2 sigmoid(b): FLA takes beta
    assert bench.fla_baseline(recurrence("kda_fused_gate")) is None
    # gdn's recurrence with two steps per token is chunk_gated_delta_product's (k of T * 2 rows),
    # never chunk_gated_delta_rule's; and gdn's is never the product's
    assert bench.fla_baseline(recurrence("gated_deltaproduct")).chunk.name == "chunk_gated_delta_product"
    assert bench.fla_baseline(recurrence("gdn")).chunk.name == "chunk_gated_delta_rule"
    # comba's delta rule reads along p: not chunk_gated_delta_rule's (which has no p), and after the
    # decay, not FLA's comba kernels' (which read before it: COMBA_AS_FLA is their recurrence)
    assert bench.fla_baseline(recurrence("comba")) is None
    assert bench.fla_baseline(comba_as_fla()).chunk.name == "chunk_comba"
    assert bench.resolve_fla(bench.fla_baseline(recurrence("gdn")), FakeFla().importer) is not None
    assert bench.resolve_fla(bench.fla_baseline(recurrence("gdn")), _no_fla) is None


def test_gdn_qwen35_is_fla_gated_delta_rule_with_its_gate_and_beta_in_kernel():
    """gdn_qwen35's formulas are FLA's in-kernel ones with its inputs renamed (a -> g, b -> beta,
    the per-head A_log and dt_bias to theirs); a spec whose formulas differ is not matched, and
    one that swaps A_log and dt_bias in its formula is matched with them swapped (by position in
    the formula, never by name)."""
    import sympy

    rec = recurrence("gdn_qwen35")
    baseline = bench.fla_baseline(rec)
    assert (baseline.chunk.name, baseline.recurrent.name) == ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule")
    assert bench.input_parameters(rec, baseline.chunk) == EXPECTED_PARAMETERS["gdn_qwen35"]
    assert baseline.chunk.options == {"use_gate_in_kernel": True, "use_beta_sigmoid_in_kernel": True}
    assert baseline.direct == ()  # FlashQLA takes the decay and beta themselves
    a, b, A_log, dt_bias = sympy.symbols("a b A_log dt_bias")
    from lrdsl.ir.formula import sigmoid, softplus

    swapped = replace(rec, log_decay=-sympy.exp(dt_bias) * softplus(a + A_log))
    assert bench.input_parameters(swapped, baseline.chunk) == {"a": "g", "b": "beta", "A_log": "dt_bias", "dt_bias": "A_log"}
    for other in (replace(rec, beta=2 * sigmoid(b)), replace(rec, log_decay=-sympy.exp(A_log) * softplus(a)),
                  replace(rec, log_decay=-sympy.exp(A_log) * softplus(a + dt_bias) * 0.5)):
        assert bench.fla_baseline(other) is None, other


def _no_fla(name):
    raise ModuleNotFoundError(f"No module named {name!r}")


# ---------------------------------------------------------------------------------------------
# Which FLA path runs
# ---------------------------------------------------------------------------------------------


class _Backend:
    """A backend as fla-core 0.6.0's dispatcher sees one; its switches are read at every call
    (BaseBackend.is_enabled: FLA_<BACKEND_TYPE> switches it on whatever env_var says)."""

    def __init__(self, backend_type, priority, accepts, available=True, env_var=None, implementation=None):
        """accepts: True, False, or a function of the call's keywords (its verifier)."""
        self.backend_type, self.priority, self.accepts, self.available = backend_type, priority, accepts, available
        self.env_var, self.implementation = env_var, implementation
        self.verified_with = None

    def is_available(self):
        return self.available

    def is_enabled(self):
        if self.env_var is None:
            return True
        if os.environ.get(f"FLA_{self.backend_type.upper()}", "0") != "0":
            return True
        return os.environ.get(self.env_var, "1") != "0"

    def get_implementation(self, function_name):
        return getattr(self, function_name, None)

    def verify(self, function_name, **keywords):
        self.verified_with = keywords
        accepted = self.accepts(**keywords) if callable(self.accepts) else self.accepts
        return accepted, None if accepted else "refused"

    def chunk_gated_delta_rule(self, **keywords):
        if self.implementation is None:
            raise AssertionError("the path is found without running anything")
        return self.implementation(**keywords)


def _fake_backends(*backends):
    registry = types.SimpleNamespace(operation_name="gated_delta_rule", _backends={b.backend_type: b for b in backends})
    other = types.SimpleNamespace(operation_name="delta_rule", _backends={"x": _Backend("x", 0, True)})
    return types.ModuleType("fla.backends"), registry, other


@pytest.mark.parametrize("accepts, available, expected", [(True, True, "flashqla"), (False, True, "fla-triton"),
                                                          (True, False, "fla-triton")])
def test_dispatch_path_asks_fla_registry_as_its_dispatcher_does(accepts, available, expected, fake_fla, generator):
    rec = recurrence("gdn")
    baseline = bench.fla_baseline(rec)
    fla_chunk, _ = bench.resolve_fla(baseline, fake_fla.importer)
    flash_qla = _Backend("flash_qla", 3, accepts, available)
    backends, registry, other = _fake_backends(flash_qla)
    backends._DISPATCH_DISABLED = False
    backends._function_registries = {}
    backends._operation_registries = {"gated_delta_rule": registry, "delta_rule": other}
    importer = {**fake_fla.modules, "fla.backends": backends}.__getitem__
    call = tiny_call(rec, TINY_TRAINING, generator)
    keywords = bench.fla_keywords(rec, baseline.chunk, call)

    assert bench.fla_dispatch_path(fla_chunk, keywords, importer) == expected
    if available:
        assert flash_qla.verified_with["beta"] is keywords["beta"]  # the verifier saw the real call's arguments


def _registries(importer_modules, *backends):
    """A fake fla.backends holding `backends` for the gated_delta_rule operation."""
    backends_module, registry, other = _fake_backends(*backends)
    backends_module._DISPATCH_DISABLED = False
    backends_module._function_registries = {}
    backends_module._operation_registries = {"gated_delta_rule": registry, "delta_rule": other}
    return {**importer_modules, "fla.backends": backends_module}


def test_an_fla_that_ignores_the_in_kernel_gate_keywords_fails_the_gate():
    """chunk_gated_delta_rule's in-kernel gate keywords pass through its **kwargs: an FLA that
    dropped them would take a and b for the decay and beta themselves. The oracle gate fails that
    row (no ratio) instead of timing another recurrence."""
    rec = recurrence("gdn_qwen35")
    gdn = recurrence("gdn")

    def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                               use_qk_l2norm_in_kernel=False, use_beta_sigmoid_in_kernel=False, **kwargs):
        return _as_fla(gdn, q, k, v, [g, beta], scale, initial_state, output_final_state, use_qk_l2norm_in_kernel)

    module = types.ModuleType("fla.ops.gated_delta_rule")
    module.chunk_gated_delta_rule = chunk_gated_delta_rule
    module.fused_recurrent_gated_delta_rule = FakeFla().modules["fla.ops.gated_delta_rule"].fused_recurrent_gated_delta_rule
    importer = {"fla.ops.gated_delta_rule": module}.get
    rows = bench.bench([bench.SpecUnderTest("gdn_qwen35", rec, _oracle_module(rec))], [Shape(1, 6, 1, 2, 8, 8)],
                       device="cpu", dtype=torch.float32, seed=int(torch.seed() % 2**31),
                       importer=lambda name: importer(name) or _no_fla(name))
    fla_row, ours = rows
    assert fla_row.impl == "fla-triton" and not fla_row.ok and "differs from the float64 oracle" in fla_row.reason
    assert ours.ok and ours.ratios == {}


def test_triton_switches_turn_off_each_backend_fla_would_pick_and_restore_the_environment(fake_fla, generator,
                                                                                        monkeypatch):
    monkeypatch.delenv("FLA_FLASH_QLA", raising=False)
    monkeypatch.setenv("FLA_OTHER", "1")  # FLA_<TYPE> = 1 switches a backend on over its own variable
    rec = recurrence("gdn")
    baseline = bench.fla_baseline(rec)
    fla_chunk, _ = bench.resolve_fla(baseline, fake_fla.importer)
    flash_qla = _Backend("flash_qla", 3, True, env_var="FLA_FLASH_QLA")
    other = _Backend("other", 4, True, env_var="OTHER_SWITCH")
    importer = _registries(fake_fla.modules, flash_qla, other).__getitem__
    keywords = bench.fla_keywords(rec, baseline.chunk, tiny_call(rec, TINY_TRAINING, generator))

    switches = bench.triton_switches(fla_chunk, keywords, importer)

    assert switches == {"FLA_FLASH_QLA": "0", "OTHER_SWITCH": "0", "FLA_OTHER": "0"}
    assert bench.fla_dispatch_path(fla_chunk, keywords, importer) == "flashqla"
    with bench.environment(switches):
        assert bench.fla_dispatch_path(fla_chunk, keywords, importer) == "fla-triton"
    assert "FLA_FLASH_QLA" not in os.environ and os.environ["FLA_OTHER"] == "1" and "OTHER_SWITCH" not in os.environ
    stuck = _Backend("ascend", 0, True)  # no environment variable switches it off
    with pytest.raises(LrdslError, match="picks its ascend backend for chunk_gated_delta_rule, which no environment"):
        bench.triton_switches(fla_chunk, keywords, _registries(fake_fla.modules, stuck).__getitem__)


class FakeFlashQla:
    """A module flash_qla with FlashQLA 0.1.3's chunk_gated_delta_rule signature, computing
    through the oracle; `calls` records each call's keywords."""

    def __init__(self):
        self.calls = []
        self.through_fla = 0  # calls FLA's backend made
        gdn = recurrence("gdn")

        def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                                   use_qk_l2norm_in_kernel=False, cu_seqlens=None, head_first=False,
                                   state_v_first=False, auto_cp=True, enable_fwd_cp_cache=True, cp_context=None,
                                   force_intra_cp=False):
            self.calls.append(dict(locals()))
            return _as_fla(gdn, q, k, v, [g, beta], scale, initial_state, output_final_state, use_qk_l2norm_in_kernel)

        self.module = types.ModuleType("flash_qla")
        self.module.chunk_gated_delta_rule = chunk_gated_delta_rule


def _dispatching_fla(fake_fla, flash_qla):
    """fake_fla whose chunk_gated_delta_rule dispatches as fla-core 0.6.0's does: to a FlashQLA
    backend (switched off by FLA_FLASH_QLA=0) that calls flash_qla as FLA's backend does, else to
    its own kernels. Returns (importer, runs: which of the two each call ran)."""
    runs = []
    triton_kernels = fake_fla.modules["fla.ops.gated_delta_rule"].chunk_gated_delta_rule

    def through_flash_qla(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                          use_qk_l2norm_in_kernel=False, state_v_first=False, cu_seqlens=None, **kwargs):
        flash_qla.through_fla += 1
        return flash_qla.module.chunk_gated_delta_rule(
            q=q, k=k, v=v, g=g, beta=beta, scale=scale, initial_state=initial_state,
            output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
            state_v_first=state_v_first, cu_seqlens=cu_seqlens, auto_cp=True)

    def verifier(q, use_beta_sigmoid_in_kernel=False, **keywords):  # what FlashQLABackend's refuses, in short
        return (q.dtype in (torch.bfloat16, torch.float16) and q.shape[-1] == 128
                and not keywords.get("use_gate_in_kernel") and not use_beta_sigmoid_in_kernel)

    backend = _Backend("flash_qla", 3, verifier, env_var="FLA_FLASH_QLA", implementation=through_flash_qla)

    @functools.wraps(triton_kernels)
    def chunk_gated_delta_rule(**keywords):
        if backend.is_available() and backend.is_enabled() and backend.verify("chunk_gated_delta_rule", **keywords)[0]:
            runs.append("flashqla")
            return backend.chunk_gated_delta_rule(**keywords)
        runs.append("fla-triton")
        return triton_kernels(**keywords)

    package = types.ModuleType("fla.ops.gated_delta_rule")
    package.chunk_gated_delta_rule = chunk_gated_delta_rule
    package.fused_recurrent_gated_delta_rule = fake_fla.modules["fla.ops.gated_delta_rule"].fused_recurrent_gated_delta_rule
    modules = _registries({**fake_fla.modules, "fla.ops.gated_delta_rule": package, "flash_qla": flash_qla.module}, backend)

    def importer(name):
        if name not in modules:
            raise ModuleNotFoundError(f"No module named {name!r}")
        return modules[name]

    return importer, runs


def _oracle_module(rec):
    """A stand-in for a generated module: chunk and recurrent computed by the oracle."""

    def oracle_kernel(q, k, v, *extras, scale=None, initial_state=None, output_final_state=False,
                      use_qk_l2norm_in_kernel=False, plan=None, chunk_size=None):
        o, final_state = reference.run(rec, q, k, v, *extras, scale=scale, initial_state=initial_state,
                                       output_final_state=output_final_state,
                                       use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
        return o.to(v.dtype), final_state.float()

    return types.SimpleNamespace(chunk=oracle_kernel, recurrent=oracle_kernel, DEFAULT_CHUNK_PLAN="split")


PEER_SHAPE = Shape(1, 12, 1, 2, 128, 128)  # FlashQLA's head dims


def test_each_peer_is_a_column_of_its_own_gated_and_given_a_ratio(monkeypatch):
    """gdn where FLA dispatches to FlashQLA: FLA's Triton kernels (FlashQLA switched off around
    every call of that column, its backward and the oracle prefix's re-run included), FLA's
    dispatch (FlashQLA), FlashQLA called directly with its own keywords, then lrdsl with a ratio
    to each."""
    monkeypatch.delenv("FLA_FLASH_QLA", raising=False)
    fake, flash_qla = FakeFla(), FakeFlashQla()
    importer, runs = _dispatching_fla(fake, flash_qla)
    rec = recurrence("gdn")
    seed = int(torch.seed() % 2**31)
    print(f"[seed {seed}]")
    rows = bench.bench([bench.SpecUnderTest("gdn", rec, _oracle_module(rec))], [PEER_SHAPE], backward=True, device="cpu",
                       dtype=torch.bfloat16, seed=seed, importer=importer, oracle_tokens=8)

    columns = [("fla-triton", "chunk_gated_delta_rule", "fla-triton"), ("flashqla", "chunk_gated_delta_rule", "flashqla"),
               ("flashqla-direct", "flash_qla.chunk_gated_delta_rule", "flashqla"), ("lrdsl", "chunk[split]", "lrdsl")]
    assert [(r.mode, r.impl, r.kernel, r.path) for r in rows] == [(m, *c) for m in ("fwd", "fwd+bwd") for c in columns]
    for r in rows:
        assert r.ok and r.err_vs_oracle <= 8e-3 and r.diff_vs_other <= 8e-3, r
    for ours in (r for r in rows if r.impl == "lrdsl"):
        peers = [r for r in rows if r.mode == ours.mode and r.impl != "lrdsl"]
        assert ours.ratios == {p.impl: pytest.approx(p.ms / ours.ms) for p in peers}
        assert all(not p.ratios for p in peers)
    # per mode: the Triton column's timed call and prefix re-run, then the flashqla column's
    assert runs == ["fla-triton", "fla-triton", "flashqla", "flashqla"] * 2
    assert "FLA_FLASH_QLA" not in os.environ
    # FlashQLA ran 8 times: 4 through FLA's backend, 4 called directly, each with these options
    assert len(flash_qla.calls) == 8 and flash_qla.through_fla == 4
    options = dict(output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=None, auto_cp=True)
    assert all(all(c[k] == v for k, v in options.items()) for c in flash_qla.calls)
    summary = bench.ratio_summary(rows)[("gdn", "1x12x1x2")]
    assert set(summary["fwd"]) == {"fla-triton", "flashqla", "flashqla-direct"}
    text = bench.format_summary(rows)
    assert "fwd+bwd flashqla-direct" in text and f"{rows[3].ratios['flashqla']:.2f}" in text
    assert "fla-triton " in bench.format_row(rows[3]) and "flashqla-direct " in bench.format_row(rows[3])


def test_flashqla_columns_only_where_they_apply(monkeypatch):
    """No FlashQLA column at K != 128, in fp32, at decode shapes, for gdn_qwen35 (FlashQLA takes
    the decay and beta themselves; FLA's dispatcher refuses its in-kernel gate), or where
    flash_qla does not import; the Triton column is always there."""
    monkeypatch.delenv("FLA_FLASH_QLA", raising=False)
    fake, flash_qla = FakeFla(), FakeFlashQla()
    importer, _ = _dispatching_fla(fake, flash_qla)
    gdn = bench.fla_baseline(recurrence("gdn"))
    assert [c.impl for c in bench.direct_peers(recurrence("gdn"), gdn, PEER_SHAPE, torch.bfloat16, True, importer)] == \
        ["flashqla-direct"]
    assert bench.direct_peers(recurrence("gdn"), gdn, Shape(1, 12, 1, 2, 64, 128), torch.bfloat16, True, importer) == []
    assert bench.direct_peers(recurrence("gdn"), gdn, PEER_SHAPE, torch.float32, True, importer) == []
    assert bench.direct_peers(recurrence("gdn"), gdn, Shape(4, 1, 1, 2, 128, 128), torch.bfloat16, True, importer) == []
    qwen = recurrence("gdn_qwen35")
    assert bench.direct_peers(qwen, bench.fla_baseline(qwen), PEER_SHAPE, torch.bfloat16, True, importer) == []
    notes = []

    def refuses(name):
        if name == "flash_qla":
            raise ValueError("FlashQLA now support sm90, sm100, sm103, sm120 and sm121 only")
        return importer(name)

    assert bench.direct_peers(recurrence("gdn"), gdn, PEER_SHAPE, torch.bfloat16, True, refuses, notes.append) == []
    assert notes == ["flash_qla does not import (ValueError: FlashQLA now support sm90, sm100, sm103, sm120 and sm121 "
                     "only): no flashqla-direct column"]
    # FLA's dispatcher declines the in-kernel gate: gdn_qwen35 gets the Triton column only
    qwen_baseline = bench.fla_baseline(qwen)
    fla_chunk = importer("fla.ops.gated_delta_rule").chunk_gated_delta_rule
    call = tiny_call(qwen, PEER_SHAPE, torch.Generator().manual_seed(0), dtype=torch.bfloat16)
    peers = bench.fla_peers(qwen, qwen_baseline.chunk, fla_chunk, True, call, bench.FORWARD, importer)
    assert [(p.impl, p.expects, p.problem) for p in peers] == [("fla-triton", "fla-triton", None)]


# ---------------------------------------------------------------------------------------------
# The correctness gate
# ---------------------------------------------------------------------------------------------


def _oracle_contender(rec, impl, kernel, damage):
    """An implementation computed by the oracle, then damaged: damage(o, final_state)."""

    def forward(call):
        o, final_state = reference.run(rec, *call.tensors, scale=call.scale, initial_state=call.initial_state,
                                       output_final_state=True, use_qk_l2norm_in_kernel=call.l2norm)
        return damage(o.to(call.tensors[2].dtype), final_state.float())

    return bench.Contender(impl, kernel, forward)


def _group(rec, contenders, call, shape, mode, prefix):
    names = ["q", "k", "v"] + [i.name for i in rec.inputs]
    oracle = bench.oracle_outputs(rec, call.prefix(rec, *prefix), names, gradients=mode == bench.FORWARD_BACKWARD)
    return bench.run_group(rec.name, rec, contenders, call, shape, mode, oracle, bench.measure_once, prefix, 2e-3)


@pytest.mark.parametrize("mode", [bench.FORWARD, bench.FORWARD_BACKWARD])
def test_gate_fails_a_wrong_or_non_finite_row_and_gives_it_no_ratio(mode, generator):
    rec = recurrence("gdn")
    shape = Shape(2, 9, 1, 2, 8, 8)
    call = tiny_call(rec, shape, generator)
    fla = _oracle_contender(rec, bench.FLA_TRITON, "fla_like", lambda o, s: (o, s))
    right = _oracle_contender(rec, bench.LRDSL, "right", lambda o, s: (o, s))
    wrong = _oracle_contender(rec, bench.LRDSL, "off by 1%", lambda o, s: (o * 1.01, s))
    nan = _oracle_contender(rec, bench.LRDSL, "nan", lambda o, s: (o, s * float("nan")))

    rows = {r.kernel: r for r in _group(rec, [fla, right, wrong, nan], call, shape, mode, (2, 9))}

    assert rows["fla_like"].ok and rows["right"].ok, rows
    assert rows["right"].ratios == {"fla-triton": pytest.approx(rows["fla_like"].ms / rows["right"].ms)}
    assert rows["right"].err_vs_oracle <= 2e-3 and rows["right"].diff_vs_other <= 2e-3
    assert not rows["off by 1%"].ok and rows["off by 1%"].ratios == {}
    assert "differs from the float64 oracle by 1.0e-02" in rows["off by 1%"].reason
    assert rows["off by 1%"].diff_vs_other == pytest.approx(1e-2, rel=1e-3)
    assert not rows["nan"].ok and rows["nan"].ratios == {}
    assert "final state not finite" in rows["nan"].reason


def test_gate_cross_checks_the_full_shape_where_the_oracle_sees_a_prefix(generator):
    """Right on the oracle's prefix, wrong after it: only the comparison with the other
    implementation at the full shape can see it, and it fails both rows (it cannot say which)."""
    rec = recurrence("deltanet")
    shape = Shape(1, 12, 1, 1, 8, 8)
    call = tiny_call(rec, shape, generator)

    def wrong_after_prefix(o, final_state):
        if o.shape[1] <= 8:
            return o, final_state
        o = o.clone()
        o[:, 8:] *= 1.1
        return o, final_state * 1.1

    fla = _oracle_contender(rec, bench.FLA_TRITON, "fla_like", lambda o, s: (o, s))
    ours = _oracle_contender(rec, bench.LRDSL, "wrong after the prefix", wrong_after_prefix)

    rows = _group(rec, [fla, ours], call, shape, bench.FORWARD, (1, 8))

    assert all(r.err_vs_oracle <= 2e-3 for r in rows)  # the prefix re-run and the full run's o prefix pass
    assert [r.status for r in rows] == ["FAILED", "FAILED"]
    assert "differs from lrdsl wrong after the prefix" in rows[0].reason
    assert "differs from fla-triton fla_like" in rows[1].reason
    assert rows[1].ratios == {}


def test_cross_check_with_several_peers_fails_only_the_odd_one_out(generator):
    """Three implementations right on the oracle's prefix, one of them wrong after it: the two
    that agree keep their rows (each agrees with a third that also differs from the odd one), the
    odd one fails, and lrdsl gets a ratio to the peer that passed only. With two alone, both
    fail (test above)."""
    rec = recurrence("deltanet")
    shape = Shape(1, 12, 1, 1, 8, 8)
    call = tiny_call(rec, shape, generator)

    def wrong_after_prefix(o, final_state):
        if o.shape[1] <= 8:
            return o, final_state
        o = o.clone()
        o[:, 8:] *= 1.1
        return o, final_state * 1.1

    triton = _oracle_contender(rec, bench.FLA_TRITON, "fla_like", lambda o, s: (o, s))
    odd = _oracle_contender(rec, "flashqla", "odd_one", wrong_after_prefix)
    ours = _oracle_contender(rec, bench.LRDSL, "ours", lambda o, s: (o, s))

    rows = {r.impl: r for r in _group(rec, [triton, odd, ours], call, shape, bench.FORWARD, (1, 8))}

    assert rows["fla-triton"].ok and rows["lrdsl"].ok, rows
    assert not rows["flashqla"].ok and "differs from fla-triton fla_like" in rows["flashqla"].reason
    assert "differs from lrdsl ours" in rows["flashqla"].reason
    assert rows["lrdsl"].ratios == {"fla-triton": pytest.approx(rows["fla-triton"].ms / rows["lrdsl"].ms)}
    assert rows["lrdsl"].diff_vs_other == pytest.approx(0.1, rel=0.2)  # its worst difference: from the odd peer
    assert bench.ratio_summary(list(rows.values()))[("deltanet", "1x12x1x1x8x8")]["fwd"] == {
        "fla-triton": rows["lrdsl"].ratios["fla-triton"], "flashqla": "FAILED"}


def test_an_implementation_that_raises_is_a_failed_row(generator):
    rec = recurrence("simple_gla")
    shape = Shape(1, 5, 1, 1, 8, 8)

    def refuses(call):
        raise RuntimeError("this shape is not supported\nsecond line")

    rows = _group(rec, [bench.Contender(bench.LRDSL, "refuses", refuses)], tiny_call(rec, shape, generator, False),
                  shape, bench.FORWARD, (1, 5))
    assert [(r.status, r.reason) for r in rows] == [("FAILED", "RuntimeError: this shape is not supported")]


def test_without_fla_the_rows_are_lrdsl_only_gated_by_the_oracle_and_without_ratio():
    rec = recurrence("simple_gla")

    def oracle_kernel(q, k, v, *extras, scale=None, initial_state=None, output_final_state=False,
                      use_qk_l2norm_in_kernel=False, plan=None):
        o, final_state = reference.run(rec, q, k, v, *extras, scale=scale, initial_state=initial_state,
                                       output_final_state=output_final_state,
                                       use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
        return o.to(v.dtype), final_state.float()

    stand_in = types.SimpleNamespace(chunk=oracle_kernel, recurrent=oracle_kernel, DEFAULT_CHUNK_PLAN="split")
    rows = bench.bench([bench.SpecUnderTest("simple_gla", rec, stand_in)], [Shape(1, 7, 1, 2, 8, 8), Shape(3, 1, 1, 2, 8, 8)],
                       backward=True, device="cpu", dtype=torch.float32, seed=int(torch.seed() % 2**31), importer=_no_fla)
    assert [(r.mode, r.impl, r.kernel, r.status, r.ratios) for r in rows] == [
        ("fwd", "lrdsl", "chunk[split]", "ok", {}), ("fwd+bwd", "lrdsl", "chunk[split]", "ok", {}),
        ("decode", "lrdsl", "recurrent", "ok", {})]
    assert all(r.err_vs_oracle <= 2e-3 and r.diff_vs_other is None for r in rows)
    assert bench.ratio_summary(rows)[("simple_gla", "1x7x1x2x8x8")] == {"fwd": {}, "fwd+bwd": {}}
    assert "(no peer)" in bench.format_summary(rows)


def test_chunk_sizes_give_one_gated_row_each_and_reach_the_kernel():
    rec = recurrence("simple_gla")
    sizes_seen = []

    def oracle_kernel(q, k, v, *extras, scale=None, initial_state=None, output_final_state=False,
                      use_qk_l2norm_in_kernel=False, plan=None, chunk_size=None):
        sizes_seen.append(chunk_size)
        o, final_state = reference.run(rec, q, k, v, *extras, scale=scale, initial_state=initial_state,
                                       output_final_state=output_final_state,
                                       use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
        return o.to(v.dtype), final_state.float()

    stand_in = types.SimpleNamespace(chunk=oracle_kernel, recurrent=oracle_kernel, DEFAULT_CHUNK_PLAN="split")
    rows = bench.bench([bench.SpecUnderTest("simple_gla", rec, stand_in)], [Shape(1, 7, 1, 2, 8, 8)], device="cpu",
                       dtype=torch.float32, seed=int(torch.seed() % 2**31), importer=_no_fla, chunk_sizes=[None, 16])
    assert [(r.kernel, r.status) for r in rows] == [("chunk[split]", "ok"), ("chunk[split,C=16]", "ok")]
    assert all(r.err_vs_oracle <= 2e-3 for r in rows)
    assert set(sizes_seen) == {None, 16}


def test_bench_chunk_sizes_option_errors_are_one_line(capsys):
    assert "--chunk-sizes takes chunk sizes or 'auto'" in _error_line(["bench", "specs/gdn.toml", "--chunk-sizes", "32,x"], capsys)
    assert "got '-16'" in _error_line(["bench", "specs/gdn.toml", "--chunk-sizes", "-16"], capsys)
    assert "128 is not one of kda's chunk sizes" in _error_line(["bench", "specs/kda.toml", "--chunk-sizes", "auto,128"], capsys)


def test_bench_chunk_sizes_auto_passes_the_checks(capsys, monkeypatch):
    """"auto" is the module's own choice: the checks before any GPU time accept it beside a size
    (the GPU is hidden, so the command stops at the next check on any machine)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "bench needs a CUDA GPU" in _error_line(["bench", "specs/kda.toml", "--chunk-sizes", "auto,32"], capsys)


def test_serving_rows_are_gated_on_the_oracle_and_compared_with_the_pool_decode():
    """--serving: pool decode (fp32, bf16 and 8-bit state), verify and verify + commit, each gated by a
    run on a fresh pool against the oracle (o and the pool rows) and timed relative to the fp32
    pool decode (graph replays only on a GPU); a commit that writes nothing fails its row."""
    spec = bench.SpecUnderTest("gdn", recurrence("gdn"), module("gdn"))
    seed = int(torch.seed() % 2**31)
    print(f"[seed {seed}]")
    rows = bench.bench([spec], [TINY_DECODE], device="cpu", dtype=torch.float32, seed=seed, importer=_no_fla, serving=True)
    serving = [r for r in rows if r.mode in bench.SERVING_CALLS]
    assert [r.mode for r in serving] == ["pool", "pool bf16", "pool int8", "verify", "verify+commit"]
    for r in serving:
        assert r.ok, r
        # an 8-bit store: within sqrt(K) / 254 of the rows (K = 16)
        assert r.err_vs_oracle <= {"pool bf16": 8e-3, "pool int8": 16**0.5 / 254}.get(r.mode, 2e-3), r
        assert r.state_tbps > 0 and r.vs_pool > 0 and r.ratios == {}
    assert serving[0].vs_pool == 1.0
    assert "pool" not in bench.format_summary(rows) and bench.format_row(serving[4]).split()[-2] == f"{serving[4].vs_pool:.2f}"
    assert bench.serving_state_bytes(TINY_DECODE, "verify+commit") == 3 * 2 * 2 * 16 * 16 * 4
    assert bench.serving_state_bytes(TINY_DECODE, "pool int8") == 2 * 2 * 2 * (16 + 4) * 16
    lazy = types.SimpleNamespace(recurrent=spec.module.recurrent, verify=spec.module.verify, commit=lambda *a, **k: None,
                                 pack_states=spec.module.pack_states, unpack_states=spec.module.unpack_states)
    rows = bench.serving_rows(bench.SpecUnderTest("gdn", spec.rec, lazy), TINY_DECODE, "cpu", torch.float32,
                              torch.Generator().manual_seed(seed), bench.measurers("cpu"), 2e-3)
    failed = {r.mode: r for r in rows if not r.ok}
    assert list(failed) == ["verify+commit"] and "pool rows differs from the float64 oracle" in failed["verify+commit"].reason


# ---------------------------------------------------------------------------------------------
# The whole harness on lrdsl's kernels (Triton's interpreter) against the fake fla-core
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gdn_rows():
    """bench() as `lrdsl bench specs/gdn.toml --backward --shapes ...` runs it, at tiny shapes on
    the CPU, with an oracle prefix shorter than the sequence (so the prefix re-runs happen)."""
    fake = FakeFla()
    seed = int(torch.seed() % 2**31)
    print(f"[seed {seed}]")
    spec = bench.SpecUnderTest("gdn", recurrence("gdn"), module("gdn"))
    rows = bench.bench([spec], [TINY_TRAINING, TINY_DECODE], backward=True, device="cpu", dtype=torch.float32,
                       seed=seed, importer=fake.importer, oracle_tokens=16)
    return rows, fake


def test_harness_times_every_mode_and_gates_every_row_on_cpu(gdn_rows):
    rows, fake = gdn_rows
    table = [(r.mode, r.shape, r.impl, r.kernel, r.path) for r in rows]
    assert table == [
        ("fwd", "2x20x1x2x16x16", "fla-triton", "chunk_gated_delta_rule", "fla-triton"),
        ("fwd", "2x20x1x2x16x16", "lrdsl", "chunk[split]", "lrdsl"),
        ("fwd+bwd", "2x20x1x2x16x16", "fla-triton", "chunk_gated_delta_rule", "fla-triton"),
        ("fwd+bwd", "2x20x1x2x16x16", "lrdsl", "chunk[split]", "lrdsl"),
        ("decode", "2x1x1x2x16x16", "fla-triton", "fused_recurrent_gated_delta_rule", "fla-triton"),
        ("decode", "2x1x1x2x16x16", "lrdsl", "recurrent", "lrdsl"),
    ]
    for r in rows:
        assert r.ok, r
        assert r.err_vs_oracle <= 2e-3 and r.diff_vs_other <= 2e-3, r
        assert bool(r.ratios) == (r.impl == "lrdsl")
    by_group = {(r.mode, r.impl): r for r in rows}
    for mode in ("fwd", "fwd+bwd", "decode"):
        assert by_group[(mode, "lrdsl")].ratios == {"fla-triton": pytest.approx(by_group[(mode, "fla-triton")].ms / by_group[(mode, "lrdsl")].ms)}
    assert by_group[("fwd+bwd", "lrdsl")].worst_vs_oracle  # gradients were checked: a name is recorded
    assert by_group[("decode", "lrdsl")].state_tbps > 0 and by_group[("decode", "lrdsl")].tflops is None
    # each FLA function was called by keyword only: full run and the oracle prefix's re-run
    assert {name for name, _ in fake.calls} == {"chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"}
    assert all(arguments["kwargs"] == {} for _, arguments in fake.calls)


def test_summary_json_and_table_carry_status_ratio_and_path(gdn_rows, tmp_path):
    rows, _ = gdn_rows
    records = json.loads(bench.to_json(rows))
    assert [(x["status"], x["path"], bool(x["ratios"])) for x in records] == [
        ("ok", r.path, r.impl == "lrdsl") for r in rows]
    summary = bench.ratio_summary(rows)
    assert set(summary) == {("gdn", "2x20x1x2x16x16"), ("gdn", "2x1x1x2x16x16")}
    assert summary[("gdn", "2x20x1x2x16x16")] == {
        "fwd": {"fla-triton": rows[1].ratios["fla-triton"]}, "fwd+bwd": {"fla-triton": rows[3].ratios["fla-triton"]}}
    text = bench.format_summary(rows)
    assert "peer ms / lrdsl ms" in text and "fwd fla-triton" in text and f"{rows[1].ratios['fla-triton']:.2f}" in text
    assert bench.format_row(rows[5]).split()[6:8] == [f"{rows[5].ms * 1e3:.1f}", "us"]


def test_rows_written_by_json_are_reported_again_without_a_gpu(gdn_rows, tmp_path, capsys):
    """Runs split over several processes (one spec each) are combined: --from-json."""
    rows, _ = gdn_rows
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    first.write_text(bench.to_json(rows[:4]))
    second.write_text(bench.to_json(rows[4:]))
    combined = tmp_path / "all.json"
    assert cli.main(["bench", "--from-json", str(first), str(second), "--json", str(combined)]) == 0
    printed = capsys.readouterr().out
    assert bench.format_row(rows[5]) in printed and bench.format_summary(rows) in printed
    assert bench.rows_from_json(combined) == rows
    (tmp_path / "bad.json").write_text('[{"spec": "gdn"}]')
    assert "not rows written by lrdsl bench --json" in _error_line(["bench", "--from-json", str(tmp_path / "bad.json")], capsys)
    assert "give no spec files or --all" in _error_line(["bench", "--all", "--from-json", str(first)], capsys)


def test_json_from_before_the_peer_columns_reads_as_those_columns(tmp_path):
    """A file written when FLA had one column ("fla-core", its path saying what ran, one
    "ratio" per lrdsl row) reads as the column that path names, with the ratio to it."""
    common = dict(spec="gdn", mode="fwd", shape="4x4096x16x32", status="ok", reason="", tflops=None, state_tbps=None,
                  peak_mib=None, cold_s=None, err_vs_oracle=1e-3, worst_vs_oracle="o", diff_vs_other=1e-3, vs_pool=None)
    old = [dict(common, impl="fla-core", kernel="chunk_gated_delta_rule", path="flashqla", ms=0.759, ratio=None),
           dict(common, impl="lrdsl", kernel="chunk[split]", path="lrdsl", ms=0.999, ratio=0.759 / 0.999),
           dict(common, mode="fwd+bwd", impl="fla-core", kernel="chunk_gated_delta_rule", path="-", ms=None,
                ratio=None, status="FAILED", reason="RuntimeError: x"),
           dict(common, mode="fwd+bwd", impl="lrdsl", kernel="chunk[split]", path="lrdsl", ms=3.8, ratio=None)]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    rows = bench.rows_from_json(path)
    assert [(r.mode, r.impl, r.ratios) for r in rows] == [
        ("fwd", "flashqla", {}), ("fwd", "lrdsl", {"flashqla": pytest.approx(0.76, abs=1e-3)}),
        ("fwd+bwd", "fla-core", {}), ("fwd+bwd", "lrdsl", {})]
    assert bench.ratio_summary(rows)[("gdn", "4x4096x16x32")] == {
        "fwd": {"flashqla": rows[1].ratios["flashqla"]}, "fwd+bwd": {"fla-core": "FAILED"}}
    rewritten = tmp_path / "new.json"
    rewritten.write_text(bench.to_json(rows))
    assert bench.rows_from_json(rewritten) == rows


def test_kept_memory_leaves_out_what_a_first_call_builds_and_keeps(monkeypatch):
    """What a forward keeps for its backward is measured on a second call: a workspace an
    implementation builds on its first call and keeps across calls is not held per layer. The
    GPU's allocator counter is stood in for by a counter the fake forward moves."""
    from lrdsl.measure.bench import timing

    allocated = {"bytes": 0}
    caches = []

    def forward():
        if not caches:
            caches.append("workspace")
            allocated["bytes"] += 500 * 2**20  # built once, kept across calls
        allocated["bytes"] += 3 * 2**20 + 4096  # saved for the backward, and the output below
        return [torch.empty(1024, dtype=torch.float32)]

    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: allocated["bytes"])
    assert timing.held_between_passes(forward) == pytest.approx(3.0)


def test_training_rows_show_what_each_forward_keeps_for_the_backward(tmp_path):
    """Issue 45: a forward + backward ratio bought with held memory must show it: the row's
    "kept MiB" column and, in the summary, each implementation's kept memory beside the ratios."""
    ours = bench.BenchRow("gdn", "fwd+bwd", "4x4096x16x32", "lrdsl", "chunk[split]", "lrdsl", ms=3.0, tflops=1.0,
                          kept_mib=80.0, ratios={"fla-triton": 1.2})
    theirs = bench.BenchRow("gdn", "fwd+bwd", "4x4096x16x32", "fla-triton", "chunk_gated_delta_rule", "fla-triton",
                            ms=3.6, tflops=1.0, kept_mib=64.0)
    forward = bench.BenchRow("gdn", "fwd", "4x4096x16x32", "lrdsl", "chunk[split]", "lrdsl", ms=1.0, tflops=1.0)
    kept_column = bench.HEADER.index("kept MiB")
    assert bench.format_row(ours)[kept_column:].startswith("80 ")
    assert bench.format_row(forward)[kept_column:].startswith("- ")
    line = bench.format_summary([forward, ours, theirs]).splitlines()[-1]
    assert line.startswith("gdn") and "1.20" in line and line.endswith("kept MiB lrdsl 80, fla-triton 64"), line
    saved = tmp_path / "rows.json"
    saved.write_text(bench.to_json([ours, theirs]))
    assert bench.rows_from_json(saved) == [ours, theirs]


def test_decode_rows_carry_the_cards_copy_bandwidth_and_their_fraction_of_it(tmp_path):
    row = bench.BenchRow("gdn", "decode", "256x1x16x32", "lrdsl", "recurrent", "lrdsl", ms=0.1, state_tbps=2.78)
    training = bench.BenchRow("gdn", "fwd", "4x4096x16x32", "lrdsl", "chunk[split]", "lrdsl", ms=1.0, tflops=100.0)
    with_copy = bench.with_copy_bandwidth([row, training], 2.98)
    assert with_copy[0].copy_tbps == 2.98 and with_copy[0].of_copy == pytest.approx(2.78 / 2.98)
    assert with_copy[1] == training  # no state traffic: nothing to hold against the copy
    assert bench.with_copy_bandwidth([row], None) == [row]  # off a GPU: not measured
    assert "2.78/2.98 TB/s" in bench.format_row(with_copy[0]) and " 0.93 " in bench.format_row(with_copy[0])
    assert bench.measure_copy_tbps("cpu") is None
    (tmp_path / "rows.json").write_text(bench.to_json(with_copy))
    assert bench.rows_from_json(tmp_path / "rows.json") == with_copy


@pytest.mark.gpu
def test_copy_bandwidth_is_measured_on_the_gpu():
    tbps = bench.measure_copy_tbps("cuda", nbytes=1 << 28)
    print(f"copy: {tbps:.2f} TB/s")
    assert 0.1 < tbps < 20  # any card this runs on: between a PCIe link's and beyond HBM3e's


def test_family_covers_every_shipped_spec_with_an_fla_counterpart():
    """Every spec in specs/ with an FLA counterpart (deltanet and simple_gla included) gets an FLA
    Triton row beside lrdsl's, gated, with a ratio, at the family's head layout (H = HV)."""
    counterparts = {}
    for path in sorted((ROOT / "specs").glob("*.toml")):
        rec = recurrence(path.stem)
        if bench.fla_baseline(rec) is not None:
            counterparts[rec.name] = rec
    assert set(counterparts) == {"gdn", "gdn_qwen35", "deltanet", "simple_gla", "kda", "gla", "rwkv7", "gdn2",
                                 "gated_deltaproduct"}
    assert bench.parse_shapes("family") == list(bench.FAMILY_SHAPES)
    family = bench.FAMILY_SHAPES[0]
    tiny = Shape(1, 6, 2, 2, 8, 8)  # the family's layout (H = HV) at a size the CPU oracle runs in a blink
    assert family.H == family.HV
    fake = FakeFla()
    specs = [bench.SpecUnderTest(name, rec, _oracle_module(rec)) for name, rec in counterparts.items()]
    rows = bench.bench(specs, [tiny], backward=True, device="cpu", dtype=torch.float32,
                       seed=int(torch.seed() % 2**31), importer=fake.importer)
    for name in counterparts:
        for mode in ("fwd", "fwd+bwd"):
            group = [(r.impl, r.ok, bool(r.ratios)) for r in rows if r.spec == name and r.mode == mode]
            assert group == [("fla-triton", True, False), ("lrdsl", True, True)], (name, mode, rows)
    called = {name for name, _ in fake.calls}
    assert {"chunk_delta_rule", "chunk_simple_gla", "chunk_gated_delta_rule", "chunk_kda", "chunk_gla", "chunk_rwkv7",
            "chunk_gdn2", "chunk_gated_delta_product"} <= called


def test_bench_peers_phases_cover_every_spec_with_an_fla_counterpart_and_issue_45s_shapes():
    """scripts/bench_peers.py: its phases name shipped specs and shapes `--shapes` takes, the
    family phases cover every spec with an FLA counterpart, and gdn runs at the training shapes
    and FlashQLA's published ones (issue 45: 1 x 32768 at 16/64 heads; 4 x 8192)."""
    script = _script_module("bench_peers")
    family = set()
    for phase, (names, shapes) in script.PHASES.items():
        parsed = bench.parse_shapes(shapes)
        assert parsed, phase
        for name in names:
            assert (ROOT / "specs" / f"{name}.toml").exists()
        if shapes == "family":
            family.update(names)
    with_counterpart = {p.stem for p in (ROOT / "specs").glob("*.toml") if bench.fla_baseline(recurrence(p.stem))}
    assert family == with_counterpart
    gdn_shapes = {bench.shape_label(s) for phase, (names, shapes) in script.PHASES.items() if "gdn" in names
                  for s in bench.parse_shapes(shapes)}
    assert {"4x4096x16x32", "1x32768x16x32", "1x65536x2x8", "1x32768x16x64", "4x8192x16x64",
            "256x1x16x32"} <= gdn_shapes


def test_bench_peers_writes_each_phase_as_it_goes_and_stops_starting_work_at_its_deadline(monkeypatch, tmp_path,
                                                                                           capsys):
    """The driver's loop without a GPU: bench() is replaced by one that makes an lrdsl row and a
    peer row per call; the copy bandwidth is measured once for the decode phase and passed on;
    each phase's JSON holds its rows; past the deadline nothing new starts and the rest is named."""
    script = _script_module("bench_peers")
    import lrdsl

    calls = []

    def fake_bench(specs, shapes, backward, seed, on_rows, on_note, copy_tbps):
        (spec,), (shape,) = specs, shapes
        calls.append((spec.name, bench.shape_label(shape), backward, copy_tbps))
        label = bench.shape_label(shape)
        peer = bench.BenchRow(spec.name, "fwd", label, "fla-triton", "f", "fla-triton", ms=2.0)
        ours = bench.BenchRow(spec.name, "fwd", label, "lrdsl", "chunk[split]", "lrdsl", ms=1.0, ratios={"fla-triton": 2.0})
        on_rows([peer, ours])
        return [peer, ours]

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "a fake card")
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(bench, "bench", fake_bench)
    monkeypatch.setattr(bench, "measure_copy_tbps", lambda device: 3.0)
    monkeypatch.setattr(bench, "allow_fla_gated_backward_on_hopper", lambda: False)
    monkeypatch.setattr(lrdsl, "load", lambda path: None)

    assert script.main(["decode", "family-b", "--out", str(tmp_path), "--deadline", "1e9"]) == 0
    assert calls[:4] == [("gdn", f"{b}x1x16x32", False, 3.0) for b in (1, 64, 256, 1024)]
    assert [c[:3] for c in calls[4:]] == [(n, "4x4096x16x16", True) for n in ("kda", "gla", "rwkv7")]
    assert [r.spec for r in bench.rows_from_json(tmp_path / "family-b.json")] == ["kda", "kda", "gla", "gla", "rwkv7", "rwkv7"]
    printed = capsys.readouterr().out
    assert "[decode] 0 FAILED row(s)" in printed and "fwd fla-triton" in printed

    calls.clear()
    assert script.main(["training", "--out", str(tmp_path), "--deadline", "0"]) == 0
    assert calls == []
    assert "not run (past --deadline 0 s): training: gdn 4x4096x16x32; training: gdn 1x32768x16x32" in capsys.readouterr().out


def test_plot_writes_a_png_of_the_ratios(gdn_rows, tmp_path):
    pytest.importorskip("matplotlib")
    rows, _ = gdn_rows
    failed = bench.BenchRow("deltanet", "fwd", "4x4096x16x32", "lrdsl", "chunk[split]", "lrdsl", "FAILED", "o wrong")
    path = tmp_path / "ratios.png"
    bench.plot_ratios(rows + [failed], path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_is_one_clear_error(monkeypatch, tmp_path):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real_find_spec(name, *a))
    with pytest.raises(LrdslError, match=r"^--plot needs matplotlib, which is not installed \(pip install matplotlib\)$"):
        bench.plot_ratios([], tmp_path / "x.png")


# ---------------------------------------------------------------------------------------------
# Shapes and the command line
# ---------------------------------------------------------------------------------------------


def test_shapes_option():
    assert bench.parse_shapes("training") == list(bench.TRAINING_SHAPES)
    assert bench.parse_shapes("4x4096,1x65536,256x1") == [bench.TRAINING_SHAPES[0], bench.TRAINING_SHAPES[2],
                                                          bench.DECODE_SHAPES[2]]
    assert bench.parse_shapes("decode,1x1") == list(bench.DECODE_SHAPES)
    assert bench.parse_shapes("2x512x4x8,3x1x1x3x64x32") == [Shape(2, 512, 4, 8, 128, 128), Shape(3, 1, 1, 3, 64, 32)]
    assert [bench.shape_label(s) for s in bench.DECODE_SHAPES] == ["1x1x16x32", "64x1x16x32", "256x1x16x32", "1024x1x16x32"]
    assert bench.modes_for(bench.DECODE_SHAPES[0], backward=True, device="cuda") == ("decode", "decode graph")
    assert bench.modes_for(bench.TRAINING_SHAPES[0], backward=True, device="cuda") == ("fwd", "fwd+bwd")
    assert bench.oracle_prefix(bench.TRAINING_SHAPES[0]) == (1, 1024)
    assert bench.oracle_prefix(bench.DECODE_SHAPES[3]) == (1024, 1)
    with pytest.raises(LrdslError, match="'4x4097' is not a shape"):
        bench.parse_shapes("4x4097")
    with pytest.raises(LrdslError, match="HV = 3 is not a multiple of H = 2"):
        bench.parse_shapes("1x8x2x3")


def _error_line(argv, capsys) -> str:
    """`lrdsl ARGV` in this process: exit status 2 and one error line, which is returned."""
    assert cli.main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lrdsl: error: "), lines
    return lines[0]


def test_bench_command_errors_are_one_line_before_any_gpu_work(tmp_path, capsys):
    assert "bench: give one or more spec files, or --all" in _error_line(["bench"], capsys)
    assert "give spec files or --all, not both" in _error_line(["bench", "specs/gdn.toml", "--all"], capsys)
    assert "--shapes: '4x4097' is not a shape" in _error_line(["bench", "specs/gdn.toml", "--shapes", "4x4097"], capsys)
    line = _error_line(["bench", "specs/gdn.toml", "--json", str(tmp_path / "no" / "x.json")], capsys)
    assert "--json" in line and "does not exist" in line
    if not HAS_GPU:
        assert "bench needs a CUDA GPU" in _error_line(["bench", "specs/gdn.toml", "specs/deltanet.toml"], capsys)


def test_all_picks_every_spec_with_an_fla_counterpart(monkeypatch, tmp_path):
    monkeypatch.chdir(ROOT)
    args = cli.build_parser().parse_args(["bench", "--all"])
    assert cli._bench_spec_paths(args) == ["specs/deltanet.toml", "specs/gated_deltaproduct.toml",
                                           "specs/gdn.toml", "specs/gdn2.toml", "specs/gdn_qwen35.toml", "specs/gla.toml",
                                           "specs/kda.toml", "specs/rwkv7.toml", "specs/simple_gla.toml"]
    monkeypatch.chdir(tmp_path)
    with pytest.raises(LrdslError, match="no spec in ./specs has an FLA counterpart"):
        cli._bench_spec_paths(args)


@pytest.mark.skipif(HAS_GPU, reason="with a GPU, bench times the training shapes (minutes)")
def test_bench_of_several_specs_without_gpu_is_a_one_line_error(tmp_path):
    has_matplotlib = importlib.util.find_spec("matplotlib") is not None
    expected = "bench needs a CUDA GPU" if has_matplotlib else "--plot needs matplotlib"
    result = run(["bench", "--all", "--backward", "--shapes", "training,decode", "--plot", str(tmp_path / "r.png"),
                  "--json", str(tmp_path / "r.json")])
    assert_one_line_error(result, expected)


# ---------------------------------------------------------------------------------------------
# On a GPU: the harness end to end at a small shape (the fake fla-core keeps it to seconds)
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_harness_on_gpu_times_decode_as_a_graph_replay_and_gates_every_row():
    fake = FakeFla()
    spec = bench.SpecUnderTest("gdn", recurrence("gdn"), module("gdn"))
    rows = bench.bench([spec], [Shape(2, 256, 2, 4, 128, 128), Shape(8, 1, 2, 4, 128, 128)], backward=True,
                       device="cuda", importer=fake.importer, oracle_tokens=128)
    for r in rows:
        print(bench.format_row(r))
    modes = [(r.mode, r.impl) for r in rows]
    assert modes == [(m, impl) for m in ("fwd", "fwd+bwd", "decode", "decode graph") for impl in ("fla-triton", "lrdsl")]
    for r in rows:
        if r.mode == "decode graph" and not r.ok:  # what the graph row says when capture fails
            assert r.reason.startswith("NotCapturable: not capturable in a CUDA graph"), r
            continue
        assert r.ok, r
        assert r.ms > 0 and r.err_vs_oracle <= 8e-3
        assert r.diff_vs_other <= 8e-3 if r.diff_vs_other is not None else r.mode == "decode graph"  # FLA's capture failed
    for ours in (r for r in rows if r.impl == "lrdsl"):
        theirs = next(r for r in rows if r.impl == "fla-triton" and r.mode == ours.mode)
        assert bool(ours.ratios) == (ours.ok and theirs.ok)
    assert all(r.peak_mib > 0 for r in rows if r.mode != "decode graph")
    # what the forward keeps for the backward, measured, is what lrdsl memory predicts from the
    # same call on meta tensors (the allocator rounds each block up to 512 bytes)
    from lrdsl.measure.memory import kept_for_backward

    assert all((r.kept_mib is not None) == (r.mode == "fwd+bwd") for r in rows), rows
    ours = next(r for r in rows if r.impl == "lrdsl" and r.mode == "fwd+bwd")
    predicted = kept_for_backward(module("gdn"), recurrence("gdn"), Shape(2, 256, 2, 4, 128, 128)).held_bytes / 2**20
    assert ours.kept_mib == pytest.approx(predicted, rel=0.03, abs=0.05), (ours.kept_mib, predicted)
    theirs = next(r for r in rows if r.impl == "fla-triton" and r.mode == "fwd+bwd")
    assert f"kept MiB fla-triton {theirs.kept_mib:.0f}, lrdsl {ours.kept_mib:.0f}" in bench.format_summary(rows)


@pytest.mark.gpu
def test_serving_rows_on_gpu_include_graph_replays():
    spec = bench.SpecUnderTest("gdn", recurrence("gdn"), module("gdn"))
    rows = bench.bench([spec], [Shape(8, 1, 2, 4, 128, 128)], device="cuda", importer=_no_fla, serving=True)
    for r in rows:
        print(bench.format_row(r))
    serving = [r for r in rows if r.mode.split(" graph")[0] in bench.SERVING_CALLS]
    assert [r.mode for r in serving] == [m + suffix for m in bench.SERVING_CALLS for suffix in ("", " graph")]
    assert all(r.ok and r.ms > 0 and r.err_vs_oracle <= 8e-3 for r in serving), [r.reason for r in serving]


def test_the_oracle_prefix_of_a_spec_with_several_steps_per_token_keeps_every_step_of_its_tokens(generator):
    """gated_deltaproduct's k, v and beta hold two rows per token: the gate's prefix of 5 tokens
    is 10 of theirs and 5 of q's and g's (it cut all to 5 rows, and the oracle refused beta's
    shape, so `lrdsl bench specs/gated_deltaproduct.toml` failed before timing anything)."""
    rec = recurrence("gated_deltaproduct")
    call = tiny_call(rec, Shape(2, 8, 1, 2, 8, 8), generator)
    q, k, v, g, beta = call.prefix(rec, 1, 5).tensors
    assert (q.shape[1], k.shape[1], v.shape[1], g.shape[1], beta.shape[1]) == (5, 10, 10, 5, 10)
    assert torch.equal(k, call.tensors[1][:1, :10]) and torch.equal(beta, call.tensors[4][:1, :10])
    specs = [bench.SpecUnderTest(rec.name, rec, _oracle_module(rec))]
    rows = bench.bench(specs, [Shape(1, 6, 1, 2, 8, 8)], backward=True, device="cpu", dtype=torch.float32,
                       seed=int(torch.seed() % 2**31), importer=FakeFla().importer)
    assert [(r.impl, r.mode, r.ok) for r in rows] == [("fla-triton", "fwd", True), ("lrdsl", "fwd", True),
                                                      ("fla-triton", "fwd+bwd", True), ("lrdsl", "fwd+bwd", True)]


def test_decode_rows_of_a_spec_whose_fla_counterpart_has_no_recurrent_form_have_no_fla_column(generator):
    rec = recurrence("gated_deltaproduct")
    specs = [bench.SpecUnderTest(rec.name, rec, _oracle_module(rec))]
    fake = FakeFla()
    rows = bench.bench(specs, [Shape(2, 1, 1, 2, 8, 8)], backward=False, device="cpu", dtype=torch.float32,
                       seed=int(torch.seed() % 2**31), importer=fake.importer)
    assert [(r.impl, r.ok) for r in rows] == [("lrdsl", True)] and fake.calls == []
