"""Gated delta rule and KDA functions with fla-core 0.6.0's signatures, on lrdsl's generated kernels.

Code written against FLA switches by changing one import:

    from lrdsl.ops import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    from lrdsl.ops import chunk_kda, fused_recurrent_kda      # g per key channel [B, T, HV, K]

Parameter names, order and defaults are FLA's. FLA's flags that are really formulas select a
spec that lrdsl writes and compiles on first use (then caches), so every combination runs on
kernels generated for exactly it, none hand-written:

    use_gate_in_kernel (with A_log, dt_bias)   log_decay = -exp(A_log) * softplus(g + dt_bias)
    ... and lower_bound (KDA)                  log_decay = lower_bound * sigmoid(exp(A_log) * (g + dt_bias))
    use_beta_sigmoid_in_kernel                 beta = sigmoid(beta)
    allow_neg_eigval (with the above)          beta = 2 * sigmoid(beta)
    g=None (fused_recurrent_gated_delta_rule)  no decay

g is one log-decay per token and value head for the gated delta rule, one per key channel too
for KDA: the same flags then pick a spec with a key-channel gate (dt_bias [HV * K], as FLA's).

chunk_size (16, 32, 64) and cu_seqlens_cpu (chunk indices built on the host, no device
synchronisation) are honoured; `state_v_first=True` (states [N, HV, V, K], the layout serving
engines keep) is a layout option of the generated kernels, which read and write states in it
(no transposed copy); every option lrdsl does not implement raises an error rather than being
ignored. Bad tensors raise the generated module's InputError (a
ValueError) with one line naming the tensor and the expected shape.
"""
from __future__ import annotations

import warnings

import torch

from . import config
from .distributed import CPContext
from .errors import InputError
from .runtime.cache import atomic_write

CHUNK_SIZES = (16, 32, 64)


class OptionError(InputError):
    """An FLA option lrdsl does not implement, or a combination FLA itself refuses (one line)."""


# ---------------------------------------------------------------------------------------------
# Specs for FLA's flags, written on demand
# ---------------------------------------------------------------------------------------------

# The decay kinds FLA's delta-rule functions take: (spec name prefix, what it is, role of g, role of dt_bias)
DECAYS = {
    "scalar": ("fla_gdn", "Gated delta rule", "token", "head"),               # chunk_gated_delta_rule: g [B, T, HV]
    "key_channel": ("fla_kda", "KDA (key-channel delta rule)", "token_key", "head_key"),  # chunk_kda: g [B, T, HV, K]
}


