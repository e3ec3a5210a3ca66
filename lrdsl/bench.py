"""Side-by-side benchmarks: lrdsl's generated kernels vs its peers (fla-core 0.6.0, FlashQLA 0.1.3),
gated on correctness.

    lrdsl bench SPEC [SPEC ...] | --all  [--shapes LIST] [--plans LIST] [--backward]
                                         [--json FILE] [--plot FILE.png]
    lrdsl bench --from-json FILE [FILE ...] [--json FILE] [--plot FILE.png]   (no GPU: report earlier runs)

Peers, each a column of its own, timed in the same process on the same inputs: "fla-triton",
FLA's public function with every backend its dispatcher would pick for the call switched off
(fla-core 0.6.0 reads each backend's environment switch at every call; the switches are set
around every call of that column, its backward included); the backend FLA's dispatcher picks,
where it picks one ("flashqla": FLA sends chunk_gated_delta_rule to FlashQLA on Hopper when
flash-qla is installed); "flashqla-direct", flash_qla.chunk_gated_delta_rule itself, where it
imports and applies (the plain scalar-gate delta rule with beta, K = V = 128, bf16 or fp16).
Each lrdsl row gets one ratio per peer: peer ms / lrdsl ms.

Protocol: bf16 q, k, v (and beta); fp32 g; use_qk_l2norm_in_kernel=True wherever FLA's function
takes it (else False on both sides); scale = K**-0.5; median of triton.testing.do_bench; peak
memory of one call (its inputs included, whatever else the process holds excluded); cold time =
the first call of that function at that shape in the process (compilation and autotuning
included). TFLOP/s: the recurrent form's 6 * B * T * HV * K * V floating-point operations for
the forward (predict, write, read: 2KV each per token and head), 3x that for forward + backward,
the same count for every implementation. Decode (T = 1): an fp32 initial state in, the final
state out, as a server does; TB/s counts that state read once and written once, also when the
kernels run as a CUDA-graph replay, beside the card's copy bandwidth (one 1 GiB device-to-device
copy, bytes read + written, measured once per run) and the fraction of it.

Correctness gate: every row's outputs (o, the final state, and for forward + backward the
gradient of every input) are compared with the float64 oracle (lrdsl.reference) and with the
other implementations'. A row whose outputs are not finite, or differ from the oracle's beyond
the dtype's tolerance, is FAILED and gets no ratio; so is one that differs from another
implementation unless a third sides with it (see _rows). Peer functions are called by keyword,
each spec input mapped to the peer's parameter by its role (the gate to `g`, beta to `beta`) or,
for an in-kernel form (gdn_qwen35: FLA's use_gate_in_kernel and use_beta_sigmoid_in_kernel),
by matching the spec's formulas with the peer's symbol for symbol; never by position.

Serving (--serving, at decode shapes; lrdsl only, FLA has no state pool): decode on a state
pool of 2B rows in random order (fp32 and bf16 state), verify of 4 draft tokens, and verify +
commit of a random number of them, each eager and as a CUDA-graph replay (validate=False, the
caller's buffers). Each row is gated by one run on a fresh pool against the oracle (o, and the
pool rows); TB/s counts the state traffic of the row's kernels (a pool decode reads and writes
each row once, verify reads it once, verify + commit reads it twice and writes it once), and
"x pool" is the row's time over the fp32 pool decode's (eager or graph alike).

The harness runs on any device: on a GPU `lrdsl bench` times it; on the CPU the tests drive the
same row building, gate, keyword mapping and ratios at tiny shapes (timings there mean nothing).
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import itertools
import json
import math
import os
import re
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Callable

import sympy
import torch

from . import reference
from .errors import LrdslError
from .ir.formula import FUNCTIONS, parse_formula
from .ir.recurrence import InputRole, Recurrence
from .workloads import TOLERANCE, Shape, make_inputs

TRAINING_SHAPES = (
    Shape(4, 4096, 16, 32, 128, 128),
    Shape(1, 32768, 16, 32, 128, 128),
    Shape(1, 65536, 2, 8, 128, 128),
)
DECODE_SHAPES = tuple(Shape(B, 1, 16, 32, 128, 128) for B in (1, 64, 256, 1024))
# the family's comparison shape (every spec with an FLA counterpart against it): no GVA
FAMILY_SHAPES = (Shape(4, 4096, 16, 16, 128, 128),)
SHAPE_GROUPS = {"training": TRAINING_SHAPES, "family": FAMILY_SHAPES, "decode": DECODE_SHAPES}

FORWARD, FORWARD_BACKWARD, DECODE, DECODE_GRAPH = "fwd", "fwd+bwd", "decode", "decode graph"
MODES = (FORWARD, FORWARD_BACKWARD, DECODE, DECODE_GRAPH)
# --serving rows (lrdsl only): what runs, its state dtype, and state rows read / written per call
POOL, POOL_BF16, VERIFY, VERIFY_COMMIT = "pool", "pool bf16", "verify", "verify+commit"
GRAPH = " graph"  # the same call as a CUDA-graph replay
SERVING_CALLS = {POOL: (torch.float32, 2), POOL_BF16: (torch.bfloat16, 2), VERIFY: (torch.float32, 1),
                 VERIFY_COMMIT: (torch.float32, 3)}
DRAFT_TOKENS = 4

# The oracle is a float64 Python loop over tokens (about ten kernel launches per token on a GPU;
# for gradients autograd keeps about 8.4 MiB per token at 32 heads of 128 x 128). So it runs on
# a prefix: the first sequences' first ORACLE_TOKENS tokens, all heads (slicing heads would give
# FLA a new autotuning key, minutes of tuning; slicing B and T does not). At the training shapes
# that is about a second and 9 GiB. Each implementation is re-run on the same prefix for the
# final state and the gradients (which depend on every token), and its full-shape o is checked
# on the prefix too; the full-shape outputs are cross-checked against the other
# implementation's. Decode (T = 1) checks every sequence: one step each.
ORACLE_TOKENS = 1024

LRDSL, FLA = "lrdsl", "fla-core"


# ---------------------------------------------------------------------------------------------
# Shapes
# ---------------------------------------------------------------------------------------------


def shape_label(shape: Shape) -> str:
    """BxTxHxHV (xKxV when not 128): the form `--shapes` takes back."""
    label = f"{shape.B}x{shape.T}x{shape.H}x{shape.HV}"
    return label if (shape.K, shape.V) == (128, 128) else f"{label}x{shape.K}x{shape.V}"


def parse_shapes(text: str) -> list[Shape]:
    """Comma-separated: a group (training, family, decode), a known shape by BxT (4x4096, 256x1;
    the first group that has one names it), or any shape as BxTxHxHV or BxTxHxHVxKxV (K = V = 128
    unless given). T = 1 is a decode shape."""
    known: dict[str, Shape] = {}
    for group in SHAPE_GROUPS.values():
        for s in group:
            known.setdefault(f"{s.B}x{s.T}", s)
    shapes: list[Shape] = []
    for token in (t.strip() for t in text.split(",")):
        if token in SHAPE_GROUPS:
            shapes += SHAPE_GROUPS[token]
        elif token in known:
            shapes.append(known[token])
        else:
            shapes.append(_parse_shape_token(token, known))
    return list(dict.fromkeys(shapes))  # in order, each once


def _parse_shape_token(token: str, known: dict) -> Shape:
    usage = (f"--shapes: {token!r} is not a shape; give {', '.join(SHAPE_GROUPS)}, one of {', '.join(known)}, "
             "or BxTxHxHV[xKxV]")
    try:
        values = [int(x) for x in token.split("x")]
    except ValueError:
        raise LrdslError(usage) from None
    if len(values) not in (4, 6) or min(values) < 1:
        raise LrdslError(usage)
    B, T, H, HV, K, V = values if len(values) == 6 else values + [128, 128]
    if HV % H:
        raise LrdslError(f"--shapes: {token!r}: HV = {HV} is not a multiple of H = {H}")
    return Shape(B, T, H, HV, K, V)


def is_decode(shape: Shape) -> bool:
    return shape.T == 1


def modes_for(shape: Shape, backward: bool, device: str) -> tuple[str, ...]:
    """Decode shapes: eager, and as a CUDA-graph replay (GPU only); training shapes: forward, and
    forward + backward when asked."""
    if is_decode(shape):
        return (DECODE, DECODE_GRAPH) if device == "cuda" else (DECODE,)
    return (FORWARD, FORWARD_BACKWARD) if backward else (FORWARD,)


def oracle_prefix(shape: Shape, tokens: int = ORACLE_TOKENS) -> tuple[int, int]:
    """(sequences, tokens) of the prefix the oracle checks (see ORACLE_TOKENS)."""
    if is_decode(shape):
        return shape.B, 1
    T = min(shape.T, tokens)
    return max(1, min(shape.B, tokens // T)), T


# ---------------------------------------------------------------------------------------------
# Peers: FLA's functions (its Triton kernels, and the backend its dispatcher picks), FlashQLA
# ---------------------------------------------------------------------------------------------

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
    recurrent: FlaFunction
    direct: tuple = ()  # DirectPeers of the chunk function (training shapes)


# The hand-written functions each recurrence is compared with, by (gate kind, update, beta): the
# plain form first, then in-kernel forms. Parameter names are fla-core 0.6.0's:
# fused_recurrent_gated_delta_rule(q, k, v, g, gk, gv, beta, ...) takes beta seventh, so
# nothing is passed by position.
_GATE_AND_BETA = {"gate": "g", "beta": "beta"}
_RWKV7_ROLES = {"gate": "w", "read": "a", "write": "b"}
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
    return {"gate": rec.log_decay, "beta": rec.beta, "read": rec.low_rank_read, "write": rec.low_rank_write}


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
    per-head parameters, per-token scalars to the others. None if there is none."""
    expressions = {role: expr for role, expr in _role_expressions(rec).items() if expr is not None}
    if set(expressions) != set(function.formulas):
        return None
    forms = {role: parse_formula(text, _formula_names(text)) for role, text in function.formulas.items()}
    parameters = sorted({str(s) for form in forms.values() for s in form.free_symbols})
    names = [i.name for i in rec.inputs]
    if len(parameters) != len(names):
        return None
    wanted_roles = {i.name: i.role for i in rec.inputs}
    for order in itertools.permutations(parameters):
        mapping = dict(zip(names, order))
        kinds = [InputRole.HEAD if mapping[n] in function.head_parameters else InputRole.TOKEN for n in names]
        if any(wanted_roles[n] != kind for n, kind in zip(names, kinds)):
            continue
        renamed = {sympy.Symbol(n): sympy.Symbol(p) for n, p in mapping.items()}
        if all(expressions[role].xreplace(renamed) == form for role, form in forms.items()):
            return mapping
    return None


