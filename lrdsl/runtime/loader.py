"""Compile a spec into a module and import it: `lrdsl.load(path)`.

Generated modules live in the cache directory (config.cache_dir()), named by spec and key, and
are imported from there: Triton needs a real file to read kernel sources from. A damaged entry is
regenerated (runtime/cache.py says how damage is found).
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from .. import config
from ..codegen.module import emit_module
from ..errors import LrdslError
from ..passes.pipeline import run_pipeline
from ..spec import load_spec
from ..specs_registry import resolve_spec
from . import cache

KNOWN_OPTIONS: dict[str, object] = {}

_loaded: dict[str, object] = {}


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
    if key in _loaded:
        return _loaded[key]
    name = recurrence.name
    file_name = f"{name}_{key[:20]}.py"
    file = cache.entry_path(file_name)
    source, damage = cache.read_entry(file)
    if source is None:
        if damage is not None:
            cache.warn(f"cache entry {file} is {damage}; regenerating it")
        source = emit_module(run_pipeline(spec, check=config.verify_ir()), spec_path=str(path))
        file = cache.store_entry(file_name, source)
    dump = config.dump_dir()
    if dump is not None:  # on a hit too: the user asked to see every module lrdsl loads
        cache.atomic_write(Path(dump) / file_name, source)
    module = import_file(file, f"lrdsl_generated_{name}_{key[:20]}", source)
    _loaded[key] = module
    return module


def import_file(file: Path, module_name: str, source: str | None = None):
    """Import `file` as `module_name`, running `source` (its text, when the caller has read and
    checked it already). The text is compiled here, never read from __pycache__: what runs is
    what was checked, and a damaged bytecode file cannot break a load."""
    source = file.read_text(encoding="utf-8") if source is None else source
    spec = importlib.util.spec_from_file_location(module_name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # Triton resolves kernel globals through the module
    try:
        # compiled under the file's name: Triton reads kernel sources back from the file
        exec(compile(source, str(file), "exec"), module.__dict__)
    except BaseException:
        del sys.modules[module_name]  # no half-initialised module left for the next import to find
        raise
    return module
