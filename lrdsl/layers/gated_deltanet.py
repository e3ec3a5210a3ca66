"""Qwen3.5's Gated DeltaNet layer on lrdsl's generated kernels.

Parameter names and shapes are those of transformers' `Qwen3_5GatedDeltaNet`, so
`layer.load_state_dict(hf_layer.state_dict())` just works. The work per call:

    in_proj_qkv -> short causal convolution + SiLU (generated kernel) -> q, k, v
    in_proj_a, in_proj_b -> the raw gate and beta projections a, b
    gated delta rule of specs/gdn_qwen35.toml (generated kernels): gate -exp(A_log) softplus(a + dt_bias),
        beta sigmoid(b), q/k L2 norm inside the kernels, value head h reads key head h // (HV / H)
    RMSNorm of each value head times SiLU(in_proj_z) (generated kernel) -> out_proj

Padded positions (attention_mask == 0) are dropped before any of it: the real tokens of each row
run as one packed sequence (varlen), so padding never reaches the convolution window or the
recurrent state, and the output there is zero.
"""
from __future__ import annotations

import functools
from types import SimpleNamespace

import torch
from torch import nn

from ..errors import InputError
from .kernels import layer_kernels

# The shipped spec whose kernels run the recurrence: Qwen3.5's gate and beta computed in-kernel.
RECURRENCE_SPEC = "gdn_qwen35"

CONFIG_ATTRIBUTES = (
    "hidden_size", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
    "linear_value_head_dim", "linear_conv_kernel_dim", "hidden_act", "rms_norm_eps",
)

_recurrence_modules: dict[str, object] = {}


def recurrence_module():
    """The generated module of RECURRENCE_SPEC (compiled through the module cache once per process)."""
    if RECURRENCE_SPEC not in _recurrence_modules:
        from .. import load

        _recurrence_modules[RECURRENCE_SPEC] = load(RECURRENCE_SPEC)
    return _recurrence_modules[RECURRENCE_SPEC]


class GatedDeltaNetCache:
    """Per layer: the convolution window [N, conv_dim, W] (the last W inputs of the convolution,
    oldest first) and the recurrent state [N, HV, K, V] fp32.

    It has the methods of transformers' Cache that the layer calls, so the layer takes either
    this or a transformers cache (DynamicCache of a Qwen3.5 model).
    """

    def __init__(self):
        self.conv_states: dict[object, torch.Tensor] = {}
        self.recurrent_states: dict[object, torch.Tensor] = {}

    def get_conv_state(self, layer_idx, state_idx: int = 0):
        return self.conv_states.get(layer_idx)

    def get_recurrent_state(self, layer_idx, state_idx: int = 0):
        return self.recurrent_states.get(layer_idx)

    def update_conv_state(self, conv_state: torch.Tensor, layer_idx, state_idx: int = 0, **kwargs):
        self.conv_states[layer_idx] = conv_state
        return conv_state

    def update_recurrent_state(self, recurrent_state: torch.Tensor, layer_idx, state_idx: int = 0, **kwargs):
        self.recurrent_states[layer_idx] = recurrent_state
        return recurrent_state

    def reset(self) -> None:
        self.conv_states.clear()
        self.recurrent_states.clear()


