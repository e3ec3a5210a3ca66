"""Peers: FLA's functions (its Triton kernels, and the backend its dispatcher picks) and FlashQLA,
each a column of its own, called by keyword."""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import itertools
import os
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import sympy
import torch

from ...errors import LrdslError
from ...ir.formula import FUNCTIONS, parse_formula
from ...ir.recurrence import InputRole, Recurrence

if TYPE_CHECKING:  # an annotation only: contenders imports this module
    from .contenders import Call


# Each peer is a column of its own, timed beside lrdsl in the same process:
FLA_TRITON = "fla-triton"  # FLA's public function with every non-Triton backend switched off for the call
FLASHQLA_DIRECT = "flashqla-direct"  # flash_qla.chunk_gated_delta_rule called directly
# FLA's public function as its dispatcher runs it, where that is not its Triton kernels, is a
# column named after the backend (FLA_BACKEND_LABELS: "flashqla")
FLA_BACKEND_LABELS = {"flash_qla": "flashqla"}
FLA = "fla-core"  # the one FLA column of files written before the peers were split (rows_from_json)


@dataclass(frozen=True)
class FlaFunction:
    """One peer function and how each spec input reaches it.

    Plain form (`formulas` empty): every spec input *is* one role's value (the log-decay, beta,
    the dplr vectors) and goes to the parameter `roles` names for that role. In-kernel form:
    the function computes each role's value from its raw parameters by `formulas` (FLA's own
    formula, over its parameter names) once `options` are passed; a spec matches when renaming
    its inputs to those parameters turns its formulas into FLA's exactly (`input_parameters`).
    `l2norm`: whether it can L2-normalise q and k itself (where it cannot, neither side does:
    the same work)."""

    name: str
    roles: dict = field(default_factory=dict)  # role ("gate", "beta", "read", "write") -> parameter
    l2norm: bool = True
    query: str = "q"  # the name for q (RWKV-7's functions call it r)
    formulas: dict = field(default_factory=dict)  # role -> the function's in-kernel formula over its parameters
    head_parameters: tuple = ()  # in-kernel form: parameters that take one value per head ([HV])
    options: dict = field(default_factory=dict)  # keywords that switch the in-kernel form on
    # parameters the function reads out of its **kwargs (fla-core 0.6.0's chunk_gated_delta_rule
    # reads use_gate_in_kernel, A_log and dt_bias there): accepted by the signature check, and a
    # version that ignored them would compute another recurrence, which the oracle gate fails
    from_kwargs: tuple = ()
    # the keyword that takes the number of delta-rule steps per token (FLA's num_householder);
    # a function without one computes one step per token
    steps_keyword: str | None = None


@dataclass(frozen=True)
class DirectPeer:
    """A kernel library called directly, outside FLA's dispatch, on the shapes it supports."""

    label: str
    module: str
    function: FlaFunction
    options: dict  # keywords beyond the common ones, as the library's own entry point takes them
    dtypes: tuple = (torch.bfloat16, torch.float16)
    head_dims: tuple = (128, 128)  # (K, V)


@dataclass(frozen=True)
class FlaBaseline:
    module: str
    chunk: FlaFunction
    recurrent: FlaFunction | None  # None: FLA has no recurrent form (decode rows get no FLA column)
    direct: tuple = ()  # DirectPeers of the chunk function (training shapes)


# The hand-written functions each recurrence is compared with, by (gate kind, update, beta): the
# plain form first, then in-kernel forms. Parameter names are fla-core 0.6.0's:
# fused_recurrent_gated_delta_rule(q, k, v, g, gk, gv, beta, ...) takes beta seventh, so
# nothing is passed by position.
_GATE_AND_BETA = {"gate": "g", "beta": "beta"}
_RWKV7_ROLES = {"gate": "w", "read": "a", "write": "b"}
# fla-core 0.6.0's comba kernels (chunk_comba, fused_recurrent_comba) read the state along p
# *before* the token's decay, u_t = beta_t (v_t - S_{t-1}^T p_t), where its naive_recurrent_comba
# (and specs/comba.toml) reads it after: the two differ by 8.9 % in float64 at g in [-1, 0]. After
# the decay that read is along p_t exp(-g_t): the recurrence these functions compute, which
# specs/comba.toml's is not
_COMBA_FORM = dict(formulas={"gate": "g", "beta": "beta", "delta_read": "p * exp(-g)"})
_GDN2_FORM = dict(formulas={"gate": "g", "delta_read": "b * k", "write_value": "w * v"})
# FlashQLA 0.1.3's entry point, with the options FLA's FlashQLA backend passes (no varlen,
# intra-card context parallelism on)
FLASH_QLA = DirectPeer(FLASHQLA_DIRECT, "flash_qla", FlaFunction("chunk_gated_delta_rule", _GATE_AND_BETA),
                       {"cu_seqlens": None, "auto_cp": True})
