"""The generated layer kernels (short convolution, gated RMSNorm), compiled through the module cache."""
from __future__ import annotations

import hashlib

from .. import config
from ..codegen.layer_kernels import emit_layer_kernels
from ..runtime.cache import atomic_write, cache_key
from ..runtime.loader import import_file

_loaded: dict[tuple[str, str], object] = {}


def layer_kernels(conv_activation: str = "silu", gate_activation: str = "silu"):
    """Import (generating on a cache miss) the module of short-convolution and gated-norm kernels."""
    wanted = (conv_activation, gate_activation)
    if wanted in _loaded:
        return _loaded[wanted]
    source = emit_layer_kernels(conv_activation, gate_activation)
    key = cache_key(hashlib.sha256(source.encode()).hexdigest(), {})[:20]
    file = config.cache_dir() / f"layer_kernels_{key}.py"
    if not file.exists():
        atomic_write(file, source)
        dump = config.dump_dir()
        if dump is not None:
            atomic_write(dump / file.name, source)
    module = import_file(file, f"lrdsl_generated_layer_kernels_{key}")
    _loaded[wanted] = module
    return module
