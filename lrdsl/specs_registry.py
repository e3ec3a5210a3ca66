"""Shipped specs, found by name: `lrdsl.load("gdn")` and `lrdsl compile gdn` work from any directory.

An installed lrdsl carries the specs as package data (lrdsl/specs/*.toml in the wheel); a source
checkout reads them from the repository's specs/ directory. A path still works and wins: a name
is looked up only when no file of that name exists.
"""
from __future__ import annotations

import re
from pathlib import Path

from .errors import SpecError

_PACKAGE = Path(__file__).resolve().parent
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def shipped_spec_dir() -> Path:
    installed = _PACKAGE / "specs"  # a wheel: the specs are package data
    if installed.is_dir():
        return installed
    return _PACKAGE.parent / "specs"  # a source checkout (editable install or PYTHONPATH)


def shipped_spec_names() -> tuple[str, ...]:
    return tuple(sorted(path.stem for path in shipped_spec_dir().glob("*.toml")))


def resolve_spec(spec: str | Path) -> Path:
    """The spec file `spec` names: an existing path as it is, else a shipped spec's name.

    A bare identifier that is neither gets one line listing the shipped names; anything else is
    returned unchanged, so the spec loader reports the missing file as before.
    """
    path = Path(spec)
    if path.exists() or not _NAME.fullmatch(str(spec)):
        return path
    shipped = shipped_spec_dir() / f"{spec}.toml"
    if shipped.is_file():
        return shipped
    names = ", ".join(shipped_spec_names()) or "none"
    raise SpecError(str(spec), f"no such spec file, and no shipped spec of that name (shipped: {names})")


def load_spec_by_name(spec: str | Path):
    """load_spec of a path or a shipped spec's name (`lrdsl show gdn`)."""
    from .spec import load_spec

    return load_spec(resolve_spec(spec))