def spec_text(gate: str, beta: str, has_dt_bias: bool = False, decay: str = "scalar",
              lower_bound: float | None = None, has_A_log: bool = True) -> tuple[str, str]:
    """(name, TOML text) of the spec FLA's flags describe.

    gate: "log" (g is the natural-log decay), "in_kernel" (g is the raw gate projection, with
    A_log and optionally dt_bias) or "none" (no decay). beta: "given", "sigmoid" or "2sigmoid".
    decay: "scalar" (one decay per token and value head, gated delta rule) or "key_channel" (one
    per key channel too, KDA: g and dt_bias then carry a key-channel axis). lower_bound (with
    gate "in_kernel"): FLA's bounded gate lower_bound * sigmoid(exp(A_log) * (g + dt_bias)),
    without A_log (has_A_log=False) lower_bound * sigmoid(g + dt_bias); the number is written into
    the formula, so each value is a spec of its own.
    """
    if decay not in DECAYS:
        raise ValueError(f"unknown decay kind {decay!r}")
    prefix, family, g_role, dt_bias_role = DECAYS[decay]
    inputs: list[tuple[str, str]] = []
    formulas: list[tuple[str, str]] = []
    name = [prefix]
    if gate == "log":
        inputs.append(("g", g_role))
        formulas.append(("log_decay", "g"))
    elif gate == "in_kernel" and lower_bound is not None:
        inputs.append(("g", g_role))
        argument = "g + dt_bias" if has_dt_bias else "g"
        argument = f"exp(A_log) * ({argument})" if has_A_log else argument
        bound = repr(float(lower_bound))
        formulas.append(("log_decay", f"{bound} * sigmoid({argument})"))
        # the bound in the name as an identifier: -5.0 -> m5p0, -1e-05 -> m1em05
        spelled = bound.replace("-", "m").replace(".", "p").replace("+", "")
        name.append(f"gate_lower_bound_{spelled}" + ("_dt_bias" if has_dt_bias else "") + ("" if has_A_log else "_no_A_log"))
    elif gate == "in_kernel":
        inputs.append(("g", g_role))
        argument = "g + dt_bias" if has_dt_bias else "g"
        formulas.append(("log_decay", f"-exp(A_log) * softplus({argument})"))
        name.append("gate_in_kernel" + ("_dt_bias" if has_dt_bias else ""))
    elif gate == "none" and decay == "scalar":
        name.append("no_gate")
    elif gate == "none":
        raise ValueError(f"a {decay} decay needs g: gate kind 'none' is the scalar family's")
    else:
        raise ValueError(f"unknown gate kind {gate!r}")
    inputs.append(("beta", "token"))
    beta_formula = {"given": "beta", "sigmoid": "sigmoid(beta)", "2sigmoid": "2 * sigmoid(beta)"}[beta]
    formulas.append(("beta", beta_formula))
    if beta != "given":
        name.append("beta_" + beta)
    if gate == "in_kernel":
        if has_A_log or lower_bound is None:
            inputs.append(("A_log", "head"))
        if has_dt_bias:
            inputs.append(("dt_bias", dt_bias_role))
    spec_name = "_".join(name)
    lines = [
        "# Written by lrdsl.ops for fla-core's flags; regenerated on demand, do not edit.",
        f'name = "{spec_name}"',
        f'summary = "{family}, FLA flags: gate {gate}, beta {beta_formula}"',
        "",
        "[recurrence]",
        'update = "delta"',
        f'gate = "{"none" if gate == "none" else decay}"',
        "",
        "[inputs]",
        *[f'{input_name} = "{role}"' for input_name, role in inputs],
        "",
        "[formulas]",
        *[f'{key} = "{formula}"' for key, formula in formulas],
        "",
    ]
    return spec_name, "\n".join(lines)


_modules: dict[tuple, object] = {}


def spec_module(gate: str, beta: str, has_dt_bias: bool = False, decay: str = "scalar",
                lower_bound: float | None = None, has_A_log: bool = True):
    """The generated module of spec_text(gate, beta, has_dt_bias, decay, lower_bound, has_A_log):
    the spec is written to the module cache directory and compiled through lrdsl.load (both
    cached)."""
    wanted = (gate, beta, has_dt_bias, decay, lower_bound, has_A_log)
    if wanted not in _modules:
        from . import load

        name, text = spec_text(gate, beta, has_dt_bias, decay, lower_bound, has_A_log)
        path = config.cache_dir() / "specs" / f"{name}.toml"
        if not path.exists() or path.read_text(encoding="utf-8") != text:
            atomic_write(path, text)
        _modules[wanted] = load(path)
    return _modules[wanted]


# ---------------------------------------------------------------------------------------------
# Option handling shared by both functions
# ---------------------------------------------------------------------------------------------

def _fail(fn: str, message: str):
    raise OptionError(f"{fn}: {message}")


def _state_layout(fn: str, state_v_first: bool, kwargs: dict) -> bool:
    """state_v_first as a bool (FLA's deprecated `transpose_state_layout` taken too)."""
    if "transpose_state_layout" in kwargs:  # FLA's deprecated name for state_v_first
        if state_v_first:
            _fail(fn, "pass either state_v_first or the deprecated transpose_state_layout, not both")
        warnings.warn("`transpose_state_layout` is deprecated and renamed to `state_v_first`.", DeprecationWarning,
                      stacklevel=3)
        state_v_first = kwargs.pop("transpose_state_layout")
    if not isinstance(state_v_first, bool):
        _fail(fn, f"state_v_first must be True or False, got {state_v_first!r}")
    return state_v_first


