"""Every environment knob lrdsl reads, in one place.

LRDSL_CACHE_DIR   where compiled modules are cached (default: $XDG_CACHE_HOME/lrdsl or ~/.cache/lrdsl)
LRDSL_DUMP        a directory: every generated module is also written there, named by spec and key
LRDSL_VERIFY      "0" turns off the IR verifier that `lrdsl.load` (on a cache miss) and `lrdsl compile`
                  run after every pass (on by default: it costs 5-45 ms per spec on a CPU, the
                  pipeline itself 2-12 ms; emitting the module costs more than both)
TRITON_INTERPRET  Triton's own switch; lrdsl turns it on when there is no GPU so kernels run on the CPU
LRDSL_FUZZ_EXAMPLES  examples per test of the spec fuzzer (tests/test_fuzz_specs.py), drawn afresh each
                  run; unset: the bounded, fixed-seed run of CI
LRDSL_FUZZ_DTYPE  the spec fuzzer's q, k, v (and other per-token inputs but gates): "float32" (default)
                  or "bfloat16" (a GPU pass; gates and per-head parameters stay fp32, as callers pass them)
"""
from __future__ import annotations

import os
import re
from pathlib import Path


def cache_dir() -> Path:
    explicit = os.environ.get("LRDSL_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "lrdsl"


def dump_dir() -> Path | None:
    value = os.environ.get("LRDSL_DUMP")
    return Path(value).expanduser() if value else None


def verify_ir() -> bool:
    """Whether lrdsl.load and lrdsl compile verify every stage the passes produce (LRDSL_VERIFY)."""
    return os.environ.get("LRDSL_VERIFY", "1").strip() != "0"


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


class InterpreterWarning(UserWarning):
    """Triton's CPU interpreter is needed (no GPU) but can no longer be turned on."""


def use_interpreter_without_gpu() -> bool:
    """Turn on Triton's CPU interpreter when no CUDA device exists. Returns whether it is on.

    `import lrdsl` calls this. Triton decides at import (its own library functions are compiled
    kernels or interpreted ones) and when a kernel is decorated, so this must run before anything
    imports triton; where triton came first it raises LrdslError saying so, in one line.
    """
    import sys

    import torch

    if torch.cuda.is_available() or interpreting():
        return interpreting()
    if "triton" in sys.modules:
        from .errors import LrdslError

        raise LrdslError("no GPU, and triton was imported before lrdsl could turn on its CPU interpreter: "
                         "import lrdsl first (before transformers' Qwen3.5 model too) or set TRITON_INTERPRET=1")
    os.environ["TRITON_INTERPRET"] = "1"
    return True


def interpreter_numpy_problem(numpy_version: str | None = None, triton_version: str | None = None) -> str | None:
    """Why the CPU interpreter cannot run lrdsl's kernels here, or None. Triton 3.6's interpreter
    cannot take a loaded loop bound (the scans' `for` over chunks) with numpy >= 2.4: every chunk
    call would die in a long InterpreterError. The wheel does not pin numpy for it (GPU users never
    interpret), so `import lrdsl` refuses the combination where it runs the interpreter. Versions
    are read from the installed distributions, never by importing triton (which must come after
    TRITON_INTERPRET is set)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        numpy_version = numpy_version or version("numpy")
        triton_version = triton_version or version("triton")
    except PackageNotFoundError:
        return None

    def release(text: str) -> tuple[int, ...]:
        return tuple(int(part) for part in re.findall(r"\d+", text)[:2])

    if release(triton_version) == (3, 6) and release(numpy_version) >= (2, 4):
        return (f"Triton {triton_version}'s CPU interpreter cannot run lrdsl's kernels with numpy {numpy_version}: "
                'pip install "numpy<2.4" (or use a GPU)')
    return None


def never_interpret() -> None:
    """Turn Triton's CPU interpreter off for this process (tools that compile for a GPU target or
    only count launches, never run a kernel: lrdsl.measure.resources, lrdsl.measure.memory). Must run before
    anything imports triton."""
    os.environ.pop("TRITON_INTERPRET", None)


def fuzz_examples() -> int | None:
    """LRDSL_FUZZ_EXAMPLES as a number of examples, or None (the CI run)."""
    value = os.environ.get("LRDSL_FUZZ_EXAMPLES", "").strip()
    return int(value) if value else None


FUZZ_DTYPES = ("float32", "bfloat16")


def fuzz_dtype() -> str:
    """LRDSL_FUZZ_DTYPE, checked: the name of a torch dtype in FUZZ_DTYPES (default float32)."""
    value = os.environ.get("LRDSL_FUZZ_DTYPE", "").strip() or "float32"
    if value not in FUZZ_DTYPES:
        raise ValueError(f"LRDSL_FUZZ_DTYPE={value!r}: expected one of {', '.join(FUZZ_DTYPES)}")
    return value