def _formula_names(text: str) -> set[str]:
    """The parameter names an in-kernel formula uses (identifiers that are not functions)."""
    return {word for word in re.findall(r"[A-Za-z_]\w*", text) if word not in FUNCTIONS}


def fla_baseline(rec: Recurrence) -> FlaBaseline | None:
    """The FLA counterpart of this recurrence, or None (no match, or inputs FLA cannot take)."""
    for baseline in FLA_BASELINES.get((rec.gate.value, rec.update.value, rec.has_beta), ()):
        if all(input_parameters(rec, f) is not None for f in (baseline.chunk, baseline.recurrent)):
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
    keywords.update(function.options)
    keywords.update(extra or {})
    return keywords


def missing_parameters(rec: Recurrence, function: FlaFunction, fla_function, l2norm: bool,
                       extra: dict | None = None) -> list[str]:
    """The keywords this harness passes that `fla_function` does not take (a version mismatch)."""
    wanted = [function.query, "k", "v", *input_parameters(rec, function).values(),
              "scale", "initial_state", "output_final_state"] + (["use_qk_l2norm_in_kernel"] if l2norm else [])
    wanted += [*function.options, *(extra or {})]
    named = explicit_parameters(fla_function)
    if _takes_kwargs(fla_function):
        named |= set(function.from_kwargs)
    return [name for name in dict.fromkeys(wanted) if name not in named]


def resolve_fla(baseline: FlaBaseline | None, importer=importlib.import_module):
    """(chunk function, recurrent function) of an installed fla-core, or None."""
    if baseline is None:
        return None
    try:
        module = importer(baseline.module)
    except ImportError:
        return None
    return getattr(module, baseline.chunk.name), getattr(module, baseline.recurrent.name)


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

# ---------------------------------------------------------------------------------------------
# Inputs and implementations
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Call:
    """One set of inputs, as every implementation receives it."""

    tensors: tuple  # q, k, v, then the spec's inputs in order
    initial_state: torch.Tensor | None
    d_o: torch.Tensor | None  # the upstream gradient of o, for forward + backward
    scale: float
    l2norm: bool

    def prefix(self, rec: Recurrence, sequences: int, tokens: int) -> Call:
        """The same call on the first `sequences` sequences' first `tokens` tokens."""

        def cut(x, per_token=True):
            return x[:sequences, :tokens].contiguous() if per_token else x

        q, k, v, *extras = self.tensors
        sliced = [cut(q), cut(k), cut(v)] + [cut(x, i.role.per_token) for i, x in zip(rec.inputs, extras)]
        return replace(
            self,
            tensors=tuple(sliced),
            initial_state=None if self.initial_state is None else self.initial_state[:sequences].contiguous(),
            d_o=None if self.d_o is None else cut(self.d_o),
        )

    def requiring_grad(self) -> Call:
        return replace(self, tensors=tuple(t.detach().requires_grad_() for t in self.tensors))

    def nbytes(self) -> int:
        tensors = [*self.tensors, self.initial_state, self.d_o]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def make_call(rec: Recurrence, shape: Shape, dtype, device, generator, l2norm: bool) -> Call:
    """Fresh random inputs: an fp32 initial state for decode shapes (state in, state out), an
    upstream gradient of o for training shapes."""
    tensors = make_inputs(rec, shape, dtype=dtype, generator=generator, normalize_keys=not l2norm and rec.is_delta)
    h0 = d_o = None
    if is_decode(shape):
        h0 = torch.randn(shape.B, shape.HV, shape.K, shape.V, generator=generator).to(device)
    else:
        d_o = torch.randn(shape.B, shape.T, shape.HV, shape.V, generator=generator).to(device, dtype)
    return Call(tuple(t.to(device) for t in tensors), h0, d_o, shape.K**-0.5, l2norm)