def _reject_unknown(fn: str, kwargs: dict, known: tuple[str, ...]) -> None:
    if "head_first" in kwargs:
        _fail(fn, "head_first was removed from FLA: inputs are [B, T, H, ...]")
    unknown = sorted(set(kwargs) - set(known))
    if unknown:
        _fail(fn, f"option {unknown[0]!r} is not supported (supported keyword options: {', '.join(known)})")


def _formula_flags(fn: str, g, use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel, allow_neg_eigval,
                   lower_bound=None):
    """(gate kind, beta kind, has dt_bias, the head inputs to pass after g and beta). lower_bound
    (KDA's bounded gate) lets A_log be None, as in FLA."""
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        _fail(fn, "allow_neg_eigval=True requires use_beta_sigmoid_in_kernel=True")
    beta = ("2sigmoid" if allow_neg_eigval else "sigmoid") if use_beta_sigmoid_in_kernel else "given"
    if not use_gate_in_kernel:
        # as in FLA, A_log, dt_bias and lower_bound are read only with use_gate_in_kernel
        return ("none" if g is None else "log"), beta, False, ()
    if g is None:
        _fail(fn, "use_gate_in_kernel=True needs g (the raw gate before its activation)")
    if A_log is None and lower_bound is None:
        _fail(fn, "use_gate_in_kernel=True needs A_log [HV]" + (" (or lower_bound)" if fn.endswith("kda") else ""))
    heads = tuple(x for x in (A_log, dt_bias) if x is not None)
    return "in_kernel", beta, dt_bias is not None, heads


# ---------------------------------------------------------------------------------------------
# The functions
# ---------------------------------------------------------------------------------------------

_CHUNK_KEYWORDS = ("chunk_size", "use_gate_in_kernel", "A_log", "dt_bias")
# ... and one more that lrdsl reads there: FLA's chunk_kda's option, which its gated delta rule lacks
_CHUNK_EXTRA_KEYWORDS = ("return_intermediate_states",)


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    cu_seqlens_cpu: torch.LongTensor | None = None,
    chunk_indices: torch.LongTensor | None = None,
    cp_context=None,
    **kwargs,
):
    """FLA's chunk_gated_delta_rule on lrdsl's chunk kernels: (o [B, T, HV, V], final state
    [N, HV, K, V] fp32 or None). Differentiable in q, k, v, g, beta, initial_state, A_log, dt_bias.
    return_intermediate_states=True, a keyword as in FLA's chunk_kda (FLA's gated delta rule has no
    such option, so its signature stays fla-core's): (o, final state or None, h), h the state at the
    start of every chunk (module.chunk()'s option of that name, which documents its shape and chunk
    size), without gradients.

    Keyword options as in FLA: chunk_size (16, 32, 64; default: the largest whose kernels fit,
    64 for 16-bit inputs up to K = 128, where FLA always takes 64), use_gate_in_kernel with
    A_log [HV] and dt_bias [HV] (g is then the raw gate). g=None: no decay (FLA requires g).
    state_v_first=True: initial and final states [N, HV, V, K]. cp_context: context
    parallelism, lrdsl.distributed.build_cp_context(global cu_seqlens, group) (module.chunk()'s
    cp_context: the tensors are this rank's slice; cu_seqlens None or cp_context.cu_seqlens;
    unlike FLA's, with initial_state of the sequences starting on this rank and the final states
    of those ending on it). Like FLA's, the backward keeps the solved systems
    and recomputes the rest (chunk()'s save_policy="save_states"): the memory a layer keeps for
    its backward stays FLA's; the module's chunk() keeps everything by default (faster, more
    memory kept per layer).
    """
    fn = "chunk_gated_delta_rule"
    state_v_first = _state_layout(fn, state_v_first, kwargs)
    _reject_unknown(fn, kwargs, _CHUNK_KEYWORDS + _CHUNK_EXTRA_KEYWORDS)
    cp_context = _cp_context(fn, cp_context)
    save_policy = _save_policy(fn, False)  # FLA's gated delta rule always recomputes
    chunk_size = kwargs.get("chunk_size")
    if chunk_size is not None and chunk_size not in CHUNK_SIZES:
        _fail(fn, f"chunk_size must be 16, 32 or 64, got {chunk_size!r}")
    gate, beta_kind, has_dt_bias, heads = _formula_flags(
        fn, g, kwargs.get("use_gate_in_kernel", False), kwargs.get("A_log"), kwargs.get("dt_bias"),
        use_beta_sigmoid_in_kernel, allow_neg_eigval)
    module = spec_module(gate, beta_kind, has_dt_bias)
    chunks = None if cp_context is not None else _host_chunks(fn, module, cu_seqlens, cu_seqlens_cpu, chunk_indices,
                                                              chunk_size, q, v)
    heads = _head_inputs(fn, kwargs.get("A_log"), kwargs.get("dt_bias"), v, g) if heads else ()
    extras = (beta, *heads) if gate == "none" else (g, beta, *heads)
    return module.chunk(
        q, k, v, *extras, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
        cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, chunk_size=chunk_size,
        chunk_indices=chunks, state_v_first=state_v_first, save_policy=save_policy, cp_context=cp_context,
        return_intermediate_states=kwargs.get("return_intermediate_states", False),
    )


