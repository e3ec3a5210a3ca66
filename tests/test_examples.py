"""Every command each example's docstring documents, run as a user runs it (a fresh process,
TRITON_INTERPRET unset; CPU: Triton's interpreter, GPU: as is): it ends with its verdict, "ok"
(or "identical" for the generation), exits 0, and every error it prints against the float64
oracle is within the tolerance of its dtypes. A command that needs a GPU is refused on a CPU in
one line (exit status 2) that says why and what to run instead."""
from __future__ import annotations

import re
import shlex
import subprocess
import sys

import pytest

from conftest import HAS_GPU, ROOT
from test_cli import user_environment

EXAMPLES = sorted((ROOT / "examples").glob("*.py"))


def documented_commands() -> list[str]:
    """The `python examples/X.py ...` lines of every example's docstring (comments dropped)."""
    commands = []
    for path in EXAMPLES:
        text = path.read_text()
        docstring = text[text.index('"""') + 3:text.index('"""', text.index('"""') + 3)]
        commands += [line.split("#")[0].strip() for line in docstring.splitlines()
                     if line.strip().startswith(f"python examples/{path.name}")]
    return commands


# On a CPU these are refused: (what the one line must say)
NEEDS_GPU = {
    "python examples/serving_decode.py --state-dtype bfloat16": "use --state-dtype float16 on a CPU",
    "python examples/qwen35_layer.py --released": "run it without --released",
    "python examples/train_hybrid.py --steps 500 --out /tmp/train_hybrid/lrdsl": "run it with --tiny",
    "python examples/train_hybrid.py --steps 500 --backend fla --out /tmp/train_hybrid/fla":
        "use --backend lrdsl or torch on a CPU",
}


def test_every_example_documents_its_commands():
    assert {p.name for p in EXAMPLES} == {"serving_decode.py", "qwen35_layer.py", "qwen35_generate.py", "train_hybrid.py"}
    assert {c.split()[1] for c in documented_commands()} == {f"examples/{p.name}" for p in EXAMPLES}
    assert set(NEEDS_GPU) <= set(documented_commands())


@pytest.mark.parametrize("command", documented_commands())
def test_documented_example_command(command):
    environment = user_environment()
    assert "TRITON_INTERPRET" not in environment
    words = shlex.split(command)
    result = subprocess.run([sys.executable, *words[1:]], cwd=ROOT, env=environment, capture_output=True, text=True,
                            timeout=1200)
    if command in NEEDS_GPU and not HAS_GPU:
        assert result.returncode == 2, result.stdout + result.stderr
        (line,) = result.stderr.strip().splitlines()
        assert "needs a GPU" in line and NEEDS_GPU[command] in line, line
        return
    assert result.returncode == 0, result.stdout + result.stderr
    last = result.stdout.splitlines()[-1]
    assert last == ("identical" if "qwen35_generate" in command else "ok"), result.stdout
    if "serving_decode" in command:
        check_serving_output(command, result.stdout)
    if "train_hybrid" in command:
        check_training_run(words)


def check_training_run(words):
    """The run.json a training command wrote: one finite loss per step, falling, and a speed."""
    import json
    from pathlib import Path

    run = json.loads((Path(words[words.index("--out") + 1]) / "run.json").read_text())
    steps = int(words[words.index("--steps") + 1])
    backend = words[words.index("--backend") + 1] if "--backend" in words else "lrdsl"
    assert run["backend"] == backend and len(run["losses"]) == steps
    assert all(0 < x < 10 for x in run["losses"]) and run["losses"][-1] < run["losses"][0] - 0.5, run["losses"]
    assert run["tokens_per_s"] > 0 and (run["peak_mib"] is None) == (not HAS_GPU)


def check_serving_output(command, stdout):
    for needed in ("prefill A (5 tokens)", "B leaves", "D joins slot 1", "verify 3 drafts each, accepted",
                   "verify a tree of 5 drafts each", "o of every node of the tree", "wrote its state after 16 and 32 tokens",
                   "checkpoint rows", "Q repeats P's first 32 tokens", "Q's pool row", "final pool rows"):
        assert needed in stdout, needed
    errors = [float(x) for x in re.findall(r"relative error vs the oracle (\S+)", stdout)]
    sixteen_bit = HAS_GPU or "--state-dtype" in command  # bf16 inputs on a GPU, a 16-bit pool
    limit = 8e-3 if sixteen_bit else 2e-3
    if "--state-dtype int8" in command:  # one store's rounding of a column, at the example's K (128 on a GPU)
        limit = (128 if HAS_GPU else 16) ** 0.5 / 254
    # 2 prefills, 6 steps, the tree step, the prefix cache's checkpoints, Q's o and row, the final rows
    assert len(errors) == 13 and max(errors) <= limit, stdout


def test_a_failing_serving_check_names_itself(monkeypatch, capsys):
    """Before: "FAILED: an error above the tolerance", without saying which check."""
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import serving_decode
    finally:
        sys.path.remove(str(ROOT / "examples"))
    monkeypatch.setitem(serving_decode.TOLERANCE, serving_decode.torch.float32, 1e-12)  # every check fails
    assert serving_decode.main([]) == 1
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith("FAILED: prefill o ") and "step 0: o " in last and "final pool rows" in last, last
    assert re.search(r"final pool rows of the requests in the batch \d\.\de-\d\d > 1e-12$", last), last


def test_serving_walkthrough_runs_a_spec_with_several_steps_per_token(capsys):
    """--spec takes any spec. Before: gated_deltaproduct (2 update steps a token) stopped in the
    example's oracle, which sliced k, v and beta one row a token ("The expanded size of the tensor
    (10) must match the existing size (5)")."""
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import serving_decode
    finally:
        sys.path.remove(str(ROOT / "examples"))
    assert serving_decode.main(["--spec", "gated_deltaproduct"]) == 0
    out = capsys.readouterr().out
    check_serving_output("python examples/serving_decode.py --spec gated_deltaproduct", out)
