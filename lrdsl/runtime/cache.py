"""Content-addressed cache of generated modules.

The key hashes everything the generated text depends on: the canonical IR, the options, lrdsl's
own source (so a changed template never serves a stale module) and the torch/triton versions.
Writes are atomic (temporary file + rename) so a concurrent reader never sees half a module.
"""
from __future__ import annotations

import hashlib
import os
import tempfile
from functools import lru_cache
from pathlib import Path

import torch
import triton

PACKAGE_ROOT = Path(__file__).resolve().parent.parent


@lru_cache(maxsize=1)
def source_fingerprint() -> str:
    digest = hashlib.sha256()
    for path in sorted(PACKAGE_ROOT.rglob("*")):
        if path.suffix in (".py", ".jinja") and path.is_file():
            digest.update(str(path.relative_to(PACKAGE_ROOT)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def cache_key(ir_fingerprint: str, options: dict) -> str:
    digest = hashlib.sha256()
    for part in (
        ir_fingerprint,
        repr(sorted(options.items())),
        source_fingerprint(),
        torch.__version__,
        triton.__version__,
    ):
        digest.update(part.encode())
        digest.update(b"\0")
    return digest.hexdigest()


def atomic_write(path: Path, text: str) -> None:
    """Write `text` to `path` so that readers see the old file or the whole new one, never a part."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
