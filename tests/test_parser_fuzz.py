"""`lrdsl compile` on generated specs: valid ones, nearly valid ones (one or two mutations of a
valid one) and garbage. Each must either compile to a whole module, or print one line naming the
file, the line and (unless the TOML itself is broken) the key, with exit status 2: never a
traceback, never a half-written output file.

The CLI's main() runs in-process for speed (hypothesis, fixed seed, bounded examples); a few
subprocess runs check the same thing through the real command.
"""
from __future__ import annotations

import ast
import contextlib
import io
import re
import subprocess
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lrdsl.cli import main

from test_cli import lrdsl_command, user_environment

FUZZ = dict(derandomize=True, database=None, deadline=None, suppress_health_check=list(HealthCheck))

# keys lrdsl may name although the spec does not spell them (a missing required key)
SCHEMA_KEYS = {"name", "summary", "recurrence", "recurrence.update", "recurrence.gate", "inputs", "formulas",
               "formulas.log_decay", "formulas.beta"}


# -- valid specs ------------------------------------------------------------------------------------

@st.composite
def valid_specs(draw) -> list[str]:
    """The lines of a valid spec: every gate kind and update (aliases included), inputs of every
    role feeding in-kernel formulas, tables in either order, comments, both quote styles."""
    quote = draw(st.sampled_from(['"', "'"]))

    def text(value: str) -> str:
        return f"{quote}{value}{quote}" if quote not in value else f'"{value}"'

    gate = draw(st.sampled_from(["none", "scalar", "constant", "key_channel", "const", "key-channel", "Scalar"]))
    update = draw(st.sampled_from(["delta", "plain", "delta_rule", "additive", "Delta"]))
    gate_input = draw(st.sampled_from(["g", "a", "gk", "w", "decay"]))
    beta_input = draw(st.sampled_from(["b", "beta", "bw", "s"]))
    inputs: dict[str, str] = {}
    formulas: dict[str, str] = {}
    kind = gate.lower().replace("-", "_")
    if kind == "scalar":
        inputs[gate_input] = "token"
        formulas["log_decay"] = draw(st.sampled_from([gate_input, f"-softplus({gate_input})", f"logsigmoid({gate_input})",
                                                      f"-exp(A_log) * softplus({gate_input} + dt_bias)"]))
        if "A_log" in formulas["log_decay"]:
            inputs.update(A_log="head", dt_bias="head")
    elif kind == "key_channel":
        inputs[gate_input] = "token_key"
        formulas["log_decay"] = draw(st.sampled_from([gate_input, f"-softplus({gate_input})", f"logsigmoid({gate_input})"]))
    elif kind in ("constant", "const"):
        formulas["log_decay"] = draw(st.sampled_from(["log(1 - 2**(-5 - h))", "-0.5", f"-exp({gate_input})"]))
        if gate_input in formulas["log_decay"]:
            inputs[gate_input] = "head"
    beta = draw(st.sampled_from([None, "token", "direct", "head"]))
    if beta == "token":
        inputs[beta_input], formulas["beta"] = "token", f"{draw(st.sampled_from(['', '2 * ']))}sigmoid({beta_input})"
    elif beta == "direct":
        inputs[beta_input], formulas["beta"] = "token", beta_input
    elif beta == "head":
        inputs[beta_input], formulas["beta"] = "head", f"sigmoid({beta_input})"

    name = draw(st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,12}", fullmatch=True))
    head = [f"name = {text(name)}"]
    if draw(st.booleans()):
        head.append(f"summary = {text(draw(st.sampled_from(['a mixer', 'gated, with beta', ''])))}")
    tables = [["[recurrence]", f"update = {text(update)}", f"gate = {text(gate)}"]]
    if inputs:
        tables.append(["[inputs]"] + [f"{n} = {text(role)}" for n, role in inputs.items()])
    if formulas:
        tables.append(["[formulas]"] + [f"{k} = {text(v)}" for k, v in formulas.items()])
    tables[1:] = draw(st.permutations(tables[1:]))
    lines = head
    for table in tables:
        lines += [""] + table
    if draw(st.booleans()):
        lines.insert(0, "# a generated spec")
    return lines


# -- nearly valid specs: a valid one with one or two mutations ---------------------------------------

