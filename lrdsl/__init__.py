"""lrdsl: compile declarative linear-recurrence specs into Triton kernels.

    import lrdsl
    mod = lrdsl.load("gdn")                 # a shipped spec by name, or a path: lrdsl.load("specs/gdn.toml")
    o, ht = mod.recurrent(q, k, v, g, beta, output_final_state=True)

    lrdsl.layers.GatedDeltaNet(config)      # Qwen3.5's linear-attention layer on generated kernels
    lrdsl.ops.chunk_gated_delta_rule(...)   # fla-core's signatures
    lrdsl.integrations.patch_qwen35(model)  # a transformers Qwen3.5 model on lrdsl

The submodules layers, ops and integrations load on first use. Importing lrdsl on a machine
without a GPU turns on Triton's CPU interpreter (config.use_interpreter_without_gpu), which must
happen before anything imports triton: import lrdsl first.
"""
import importlib
import warnings

from . import config
from .errors import InputError, LrdslError

from .version import __version__

__all__ = ["load", "layers", "ops", "integrations", "InputError", "LrdslError", "__version__"]

_SUBMODULES = ("layers", "ops", "integrations")

try:
    config.use_interpreter_without_gpu()
except LrdslError as _too_late:  # triton came first: say so once; the kernels' own check refuses CPU tensors
    warnings.warn(str(_too_late), config.InterpreterWarning, stacklevel=2)
if config.interpreting() and (_problem := config.interpreter_numpy_problem()):
    raise LrdslError(_problem)


def load(spec):
    """Compile the spec at path `spec`, or the shipped spec of that name (through the on-disk
    cache), and import the generated module. The kernels' options (chunk_size, plan, precision,
    save_policy, ...) are the module functions' keyword arguments, given per call."""
    from .runtime.loader import load as _load

    return _load(spec)


def __getattr__(name):
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'lrdsl' has no attribute {name!r}")
