"""Name hygiene: a spec's input names can never collide with the names generated code uses.

Specs whose inputs take every name the generated modules use (kernel registers and parameters,
launcher locals, module globals, autograd arguments) and every value name of the IR compile and
match the float64 oracle in recurrent, chunk and gradients; names that cannot work (the keyword
options of the public functions) are refused at spec time with one line naming file:line:key.
"""
from __future__ import annotations

import ast
import inspect
import re
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import pytest
import torch

import lrdsl
from lrdsl.codegen.names import reserved_input_name
from lrdsl.errors import SpecError
from lrdsl.ir.chunk import NoChunkForm
from lrdsl.ir.step import Formula as StepFormula
from lrdsl.passes.pipeline import run_pipeline
from lrdsl.runtime.loader import generate
from lrdsl.spec import load_spec
from lrdsl.verification.workloads import TOLERANCE, Shape

from helpers import ALL_SPECS, spec_path
from oracle_checks import Call, assert_errors, oracle_errors

ROOT = Path(__file__).resolve().parent.parent

BATCHES = 6  # the names are spread over this many specs
LIMIT = TOLERANCE[torch.float32]
USER_PREFIXES = ("in_", "b_in_", "p_in_", "d_in_")  # lrdsl.codegen.names: what input names become


def code_names(source: str) -> set[str]:
    """Every identifier a module binds or reads."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.keyword) and node.arg:
            names.add(node.arg)
        elif isinstance(node, ast.alias):
            names.add((node.asname or node.name).split(".")[0])
    return names


def ir_names(stages: dict) -> set[str]:
    """The value names of the chunk programs and the variables of the step program."""
    names = set()
    for key in ("chunk", "backward"):
        if not isinstance(stages[key], NoChunkForm):
            names |= {op.out for op in stages[key].ops}
    for op in stages["step"].prologue + stages["step"].body:
        names |= set(op.uses()) | set(op.defines())
        if isinstance(op, StepFormula):
            names.add(op.target)
    return names


SPEC_NAME = "hygiene"  # the specs below; kernels are named after it


@lru_cache(maxsize=1)
def generated_names() -> tuple[str, ...]:
    """Every name the shipped specs' generated modules and IR use that an input may take (~400):
    the modules' identifiers, the IR's value and variable names, and the stems of prefixed names
    (s of b_s), which an input named so used to collide with. Registers of IR values (b_G) are
    left out, checked by test_user_prefixes_are_only_for_inputs instead; kernel names are tried
    as this test's spec names them."""
    names, values = set(), set()
    for spec in ALL_SPECS:
        source, stages = generate(spec_path(spec))
        names |= code_names(source) | ir_names(stages)
        values |= ir_names(stages)
    names |= {match.group(2) for n in names if (match := re.fullmatch(r"(b|p|d|m|o|i|f|in|blk|buf|saved)_(\w+)", n))}
    names -= {f"b_{value}" for value in values}
    kernel = re.compile(rf"({'|'.join(ALL_SPECS)})_(chunk|recurrent)(\w*)_kernel")
    names = {kernel.sub(lambda m: f"{SPEC_NAME}_{m.group(2)}{m.group(3)}_kernel", n) for n in names}
    return tuple(sorted(n for n in names if re.fullmatch(r"[A-Za-z_]\w*", n) and reserved_input_name(n) is None))


def write_spec(tmp_path, names: list[str], tag: str, tokens_only=False) -> str:
    """A delta rule with a scalar gate whose inputs are `names`: token and per-head ones, read by
    the gate (first half) and beta (second half). Inputs alternate token / head, and the
    first one is a token input: a scalar gate needs one."""
    roles = {name: "token" if i % 2 == 0 or tokens_only else "head" for i, name in enumerate(names)}
    gate, beta = names[: (len(names) + 1) // 2], names[(len(names) + 1) // 2:] or names[:1]
    lines = [f'name = "{SPEC_NAME}"', "[recurrence]", 'update = "delta"', 'gate = "scalar"', "[inputs]"]
    lines += [f'{name} = "{role}"' for name, role in roles.items()]
    # means of sigmoids: each input's derivative is its own term, not the whole formula again
    lines += ["[formulas]", f'log_decay = "-({" + ".join(f"sigmoid({n})" for n in gate)}) / {len(gate)}"',
              f'beta = "({" + ".join(f"sigmoid({n})" for n in beta)}) / {len(beta)}"']
    path = tmp_path / f"{SPEC_NAME}_{tag}.toml"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_the_names_include_the_ones_that_collided():
    """The names the issue found colliding are among those tried below."""
    assert {"s", "p", "u", "d_o", "BT", "bos", "eos", "NC", "c", "run", "a", "x", "T", "H", "b_s", "blk_a"} <= set(
        generated_names()
    )


# Finding 1 of issue 8: an input s, p or u corrupted the recurrent kernel (its state, prediction
# and residual registers b_s, b_p, b_u); d_o, BT, bos, eos, NC, c and run broke the module; the
# solve's b_a and b_x overwrote an input a or x.
ISSUE_NAMES = ["s", "p", "u", "d_o", "BT", "bos", "eos", "NC", "c", "run", "a", "x"]


def test_the_names_the_issue_found(tmp_path, generator, device):
    path = write_spec(tmp_path, ["g"] + ISSUE_NAMES, "issue", tokens_only=True)
    rec = run_pipeline(load_spec(path), until="recurrence")["recurrence"]
    mod = lrdsl.load(path)
    call = Call(Shape(1, 20, 1, 2, 8, 8), h0=True, dht=True)
    recurrent = oracle_errors(rec, mod, call, generator, "recurrent", gradients=False, device=device)
    assert_errors(recurrent, LIMIT, "recurrent")
    assert_errors(oracle_errors(rec, mod, call, generator, "chunk", chunk_size=16, device=device), LIMIT, "chunk")


@pytest.mark.parametrize("batch", range(BATCHES))
def test_inputs_named_like_generated_code(batch, tmp_path, generator, device):
    names = list(generated_names()[batch::BATCHES])
    path = write_spec(tmp_path, names, str(batch))
    rec = run_pipeline(load_spec(path), until="recurrence")["recurrence"]
    mod = lrdsl.load(path)
    call = Call(Shape(1, 17, 1, 1, 8, 8), h0=True, dht=True)  # two chunks of 16
    recurrent = oracle_errors(rec, mod, call, generator, "recurrent", gradients=False, device=device)
    assert_errors(recurrent, LIMIT, f"recurrent {names}")
    errors = oracle_errors(rec, mod, call, generator, "chunk", chunk_size=16, device=device)
    assert_errors(errors, LIMIT, f"chunk {names}")


def test_namespaces_hold_only_their_names():
    """In every shipped spec's module, names with the prefixes inputs become are inputs' names, and
    in the chunk kernels the b_, buf_ and saved_ names are chunk-program values': the templates and
    emitters define none of their own there."""
    for spec in ALL_SPECS:
        source, stages = generate(spec_path(spec))
        inputs = {i.name for i in stages["substeps"].inputs}  # what the kernels take (a step gate too)
        for name in code_names(source):
            for prefix in USER_PREFIXES:
                if name.startswith(prefix):
                    assert name[len(prefix):] in inputs or any(
                        name == p + "in_" + i for p in ("b_", "p_", "d_") for i in inputs
                    ), f"{spec}: {name} uses the prefix {prefix!r} of input names"
        if isinstance(stages["chunk"], NoChunkForm):
            continue
        values = {op.out for key in ("chunk", "backward_factored") for op in stages[key].ops}
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.FunctionDef) and re.search(r"_chunk\w*_kernel$", node.name):
                for name in code_names(ast.unparse(node)):
                    prefix = re.match(r"(b|buf|saved)_", name)
                    assert not prefix or name[prefix.end():] in values, f"{spec}: {name} in {node.name} is no value's"