@dataclass(frozen=True)
class Contender:
    """One implementation of one kernel kind: forward(call) -> (o, final state)."""

    impl: str  # LRDSL or a peer's column: FLA_TRITON, a backend FLA dispatches to, FLASHQLA_DIRECT
    kernel: str  # what runs: "chunk[split]", "recurrent", the peer's function name
    forward: Callable
    path: Callable = lambda call: LRDSL  # which code runs for this call
    problem: str | None = None  # why it cannot run at all (its rows are FAILED with this reason)
    scope: Callable = contextlib.nullcontext  # entered around all its calls (FLA's backends switched off)
    expects: str | None = None  # the path its column stands for: a row that ran another is FAILED


def lrdsl_contenders(module, decode: bool, plans, chunk_sizes=(None,)) -> list[Contender]:
    """lrdsl's recurrent kernel at decode shapes; else its chunk kernels per plan x chunk size
    (None: the module's own choice for the shape; a size pins the backward's to it too)."""
    def caller(function, options):
        def forward(call: Call):
            return function(*call.tensors, scale=call.scale, initial_state=call.initial_state,
                            output_final_state=True, use_qk_l2norm_in_kernel=call.l2norm, **options)
        return forward

    if decode:
        return [Contender(LRDSL, "recurrent", caller(module.recurrent, {}))]
    return [Contender(LRDSL, f"chunk[{plan}]" if size is None else f"chunk[{plan},C={size}]",
                      caller(module.chunk, {"plan": plan} if size is None else {"plan": plan, "chunk_size": size}))
            for plan in plans for size in chunk_sizes]


def fla_contender(rec: Recurrence, function: FlaFunction, fla_function, l2norm: bool,
                  importer=importlib.import_module, impl: str = FLA, switches: dict | None = None,
                  expects: str | None = None, problem: str | None = None) -> Contender:
    """FLA's public function, called by keyword; with `switches`, under those environment settings
    (its backends switched off). `impl` names its column (FLA: whatever its dispatcher runs)."""
    missing = missing_parameters(rec, function, fla_function, l2norm)
    if missing and problem is None:
        problem = f"fla-core's {function.name} has no parameter {', '.join(missing)} (this harness expects fla-core 0.6.0)"

    def forward(call: Call):
        return fla_function(**fla_keywords(rec, function, call))

    def path(call: Call) -> str:
        return fla_dispatch_path(fla_function, fla_keywords(rec, function, call), importer)

    scope = (lambda: environment(switches)) if switches else contextlib.nullcontext
    return Contender(impl, function.name, forward, path, problem, scope, expects)


def fla_peers(rec: Recurrence, function: FlaFunction, fla_function, l2norm: bool, call: Call, mode: str,
              importer=importlib.import_module) -> list[Contender]:
    """FLA's columns for one group: its Triton kernels (every backend its dispatcher would pick
    for this call switched off, FLA_TRITON), and, where its dispatcher picks a backend, the
    function as FLA runs it (a column named after the backend, "flashqla"). Asked with the
    mode's gradient setting: a backend may serve grad-free calls only."""
    mode_call = call.requiring_grad() if mode == FORWARD_BACKWARD else call
    keywords = fla_keywords(rec, function, mode_call)
    with torch.set_grad_enabled(mode == FORWARD_BACKWARD):
        path = fla_dispatch_path(fla_function, keywords, importer)
        try:
            switches, problem = triton_switches(fla_function, keywords, importer), None
        except LrdslError as exc:
            switches, problem = {}, str(exc)
        except AttributeError:  # the dispatch machinery moved: the path check below says so
            switches, problem = {}, None
    peers = [fla_contender(rec, function, fla_function, l2norm, importer, FLA_TRITON, switches, FLA_TRITON, problem)]
    if path not in (FLA_TRITON, "unknown"):
        peers.append(fla_contender(rec, function, fla_function, l2norm, importer, path, expects=path))
    return peers


def direct_peers(rec: Recurrence, baseline: FlaBaseline | None, shape: Shape, dtype, l2norm: bool,
                 importer=importlib.import_module, on_note=None) -> list[Contender]:
    """The libraries called directly (FlashQLA) where the spec is their recurrence in its plain
    form, the shape and dtype are theirs, and they import; training shapes only."""
    if baseline is None or is_decode(shape):
        return []
    peers = []
    for peer in baseline.direct:
        if dtype not in peer.dtypes or (shape.K, shape.V) != peer.head_dims:
            continue
        try:
            module = importer(peer.module)
        except Exception as exc:  # flash_qla raises ValueError at import on cards it does not support
            if on_note is not None and not isinstance(exc, ImportError):
                on_note(f"{peer.module} does not import ({type(exc).__name__}: {_first_line(exc)}): no {peer.label} column")
            continue
        peers.append(direct_contender(rec, peer, getattr(module, peer.function.name), l2norm))
    return peers


def direct_contender(rec: Recurrence, peer: DirectPeer, entry, l2norm: bool) -> Contender:
    missing = missing_parameters(rec, peer.function, entry, l2norm, peer.options)
    problem = None
    if missing:
        problem = f"{peer.module}.{peer.function.name} has no parameter {', '.join(missing)}"

    def forward(call: Call):
        return entry(**fla_keywords(rec, peer.function, call, peer.options))

    ran = FLA_BACKEND_LABELS.get(peer.module, peer.module)  # flash_qla: "flashqla", as FLA's column says
    return Contender(peer.label, f"{peer.module}.{peer.function.name}", forward, lambda call: ran, problem)


