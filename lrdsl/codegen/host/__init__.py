"""Host code every generated module carries, kept as real Python modules.

Generated modules import torch and triton only, so the host code they share cannot be imported
from lrdsl at run time; it is written here instead of as template text, where tests import it
and linters read it, and the emitter copies each module's code into the generated module
verbatim (codegen/templating.py, `host_code`): everything after the module docstring, less the
imports of sibling host modules (in the generated module they are one namespace). A host module
imports nothing else that a generated module lacks.
"""
