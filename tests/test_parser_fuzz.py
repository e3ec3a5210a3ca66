"""`lrdsl compile` on generated specs: valid ones, nearly valid ones (one or two mutations of a
valid one) and garbage. Each must either compile to a whole module, or print one line naming the
file, the line and (unless the TOML itself is broken) the key, with exit status 2: never a
traceback, never a half-written output file. Every update is drawn, the diagonal-plus-low-rank
one (dplr) too, whose mutations give dplr without a low-rank formula or with another gate,
low-rank formulas beside another update, low-rank formulas reading no per-key-channel input or
the head index, and broken formula text.

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
               "formulas.log_decay", "formulas.beta", "formulas.low_rank_read", "formulas.low_rank_write"}
FORMULA_KEYS = ["log_decay", "beta", "low_rank_read", "low_rank_write"]


# -- valid specs ------------------------------------------------------------------------------------

@st.composite
def valid_specs(draw) -> list[str]:
    """The lines of a valid spec: every gate kind and update (aliases included), inputs of every
    role feeding in-kernel formulas, tables in either order, comments, both quote styles. The dplr
    update (diagonal plus low rank) takes a key-channel gate and two low-rank formulas, which read
    per-key-channel inputs of their own, the gate's input, or per-token and per-head ones beside."""
    quote = draw(st.sampled_from(['"', "'"]))

    def text(value: str) -> str:
        return f"{quote}{value}{quote}" if quote not in value else f'"{value}"'

    update = draw(st.sampled_from(["delta", "plain", "delta_rule", "additive", "Delta", "dplr", "diagonal_plus_low_rank",
                                   "DPLR", "diagonal-plus-low-rank"]))
    low_rank = update.lower().replace("-", "_") in ("dplr", "diagonal_plus_low_rank")
    if low_rank:  # its decay is per key channel
        gate = draw(st.sampled_from(["key_channel", "key-channel", "channel", "per_key"]))
    else:
        gate = draw(st.sampled_from(["none", "scalar", "constant", "key_channel", "const", "key-channel", "Scalar"]))
    gate_input = draw(st.sampled_from(["g", "a", "gk", "w", "decay"]))
    beta_input = draw(st.sampled_from(["b", "beta", "bw", "s"]))
    inputs: dict[str, str] = {}
    formulas: dict[str, str] = {}
    kind = gate.lower().replace("-", "_")
    if kind in ("channel", "per_key"):
        kind = "key_channel"
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
        if re.search(rf"\b{gate_input}\b", formulas["log_decay"]):  # a name, not a substring: "g" is in "log"
            inputs[gate_input] = "head"
    beta = draw(st.sampled_from([None, "token", "direct", "head"]))
    if beta == "token":
        inputs[beta_input], formulas["beta"] = "token", f"{draw(st.sampled_from(['', '2 * ']))}sigmoid({beta_input})"
    elif beta == "direct":
        inputs[beta_input], formulas["beta"] = "token", beta_input
    elif beta == "head":
        inputs[beta_input], formulas["beta"] = "head", f"sigmoid({beta_input})"
    if low_rank:
        formulas.update(draw(low_rank_formulas(inputs, gate_input)))

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


LOW_RANK_FORMS = ["{x}", "-{x}", "sigmoid({x})", "0.5 * tanh({x})", "-exp({x})", "{x} / (1 + {x}**2)", "{x}**2"]


@st.composite
def low_rank_formulas(draw, inputs: dict[str, str], gate_input: str) -> dict[str, str]:
    """formulas.low_rank_read and low_rank_write (a_t, b_t of the dplr update), declaring in
    `inputs` what they read: each a per-key-channel input of its own (token_key or head_key) or the
    gate's, sometimes times a per-token or per-head input already declared."""
    formulas = {}
    for key, own in (("low_rank_read", "ra"), ("low_rank_write", "wb")):
        name = draw(st.sampled_from([own, "kk", gate_input]))  # kk: both formulas may read one input
        if name not in inputs:
            inputs[name] = draw(st.sampled_from(["token_key", "head_key"]))
        text = draw(st.sampled_from(LOW_RANK_FORMS)).format(x=name)
        per_token_or_head = [n for n, role in inputs.items() if role in ("token", "head")]
        if per_token_or_head and draw(st.booleans()):
            text = f"({text}) * sigmoid({draw(st.sampled_from(per_token_or_head))})"
        formulas[key] = text
    return formulas


# -- nearly valid specs: a valid one with one or two mutations ---------------------------------------

WRONG_VALUES = ["1", "true", "[1, 2]", "{ x = 1 }", '""', '"???"', "1.5", '"diagonal"', "'token_key'", '"h"',
                '"q"', '"exp(q)"', '"log_decay"', '"softplus("', '"foo(a)"', '"a +"', '"1/0"', '"sqrt(-1)"',
                '"import os"', '"__import__(\'os\')"', '"lambda x: x"', '"a if a else b"', '"a[0]"', '"a.b"',
                '"1e400"', '"exp(1e400)"', '"-0"', '"nan"', '"oo"', '"I"', '"h * a"', '"2**62"', '"(a"',
                '"token"', '"head"', '"head_key"', '"dplr"', '"h * ra"', '"kk + 1"']
ODD_KEYS = ["gates", "updat", "formula", "log-decay", "bet", "chunk", "q", "k", "scale", "b_x", "1a", "def",
            '"a b"', "ñame", "名前", "h", "inputs", "recurrence", "low_rank", "low-rank-read", "lowrank_write",
            "low_rank_reads"]
# every value recurrence.update and recurrence.gate take, in some spelling
RULES = {"update": ["delta", "plain", "dplr", "diagonal_plus_low_rank"],
         "gate": ["none", "scalar", "constant", "key_channel", "channel"]}
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
                                 "inline", "dotted", "rule", "edit"]))
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
        key = draw(st.sampled_from(FORMULA_KEYS))
        lines += ["[formulas]" if "[formulas]" not in lines else "", f'{key} = "{"".join(fragments)}"']
    elif kind == "rule":  # another update or gate: dplr without its formulas, low-rank ones without dplr, ...
        key = draw(st.sampled_from(sorted(RULES)))
        found = [i for i, line in enumerate(lines) if re.match(rf"\s*{key}\s*=", line)]
        if found:
            lines[found[0]] = f'{key} = "{draw(st.sampled_from(RULES[key]))}"'
    elif kind == "edit":  # a fragment inserted into a formula's text
        found = [i for i, line in enumerate(lines) if re.match(rf"\s*({'|'.join(FORMULA_KEYS)})\s*=\s*[\"']", line)]
        if found:
            i = draw(st.sampled_from(found))
            opening = re.search(r"[\"']", lines[i]).start()  # inside the quotes, the closing one's place included
            cut = draw(st.integers(opening + 1, len(lines[i]) - 1))
            fragment = draw(st.sampled_from([f for f in FRAGMENTS if f != "**"]))
            lines[i] = lines[i][:cut] + fragment + lines[i][cut:]
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