def run_mode(contender: Contender, call: Call, mode: str, leaf_names) -> dict:
    """One call in a mode: the named outputs the gate compares (o, final state, gradients)."""
    if mode != FORWARD_BACKWARD:
        with torch.no_grad():
            o, final_state = contender.forward(call)
        return {"o": o, "final state": final_state}
    o, final_state = contender.forward(call)
    # allow_unused: an input an implementation ignores gets no gradient, which the gate names
    grads = torch.autograd.grad(o, call.tensors, call.d_o, allow_unused=True)
    return {"o": o.detach(), "final state": final_state.detach(),
            **{f"grad {name}": g for name, g in zip(leaf_names, grads)}}


def oracle_outputs(rec: Recurrence, call: Call, leaf_names, gradients: bool) -> dict:
    """The float64 oracle's outputs for `call` (gradients of <o, d_o> too when asked)."""
    leaves = [t.detach().to(torch.float64).requires_grad_(gradients) for t in call.tensors]
    h0 = None if call.initial_state is None else call.initial_state.to(torch.float64)
    with torch.set_grad_enabled(gradients):
        o, final_state = reference.run(rec, *leaves, scale=call.scale, initial_state=h0, output_final_state=True,
                                       use_qk_l2norm_in_kernel=call.l2norm)
    outputs = {"o": o.detach(), "final state": final_state.detach()}
    if gradients:
        grads = torch.autograd.grad(o, leaves, call.d_o.to(torch.float64))
        outputs.update({f"grad {name}": g for name, g in zip(leaf_names, grads)})
    return outputs


# ---------------------------------------------------------------------------------------------
# Measuring
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Measurement:
    outputs: dict
    ms: float
    peak_mib: float | None = None
    cold_s: float | None = None


class NotCapturable(Exception):
    """A function could not be captured in a CUDA graph (a host sync, an unsupported call)."""


def measure_on_gpu(fn, input_bytes: int) -> Measurement:
    import triton.testing

    torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = fn()
    torch.cuda.synchronize()
    cold = time.perf_counter() - start
    # peak of one call alone: what the process already holds (other rows' outputs) is excluded,
    # the call's inputs are counted
    baseline = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - baseline + input_bytes) / 2**20
    ms = float(triton.testing.do_bench(fn, warmup=50, rep=200, return_mode="median"))
    return Measurement(outputs, ms, peak, cold)


def measure_graph_replay(fn, input_bytes: int) -> Measurement:
    """Capture one call in a CUDA graph over the same (static) input buffers, replay it, time the
    replays. The outputs returned are the replay's, so the gate checks what the graph computed."""
    import triton.testing

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # capture needs compiled kernels and a warm allocator, on a stream other than the default
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            static_outputs = fn()
    except Exception as exc:
        torch.cuda.synchronize()
        raise NotCapturable(f"not capturable in a CUDA graph: {type(exc).__name__}: {_first_line(exc)}") from None
    graph.replay()
    torch.cuda.synchronize()
    outputs = {name: t.clone() for name, t in static_outputs.items()}
    ms = float(triton.testing.do_bench(graph.replay, warmup=50, rep=200, return_mode="median"))
    return Measurement(outputs, ms)


def measure_once(fn, input_bytes: int) -> Measurement:
    """One call, wall clock: the CPU smoke test's stand-in (timings there mean nothing)."""
    start = time.perf_counter()
    outputs = fn()
    elapsed = time.perf_counter() - start
    return Measurement(outputs, elapsed * 1e3, None, elapsed)


def measurers(device: str) -> dict:
    if device != "cuda":
        return {mode: measure_once for mode in MODES}
    return {FORWARD: measure_on_gpu, FORWARD_BACKWARD: measure_on_gpu, DECODE: measure_on_gpu,
            DECODE_GRAPH: measure_graph_replay}


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else ""


# ---------------------------------------------------------------------------------------------
# Rows and the correctness gate
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BenchRow:
    spec: str
    mode: str  # fwd, fwd+bwd, decode, decode graph
    shape: str  # shape_label
    impl: str  # lrdsl or a peer's column: fla-triton, flashqla (FLA's dispatch), flashqla-direct
    kernel: str
    path: str  # the code that ran: lrdsl, fla-triton, flashqla
    status: str = "ok"  # ok or FAILED
    reason: str = ""  # why FAILED
    ms: float | None = None
    tflops: float | None = None  # training modes
    state_tbps: float | None = None  # decode modes: fp32 state read + written per second
    peak_mib: float | None = None
    cold_s: float | None = None
    err_vs_oracle: float | None = None  # the worst relative error of any output vs the float64 oracle
    worst_vs_oracle: str = ""  # which output that is
    diff_vs_other: float | None = None  # the worst relative difference from the other side (lrdsl vs peers)
    ratios: dict = field(default_factory=dict)  # lrdsl rows that are ok: {peer: peer ms / this row's ms}, ok peers
    vs_pool: float | None = None  # serving rows: this row's ms / the fp32 pool decode's (same timing kind)
    copy_tbps: float | None = None  # rows with state_tbps, on a GPU: the card's copy bandwidth (read + written)
    of_copy: float | None = None  # state_tbps / copy_tbps

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def relative_error(out: torch.Tensor | None, ref: torch.Tensor | None) -> float:
    """||out - ref|| / ||ref|| in float64 on the tensors' own device (a full-shape gradient is a
    GiB in float64: copying it to the host would cost more than the kernels); inf when out is
    missing or not finite, so it never passes."""
    if out is None or ref is None:
        return math.inf
    out = out.detach().to(torch.float64)
    ref = ref.detach().to(out.device, torch.float64)
    if out.shape != ref.shape or not torch.isfinite(out).all():
        return math.inf
    denominator = ref.norm().item()
    difference = (out - ref).norm().item()
    return difference / denominator if denominator > 0 else difference


def worst_error(outputs: dict, references: dict, prefix=None) -> tuple[float, str]:
    """(worst relative error, its output's name) over the outputs `references` has; with
    `prefix` = (sequences, tokens), o is cut to that prefix first (a full-shape run's o)."""
    errors = {}
    for name, ref in references.items():
        out = outputs.get(name)
        if prefix is not None:
            if name != "o":
                continue
            out, name = out[: prefix[0], : prefix[1]], "o (full run, prefix)"
        errors[name] = relative_error(out, ref)
    worst = max(errors, key=errors.get)
    return errors[worst], worst


def broken_outputs(outputs: dict) -> list[str]:
    """Outputs that are missing (a gradient an implementation did not produce) or not finite."""
    missing = [f"{name} missing" for name, t in outputs.items() if t is None]
    return missing + [f"{name} not finite" for name, t in outputs.items() if t is not None and not torch.isfinite(t).all()]


@dataclass(eq=False)  # compared by identity: fields hold tensors
class _Result:
    """What one contender gave in one group, before the rows are made."""

    contender: Contender
    path: str
    measurement: Measurement | None = None
    error: str = ""  # it raised, or cannot run
    oracle_error: float | None = None
    oracle_worst: str = ""
    failures: list = field(default_factory=list)