# chunk_gated_delta_rule(use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True): the decay
# -exp(A_log) * softplus(g + dt_bias) and beta = sigmoid(beta) computed in its kernels (FLA's
# docstring and gate kernels); its chunk form reads the three gate keywords out of **kwargs
_GDN_IN_KERNEL = dict(formulas={"gate": "-exp(A_log) * softplus(g + dt_bias)", "beta": "sigmoid(beta)"},
                      head_parameters=("A_log", "dt_bias"),
                      options={"use_gate_in_kernel": True, "use_beta_sigmoid_in_kernel": True})
FLA_BASELINES = {
    ("scalar", "delta", True): (
        FlaBaseline(
            "fla.ops.gated_delta_rule",
            FlaFunction("chunk_gated_delta_rule", _GATE_AND_BETA),
            FlaFunction("fused_recurrent_gated_delta_rule", _GATE_AND_BETA),
            direct=(FLASH_QLA,),
        ),
        FlaBaseline(
            "fla.ops.gated_delta_rule",
            FlaFunction("chunk_gated_delta_rule", **_GDN_IN_KERNEL, from_kwargs=("use_gate_in_kernel", "A_log", "dt_bias")),
            FlaFunction("fused_recurrent_gated_delta_rule", **_GDN_IN_KERNEL),
        ),
        # Comba as FLA's kernels compute it (_COMBA_FORM; fused_recurrent_comba takes p third,
        # so again nothing by position)
        FlaBaseline(
            "fla.ops.comba",
            FlaFunction("chunk_comba", **_COMBA_FORM),
            FlaFunction("fused_recurrent_comba", **_COMBA_FORM),
        ),
        # Gated DeltaProduct: k, v and beta of num_householder steps per token; FLA ships no
        # recurrent form of it
        FlaBaseline(
            "fla.ops.gated_delta_product",
            FlaFunction("chunk_gated_delta_product", _GATE_AND_BETA, steps_keyword="num_householder"),
            None,
        ),
    ),
    ("none", "delta", True): (FlaBaseline(
        "fla.ops.delta_rule",
        FlaFunction("chunk_delta_rule", {"beta": "beta"}),
        FlaFunction("fused_recurrent_delta_rule", {"beta": "beta"}),
    ),),
    ("scalar", "plain", False): (FlaBaseline(
        "fla.ops.simple_gla",
        FlaFunction("chunk_simple_gla", {"gate": "g"}, l2norm=False),
        FlaFunction("fused_recurrent_simple_gla", {"gate": "g"}, l2norm=False),
    ),),
    # key-channel gates: g [B, T, HV, K]; fused_recurrent_gla names its key gate gk
    ("key_channel", "delta", True): (FlaBaseline(
        "fla.ops.kda",
        FlaFunction("chunk_kda", _GATE_AND_BETA),
        FlaFunction("fused_recurrent_kda", _GATE_AND_BETA),
    ),),
    # GDN-2: key-channel decay g, the delta rule reading along b * k and writing w * v (its
    # functions form both products themselves from b and w)
    ("key_channel", "delta", False): (FlaBaseline(
        "fla.ops.gdn2",
        FlaFunction("chunk_gdn2", **_GDN2_FORM),
        FlaFunction("fused_recurrent_gdn2", **_GDN2_FORM),
    ),),
    ("key_channel", "plain", False): (FlaBaseline(
        "fla.ops.gla",
        FlaFunction("chunk_gla", {"gate": "g"}, l2norm=False),
        FlaFunction("fused_recurrent_gla", {"gate": "gk"}, l2norm=False),
    ),),
    # RWKV-7: chunk_rwkv7(r, w, k, v, a, b): w the log-decay, a what the low-rank term reads
    ("key_channel", "dplr", False): (FlaBaseline(
        "fla.ops.rwkv7",
        FlaFunction("chunk_rwkv7", _RWKV7_ROLES, l2norm=False, query="r"),
        FlaFunction("fused_recurrent_rwkv7", _RWKV7_ROLES, l2norm=False, query="r"),
    ),),
}


def _role_expressions(rec: Recurrence) -> dict:
    # the delta rule's read vector and written value too: an FLA function without them (gdn's,
    # kda's) is no counterpart of a spec with them (comba, gdn2)
    return {"gate": rec.log_decay, "beta": rec.beta, "read": rec.low_rank_read, "write": rec.low_rank_write,
            "delta_read": rec.delta_read, "write_value": rec.write_value}


def input_role(rec: Recurrence, name: str) -> str | None:
    """What a spec input is to FLA: the log-decay itself ("gate"), beta itself ("beta"), the
    dplr update's low-rank vectors themselves ("read" a, "write" b), or none of these (an input a
    formula transforms, which FLA's plain forms do not take)."""
    symbol = sympy.Symbol(name)
    return next((role for role, expr in _role_expressions(rec).items() if expr == symbol), None)