WRONG_VALUES = ["1", "true", "[1, 2]", "{ x = 1 }", '""', '"???"', "1.5", '"diagonal"', "'token_key'", '"h"',
                '"q"', '"exp(q)"', '"log_decay"', '"softplus("', '"foo(a)"', '"a +"', '"1/0"', '"sqrt(-1)"',
                '"import os"', '"__import__(\'os\')"', '"lambda x: x"', '"a if a else b"', '"a[0]"', '"a.b"',
                '"1e400"', '"exp(1e400)"', '"-0"', '"nan"', '"oo"', '"I"', '"h * a"', '"2**62"', '"(a"']
ODD_KEYS = ["gates", "updat", "formula", "log-decay", "bet", "chunk", "q", "k", "scale", "b_x", "1a", "def",
            '"a b"', "ñame", "名前", "h", "inputs", "recurrence"]
# Formula fragments. At most one power per formula: lrdsl hangs on a chain of numeric powers
# such as 9**9**9 (sympy evaluates the integer exactly); that is a separate, reported issue.
FRAGMENTS = ["a", "b", "g", "h", "x", "exp(", "log(", "softplus(", "sigmoid(", "tanh(", "sqrt(", "foo(", "(", ")",
             "+", "-", "*", "/", "**", "1", "2", "0.5", ",", " ", "q", "1e400", "E", "pi", "==", "[", "]"]


@st.composite
def nearly_valid_specs(draw) -> list[str]:
    lines = draw(valid_specs())
    for _ in range(draw(st.integers(1, 2))):
        lines = draw(mutations(lines))
    return lines


@st.composite
def mutations(draw, lines: list[str]) -> list[str]:
    lines = list(lines)
    at = draw(st.integers(0, len(lines) - 1))
    assignment = re.match(r"(\s*)([^=\s]+)(\s*=\s*)(.*)", lines[at])
    kind = draw(st.sampled_from(["drop", "duplicate", "swap", "value", "key", "extra", "formula", "break", "table",
                                 "inline", "dotted"]))
    if kind == "drop":
        del lines[at]
    elif kind == "duplicate":
        lines.insert(at, lines[at])
    elif kind == "swap":
        other = draw(st.integers(0, len(lines) - 1))
        lines[at], lines[other] = lines[other], lines[at]
    elif kind == "value" and assignment:
        lines[at] = "".join(assignment.group(1, 2, 3)) + draw(st.sampled_from(WRONG_VALUES))
    elif kind == "key" and assignment:
        lines[at] = assignment.group(1) + draw(st.sampled_from(ODD_KEYS)) + assignment.group(3) + assignment.group(4)
    elif kind == "extra":
        lines.insert(at, f"{draw(st.sampled_from(ODD_KEYS))} = {draw(st.sampled_from(WRONG_VALUES))}")
    elif kind == "formula":
        fragments = draw(st.lists(st.sampled_from(FRAGMENTS), max_size=12).filter(lambda f: f.count("**") <= 1))
        key = draw(st.sampled_from(["log_decay", "beta"]))
        lines += ["[formulas]" if "[formulas]" not in lines else "", f'{key} = "{"".join(fragments)}"']
    elif kind == "break":
        cut = draw(st.integers(0, max(0, len(lines[at]) - 1)))
        lines[at] = lines[at][:cut]
    elif kind == "table":
        lines.insert(at, draw(st.sampled_from(["[recurrence]", "[[inputs]]", "[formulas.beta]", "[x]", "[", "[inputs"])))
    elif kind in ("inline", "dotted"):  # other TOML spellings of the same tables
        lines = respelled(lines, kind)
    return lines


def respelled(lines: list[str], kind: str) -> list[str]:
    """The [recurrence] table as an inline table, or as dotted keys at the top."""
    if "[recurrence]" not in lines:
        return lines
    start = lines.index("[recurrence]")
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("[")), len(lines))
    body = [line for line in lines[start + 1:end] if line.strip()]
    if kind == "inline":
        spelled = [f"recurrence = {{ {', '.join(body)} }}"]
    else:
        spelled = [f"recurrence.{line.strip()}" for line in body]
    rest = lines[:start] + lines[end:]
    first_table = next((i for i, line in enumerate(rest) if line.startswith("[")), len(rest))
    return rest[:first_table] + spelled + rest[first_table:]


# -- the property ------------------------------------------------------------------------------------

