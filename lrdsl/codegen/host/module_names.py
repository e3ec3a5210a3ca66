"""Names a generated module defines itself, around the host code that reads them: from the spec
(its name, its inputs) or from its launch tables (_launch), and the chunk-size constants of the
module's chunk section, which is still template text. Declared here so that the host modules
import them like any name and a linter checks every use; the emitter drops these imports (in a
generated module they are its own globals). This module is never copied; a test that calls host
code reading one of these names sets it first.
"""


class InputError(ValueError):
    """The generated module's error for a tensor of the wrong shape, dtype or device."""


SPEC_NAME = "host"  # the spec's name, which every InputError starts with
INPUTS = ()  # the spec's inputs after q, k, v, in positional order: ((name, role), ...)
WIDE_K = 128  # key channels above which the module's wide-key launch settings and chunk sizes apply


def _launch(role, c, segmented=False, replaced=None):
    """Launch settings of a kernel role for a call: resolve_launch on the module's tables."""
    raise NotImplementedError("defined by the generated module")