def input_parameters(rec: Recurrence, function: FlaFunction) -> dict | None:
    """{spec input: the function's parameter that takes it}, or None where the function cannot
    compute this recurrence from the spec's inputs."""
    if not function.formulas:
        roles = {i.name: input_role(rec, i.name) for i in rec.inputs}
        if any(role not in function.roles for role in roles.values()):
            return None
        return {name: function.roles[role] for name, role in roles.items()}
    return _match_in_kernel_form(rec, function)


def _match_in_kernel_form(rec: Recurrence, function: FlaFunction) -> dict | None:
    """The renaming of the spec's inputs to the function's parameters under which the spec's
    formulas are the function's in-kernel formulas, symbol for symbol; per-head inputs go to
    per-head parameters, per-token ones (scalars, key or value rows) to the others. None if there
    is none."""
    expressions = {role: expr for role, expr in _role_expressions(rec).items() if expr is not None}
    if set(expressions) != set(function.formulas):
        return None
    forms = {role: parse_formula(text, _formula_names(text)) for role, text in function.formulas.items()}
    parameters = sorted({str(s) for form in forms.values() for s in form.free_symbols} - _CALL_TENSORS)
    names = [i.name for i in rec.inputs]
    if len(parameters) != len(names):
        return None
    wanted_roles = {i.name: i.role for i in rec.inputs}
    for order in itertools.permutations(parameters):
        mapping = dict(zip(names, order))
        if any((wanted_roles[n] is InputRole.HEAD) != (mapping[n] in function.head_parameters) for n in names):
            continue
        renamed = {sympy.Symbol(n): sympy.Symbol(p) for n, p in mapping.items()}
        if all(expressions[role].xreplace(renamed) == form for role, form in forms.items()):
            return mapping
    return None


# what a formula may read besides the spec's inputs (GDN-2's b * k): passed as themselves
_CALL_TENSORS = {"q", "k", "v"}


def _formula_names(text: str) -> set[str]:
    """The parameter names an in-kernel formula uses (identifiers that are not functions)."""
    return {word for word in re.findall(r"[A-Za-z_]\w*", text) if word not in FUNCTIONS}


def fla_baseline(rec: Recurrence) -> FlaBaseline | None:
    """The FLA counterpart of this recurrence, or None (no match, or inputs FLA cannot take)."""
    for baseline in FLA_BASELINES.get((rec.gate.value, rec.update.value, rec.has_beta), ()):
        # k, v and beta of several steps per token go only to a function that takes the count
        if (baseline.chunk.steps_keyword is not None) != (rec.steps_per_token > 1):
            continue
        functions = [f for f in (baseline.chunk, baseline.recurrent) if f is not None]
        if all(input_parameters(rec, f) is not None for f in functions):
            return baseline
    return None


def explicit_parameters(function) -> set[str]:
    """Parameters a function names (not what a **kwargs would swallow: a misspelt keyword there
    would be ignored silently)."""
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return {p.name for p in inspect.signature(function).parameters.values() if p.kind in kinds}


def _takes_kwargs(function) -> bool:
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in inspect.signature(function).parameters.values())


def fla_keywords(rec: Recurrence, function: FlaFunction, call: Call, extra: dict | None = None) -> dict:
    """The keyword arguments of one peer call: q, k, v, each spec input under the function's
    parameter for it, the options (and `extra`, a direct peer's own)."""
    q, k, v, *extras = call.tensors
    keywords = {function.query: q, "k": k, "v": v}
    parameters = input_parameters(rec, function)
    for inp, tensor in zip(rec.inputs, extras):
        keywords[parameters[inp.name]] = tensor
    keywords.update(scale=call.scale, initial_state=call.initial_state, output_final_state=True)
    if call.l2norm:
        keywords["use_qk_l2norm_in_kernel"] = True
    if function.steps_keyword is not None:
        keywords[function.steps_keyword] = rec.steps_per_token
    keywords.update(function.options)
    keywords.update(extra or {})
    return keywords


def missing_parameters(rec: Recurrence, function: FlaFunction, fla_function, l2norm: bool,
                       extra: dict | None = None) -> list[str]:
    """The keywords this harness passes that `fla_function` does not take (a version mismatch)."""
    wanted = [function.query, "k", "v", *input_parameters(rec, function).values(),
              "scale", "initial_state", "output_final_state"] + (["use_qk_l2norm_in_kernel"] if l2norm else [])
    wanted += [*function.options, *(extra or {})] + ([function.steps_keyword] if function.steps_keyword else [])
    named = explicit_parameters(fla_function)
    if _takes_kwargs(fla_function):
        named |= set(function.from_kwargs)
    return [name for name in dict.fromkeys(wanted) if name not in named]