def run_group(spec: str, rec: Recurrence, contenders, call: Call, shape: Shape, mode: str, oracle: dict,
              measure, prefix: tuple[int, int], tolerance: float) -> list[BenchRow]:
    """Every contender in one (spec, shape, mode): measured, gated, then compared with each other."""
    names = ["q", "k", "v"] + [i.name for i in rec.inputs]
    mode_call = call.requiring_grad() if mode == FORWARD_BACKWARD else call
    full = prefix == (shape.B, shape.T)
    prefix_call = None if full else call.prefix(rec, *prefix)
    if prefix_call is not None and mode == FORWARD_BACKWARD:
        prefix_call = prefix_call.requiring_grad()
    # a graph replay runs the eager call's kernels, so the prefix re-run is the eager call
    prefix_mode = DECODE if mode == DECODE_GRAPH else mode
    wanted = {name: ref for name, ref in oracle.items() if mode == FORWARD_BACKWARD or not name.startswith("grad ")}

    results = []
    for contender in contenders:
        result = _Result(contender, path="-")
        results.append(result)
        if contender.problem:
            result.error = contender.problem
            continue
        try:
            with contender.scope():  # every call of it, the backward and the prefix re-run included
                with torch.set_grad_enabled(mode == FORWARD_BACKWARD):  # as its calls run: a backend may care
                    result.path = contender.path(mode_call)
                if contender.expects is not None and result.path != contender.expects:
                    result.error = f"ran {result.path}, not {contender.expects}"
                    continue
                result.measurement = measure(lambda: run_mode(contender, mode_call, mode, names), mode_call.nbytes())
                outputs = result.measurement.outputs
                if full:
                    result.oracle_error, result.oracle_worst = worst_error(outputs, wanted)
                else:
                    prefix_outputs = run_mode(contender, prefix_call, prefix_mode, names)
                    checks = [worst_error(prefix_outputs, wanted), worst_error(outputs, wanted, prefix)]
                    result.oracle_error, result.oracle_worst = max(checks)
        except Exception as exc:  # a refused shape, a crash, an uncapturable call: a FAILED row, not a lost run
            result.measurement = None
            result.error = f"{type(exc).__name__}: {_first_line(exc)}"
            continue
        result.failures += broken_outputs(outputs)
        if result.oracle_error > tolerance:
            result.failures.append(f"{result.oracle_worst} differs from the float64 oracle by {result.oracle_error:.1e}")

    return _rows(spec, shape, mode, results, tolerance)


def _difference(a: _Result, b: _Result) -> float:
    """The worst relative difference between two implementations' outputs (a's names)."""
    return max(relative_error(t, b.measurement.outputs.get(name)) for name, t in a.measurement.outputs.items())


def _rows(spec: str, shape: Shape, mode: str, results: list[_Result], tolerance: float) -> list[BenchRow]:
    """Cross-check the implementations against each other at the full shape, then make the rows.

    Every two rows of different implementations that each pass the oracle are compared (lrdsl's
    rows with each other are not: one compiler). A difference beyond the tolerance fails both,
    since the check alone cannot say which is wrong, unless one of them agrees with a third
    implementation that also differs from the other: then only the odd one out fails. A row that
    already failed fails no other. "vs other" is each lrdsl row's worst difference from the
    peers, and each peer's from lrdsl's rows."""
    measured = [r for r in results if r.measurement is not None]
    passed = [r for r in measured if not r.error and not r.failures]
    diffs = {}
    for a, b in itertools.combinations(measured, 2):
        if a.contender.impl != b.contender.impl:  # each relative to the other's norm
            diffs[(id(a), id(b))], diffs[(id(b), id(a))] = _difference(a, b), _difference(b, a)

    def agree(a, b) -> bool:
        return diffs.get((id(a), id(b)), math.inf) <= tolerance

    for r in passed:
        for other in passed:
            if (id(r), id(other)) not in diffs or agree(r, other):
                continue
            third_sides_with_r = any(t is not r and t is not other and t.contender.impl not in (r.contender.impl, other.contender.impl)
                                     and agree(r, t) and (id(t), id(other)) in diffs and not agree(t, other) for t in passed)
            if not third_sides_with_r:
                r.failures.append(f"differs from {other.contender.impl} {other.contender.kernel} by "
                                  f"{diffs[(id(r), id(other))]:.1e}")

    rows = []
    for r in results:
        m = r.measurement
        reasons = ([r.error] if r.error else []) + r.failures
        counterparts = [o for o in measured if (id(r), id(o)) in diffs and LRDSL in (r.contender.impl, o.contender.impl)]
        rows.append(BenchRow(
            spec=spec, mode=mode, shape=shape_label(shape), impl=r.contender.impl, kernel=r.contender.kernel,
            path=r.path, status="FAILED" if reasons else "ok", reason="; ".join(reasons),
            ms=m.ms if m else None,
            tflops=_tflops(shape, mode, m.ms) if m and not is_decode(shape) else None,
            state_tbps=_state_tbps(shape, m.ms) if m and is_decode(shape) else None,
            peak_mib=m.peak_mib if m else None, cold_s=m.cold_s if m else None,
            err_vs_oracle=r.oracle_error, worst_vs_oracle=r.oracle_worst,
            diff_vs_other=max((diffs[(id(r), id(o))] for o in counterparts), default=None),
        ))
    return with_ratios(rows)


def with_ratios(rows: list[BenchRow]) -> list[BenchRow]:
    """On each lrdsl row that is ok: {peer: peer ms / lrdsl ms} for every peer row of its group
    that is ok (a FAILED peer gets no number)."""
    peers: dict = {}
    for r in rows:
        if r.impl != LRDSL and r.ok:
            peers.setdefault((r.spec, r.shape, r.mode), []).append(r)
    out = []
    for r in rows:
        if r.impl == LRDSL and r.ok:
            r = replace(r, ratios={p.impl: p.ms / r.ms for p in peers.get((r.spec, r.shape, r.mode), ())})
        out.append(r)
    return out


def _tflops(shape: Shape, mode: str, ms: float) -> float:
    flops = 6 * shape.B * shape.T * shape.HV * shape.K * shape.V * (3 if mode == FORWARD_BACKWARD else 1)
    return flops / (ms * 1e-3) / 1e12


def state_bytes(shape: Shape) -> int:
    """The fp32 state read (initial) and written (final) once per decode step."""
    return 2 * shape.B * shape.HV * shape.K * shape.V * 4


def _state_tbps(shape: Shape, ms: float) -> float:
    return state_bytes(shape) / (ms * 1e-3) / 1e12


# ---------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SpecUnderTest:
    name: str
    rec: Recurrence
    module: object  # the generated module (or anything with chunk / recurrent of its signature)


