"""Host code every generated module carries, kept as real Python modules.

Generated modules import torch and triton only, so the host code they share cannot be imported
from lrdsl at run time; it is written here instead of as template text, where tests import it
and linters read it, and the emitter copies each module's code into the generated module
verbatim (codegen/templating.py, `host_code`): everything after the module docstring and the
imports. A host module imports torch, triton and its siblings only (in the generated module
they are its own imports and its own code); the names a generated module defines itself from
its spec are declared in module_names, which is never copied. Templates keep what varies per
spec: tables, signatures, kernels and their launchers.
"""