def resolve_fla(baseline: FlaBaseline | None, importer=importlib.import_module):
    """(chunk function, recurrent function or None) of an installed fla-core, or None."""
    if baseline is None:
        return None
    try:
        module = importer(baseline.module)
    except ImportError:
        return None
    recurrent = None if baseline.recurrent is None else getattr(module, baseline.recurrent.name)
    return getattr(module, baseline.chunk.name), recurrent


def dispatched_backend(function, keywords: dict, importer=importlib.import_module):
    """The backend FLA's dispatcher runs for this call, or None for its own Triton kernels. Asks
    FLA's backend registries what its dispatcher asks, in its order: available, enabled (FLA
    reads its environment switches at every call), and the backend's verifier accepting these
    arguments. Raises AttributeError where that machinery is not where fla-core 0.6.0 keeps it."""
    try:
        backends = importer("fla.backends")
    except ImportError:
        return None  # an fla-core without backend dispatch
    for backend in _candidate_backends(backends, function):
        if not (backend.is_available() and backend.is_enabled()):
            continue
        if backend.get_implementation(function.__name__) is None:
            continue
        accepted, _ = backend.verify(function.__name__, **keywords)
        if accepted:
            return backend
    return None


def fla_dispatch_path(function, keywords: dict, importer=importlib.import_module) -> str:
    """Which code FLA runs for this call: its own Triton kernels ("fla-triton") or the backend
    its dispatcher picks (fla-core 0.6.0 sends chunk_gated_delta_rule to FlashQLA on Hopper
    when the flash-qla package is importable: "flashqla"); "unknown" when the dispatch
    machinery is not where fla-core 0.6.0 keeps it."""
    try:
        backend = dispatched_backend(function, keywords, importer)
    except AttributeError:
        return "unknown"
    if backend is None:
        return FLA_TRITON
    return FLA_BACKEND_LABELS.get(backend.backend_type, backend.backend_type)


def _candidate_backends(backends, function) -> list:
    """The backends registered for `function`: for the function itself, and for its operation
    (fla.ops.<operation>.<file>), lowest priority number first, as FLA's dispatcher orders them."""
    if getattr(backends, "_DISPATCH_DISABLED", False):
        return []
    unwrapped = inspect.unwrap(function)
    registries = [backends._function_registries.get(unwrapped)]
    parts = unwrapped.__module__.split(".")
    operation = parts[2] if parts[:2] == ["fla", "ops"] and len(parts) > 2 else None
    registries += [r for r in backends._operation_registries.values() if r.operation_name == operation]
    found = [b for r in registries if r is not None for b in r._backends.values()]
    return sorted(found, key=lambda b: b.priority)


# Backends switched off one after another for the Triton column: more than this means a
# dispatcher this harness does not understand
_MOST_BACKENDS = 8


def triton_switches(function, keywords: dict, importer=importlib.import_module) -> dict:
    """The environment settings under which FLA's dispatcher runs its own Triton kernels for this
    call: each backend it would pick switched off by its variable (fla-core 0.6.0's
    BaseBackend.is_enabled reads `env_var`, and FLA_<BACKEND_TYPE>, which overrides it, at every
    call), asked again until none is picked. {} where none is. Raises LrdslError where a
    backend it picks has no switch."""
    settings: dict = {}
    for _ in range(_MOST_BACKENDS):
        with environment(settings):
            backend = dispatched_backend(function, keywords, importer)
        if backend is None:
            return settings
        if getattr(backend, "env_var", None) is None:
            raise LrdslError(f"FLA's dispatcher picks its {backend.backend_type} backend for {function.__name__}, "
                             "which no environment variable switches off")
        settings = {**settings, backend.env_var: "0", f"FLA_{backend.backend_type.upper()}": "0"}
    raise LrdslError(f"FLA's dispatcher still picks a backend for {function.__name__} with {_MOST_BACKENDS} switched off")


@contextlib.contextmanager
def environment(settings: dict):
    """os.environ with `settings` applied, restored afterwards (variables it added removed)."""
    saved = {name: os.environ.get(name) for name in settings}
    os.environ.update(settings)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def allow_fla_gated_backward_on_hopper(importer=importlib.import_module) -> bool:
    """fla-core 0.6.0 refuses its gated backward on Hopper with triton < 3.7.1 (a miscompile it
    saw there). To time it side by side we lift that check; the gate compares its gradients with
    the oracle's and ours, so a wrong one is FAILED, not timed."""
    try:
        chunk_o = importer("fla.ops.common.chunk_o")
    except ImportError:
        return False
    if getattr(chunk_o, "TRITON_ABOVE_3_7_1", True):
        return False
    chunk_o.TRITON_ABOVE_3_7_1 = True
    return True