def bench(specs, shapes, plans=None, backward: bool = False, device: str = "cuda", dtype=torch.bfloat16,
          seed: int = 0, importer=importlib.import_module, oracle_tokens: int = ORACLE_TOKENS,
          on_rows=None, on_note=None, serving: bool = False, chunk_sizes=None,
          copy_tbps: float | None = None) -> list[BenchRow]:
    """Rows for every spec x shape x mode: the peers' (FLA's Triton kernels and the backend its
    dispatcher picks, where it has a counterpart and is installed; FlashQLA called directly,
    where it applies), then lrdsl's per plan (None: the module's default plan) and chunk size
    (None: the module's choice), each gated on correctness; with `serving`, the serving rows at
    each decode shape after its decode rows. Rows with a state TB/s carry the card's copy
    bandwidth, measured once (on a GPU; `copy_tbps`: measured already, by a caller that runs
    bench() piece by piece).
    `on_rows` gets each group's rows as soon as they exist (a long run shows progress), `on_note`
    one-line notes (a skipped shape)."""
    rows: list[BenchRow] = []
    generator = torch.Generator().manual_seed(seed)
    measure = measurers(device)
    tolerance = TOLERANCE[dtype]
    if copy_tbps is None and any(is_decode(s) for s in shapes):
        copy_tbps = measure_copy_tbps(device)
        if copy_tbps is not None and on_note is not None:
            on_note(f"this card copies {copy_tbps:.2f} TB/s ({COPY_BYTES >> 30} GiB device to device, bytes read + written)")

    def emit(group):
        group = with_copy_bandwidth(group, copy_tbps)
        rows.extend(group)
        if on_rows is not None:
            on_rows(group)

    for spec in specs:
        baseline = fla_baseline(spec.rec)
        fla = resolve_fla(baseline, importer)
        for shape in shapes:
            decode = is_decode(shape)
            function = None if baseline is None else (baseline.recurrent if decode else baseline.chunk)
            l2norm = function is None or function.l2norm
            if decode:
                ours = lrdsl_contenders(spec.module, decode=True, plans=())
            else:
                ours = lrdsl_contenders(spec.module, decode=False, plans=plans or [spec.module.DEFAULT_CHUNK_PLAN],
                                        chunk_sizes=chunk_sizes or (None,))
            direct = direct_peers(spec.rec, baseline, shape, dtype, l2norm, importer, on_note)

            modes = modes_for(shape, backward, device)
            call = make_call(spec.rec, shape, dtype, device, generator, l2norm)
            prefix = oracle_prefix(shape, oracle_tokens)
            names = ["q", "k", "v"] + [i.name for i in spec.rec.inputs]
            oracle = oracle_outputs(spec.rec, call.prefix(spec.rec, *prefix), names,
                                    gradients=FORWARD_BACKWARD in modes)
            for mode in modes:
                peers = [] if fla is None else fla_peers(spec.rec, function, fla[1 if decode else 0], l2norm, call, mode,
                                                         importer)
                emit(run_group(spec.name, spec.rec, peers + direct + ours, call, shape, mode, oracle, measure[mode],
                               prefix, tolerance))
            del call, oracle
            if serving and decode:
                emit(serving_rows(spec, shape, device, dtype, generator, measure, tolerance))
            if device == "cuda":
                torch.cuda.empty_cache()
    return rows


# One device-to-device copy this large gives the card's copy bandwidth (far above its L2)
COPY_BYTES = 1 << 30


def measure_copy_tbps(device: str, nbytes: int = COPY_BYTES) -> float | None:
    """The card's measured copy bandwidth in TB/s (bytes read + written per second, median of
    do_bench over one copy of `nbytes`): what a decode step's state traffic is held against.
    None off a GPU."""
    if device != "cuda":
        return None
    import triton.testing

    source = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda").normal_()
    target = torch.empty_like(source)
    ms = float(triton.testing.do_bench(lambda: target.copy_(source), warmup=25, rep=100, return_mode="median"))
    del source, target
    torch.cuda.empty_cache()
    return 2 * nbytes / (ms * 1e-3) / 1e12


def with_copy_bandwidth(rows: list[BenchRow], copy_tbps: float | None) -> list[BenchRow]:
    """Rows with a state TB/s get the card's copy bandwidth and their fraction of it."""
    if copy_tbps is None:
        return rows
    return [replace(r, copy_tbps=copy_tbps, of_copy=r.state_tbps / copy_tbps) if r.state_tbps is not None else r
            for r in rows]


# ---------------------------------------------------------------------------------------------
# Serving rows: a state pool, verify and commit (lrdsl only)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ServingCase:
    """The inputs of every serving row at one decode shape, and the oracle's results for them."""

    decode: tuple  # one token per sequence: q, k, v, the spec's inputs
    drafts: tuple  # DRAFT_TOKENS tokens per sequence
    indices: torch.Tensor  # [B] int32: B distinct rows of a pool of 2B, in random order
    accepted: torch.Tensor  # [B] int32 in 0 .. DRAFT_TOKENS, the first DRAFT_TOKENS
    start: dict  # state dtype -> the pool's start [2B, HV, K, V] (bf16: the fp32 start rounded)
    expected: dict  # call -> {output name: the oracle's float64 tensor}


def make_serving_case(rec: Recurrence, shape: Shape, dtype, device, generator) -> ServingCase:
    B, P = shape.B, 2 * shape.B
    decode = tuple(t.to(device) for t in make_inputs(rec, shape, dtype=dtype, generator=generator, normalize_keys=False))
    drafts = tuple(t.to(device) for t in make_inputs(rec, replace(shape, T=DRAFT_TOKENS), dtype=dtype, generator=generator,
                                                     normalize_keys=False))
    indices = torch.randperm(P, generator=generator)[:B].to(device, torch.int32)
    accepted = torch.randint(0, DRAFT_TOKENS + 1, (B,), generator=generator)
    # the first sequence accepts every draft token: with all counts 0 the pool rows would keep
    # their start, and a commit that writes nothing would pass the oracle gate
    accepted[0] = DRAFT_TOKENS
    accepted = accepted.to(device, torch.int32)
    start32 = (torch.randn(P, shape.HV, shape.K, shape.V, generator=generator) * 0.1).to(device)
    start = {torch.float32: start32, torch.bfloat16: start32.to(torch.bfloat16)}
    options = dict(output_final_state=True, use_qk_l2norm_in_kernel=True)
    expected = {}
    for call in (POOL, POOL_BF16):
        h0 = start[SERVING_CALLS[call][0]].double()[indices.long()]
        o, final = reference.run(rec, *decode, initial_state=h0, **options)
        expected[call] = {"o": o, "pool rows": final}
    h0 = start32.double()[indices.long()]
    o, _ = reference.run(rec, *drafts, initial_state=h0, **options)
    expected[VERIFY] = {"o": o}
    # commit: each sequence's accepted tokens, packed into one varlen call of the oracle
    counts = accepted.long().cpu()
    per_token = [True] * 3 + [i.role.per_token for i in rec.inputs]
    packed = [torch.cat([x[n, :counts[n]] for n in range(B)])[None] if p else x for x, p in zip(drafts, per_token)]
    bounds = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)])
    _, final = reference.run(rec, *packed, initial_state=h0, cu_seqlens=bounds, **options)
    expected[VERIFY_COMMIT] = {"o": o, "pool rows": final}
    return ServingCase(decode, drafts, indices, accepted, start, expected)


