"""Errors lrdsl raises on purpose. Each carries one line that names the problem.

The CLI prints `str(error)` and exits non-zero (2; 73 for an OutputError); anything else escaping
is a bug in lrdsl.
"""
from __future__ import annotations


class LrdslError(Exception):
    """Base class: a user-facing problem described in one line."""


class SpecError(LrdslError):
    """A spec file is missing, not valid TOML, or does not describe a valid recurrence."""

    def __init__(self, path: str, message: str, line: int | None = None):
        self.path = path
        self.line = line
        self.message = message
        where = f"{path}:{line}" if line is not None else str(path)
        super().__init__(f"{where}: {message}")


class IRError(LrdslError):
    """The IR broke an invariant: a bug in a pass, reported by the verifier."""


class CompileError(LrdslError):
    """The generator cannot emit kernels for this recurrence or these options."""


class InputError(LrdslError, ValueError):
    """A tensor or argument handed to lrdsl's functions, a generated module or the layer has the
    wrong shape, dtype, device or value. A ValueError too, as Python's own argument checks raise.

    Generated modules raise this very class when lrdsl is importable (`except lrdsl.InputError`
    catches every module's), and a class of their own, also a ValueError, when they run
    standalone (torch and triton only)."""


class OutputError(LrdslError):
    """A file the user asked for cannot be written: no permission, a read-only or full file
    system, a missing directory or a parent that is a file."""
