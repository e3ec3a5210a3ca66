"""The generated layer kernels (short convolution, gated RMSNorm), compiled through the module cache."""
from __future__ import annotations

import hashlib

from ..codegen.layer_kernels import emit_layer_kernels
from ..runtime.cache import cache_key
from ..runtime.loader import load_cached

_loaded: dict[tuple[str, str], object] = {}


def layer_kernels(conv_activation: str = "silu", gate_activation: str = "silu"):
    """Import (generating on a cache miss) the module of short-convolution and gated-norm kernels."""
    wanted = (conv_activation, gate_activation)
    if wanted in _loaded:
        return _loaded[wanted]
    source = emit_layer_kernels(conv_activation, gate_activation)
    key = cache_key(hashlib.sha256(source.encode()).hexdigest(), {})
    # the cache's entry (key and digest checked, damage regenerated), imported once however many
    # threads ask at once
    module = load_cached("layer_kernels", key, lambda: source)
    _loaded[wanted] = module
    return module