def compile_in_process(content: bytes) -> tuple[int, str, str, Path, list[str], str]:
    """lrdsl compile SPEC -o OUT via main(); (status, stdout, stderr, spec path, files left in the
    output directory, the module text if any)."""
    with tempfile.TemporaryDirectory() as directory:
        spec_file, out_dir = Path(directory) / "fuzz.toml", Path(directory) / "out"
        spec_file.write_bytes(content)
        out_dir.mkdir()
        stdout, stderr = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            status = main(["compile", str(spec_file), "-o", str(out_dir / "ops.py")])
        left = sorted(p.name for p in out_dir.iterdir())
        module = (out_dir / "ops.py").read_text() if (out_dir / "ops.py").exists() else ""
        return status, stdout.getvalue(), stderr.getvalue(), spec_file, left, module


def assert_compiles_or_one_line(status, stdout, stderr, spec_file: Path, left: list[str], module: str, content: bytes):
    if status == 0:
        assert stderr == "" and stdout.startswith("wrote "), (stdout, stderr)
        assert left == ["ops.py"], left
        tree = ast.parse(module)  # a whole module, not a part
        functions = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
        assert "recurrent" in functions, sorted(functions)
        return
    assert status == 2, (status, stderr)
    assert left == [], f"a failed compile leaves nothing behind: {left}"
    assert stdout == ""
    lines = stderr.splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    match = re.fullmatch(rf"lrdsl: error: {re.escape(str(spec_file))}:(\d+): (.+)", lines[0])
    assert match, f"no file:line in {lines[0]!r}"
    number_of_lines = max(1, len(content.splitlines()))
    assert 1 <= int(match.group(1)) <= number_of_lines + 1, (lines[0], number_of_lines)
    message = match.group(2)
    if message.startswith(("invalid TOML: ", "not UTF-8 text")):
        return  # the file is not TOML text: there is no key to name
    key, _, why = message.partition(": ")
    assert why, f"no key named in {message!r}"
    text = content.decode("utf-8", errors="replace")
    assert key in SCHEMA_KEYS or key.split(".")[-1].strip('"') in text, f"{key!r} is neither a schema key nor in the spec"


def check(content: bytes):
    assert_compiles_or_one_line(*compile_in_process(content), content)


def encoded(lines: list[str]) -> bytes:
    return ("\n".join(lines) + "\n").encode()


@settings(max_examples=20, **FUZZ)
@given(valid_specs())
def test_valid_specs_compile(lines):
    status, stdout, stderr, *_ = result = compile_in_process(encoded(lines))
    assert status == 0, "\n".join(lines) + "\n--> " + stderr
    assert_compiles_or_one_line(*result, encoded(lines))


@settings(max_examples=150, **FUZZ)
@given(nearly_valid_specs())
def test_nearly_valid_specs_compile_or_say_where(lines):
    check(encoded(lines))


@settings(max_examples=100, **FUZZ)
@given(st.one_of(st.text(max_size=200).map(str.encode), st.binary(max_size=200)))
def test_garbage_says_where(content):
    check(content)


REAL_COMMAND_SAMPLES = {
    "valid": b'name = "mine"\n[recurrence]\nupdate = "plain"\ngate = "none"\n',
    "nearly valid": b'name = "mine"\n[recurrence]\nupdate = "plain"\ngate = "none"\n[inputs]\nx = "token"\n',
    "inline table": b'name = "mine"\nrecurrence = { update = "delta", gate = "scalar" }\n',
    "garbage": b"\x00\xff[[[ = =\n",
}


def test_the_real_command_on_a_few_samples(tmp_path):
    for label, content in REAL_COMMAND_SAMPLES.items():
        spec_file, out_dir = tmp_path / label / "fuzz.toml", tmp_path / label / "out"
        out_dir.mkdir(parents=True)
        spec_file.write_bytes(content)
        result = subprocess.run(lrdsl_command() + ["compile", str(spec_file), "-o", str(out_dir / "ops.py")],
                                env=user_environment(), capture_output=True, text=True, timeout=600)
        left = sorted(p.name for p in out_dir.iterdir())
        module = (out_dir / "ops.py").read_text() if (out_dir / "ops.py").exists() else ""
        assert (result.returncode == 0) == (label == "valid"), (label, result.stderr)
        assert_compiles_or_one_line(result.returncode, result.stdout, result.stderr, spec_file, left, module, content)
