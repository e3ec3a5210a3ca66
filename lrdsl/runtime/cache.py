"""Content-addressed cache of generated modules, which heals itself.

The key hashes everything the generated text depends on: the canonical IR, the options, lrdsl's
own source (so a changed template never serves a stale module) and the torch/triton versions.
Writes are atomic (temporary file + rename) so a concurrent reader never sees half a module, and
they honour the umask, so a module one user builds another can import.

lrdsl never damages an entry itself, but the directory is not lrdsl's alone: a full disk, a copy
cut short or a stray edit can. So each entry ends with a line recording the sha256 of everything
above it; an entry that is empty, truncated, edited or unreadable is treated as a miss and
regenerated, with one warning line. A cache directory that cannot be written falls back to a
private temporary directory for the rest of the process, again with one warning line.
"""
from __future__ import annotations

import atexit
import hashlib
import os
import re
import shutil
import sys
import tempfile
from functools import lru_cache
from pathlib import Path

import torch
import triton

from .. import config

PACKAGE_ROOT = Path(__file__).resolve().parent.parent

# The last line of every cache entry: the sha256 of the bytes above it.
DIGEST_LINE = re.compile(rb"# lrdsl cache entry sha256=([0-9a-f]{64})\n\Z")

# configured cache directory -> the private directory used instead, once writing to it failed
_fallback_dirs: dict[Path, Path] = {}


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


def warn(message: str) -> None:
    """One line on stderr: the cache carries on, but the user should know why it is slower."""
    print(f"lrdsl: warning: {message}", file=sys.stderr, flush=True)


def file_mode() -> int:
    """The mode a new, non-executable file gets under the process's umask (0644 for umask 022)."""
    # os.umask can only be read by setting it; the previous value is restored at once
    umask = os.umask(0o077)
    os.umask(umask)
    return 0o666 & ~umask


def atomic_write(path: Path, text: str) -> None:
    """Write `text` to `path` so that readers see the old file or the whole new one, never a part.

    The file gets the mode an ordinary write would (0666 less the umask), not mkstemp's 0600."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, file_mode())
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def entry_text(source: str) -> str:
    """A cache entry: the module source, then the line recording its digest."""
    body = source if source.endswith("\n") else source + "\n"
    return body + f"# lrdsl cache entry sha256={hashlib.sha256(body.encode()).hexdigest()}\n"


def read_entry(file: Path) -> tuple[str | None, str | None]:
    """(module source, None) for a sound entry; (None, None) when there is none; (None, why) when
    the entry is damaged or unreadable."""
    try:
        data = file.read_bytes()
    except (FileNotFoundError, NotADirectoryError):  # no entry (or no cache directory) yet
        return None, None
    except OSError as exc:
        return None, f"unreadable ({exc.strerror or type(exc).__name__})"
    if not data:
        return None, "empty"
    body_end = data.rfind(b"\n", 0, len(data) - 1) + 1  # the start of the last line
    match = DIGEST_LINE.match(data, body_end)
    if match is None:
        return None, "truncated or edited (its digest line is missing)"
    body = data[:body_end]
    if hashlib.sha256(body).hexdigest() != match.group(1).decode():
        return None, "truncated or edited (its contents do not match their digest)"
    try:
        return body.decode("utf-8"), None
    except UnicodeDecodeError:  # only a sha256 collision gets here; still, no traceback
        return None, "not UTF-8 text"


def entry_path(file_name: str) -> Path:
    """Where the entry `file_name` lives: the cache directory, or this process's fallback for it."""
    configured = config.cache_dir()
    return _fallback_dirs.get(configured, configured) / file_name


def store_entry(file_name: str, source: str) -> Path:
    """Write an entry atomically; returns its path. If the cache directory cannot be written,
    the entry goes to a private temporary directory instead (one warning per process)."""
    configured = config.cache_dir()
    target = entry_path(file_name)
    try:
        atomic_write(target, entry_text(source))
        return target
    except OSError as exc:
        if target.parent != configured:  # the private directory itself failed: nothing to fall back to
            raise
        private = Path(tempfile.mkdtemp(prefix="lrdsl-cache-"))  # mode 0700: private to this user
        atexit.register(shutil.rmtree, private, ignore_errors=True)
        _fallback_dirs[configured] = private
        why = exc.strerror or type(exc).__name__
        warn(f"cannot write the module cache {configured} ({why}); using {private} for this process")
    target = private / file_name
    atomic_write(target, entry_text(source))
    return target
