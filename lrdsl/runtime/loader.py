"""Compile a spec into a module and import it: `lrdsl.load(path)`.

Generated modules live in the cache directory (config.cache_dir()), named by spec and key, and
are imported from there: Triton needs a real file to read kernel sources from. A damaged entry is
regenerated (runtime/cache.py says how damage is found).

Loading is safe from any number of threads: the look-up in the in-process table, the cache read or
write and the import (which registers the module's custom ops) run under one lock per key, so the
threads that ask for one module at once get the first thread's module, imported once; threads
loading other modules do not wait for it.
"""
from __future__ import annotations

import importlib.util
import sys
import threading
from pathlib import Path
from typing import Callable

from .. import config
from ..codegen.module import emit_module
from ..errors import LrdslError
from ..passes.pipeline import run_pipeline
from ..spec import load_spec
from ..spec import resolve_spec
from . import cache

KNOWN_OPTIONS: dict[str, object] = {}

_loaded: dict[str, object] = {}
# LRDSL_DUMP directories that could not be written (warned about once per process)
_dump_failures: set[Path] = set()

# key -> the lock its loader holds; the table itself is guarded by _key_locks_guard
_key_locks: dict[str, threading.Lock] = {}
_key_locks_guard = threading.Lock()


def _lock_for(key: str) -> threading.Lock:
    with _key_locks_guard:
        return _key_locks.setdefault(key, threading.Lock())


def _check_options(options: dict) -> dict:
    unknown = sorted(set(options) - set(KNOWN_OPTIONS))
    if unknown:
        known = ", ".join(sorted(KNOWN_OPTIONS)) or "none"
        raise LrdslError(f"unknown option {unknown[0]!r} (known options: {known})")
    return {**KNOWN_OPTIONS, **options}


def generate(path, **options) -> tuple[str, dict]:
    """Run the pipeline on the spec at `path` (or a shipped spec's name) and emit the module source.
    Returns (source, stages)."""
    _check_options(options)
    stages = run_pipeline(load_spec(resolve_spec(path)), check=config.verify_ir())
    return emit_module(stages, spec_path=str(path)), stages


def load(path, **options):
    options = _check_options(options)
    spec = load_spec(resolve_spec(path))
    # the key needs only the canonical IR; the later passes run on a cache miss alone
    recurrence = run_pipeline(spec, until="recurrence")["recurrence"]
    key = cache.cache_key(recurrence.fingerprint(), options)
    return load_cached(recurrence.name, key,
                       lambda: emit_module(run_pipeline(spec, check=config.verify_ir()), spec_path=spec.path))


def load_cached(name: str, key: str, make_source: Callable[[], str]):
    """The module `name` of `key`: this process's, else its cache entry's, else made by
    `make_source()` and stored first. Safe from any number of threads."""
    with _lock_for(key):
        if key not in _loaded:
            _loaded[key] = _load_entry(name, key, make_source)
        return _loaded[key]


def _load_entry(name: str, key: str, make_source: Callable[[], str]):
    """Read (or make and store) the entry of `key` and import it. Called under key's lock."""
    file_name = cache.entry_name(name, key)
    file = cache.entry_path(file_name)
    source, damage = cache.read_entry(file, key)
    if source is None:
        if damage is not None:
            cache.warn(f"cache entry {file} is {damage}; regenerating it")
        source = make_source()
        file = cache.store_entry(file_name, source, key)
    _dump(file_name, source)
    return import_file(file, f"lrdsl_generated_{name}_{key[:20]}", source)


def _dump(file_name: str, source: str) -> None:
    """Copy a module into LRDSL_DUMP, on a hit too: the user asked to see every module lrdsl loads.
    A dump directory that cannot be written costs one warning, never the load."""
    dump = config.dump_dir()
    if dump is None:
        return
    try:
        cache.atomic_write(dump / file_name, source)
    except OSError as exc:
        with _key_locks_guard:
            first = dump not in _dump_failures
            _dump_failures.add(dump)
        if first:
            cache.warn(f"cannot write LRDSL_DUMP={dump} ({exc.strerror or type(exc).__name__}); "
                       "modules load without their copies there")


def import_file(file: Path, module_name: str, source: str | None = None):
    """Import `file` as `module_name`, running `source` (its text, when the caller has read and
    checked it already). The text is compiled here, never read from __pycache__: what runs is
    what was checked, and a damaged bytecode file cannot break a load."""
    source = file.read_text(encoding="utf-8") if source is None else source
    spec = importlib.util.spec_from_file_location(module_name, file)
    module = importlib.util.module_from_spec(spec)
    previous = sys.modules.get(module_name)
    sys.modules[module_name] = module  # Triton resolves kernel globals through the module
    try:
        # compiled under the file's name: Triton reads kernel sources back from the file
        exec(compile(source, str(file), "exec"), module.__dict__)
    except BaseException:
        # no half-initialised module left for the next import to find; and only this one removed:
        # a module another import put there is not this failure's to take away
        if sys.modules.get(module_name) is module:
            if previous is None:
                del sys.modules[module_name]
            else:
                sys.modules[module_name] = previous
        raise
    return module