def test_keyword_options_are_refused_at_spec_time(tmp_path):
    """Every keyword parameter of the public functions, read off a generated module, is refused
    as an input name with one line naming the file, the line and the key."""
    mod = lrdsl.load(spec_path("gdn"))
    options = set()
    for fn in (mod.chunk, mod.recurrent):
        params = list(inspect.signature(fn).parameters)
        options |= set(params[params.index("beta") + 1:])
    assert {"scale", "precision", "save_policy", "chunk_indices"} <= options
    for option in sorted(options) + ["q", "h", "exp", "_private", "class"]:
        text = (f'name = "x"\n[recurrence]\nupdate = "plain"\ngate = "scalar"\n[inputs]\n{option} = "token"\n'
                f'[formulas]\nlog_decay = "-softplus({option})"\n')
        path = tmp_path / "reserved.toml"
        path.write_text(text)
        with pytest.raises(SpecError) as info:
            load_spec(path)
        message = str(info.value)
        assert "\n" not in message and f"reserved.toml:6: inputs.{option}: " in message, message


def test_a_printed_seed_replays_a_test():
    """Tests print the seed of their random inputs; `pytest --seed N` starts every generator from N."""
    test = "tests/test_reference.py::test_oracle_default_scale_and_no_state"
    run = subprocess.run([sys.executable, "-m", "pytest", test, "-s", "-q", "-p", "no:cacheprovider", "--seed", "12345"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "[seed 12345]" in run.stdout


# random tensors drawn from torch's global generator: the printed seed would not replay them
_UNSEEDED = re.compile(r"torch\.(randn|rand|randint)_like\(|torch\.(randn|rand|randint|randperm)\((?![^\n]*generator=)")


def test_gpu_tests_draw_every_random_tensor_from_the_seeded_generator():
    """A GPU test that fails prints its seed; `--seed N` must rebuild every input it used (the
    d_ht of the gradient tests once came from the global generator, and a failure could not be
    replayed)."""
    unseeded = [f"{path.name}:{number}: {line.strip()}"
                for path in sorted((ROOT / "tests").glob("test_gpu*.py"))
                for number, line in enumerate(path.read_text().splitlines(), 1)
                if _UNSEEDED.search(line)]
    assert unseeded == [], "\n".join(unseeded)


def test_no_merge_conflict_markers_are_committed():
    """A merge once committed unresolved conflict markers into README.md and docs/design.md: no
    tracked text file may hold a line that is one."""
    root = Path(__file__).resolve().parent.parent
    files = subprocess.run(["git", "ls-files"], cwd=root, capture_output=True, text=True, check=True).stdout.split()
    marker = re.compile(r"^(<{7}( |$)|>{7}( |$)|={7}$)")
    found = []
    for name in files:
        path = root / name
        if path.suffix not in (".py", ".md", ".jinja", ".toml", ".txt", ".json", ".sh", ".cfg") and path.name not in ("Makefile", "run"):
            continue
        if not path.is_file():
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if marker.match(line):
                found.append(f"{name}:{number}")
    assert not found, f"conflict markers: {found}"


def test_generated_modules_are_ascii():
    """Every shipped spec's module text is ASCII: `lrdsl show` prints it and `lrdsl compile` writes
    it under any locale (under LC_ALL=C a "§" in copied host code stopped `lrdsl show`)."""
    for spec in ALL_SPECS:
        source, _ = generate(spec_path(spec))
        odd = [(n, line) for n, line in enumerate(source.splitlines(), 1) if not line.isascii()]
        assert not odd, f"{spec}: non-ASCII text in the module, line {odd[0][0]}: {odd[0][1].strip()}"