def fused_recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None = None,
    gk: torch.Tensor | None = None,
    gv: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
    scale: float = None,
    initial_state: torch.Tensor = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FLA's fused_recurrent_gated_delta_rule on lrdsl's token-by-token kernel (decode):
    (o [B, T, HV, V], final state [N, HV, K, V] fp32 or None).

    g=None: no decay; beta=None: beta = 1 (as in FLA). state_v_first=True: initial and final
    states [N, HV, V, K]. gk and gv (per-key and per-value decays) are not supported and raise.
    Unlike FLA's, it is differentiable (the backward is the chunked one).
    """
    fn = "fused_recurrent_gated_delta_rule"
    state_v_first = _state_layout(fn, state_v_first, kwargs)
    _reject_unknown(fn, kwargs, ())
    if gk is not None or gv is not None:
        _fail(fn, "gk and gv (per-key and per-value decays) are not supported: pass the scalar decay g [B, T, HV]")
    gate, beta_kind, has_dt_bias, heads = _formula_flags(
        fn, g, use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    if beta is None and isinstance(v, torch.Tensor) and v.dim() == 4:
        beta = torch.ones(v.shape[:3], dtype=v.dtype, device=v.device)
    module = spec_module(gate, beta_kind, has_dt_bias)
    heads = _head_inputs(fn, A_log, dt_bias, v, g) if heads else ()
    extras = (beta, *heads) if gate == "none" else (g, beta, *heads)
    return module.recurrent(
        q, k, v, *extras, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
        cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, state_v_first=state_v_first,
    )


# What each FLA option lrdsl does not implement would do, for its one-line refusal. The option's
# default (False / None) is what lrdsl computes anyway, so that value is accepted silently.
_UNSUPPORTED = {
    "use_graph": "use_graph (FLA's fixed-shape varlen chunk list for graph capture) is not supported",
    "max_num_seqs": "max_num_seqs (only used with use_graph) is not supported",
}


def _reject_unsupported(fn: str, **options) -> None:
    """Refuse, in one line, any of these options set to something other than its default."""
    for option, value in options.items():
        if value is not None and value is not False:
            _fail(fn, f"{_UNSUPPORTED[option]}, got {option}={value!r}")


def _cp_context(fn: str, cp_context):
    """cp_context checked: None, or what lrdsl.distributed.build_cp_context returns."""
    if cp_context is not None and not isinstance(cp_context, CPContext):
        _fail(fn, f"cp_context must be what lrdsl.distributed.build_cp_context returns, got a {type(cp_context).__name__}")
    return cp_context


def _save_policy(fn: str, disable_recompute) -> str | None:
    """chunk()'s save_policy for FLA's disable_recompute. Both say what the backward recomputes,
    never what it computes: True, keep every forward activation the backward reads and recompute
    none, is save_policy "save"; False, FLA's default, is "save_states" (chunk()'s own default;
    like FLA then, which keeps its chunk-local solved matrices and recomputes the rest; lrdsl
    also keeps a few entry states where its re-run scan has few programs): the memory a layer
    keeps for its backward stays FLA's. Under torch.compile, where chunk() keeps nothing for its
    backward whatever the policy, False is chunk()'s own (None)."""
    if not isinstance(disable_recompute, bool):
        _fail(fn, f"disable_recompute must be True or False, got {disable_recompute!r}")
    if disable_recompute:
        return "save"
    return None if torch.compiler.is_compiling() else "save_states"


