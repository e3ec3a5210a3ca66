"""Content-addressed cache of generated modules, which heals itself.

The key hashes everything the generated text depends on: the canonical IR, the options, lrdsl's
own source (so a changed template never serves a stale module) and the torch/triton versions.
Writes are atomic (temporary file + rename) so a concurrent reader never sees half a module, and
they honour the umask, so a module one user builds another can import.

lrdsl never damages an entry itself, but the directory is not lrdsl's alone: a full disk, a copy
cut short, a stray edit or an entry copied under another's name can. So each entry ends with two
lines: the key it was made for (and the build of lrdsl, torch and triton that made it), then the
sha256 of everything above. An entry that is empty, truncated, edited, unreadable or filed under a
key it was not made for is treated as a miss and regenerated, with one warning line. A cache
directory that cannot be written falls back to a private temporary directory for the rest of the
process, again with one warning line.

Nothing removes entries on its own: each new lrdsl source, torch or triton makes new keys, and a
writer killed mid-write leaves its temporary file. `survey` sorts a directory's files into entries
this build serves, entries of other builds, damaged entries and temporary files; `lrdsl cache
info | prune | clear` shows and removes them.
"""
from __future__ import annotations

import atexit
import hashlib
import os
import re
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch
import triton

from .. import config
from ..errors import LrdslError

PACKAGE_ROOT = Path(__file__).resolve().parent.parent

# The last two lines of every cache entry: the key it was made for and the build that made it
# (build_fingerprint), then the sha256 of the bytes above the digest line, the key line included.
KEY_LINE = re.compile(rb"# lrdsl cache entry key=([0-9a-f]{64}) build=([0-9a-f]{16})\n\Z")
DIGEST_LINE = re.compile(rb"# lrdsl cache entry sha256=([0-9a-f]{64})\n\Z")

# The files lrdsl writes in a cache directory: entries `<spec name>_<key[:20]>.py`, and atomic
# writes' temporary files `.<entry>.<random>.tmp`
ENTRY_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*_[0-9a-f]{20}\.py")
TEMPORARY_NAME = re.compile(r"\.[A-Za-z_][A-Za-z0-9_]*_[0-9a-f]{20}\.py\.[A-Za-z0-9_]+\.tmp")
# A temporary file this old belongs to a writer that stopped (killed, or its machine went down):
# a live writer renames its file away within a second.
STALE_TEMPORARY_SECONDS = 3600

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


def build_fingerprint() -> str:
    """What, besides the spec and the options, a module's text depends on: lrdsl's source and the
    torch and triton versions. An entry made by another build is never served by this one."""
    digest = hashlib.sha256()
    for part in (source_fingerprint(), torch.__version__, triton.__version__):
        digest.update(part.encode())
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def cache_key(ir_fingerprint: str, options: dict) -> str:
    digest = hashlib.sha256()
    for part in (ir_fingerprint, repr(sorted(options.items())), build_fingerprint()):
        digest.update(part.encode())
        digest.update(b"\0")
    return digest.hexdigest()


def entry_name(name: str, key: str) -> str:
    """The file name of the entry of spec `name` under `key`."""
    return f"{name}_{key[:20]}.py"


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


def entry_text(source: str, key: str) -> str:
    """A cache entry: the module source, the line recording its key and build, then the line
    recording the digest of everything above it."""
    body = source if source.endswith("\n") else source + "\n"
    body += f"# lrdsl cache entry key={key} build={build_fingerprint()}\n"
    return body + f"# lrdsl cache entry sha256={hashlib.sha256(body.encode()).hexdigest()}\n"


@dataclass(frozen=True)
class Entry:
    """What an entry's bytes say: its module source, the key and build it was made for, or why it
    cannot be served (`damage`)."""

    source: str | None = None
    key: str | None = None
    build: str | None = None
    damage: str | None = None


def _last_line_start(data: bytes, end: int) -> int:
    return data.rfind(b"\n", 0, end - 1) + 1


def parse_entry(data: bytes) -> Entry:
    """An entry's bytes, checked against their digest and split into source, key and build."""
    if not data:
        return Entry(damage="empty")
    body_end = _last_line_start(data, len(data))
    match = DIGEST_LINE.match(data, body_end)
    if match is None:
        return Entry(damage="truncated or edited (its digest line is missing)")
    body = data[:body_end]
    if hashlib.sha256(body).hexdigest() != match.group(1).decode():
        return Entry(damage="truncated or edited (its contents do not match their digest)")
    source_end = _last_line_start(body, len(body))
    made_for = KEY_LINE.match(body, source_end)
    if made_for is None:  # sound, but older than key lines: another build's entry
        return Entry(damage="made by another lrdsl (it records no key)")
    try:
        source = body[:source_end].decode("utf-8")
    except UnicodeDecodeError:  # only a sha256 collision gets here; still, no traceback
        return Entry(damage="not UTF-8 text")
    return Entry(source=source, key=made_for.group(1).decode(), build=made_for.group(2).decode())


