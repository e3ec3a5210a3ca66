"""lrdsl: compile declarative linear-recurrence specs into Triton kernels.

    import lrdsl
    mod = lrdsl.load("gdn")                 # a shipped spec by name, or a path: lrdsl.load("specs/gdn.toml")
    o, ht = mod.recurrent(q, k, v, g, beta, output_final_state=True)

    lrdsl.layers.GatedDeltaNet(config)      # Qwen3.5's linear-attention layer on generated kernels
    lrdsl.ops.chunk_gated_delta_rule(...)   # fla-core's signatures
    lrdsl.integrations.patch_qwen35(model)  # a transformers Qwen3.5 model on lrdsl

The submodules layers, ops and integrations import torch; they load on first use.
"""
import importlib

__version__ = "0.1.0"

__all__ = ["load", "layers", "ops", "integrations", "__version__"]

_SUBMODULES = ("layers", "ops", "integrations")


def load(path, **options):
    """Compile the spec at `path`, or the shipped spec of that name (through the on-disk cache),
    and import the generated module."""
    from .runtime.loader import load as _load

    return _load(path, **options)


def __getattr__(name):
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'lrdsl' has no attribute {name!r}")