def _head_inputs(fn: str, A_log, dt_bias, v, g, decay: str = "scalar") -> tuple:
    """(A_log as [HV], dt_bias as [HV] or, KDA's, [HV, K]), those given, in FLA's shapes: any shape
    with their number of elements (A_log [1, 1, HV, 1], dt_bias flat [HV * K]), as FLA's kernels
    read them flat. Reshaped views where possible, so gradients come back in the given shapes."""
    if not isinstance(v, torch.Tensor) or v.dim() != 4:
        return tuple(x for x in (A_log, dt_bias) if x is not None)  # the module names the wrong tensor
    HV = v.shape[2]
    heads = []
    if isinstance(A_log, torch.Tensor) and A_log.dim() != 1 and A_log.numel() == HV:
        A_log = A_log.reshape(HV)
    if A_log is not None:
        heads.append(A_log)
    if isinstance(dt_bias, torch.Tensor):
        if decay == "key_channel" and isinstance(g, torch.Tensor) and g.dim() == 4:
            K = g.shape[3]
            if dt_bias.numel() != HV * K:
                _fail(fn, f"dt_bias must be [HV * K] = [{HV * K}] (or [HV, K]), got {list(dt_bias.shape)}")
            dt_bias = dt_bias.reshape(HV, K)
        elif decay == "scalar" and dt_bias.dim() != 1 and dt_bias.numel() == HV:
            dt_bias = dt_bias.reshape(HV)
    if dt_bias is not None:
        heads.append(dt_bias)
    return tuple(heads)


def _bounded_gate(fn: str, use_gate_in_kernel, safe_gate, lower_bound) -> float | None:
    """FLA's lower_bound as the number the gate formula uses (None: the softplus gate), checked as
    FLA checks it. It applies only with use_gate_in_kernel (else g is the decay itself, as in FLA).
    safe_gate selects FLA's kernels for gates bounded below (lrdsl's take any gate): with
    use_gate_in_kernel FLA requires a lower_bound in [-5, 0) then, and so does this."""
    if not isinstance(safe_gate, bool):
        _fail(fn, f"safe_gate must be True or False, got {safe_gate!r}")
    if not use_gate_in_kernel:
        return None
    if lower_bound is not None and (isinstance(lower_bound, bool) or not isinstance(lower_bound, (int, float))
                                    or not -float("inf") < lower_bound < 0):
        _fail(fn, f"lower_bound must be a finite negative number (the gate's least log decay), got {lower_bound!r}")
    if safe_gate and lower_bound is None:
        _fail(fn, "safe_gate=True with use_gate_in_kernel=True needs lower_bound (as in FLA)")
    if safe_gate and not -5 <= lower_bound < 0:
        _fail(fn, f"safe_gate=True needs lower_bound in [-5, 0) (as in FLA), got {lower_bound!r}")
    return None if lower_bound is None else float(lower_bound)