class GatedRMSNorm(nn.Module):
    """RMSNorm over the last axis times weight and SiLU(gate); transformers' Qwen3_5RMSNormGated names."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return layer_kernels().gated_rms_norm(hidden_states, gate, self.weight, self.variance_epsilon)


def _check_config(config) -> None:
    missing = [name for name in CONFIG_ATTRIBUTES if not hasattr(config, name)]
    if missing:
        raise InputError(f"GatedDeltaNet: the config lacks {', '.join(missing)} (a Qwen3.5 text config has them)")
    if config.linear_num_value_heads % config.linear_num_key_heads:
        raise InputError(
            f"GatedDeltaNet: linear_num_value_heads={config.linear_num_value_heads} must be a multiple of "
            f"linear_num_key_heads={config.linear_num_key_heads}"
        )
    if config.hidden_act not in ("silu", "swish"):
        raise InputError(f"GatedDeltaNet: hidden_act {config.hidden_act!r} is not supported (the convolution applies SiLU)")


class GatedDeltaNet(nn.Module):
    """Qwen3.5's linear-attention layer: `forward(hidden_states, cache=None, attention_mask=None)`.

    config: any object with the Qwen3.5 text-config attributes in CONFIG_ATTRIBUTES.
    cache: a GatedDeltaNetCache or a transformers Cache; with one, the layer reads and updates
    its convolution window and recurrent state (a prefill of T tokens then one-token steps equals
    one prefill of all of them). attention_mask: [B, T], 1 for real tokens, 0 for padding.
    save_policy: what the chunked kernels keep from a training forward for the backward (None: the
    generated module's default, "save", which keeps every buffer the backward reads, about 58 KiB
    per token at Qwen3.5's 32 value heads; "save_states" keeps about 4 KiB, as FLA does, and
    recomputes the rest in the backward: for deep models trained without activation checkpointing;
    under torch.compile nothing is kept, whatever it says).
    """

    save_policy: str | None = None

    def __init__(self, config, layer_idx: int | None = None):
        super().__init__()
        _check_config(config)
        self.hidden_size = config.hidden_size
        self.num_v_heads = config.linear_num_value_heads
        self.num_k_heads = config.linear_num_key_heads
        self.head_k_dim = config.linear_key_head_dim
        self.head_v_dim = config.linear_value_head_dim
        self.key_dim = self.head_k_dim * self.num_k_heads
        self.value_dim = self.head_v_dim * self.num_v_heads
        self.conv_kernel_size = config.linear_conv_kernel_dim
        self.layer_idx = layer_idx
        self.activation = config.hidden_act
        self.layer_norm_epsilon = config.rms_norm_eps
        self.layer_type = "linear_attention"
        self.conv_dim = self.key_dim * 2 + self.value_dim
        # registered in transformers' order, so state dicts list the same keys in the same order
        self.conv1d = nn.Conv1d(
            in_channels=self.conv_dim, out_channels=self.conv_dim, bias=False, kernel_size=self.conv_kernel_size,
            groups=self.conv_dim, padding=self.conv_kernel_size - 1,
        )
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.log(torch.empty(self.num_v_heads).uniform_(0.01, 16)))
        self.norm = GatedRMSNorm(self.head_v_dim, eps=self.layer_norm_epsilon)
        self.out_proj = nn.Linear(self.value_dim, self.hidden_size, bias=False)
        self.in_proj_qkv = nn.Linear(self.hidden_size, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(self.hidden_size, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(self.hidden_size, self.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(self.hidden_size, self.num_v_heads, bias=False)
        # the kernels' modules now, not at the first forward: loading them (code generation, the
        # module cache) inside torch.compile's trace breaks the graph there, and the compiled
        # model keeps those breaks for every later step
        layer_kernels()
        recurrence_module()

    @classmethod
    def sharing_parameters_of(cls, layer: nn.Module) -> "GatedDeltaNet":
        """A GatedDeltaNet that holds `layer`'s own Parameter objects (no copy): `layer` is a
        transformers Qwen3.5 Gated DeltaNet (or any module with the same attributes and parameters)."""
        config = SimpleNamespace(
            hidden_size=layer.hidden_size, linear_num_key_heads=layer.num_k_heads,
            linear_num_value_heads=layer.num_v_heads, linear_key_head_dim=layer.head_k_dim,
            linear_value_head_dim=layer.head_v_dim, linear_conv_kernel_dim=layer.conv_kernel_size,
            hidden_act=layer.activation, rms_norm_eps=layer.layer_norm_epsilon,
        )
        with torch.device("meta"):  # no memory for parameters about to be replaced
            shared = cls(config, layer_idx=layer.layer_idx)
        theirs = dict(layer.named_parameters())
        ours = dict(shared.named_parameters())
        if set(theirs) != set(ours) or any(theirs[name].shape != ours[name].shape for name in ours):
            differing = sorted(set(theirs) ^ set(ours)) or [n for n in ours if theirs[n].shape != ours[n].shape]
            raise InputError(f"GatedDeltaNet: {type(layer).__name__}'s parameters differ from Qwen3.5's ({', '.join(differing)})")
        for name, parameter in theirs.items():
            owner, _, attribute = name.rpartition(".")
            setattr(shared.get_submodule(owner), attribute, parameter)
        return shared.train(layer.training)

    def extra_repr(self) -> str:
        return (f"heads {self.num_k_heads}/{self.num_v_heads}, head dims {self.head_k_dim}/{self.head_v_dim}, "
                f"kernels of {RECURRENCE_SPEC}")

    def forward(self, hidden_states: torch.Tensor, cache=None, attention_mask: torch.Tensor | None = None, **kwargs):
        # transformers' names for the same things: the deprecated cache keyword, packed sequences
        cache = kwargs.pop("cache_params", None) if cache is None else cache
        cu_seqlens = kwargs.pop("cu_seq_lens_q", None)
        cp_context = kwargs.pop("cp_context", None)  # context parallelism: lrdsl.distributed.build_cp_context
        self._check_input(hidden_states, attention_mask, cu_seqlens, cache)
        if cp_context is not None:
            if attention_mask is not None:
                raise InputError("GatedDeltaNet: cp_context takes packed sequences (its cu_seqlens), not an attention_mask")
            return self._mix(hidden_states, cache, cu_seqlens, cp_context)
        B, T, _ = hidden_states.shape
        kept = None
        if attention_mask is not None and not bool(attention_mask.bool().all()):
            kept, cu_seqlens = _pack(attention_mask.bool())
            hidden_states = hidden_states.reshape(B * T, -1).index_select(0, kept)[None]
        out = self._mix(hidden_states, cache, cu_seqlens)
        if kept is None:
            return out
        return out.new_zeros(B * T, self.hidden_size).index_copy(0, kept, out[0]).reshape(B, T, self.hidden_size)

    def _check_input(self, hidden_states, attention_mask, cu_seqlens, cache) -> None:
        if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() != 3 or hidden_states.shape[-1] != self.hidden_size:
            shape = list(hidden_states.shape) if isinstance(hidden_states, torch.Tensor) else type(hidden_states).__name__
            raise InputError(f"GatedDeltaNet: hidden_states must be [B, T, {self.hidden_size}], got {shape}")
        B, T, _ = hidden_states.shape
        if attention_mask is not None:
            if not isinstance(attention_mask, torch.Tensor) or tuple(attention_mask.shape) != (B, T):
                shape = list(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask).__name__
                raise InputError(f"GatedDeltaNet: attention_mask must be a 2-D padding mask [B, T] = [{B}, {T}], got {shape}")
            if cu_seqlens is not None:
                raise InputError("GatedDeltaNet: pass either attention_mask (padding) or cu_seq_lens_q (packed sequences), not both")
        if cache is not None:
            readable = all(hasattr(cache, name) for name in ("get_conv_state", "get_recurrent_state")) or \
                all(hasattr(cache, name) for name in ("layers", "has_previous_state"))
            if not readable or not all(hasattr(cache, name) for name in ("update_conv_state", "update_recurrent_state")):
                raise InputError(f"GatedDeltaNet: cache {type(cache).__name__} lacks get_/update_conv_state and "
                                 "get_/update_recurrent_state (use GatedDeltaNetCache or a transformers Cache)")
            if getattr(cache, "is_recording_past", lambda _: False)(self.layer_idx):
                raise InputError("GatedDeltaNet: a cache recording past convolution inputs (for cropping) is not supported")

    def _mix(self, x: torch.Tensor, cache, cu_seqlens, cp_context=None):
        """The layer on unpadded tokens x [B, T, hidden] (B == 1 with cu_seqlens)."""
        B, T, _ = x.shape
        o = self.mix_projections(self.in_proj_qkv(x), self.in_proj_z(x), self.in_proj_a(x), self.in_proj_b(x),
                                 cache=cache, cu_seqlens=cu_seqlens, cp_context=cp_context)
        return self.out_proj(o.reshape(B, T, self.value_dim))

    def mix_projections(self, mixed_qkv, z, a, b, cache=None, cu_seqlens=None, cp_context=None):
        """The part of the layer that runs on lrdsl's kernels, from the projections' outputs
        (mixed_qkv [B, T, conv_dim], z [B, T, value_dim], a and b [B, T, HV]) to the gated norm's
        output [B, T, HV, V]: short convolution + SiLU, the gated delta rule, RMSNorm x SiLU(z).
        cp_context: this rank's slice of a packed batch (lrdsl.distributed.build_cp_context with
        conv1d_kernel_size=linear_conv_kernel_dim): the convolution reads its halo from the earlier
        ranks, the recurrence its entry state (no cache)."""
        if cp_context is not None:
            return self._mix_context_parallel(mixed_qkv, z, a, b, cache, cu_seqlens, cp_context)
        kernels = layer_kernels()
        recurrence = recurrence_module()
        B, T, _ = mixed_qkv.shape
        window = cached_state(cache, self.layer_idx, "conv") if cache is not None else None
        state = cached_state(cache, self.layer_idx, "recurrent") if cache is not None else None
        weight = self.conv1d.weight
        one_step = T == 1 and cu_seqlens is None
        new_window = None
        if window is not None and one_step and not (torch.is_grad_enabled() and mixed_qkv.requires_grad):
            # decode: the kernel shifts the cached window by this token in place
            mixed = kernels.short_conv_update(mixed_qkv, window, weight, self.conv1d.bias)
        else:
            mixed, new_window = kernels.short_conv(mixed_qkv, weight, self.conv1d.bias, initial_window=window,
                                                   output_final_window=cache is not None, cu_seqlens=cu_seqlens)
        q, k, v = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(B, T, self.num_k_heads, self.head_k_dim)
        k = k.reshape(B, T, self.num_k_heads, self.head_k_dim)
        v = v.reshape(B, T, self.num_v_heads, self.head_v_dim)
        if state is not None and one_step:
            run = recurrence.recurrent
        else:
            # under torch.compile chunk() keeps nothing for its backward, whatever the policy
            policy = None if torch.compiler.is_compiling() else self.save_policy
            run = functools.partial(recurrence.chunk, save_policy=policy)
        o, new_state = run(q, k, v, a, b, self.A_log, self.dt_bias, initial_state=state,
                           output_final_state=cache is not None, cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=True)
        if cache is not None:
            self._store(cache, new_window, new_state)
        return self.norm(o, z.reshape(B, T, self.num_v_heads, self.head_v_dim))

    def _mix_context_parallel(self, mixed_qkv, z, a, b, cache, cu_seqlens, ctx):
        """mix_projections on this rank's slice (lrdsl.distributed: the convolution's halo, the state maps)."""
        from ..distributed.halo import causal_conv_with_halo

        if cache is not None:
            raise InputError("GatedDeltaNet: cp_context with a cache is not supported (a prefill split over ranks)")
        if ctx.conv1d_kernel_size != self.conv_kernel_size:
            raise InputError(f"GatedDeltaNet: cp_context was built with conv1d_kernel_size={ctx.conv1d_kernel_size}, "
                             f"the layer's convolution is {self.conv_kernel_size} wide")
        if cu_seqlens is not None and cu_seqlens is not ctx.cu_seqlens:
            raise InputError("GatedDeltaNet: with cp_context pass no cu_seqlens (the context holds this rank's)")
        kernels, weight, bias = layer_kernels(), self.conv1d.weight, self.conv1d.bias
        mixed = causal_conv_with_halo(lambda x, cu: kernels.short_conv(x, weight, bias, cu_seqlens=cu)[0], mixed_qkv, ctx)
        B, T, _ = mixed_qkv.shape
        q, k, v = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(B, T, self.num_k_heads, self.head_k_dim)
        k = k.reshape(B, T, self.num_k_heads, self.head_k_dim)
        v = v.reshape(B, T, self.num_v_heads, self.head_v_dim)
        o, _ = recurrence_module().chunk(q, k, v, a, b, self.A_log, self.dt_bias, use_qk_l2norm_in_kernel=True,
                                         save_policy=self.save_policy, cp_context=ctx)
        return self.norm(o, z.reshape(B, T, self.num_v_heads, self.head_v_dim))

    def _store(self, cache, window, state) -> None:
        if window is not None:  # None: the decode kernel already updated the cached window in place
            cached = cached_state(cache, self.layer_idx, "conv")
            if cached is None:
                cache.update_conv_state(window, self.layer_idx, conv_kernel_size=self.conv_kernel_size)
            else:
                cached.copy_(window)
        cache.update_recurrent_state(state, self.layer_idx)


def cached_state(cache, layer_idx: int, kind: str):
    """The convolution window (kind "conv") or recurrent state (kind "recurrent") a cache holds for a
    layer, None before its first update. GatedDeltaNetCache and recent transformers (5.24) have
    get_conv_state / get_recurrent_state; earlier 5.x releases (5.17, 5.18) keep the states on its layer
    (cache.layers[i].conv_states[0], set once has_previous_state says so)."""
    getter = getattr(cache, f"get_{kind}_state", None)
    if getter is not None:
        return getter(layer_idx)
    if layer_idx >= len(cache.layers) or not cache.layers[layer_idx].has_previous_state[0]:
        return None
    return getattr(cache.layers[layer_idx], f"{kind}_states")[0]


def _pack(keep: torch.Tensor):
    """(flat indices of the kept tokens, cu_seqlens [B + 1] int32) of a [B, T] padding mask: each
    row's real tokens become one sequence of the packed batch (reads the mask on the host)."""
    kept = keep.reshape(-1).nonzero().squeeze(1)
    lengths = keep.sum(dim=1)
    cu_seqlens = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]).to(torch.int32)
    return kept, cu_seqlens