def read_entry(file: Path, key: str) -> tuple[str | None, str | None]:
    """(module source, None) for a sound entry made for `key`; (None, None) when there is none;
    (None, why) when the entry is damaged, unreadable or was made for another key."""
    try:
        data = file.read_bytes()
    except (FileNotFoundError, NotADirectoryError):  # no entry (or no cache directory) yet
        return None, None
    except OSError as exc:
        return None, f"unreadable ({exc.strerror or type(exc).__name__})"
    entry = parse_entry(data)
    if entry.damage is not None:
        return None, entry.damage
    if entry.key != key:  # a sound entry copied or renamed onto this file: another module's text
        return None, f"filed under the wrong key (it was made for key {entry.key[:20]}...)"
    return entry.source, None


def entry_path(file_name: str) -> Path:
    """Where the entry `file_name` lives: the cache directory, or this process's fallback for it."""
    configured = config.cache_dir()
    return _fallback_dirs.get(configured, configured) / file_name


def store_entry(file_name: str, source: str, key: str) -> Path:
    """Write an entry atomically; returns its path. If the cache directory cannot be written,
    the entry goes to a private temporary directory instead (one warning per process)."""
    configured = config.cache_dir()
    target = entry_path(file_name)
    try:
        atomic_write(target, entry_text(source, key))
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
    atomic_write(target, entry_text(source, key))
    return target


# -- keeping the directory bounded: `lrdsl cache info | prune | clear` -----------------------------

SERVED = "served by this lrdsl"
OTHER_BUILD = "made by another lrdsl, torch or triton"
DAMAGED = "damaged"
WRITING = "being written"
ABANDONED = "left by a writer that stopped"

# what `prune` removes: nothing this build would serve, nothing a live writer still needs
PRUNED = (OTHER_BUILD, DAMAGED, ABANDONED)


@dataclass(frozen=True)
class CacheFile:
    path: Path
    size: int
    state: str  # one of SERVED, OTHER_BUILD, DAMAGED, WRITING, ABANDONED
    why: str = ""  # the damage, for DAMAGED

    @property
    def is_entry(self) -> bool:
        return self.state in (SERVED, OTHER_BUILD, DAMAGED)


def _entry_state(path: Path, build: str) -> tuple[str, str]:
    try:
        entry = parse_entry(path.read_bytes())
    except OSError as exc:
        return DAMAGED, f"unreadable ({exc.strerror or type(exc).__name__})"
    if entry.damage is not None:
        return (OTHER_BUILD, "") if entry.damage.startswith("made by another lrdsl") else (DAMAGED, entry.damage)
    if not path.name.endswith(f"_{entry.key[:20]}.py"):
        return DAMAGED, f"filed under the wrong key (it was made for key {entry.key[:20]}...)"
    return (SERVED, "") if entry.build == build else (OTHER_BUILD, "")


def survey(directory: Path) -> list[CacheFile]:
    """lrdsl's files in a cache directory (entries and temporary files; nothing else is lrdsl's to
    judge), each with its state, by name."""
    if not directory.exists():
        return []
    if not directory.is_dir():
        raise LrdslError(f"the module cache {directory} is not a directory")
    build, now = build_fingerprint(), time.time()
    found = []
    for path in sorted(directory.iterdir()):
        try:
            stat = path.lstat()
        except FileNotFoundError:  # removed by another process since the listing
            continue
        if ENTRY_NAME.fullmatch(path.name):
            state, why = _entry_state(path, build)
        elif TEMPORARY_NAME.fullmatch(path.name):
            state, why = (ABANDONED if now - stat.st_mtime > STALE_TEMPORARY_SECONDS else WRITING), ""
        else:
            continue
        found.append(CacheFile(path, stat.st_size, state, why))
    return found


def remove(files: list[CacheFile]) -> list[CacheFile]:
    """Unlink `files`; returns those removed (one another process removed first is not)."""
    removed = []
    for file in files:
        try:
            file.path.unlink()
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise LrdslError(f"cannot remove {file.path} ({exc.strerror or type(exc).__name__})") from None
        removed.append(file)
    return removed


def prune(directory: Path) -> list[CacheFile]:
    """Remove the entries this build would never serve (other builds', damaged ones) and temporary
    files of writers that stopped. Returns what was removed."""
    return remove([file for file in survey(directory) if file.state in PRUNED])


def clear(directory: Path) -> list[CacheFile]:
    """Remove every entry and every temporary file of a writer that stopped (a live writer's file
    is left to it: it renames the file into place within a second)."""
    return remove([file for file in survey(directory) if file.state != WRITING])