_KDA_CHUNK_KEYWORDS = ("chunk_size", "A_log", "dt_bias")


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    safe_gate: bool = False,
    lower_bound: float | None = None,
    disable_recompute: bool = False,
    return_intermediate_states: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    cu_seqlens_cpu: torch.LongTensor | None = None,
    cp_context=None,
    use_graph: bool = False,
    max_num_seqs: int | None = None,
    **kwargs,
):
    """FLA's chunk_kda on lrdsl's chunk kernels: (o [B, T, HV, V], final state [N, HV, K, V]
    fp32 or None). g is the log-decay per key channel [B, T, HV, K]; differentiable in q, k, v,
    g, beta, initial_state, A_log, dt_bias.

    Keyword options as in FLA: chunk_size (16, 32, 64; default: the largest whose kernels fit,
    64, or 32 at K > 128), A_log (HV elements, any shape: [HV], [1, 1, HV, 1]) and dt_bias
    ([HV * K] or any shape of HV * K elements) with use_gate_in_kernel=True (g is then the raw gate
    of -exp(A_log) * softplus(g + dt_bias); with lower_bound the bounded gate lower_bound *
    sigmoid(exp(A_log) * (g + dt_bias)), A_log optional there: lower_bound * sigmoid(g +
    dt_bias)). safe_gate selects FLA's kernels for bounded gates, the same result: accepted, with
    FLA's checks (with use_gate_in_kernel it needs lower_bound in [-5, 0)). state_v_first=True:
    initial and final states [N, HV, V, K]. disable_recompute=True keeps every forward buffer the
    backward reads, so it re-runs no forward kernel (chunk()'s save_policy="save"; more memory,
    the same gradients; eager only: under torch.compile chunk() keeps nothing for its backward).
    cp_context: context parallelism, as in chunk_gated_delta_rule. return_intermediate_states=True:
    (o, final state or None, h) as FLA's, h the state at the start of every chunk (module.chunk()'s
    option of that name, which documents its shape and chunk size; FLA requires inference mode,
    lrdsl refuses only a call that needs gradients). use_graph and max_num_seqs are not
    supported: anything but their defaults raises.
    """
    fn = "chunk_kda"
    state_v_first = _state_layout(fn, state_v_first, kwargs)
    _reject_unknown(fn, kwargs, _KDA_CHUNK_KEYWORDS)
    _reject_unsupported(fn, use_graph=use_graph, max_num_seqs=max_num_seqs)
    cp_context = _cp_context(fn, cp_context)
    bound = _bounded_gate(fn, use_gate_in_kernel, safe_gate, lower_bound)
    save_policy = _save_policy(fn, disable_recompute)
    if g is None:
        _fail(fn, "g [B, T, HV, K] is required (KDA decays per key channel)")
    chunk_size = kwargs.get("chunk_size")
    if chunk_size is not None and chunk_size not in CHUNK_SIZES:
        _fail(fn, f"chunk_size must be 16, 32 or 64, got {chunk_size!r}")
    A_log, dt_bias = kwargs.get("A_log"), kwargs.get("dt_bias")
    gate, beta_kind, has_dt_bias, heads = _formula_flags(
        fn, g, use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel, allow_neg_eigval, bound)
    module = spec_module(gate, beta_kind, has_dt_bias, decay="key_channel", lower_bound=bound,
                         has_A_log=A_log is not None)
    chunks = None if cp_context is not None else _host_chunks(fn, module, cu_seqlens, cu_seqlens_cpu, None, chunk_size, q, v)
    heads = _head_inputs(fn, A_log, dt_bias, v, g, "key_channel") if heads else ()
    return module.chunk(
        q, k, v, g, beta, *heads, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        chunk_size=chunk_size, chunk_indices=chunks, state_v_first=state_v_first, save_policy=save_policy,
        cp_context=cp_context, return_intermediate_states=return_intermediate_states,
    )