def serving_call(module, case: ServingCase, call: str, pool, validate: bool, buffers: dict):
    """One serving call on `pool`: returns its outputs by name (o; the pool's rows of the batch
    where the call writes the pool). `buffers` holds o's buffer and the Draft, made on the first
    call (a graph replays into them)."""
    common = dict(state_pool=pool, state_indices=case.indices, validate=validate, use_qk_l2norm_in_kernel=True)
    if call in (POOL, POOL_BF16):
        o, _ = module.recurrent(*case.decode, out=buffers.get("o"), **common)
        buffers["o"] = o
        return {"o": o}
    o, draft = module.verify(*case.drafts, out=buffers.get("o"), draft=buffers.get("draft"), **common)
    buffers.update(o=o, draft=draft)
    if call == VERIFY_COMMIT:
        module.commit(draft, case.accepted, validate=validate)
    return {"o": o}


def serving_gate(module, case: ServingCase, call: str, tolerance: float) -> tuple[float, str, list[str]]:
    """(worst error vs the oracle, its name, failures) of one call on a fresh pool."""
    state_dtype = SERVING_CALLS[call][0]
    pool = case.start[state_dtype].clone()
    with torch.no_grad():
        outputs = serving_call(module, case, call, pool, validate=True, buffers={})
    if call != VERIFY:
        outputs["pool rows"] = pool[case.indices.long()]
        others = torch.ones(pool.shape[0], dtype=torch.bool, device=pool.device)
        others[case.indices.long()] = False
        if not torch.equal(pool[others], case.start[state_dtype][others]):
            return math.inf, "pool rows", ["a pool row no sequence uses changed"]
    error, worst = worst_error(outputs, case.expected[call])
    failures = broken_outputs(outputs)
    if state_dtype == torch.bfloat16:  # the rows are rounded to bf16 whatever the inputs' dtype
        tolerance = max(tolerance, TOLERANCE[torch.bfloat16])
    if error > tolerance:
        failures.append(f"{worst} differs from the float64 oracle by {error:.1e}")
    return error, worst, failures


def serving_state_bytes(shape: Shape, call: str) -> int:
    state_dtype, passes = SERVING_CALLS[call]
    element = 2 if state_dtype == torch.bfloat16 else 4
    return passes * shape.B * shape.HV * shape.K * shape.V * element


def serving_rows(spec: SpecUnderTest, shape: Shape, device: str, dtype, generator, measure: dict,
                 tolerance: float) -> list[BenchRow]:
    """Every serving call at one decode shape, eager and (on a GPU) as a graph replay, each gated
    on one run against the oracle, then timed on a pool of its own."""
    case = make_serving_case(spec.rec, shape, dtype, device, generator)
    timings = [(DECODE, "")] + ([(DECODE_GRAPH, GRAPH)] if device == "cuda" else [])
    rows, pool_ms = [], {}
    for call in SERVING_CALLS:
        try:
            error, worst, failures = serving_gate(spec.module, case, call, tolerance)
        except Exception as exc:
            error, worst, failures = None, "", [f"{type(exc).__name__}: {_first_line(exc)}"]
        for timing, suffix in timings:
            pool = case.start[SERVING_CALLS[call][0]].clone()
            buffers: dict = {}
            reasons = list(failures)
            ms = None
            if not reasons:
                try:
                    with torch.no_grad():
                        serving_call(spec.module, case, call, pool, validate=False, buffers=buffers)  # buffers, compiled kernels
                        ms = measure[timing](lambda: serving_call(spec.module, case, call, pool, False, buffers), 0).ms
                except Exception as exc:
                    reasons.append(f"{type(exc).__name__}: {_first_line(exc)}")
            if call == POOL and ms is not None:
                pool_ms[timing] = ms
            rows.append(BenchRow(
                spec=spec.name, mode=call + suffix, shape=shape_label(shape), impl=LRDSL,
                kernel="verify+commit" if call == VERIFY_COMMIT else ("verify" if call == VERIFY else "recurrent[pool]"),
                path=LRDSL, status="FAILED" if reasons else "ok", reason="; ".join(reasons), ms=ms,
                state_tbps=serving_state_bytes(shape, call) / (ms * 1e-3) / 1e12 if ms else None,
                err_vs_oracle=error, worst_vs_oracle=worst,
                vs_pool=ms / pool_ms[timing] if ms and pool_ms.get(timing) else None,
            ))
    return rows


# ---------------------------------------------------------------------------------------------
# Output: table, ratio summary, JSON, plot
# ---------------------------------------------------------------------------------------------

_COLUMNS = (("spec", 10), ("mode", 19), ("shape", 15), ("impl", 15), ("kernel", 32), ("path", 10),
            ("time", 11), ("rate", 16), ("of copy", 7), ("peak MiB", 8), ("cold s", 6), ("vs oracle", 9),
            ("vs other", 8), ("peer/lrdsl", 50), ("x pool", 6), ("status", 0))
HEADER = " ".join(f"{name:<{width}}" if width else name for name, width in _COLUMNS)


def format_row(r: BenchRow) -> str:
    def number(value, fmt):
        return "-" if value is None else format(value, fmt)

    if r.ms is None:
        time_text = rate = "-"
    elif r.state_tbps is not None or r.mode in (DECODE, DECODE_GRAPH):
        # beside the card's copy bandwidth where it was measured: state / copy
        bandwidth = number(r.state_tbps, ".2f") + ("" if r.copy_tbps is None else f"/{r.copy_tbps:.2f}")
        time_text, rate = f"{r.ms * 1e3:.1f} us", f"{bandwidth} TB/s"
    else:
        time_text, rate = f"{r.ms:.3f} ms", f"{number(r.tflops, '.1f')} TFLOP/s"
    status = r.status if r.ok else f"FAILED: {r.reason}"
    ratios = " ".join(f"{peer} {value:.2f}" for peer, value in r.ratios.items()) or "-"
    cells = [r.spec, r.mode, r.shape, r.impl, r.kernel, r.path, time_text, rate, number(r.of_copy, ".2f"),
             number(r.peak_mib, ".0f"), number(r.cold_s, ".1f"), number(r.err_vs_oracle, ".1e"),
             number(r.diff_vs_other, ".1e"), ratios, number(r.vs_pool, ".2f"), status]
    return " ".join(f"{cell:<{width}}" if width else cell for cell, (_, width) in zip(cells, _COLUMNS))


