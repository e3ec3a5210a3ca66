"""Spec files: the forgiving, user-facing description of a recurrence (TOML).

A spec is read and checked here for syntax, keys and types; the canonicalize pass turns it into
the strict recurrence IR and checks that the combination makes sense. Every problem becomes one
`SpecError` line naming the file, the line and the key. specs/README.md documents the schema.
"""
from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from .codegen.names import reserved_input_name
from .errors import SpecError
from .ir.formula import FormulaSyntaxError, parse_formula
from .ir.recurrence import TOKEN_VECTORS, GateKind, InputRole, UpdateRule

TOP_LEVEL_KEYS = ("name", "summary", "recurrence", "inputs", "formulas")
RECURRENCE_KEYS = ("update", "gate", "steps_per_token")
FORMULA_KEYS = ("log_decay", "beta", "low_rank_read", "low_rank_write", "delta_read", "write_value")

# Spellings users reach for, mapped to the canonical values.
GATE_ALIASES = {
    "none": GateKind.NONE,
    "scalar": GateKind.SCALAR,
    "key_channel": GateKind.KEY_CHANNEL,
    "keychannel": GateKind.KEY_CHANNEL,
    "channel": GateKind.KEY_CHANNEL,
    "per_key": GateKind.KEY_CHANNEL,
    "constant": GateKind.CONSTANT,
    "const": GateKind.CONSTANT,
}
UPDATE_ALIASES = {
    "delta": UpdateRule.DELTA,
    "delta_rule": UpdateRule.DELTA,
    "plain": UpdateRule.PLAIN,
    "additive": UpdateRule.PLAIN,
    "dplr": UpdateRule.DPLR,
    "diagonal_plus_low_rank": UpdateRule.DPLR,
}
ROLE_ALIASES = {
    "token": InputRole.TOKEN,
    "token_key": InputRole.TOKEN_KEY,
    "head": InputRole.HEAD,
    "head_key": InputRole.HEAD_KEY,
    "token_value": InputRole.TOKEN_VALUE,
}


@dataclass(frozen=True)
class SpecFormula:
    key: str  # one of FORMULA_KEYS
    text: str
    expr: object  # sympy.Expr


@dataclass(frozen=True)
class Spec:
    path: str
    name: str
    summary: str
    update: UpdateRule
    gate: GateKind
    inputs: tuple[tuple[str, InputRole], ...]
    formulas: dict[str, SpecFormula] = field(hash=False)
    key_lines: dict[str, int] = field(hash=False, repr=False)
    steps_per_token: int = 1  # update steps per token after one decay (Gated DeltaProduct: 2)

    def line_of(self, dotted_key: str) -> int:
        return _line_of(self.key_lines, dotted_key)

    def error(self, dotted_key: str, message: str) -> SpecError:
        """A SpecError pointing at the line of `dotted_key`, naming the key in the message."""
        return SpecError(self.path, f"{dotted_key}: {message}", self.line_of(dotted_key))


def load_spec(path: str | Path) -> Spec:
    path = Path(path)
    if not path.exists():
        raise SpecError(str(path), "no such spec file")
    if path.is_dir():
        raise SpecError(str(path), "is a directory, expected a .toml spec file")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise SpecError(str(path), f"cannot read spec file ({exc.__class__.__name__})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SpecError(str(path), f"not UTF-8 text (byte {exc.start})", data[: exc.start].count(b"\n") + 1) from None
    return parse_spec(text, str(path))


def parse_spec(text: str, path: str = "<spec>") -> Spec:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        message, line = _split_toml_position(str(exc))
        end_of_document = max(1, len(text.splitlines()))  # where tomllib gives no line
        raise SpecError(path, f"invalid TOML: {message}", line or end_of_document) from None
    lines = _key_lines(text)

    def fail(key: str, message: str) -> SpecError:
        return SpecError(path, f"{key}: {message}", _line_of(lines, key))

    _reject_unknown(data, TOP_LEVEL_KEYS, "", fail)
    name = _required_str(data, "name", fail)
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
        raise fail("name", f"expected an identifier (letters, digits, '_'), got {name!r}")
    summary = data.get("summary", "")
    if not isinstance(summary, str):
        raise fail("summary", f"expected a string, got {_type_name(summary)}")

    recurrence = _required_table(data, "recurrence", fail)
    _reject_unknown(recurrence, RECURRENCE_KEYS, "recurrence.", fail)
    update = _choice(recurrence, "recurrence.update", "update", UPDATE_ALIASES, fail)
    gate = _choice(recurrence, "recurrence.gate", "gate", GATE_ALIASES, fail)
    steps_per_token = recurrence.get("steps_per_token", 1)
    # bool is an int to Python, never a count here
    if isinstance(steps_per_token, bool) or not isinstance(steps_per_token, int):
        raise fail("recurrence.steps_per_token", f"expected an integer >= 1, got {_type_name(steps_per_token)}")
    if steps_per_token < 1:
        raise fail("recurrence.steps_per_token", f"expected an integer >= 1, got {steps_per_token}")

    inputs_table = data.get("inputs", {})
    if not isinstance(inputs_table, dict):
        raise fail("inputs", f"expected a table of name = role, got {_type_name(inputs_table)}")
    inputs = []
    for name_, role_text in inputs_table.items():
        key = f"inputs.{name_}"
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name_):
            # ASCII only: the name reaches generated kernels, custom-op schemas and C launchers
            raise fail(key, f"an input name must be ASCII letters, digits and '_', not starting with a digit, got {name_!r}")
        reserved = reserved_input_name(name_)
        if reserved is not None:
            raise fail(key, f"the name {name_!r} is reserved ({reserved}); choose another")
        if not isinstance(role_text, str):
            raise fail(key, f"expected a role string ({_expected(ROLE_ALIASES)}), got {_type_name(role_text)}")
        role = ROLE_ALIASES.get(_normal(role_text))
        if role is None:
            raise fail(key, f"unknown role {role_text!r}; expected {_expected(ROLE_ALIASES)}")
        inputs.append((name_, role))

    formulas_table = data.get("formulas", {})
    if not isinstance(formulas_table, dict):
        raise fail("formulas", f"expected a table, got {_type_name(formulas_table)}")
    _reject_unknown(formulas_table, FORMULA_KEYS, "formulas.", fail)
    # k and v parse in every formula; canonicalize says which formula may read them
    declared = {n for n, _ in inputs} | set(TOKEN_VECTORS)
    formulas = {}
    for key_, text_ in formulas_table.items():
        key = f"formulas.{key_}"
        if not isinstance(text_, str):
            raise fail(key, f"expected a formula string, got {_type_name(text_)}")
        try:
            expr = parse_formula(text_, declared)
        except FormulaSyntaxError as exc:
            raise fail(key, str(exc)) from None
        formulas[key_] = SpecFormula(key_, text_, expr)

    return Spec(
        path=path,
        name=name,
        summary=summary,
        update=update,
        gate=gate,
        inputs=tuple(inputs),
        formulas=formulas,
        key_lines=lines,
        steps_per_token=steps_per_token,
    )