def fused_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    lower_bound: float | None = None,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FLA's fused_recurrent_kda on lrdsl's token-by-token kernel (decode): (o [B, T, HV, V],
    final state [N, HV, K, V] fp32 or None). g [B, T, HV, K]; with use_gate_in_kernel=True the raw
    gate of -exp(A_log) * softplus(g + dt_bias), A_log [HV], dt_bias [HV * K] (as chunk_kda's).
    lower_bound with use_gate_in_kernel=True: the bounded gate, as chunk_kda's. state_v_first=True:
    initial and final states [N, HV, V, K]. Unlike FLA's, it is differentiable (the backward is
    the chunked one).
    """
    fn = "fused_recurrent_kda"
    state_v_first = _state_layout(fn, state_v_first, kwargs)
    _reject_unknown(fn, kwargs, ())
    bound = _bounded_gate(fn, use_gate_in_kernel, False, lower_bound)
    if g is None:
        _fail(fn, "g [B, T, HV, K] is required (KDA decays per key channel)")
    gate, beta_kind, has_dt_bias, heads = _formula_flags(
        fn, g, use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel, allow_neg_eigval, bound)
    module = spec_module(gate, beta_kind, has_dt_bias, decay="key_channel", lower_bound=bound,
                         has_A_log=A_log is not None)
    heads = _head_inputs(fn, A_log, dt_bias, v, g, "key_channel") if heads else ()
    return module.recurrent(
        q, k, v, g, beta, *heads, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        state_v_first=state_v_first,
    )


def _host_chunks(fn, module, cu_seqlens, cu_seqlens_cpu, chunk_indices, chunk_size, q, v):
    """The chunk_indices for the module's chunk(), or None.

    Where the caller gave lrdsl nothing to keep to (no cu_seqlens_cpu, no chunk_indices), None:
    chunk() counts the chunks itself. With them, the chunks of the given chunk size (else of the
    one chunk() picks) are counted on the host: on cu_seqlens_cpu (no device synchronisation), or,
    for FLA's chunk_indices alone, on one host copy of cu_seqlens (one). Counted on the host, they
    leave chunk()'s backward free to recompute at its own chunk size, BACKWARD_CHUNK_SIZE, where the
    caller gave no chunk_size: chunk() counts that size's chunks on the same host copy."""
    if cu_seqlens is None or (cu_seqlens_cpu is None and chunk_indices is None):
        return None
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (q, v)) or not isinstance(cu_seqlens, torch.Tensor):
        return None  # chunk() names the wrong tensor itself
    if chunk_size is None:  # chunk()'s own
        chunk_size = module._default_chunk_size(fn, q, q.shape[-1], "input", module.DEFAULT_CHUNK_PLAN, v.shape[-1])
    return _varlen_chunks(fn, module, cu_seqlens, cu_seqlens_cpu, chunk_indices, chunk_size)


def _varlen_chunks(fn, module, cu_seqlens, cu_seqlens_cpu, chunk_indices, chunk_size):
    """The module's chunks of the packed sequences (what its prepare_varlen returns), counted on
    the host copy of cu_seqlens: cu_seqlens_cpu when given, else one copied here.

    FLA's own chunk_indices table ([NC, 2] (sequence, chunk) pairs) says nothing the count does
    not, so it is only checked against it: a table made for another chunk size would send the
    kernels past the sequences' ends."""
    if cu_seqlens_cpu is None:
        cu_seqlens_cpu = cu_seqlens.cpu()  # the one synchronisation
    if not isinstance(cu_seqlens_cpu, torch.Tensor) or cu_seqlens_cpu.device.type != "cpu":
        _fail(fn, "cu_seqlens_cpu must be a CPU tensor (the host copy of cu_seqlens)")
    if cu_seqlens_cpu.shape != cu_seqlens.shape:
        _fail(fn, f"cu_seqlens_cpu must have cu_seqlens's shape {list(cu_seqlens.shape)}, got {list(cu_seqlens_cpu.shape)}")
    chunks = module.prepare_varlen(cu_seqlens, chunk_size, cu_seqlens_cpu)
    if chunk_indices is not None:
        if not isinstance(chunk_indices, torch.Tensor) or chunk_indices.dim() != 2 or chunk_indices.shape[1] != 2:
            _fail(fn, "chunk_indices must be a [NC, 2] tensor of (sequence, chunk) pairs")
        if chunk_indices.shape[0] != chunks.indices.shape[0]:
            _fail(fn, f"chunk_indices has {chunk_indices.shape[0]} chunks but cu_seqlens has {chunks.indices.shape[0]} "
                      f"of chunk_size={chunk_size}: prepared for another chunk size?")
    return chunks