def peers_of(rows: list[BenchRow]) -> list[str]:
    """The peer columns the rows have, in the order they first appear (FLA's Triton kernels first)."""
    return list(dict.fromkeys(r.impl for r in rows if r.impl != LRDSL and r.mode in MODES))


def ratio_summary(rows: list[BenchRow]) -> dict:
    """{(spec, shape): {mode: {peer: ratio | "FAILED"}}} from each group's first lrdsl row (the
    first plan asked for): peer ms / lrdsl ms where both rows are ok, "FAILED" where either
    failed; {} for a mode without peers (no FLA counterpart, or fla-core not installed)."""
    groups: dict = {}
    for r in rows:
        if r.impl != LRDSL or r.mode not in MODES:  # serving rows have no peers
            continue
        modes = groups.setdefault((r.spec, r.shape), {})
        if r.mode in modes:
            continue
        peers = [x.impl for x in rows if x.impl != LRDSL and (x.spec, x.shape, x.mode) == (r.spec, r.shape, r.mode)]
        modes[r.mode] = {peer: r.ratios.get(peer, "FAILED") for peer in dict.fromkeys(peers)}
    return groups


def format_summary(rows: list[BenchRow]) -> str:
    summary = ratio_summary(rows)
    peers = peers_of(rows)
    columns = [(m, p) for m in MODES for p in peers if any(p in v.get(m, {}) for v in summary.values())]
    labels = [f"{m} {p}" for m, p in columns]
    widths = [max(len(label), 8) for label in labels]
    header = f"{'spec':<10} {'shape':<15} " + " ".join(f"{label:>{w}}" for label, w in zip(labels, widths))
    lines = ["peer ms / lrdsl ms (above 1: lrdsl faster)", header, "-" * len(header)]
    for (spec, shape), values in summary.items():
        cells = []
        for (m, p), w in zip(columns, widths):
            value = values.get(m, {}).get(p, "-")
            cells.append(f"{value:>{w}.2f}" if isinstance(value, float) else f"{value:>{w}}")
        alone = "  (no peer)" if not any(values.values()) else ""
        lines.append(f"{spec:<10} {shape:<15} " + " ".join(cells) + alone)
    return "\n".join(lines)


def to_json(rows: list[BenchRow]) -> str:
    return json.dumps([asdict(r) for r in rows], indent=1)


def rows_from_json(path) -> list[BenchRow]:
    """The rows a --json file holds (runs split over several processes are combined this way).
    Files written before the peers had columns of their own (one "fla-core" row per group, a
    single "ratio") are read as the column their path names."""
    try:
        records = json.loads(open(path).read())
        return [BenchRow(**record) for record in _with_peer_columns(records)]
    except OSError as exc:
        raise LrdslError(f"--from-json {path}: {exc.strerror}") from None
    except (ValueError, TypeError, AttributeError, KeyError) as exc:
        raise LrdslError(f"--from-json {path}: not rows written by lrdsl bench --json ({_first_line(exc)})") from None


def _with_peer_columns(records: list) -> list:
    """Old records made new: the "fla-core" row is the column of the code it ran (its path),
    and an lrdsl row's "ratio" the ratio to that column."""
    if not any("ratio" in record for record in records):
        return records
    column = {}
    for record in records:
        if record["impl"] == FLA:
            column[(record["spec"], record["shape"], record["mode"])] = record["path"] if record["path"] not in ("-", "unknown") else FLA
    upgraded = []
    for record in records:
        record = dict(record)
        ratio = record.pop("ratio", None)
        if record["impl"] == FLA:
            record["impl"] = column[(record["spec"], record["shape"], record["mode"])]
        elif ratio is not None:
            record["ratios"] = {column[(record["spec"], record["shape"], record["mode"])]: ratio}
        upgraded.append(record)
    return upgraded


def require_matplotlib() -> None:
    """--plot's one dependency, checked before any GPU time is spent."""
    if importlib.util.find_spec("matplotlib") is None:
        raise LrdslError("--plot needs matplotlib, which is not installed (pip install matplotlib)")


def plot_ratios(rows: list[BenchRow], path) -> None:
    """A PNG: per spec, peer ms / lrdsl ms per shape, one bar per mode and peer, a line at 1.0
    (parity)."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")  # files only: no display
    import matplotlib.pyplot as plt

    summary = ratio_summary(rows)
    specs = list(dict.fromkeys(spec for spec, _ in summary))
    if not specs:
        raise LrdslError("--plot: no lrdsl rows to plot")
    peers = peers_of(rows)
    series = [(m, p) for m in MODES for p in peers if any(p in v.get(m, {}) for v in summary.values())]
    widest = max(sum(1 for s, _ in summary if s == spec) for spec in specs)
    bars = max([sum(len(v) for v in values.values()) for values in summary.values()] + [1])
    fig, axes = plt.subplots(len(specs), 1, figsize=(max(6.0, 0.4 * bars * widest + 4), 3.4 * len(specs)), squeeze=False)
    width = 0.8 / bars
    colors = {key: f"C{i}" for i, key in enumerate(series)}
    for ax, spec in zip(axes[:, 0], specs):
        shapes = [shape for s, shape in summary if s == spec]
        top = 1.0
        for j, shape in enumerate(shapes):
            present = [(m, p) for m, p in series if p in summary[(spec, shape)].get(m, {})]  # side by side
            for i, (mode, peer) in enumerate(present):
                value = summary[(spec, shape)][mode][peer]
                x = j + (i - (len(present) - 1) / 2) * width
                if isinstance(value, float):
                    ax.bar(x, value, width, color=colors[(mode, peer)])
                    ax.annotate(f"{value:.2f}", (x, value), ha="center", va="bottom", fontsize=7)
                    top = max(top, value)
                else:
                    ax.annotate(value, (x, 0), ha="center", va="bottom", rotation=90, fontsize=7,
                                color=colors[(mode, peer)])
            if not present:
                ax.annotate("no peer", (j, 0), ha="center", va="bottom", fontsize=7)
        ax.axhline(1.0, color="black", linestyle="--", linewidth=1)
        ax.set_xticks(range(len(shapes)))
        ax.set_xticklabels(shapes)
        ax.set_xlim(-0.6, len(shapes) - 0.4)
        ax.set_ylim(0, top * 1.15)
        ax.set_ylabel("peer ms / lrdsl ms")
        ax.set_title(f"{spec}: above 1, lrdsl is faster")
        own = [(m, p) for m, p in series if any(p in summary[(spec, shape)].get(m, {}) for shape in shapes)]
        if own:  # a spec without peers has only its "no peer" notes
            ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=colors[key]) for key in own],
                      labels=[f"{m} vs {p}" for m, p in own], fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