def _normal(text: str) -> str:
    return text.strip().lower().replace("-", "_").replace(" ", "_")


def _expected(aliases: dict) -> str:
    canonical = []
    for value in aliases.values():
        if value.value not in canonical:
            canonical.append(value.value)
    return " | ".join(repr(c) for c in canonical)


def _type_name(value) -> str:
    return {dict: "a table", list: "an array", bool: "a boolean", int: "an integer", float: "a float"}.get(
        type(value), type(value).__name__
    )


def _reject_unknown(table: dict, allowed: tuple[str, ...], prefix: str, fail) -> None:
    for key in table:
        if key not in allowed:
            known = ", ".join(allowed)
            raise fail(f"{prefix}{key}", f"unknown key (expected one of: {known})")


def _required_str(table: dict, key: str, fail) -> str:
    if key not in table:
        raise fail(key, "missing required key")
    value = table[key]
    if not isinstance(value, str):
        raise fail(key, f"expected a string, got {_type_name(value)}")
    return value


def _required_table(table: dict, key: str, fail) -> dict:
    if key not in table:
        raise fail(key, f"missing required table [{key}]")
    value = table[key]
    if not isinstance(value, dict):
        raise fail(key, f"expected a table [{key}], got {_type_name(value)}")
    return value


def _choice(table: dict, dotted: str, key: str, aliases: dict, fail):
    if key not in table:
        raise fail(dotted, f"missing required key (expected {_expected(aliases)})")
    value = table[key]
    if not isinstance(value, str):
        raise fail(dotted, f"expected a string ({_expected(aliases)}), got {_type_name(value)}")
    choice = aliases.get(_normal(value))
    if choice is None:
        raise fail(dotted, f"unknown value {value!r}; expected {_expected(aliases)}")
    return choice


_POSITION = re.compile(r"\s*\(at line (\d+), column \d+\)\s*$")


def _split_toml_position(message: str) -> tuple[str, int | None]:
    match = _POSITION.search(message)
    if not match:
        return message, None
    return message[: match.start()], int(match.group(1))


def _line_of(lines: dict[str, int], dotted_key: str) -> int:
    """The line of a key; for a key not written as `key = ...` (missing, or in an inline table) the
    line of the nearest table that holds it, else line 1."""
    while dotted_key not in lines and "." in dotted_key:
        dotted_key = dotted_key.rsplit(".", 1)[0]
    return lines.get(dotted_key, 1)


_TABLE = re.compile(r"^\s*\[\s*([A-Za-z0-9_.\-\" ]+?)\s*\]\s*(#.*)?$")
_KEY = re.compile(r"^\s*(\"[^\"]*\"|'[^']*'|[A-Za-z0-9_\-]+)\s*=")


def _key_lines(text: str) -> dict[str, int]:
    """Map dotted keys ("recurrence.gate", "inputs.g", "formulas") to their 1-based line numbers.

    tomllib keeps no positions, so this scans the text; it only has to understand the simple
    layouts specs use (tables and key = value lines).
    """
    lines: dict[str, int] = {}
    table = ""
    for number, raw in enumerate(text.splitlines(), start=1):
        header = _TABLE.match(raw)
        if header:
            table = ".".join(part.strip().strip('"') for part in header.group(1).split("."))
            lines.setdefault(table, number)
            continue
        key = _KEY.match(raw)
        if key:
            name = key.group(1).strip("\"'")
            lines.setdefault(f"{table}.{name}" if table else name, number)
    return lines


# Shipped specs, found by name: `lrdsl.load("gdn")` and `lrdsl compile gdn` work from any directory.
#
# An installed lrdsl carries the specs as package data (lrdsl/specs/*.toml in the wheel); a source
# checkout reads them from the repository's specs/ directory. A path still works and wins: a name
# is looked up only when no file of that name exists.
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
    return load_spec(resolve_spec(spec))
