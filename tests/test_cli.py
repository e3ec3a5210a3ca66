"""The command line as a user runs it: subprocesses, exit codes, one-line errors, files on disk."""
from __future__ import annotations

import ast
import os
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from lrdsl import reference
from lrdsl.workloads import Shape, make_inputs

from conftest import HAS_GPU, INTERPRETED, ROOT
from helpers import assert_close, recurrence, spec_path

LRDSL_SCRIPT = Path(sys.executable).parent / "lrdsl"


def lrdsl_command() -> list[str]:
    return [str(LRDSL_SCRIPT)] if LRDSL_SCRIPT.exists() else [sys.executable, "-m", "lrdsl"]


def user_environment(**extra) -> dict:
    """The environment a user's shell has: without the TRITON_INTERPRET the test process set."""
    environment = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return {**environment, **extra}


def run(args: list[str], cwd=ROOT, env=None, timeout=600) -> subprocess.CompletedProcess:
    full_env = user_environment(**(env or {}))
    return subprocess.run(lrdsl_command() + args, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout)


def assert_one_line_error(result: subprocess.CompletedProcess, *fragments: str):
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, f"expected one error line, got:\n{result.stderr}"
    assert lines[0].startswith("lrdsl: error: ")
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in lines[0]


def test_compile_writes_standalone_module(tmp_path):
    out = tmp_path / "gdn_ops.py"
    result = run(["compile", "specs/gdn.toml", "-o", str(out)])
    assert result.returncode == 0, result.stderr
    assert f"wrote {out}" in result.stdout
    tree = ast.parse(out.read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add(node.module.split(".")[0])
    assert imported == {"torch", "triton"}


def test_standalone_module_runs_without_lrdsl(tmp_path, generator):
    out = tmp_path / "gdn_ops.py"
    assert run(["compile", "specs/gdn.toml", "-o", str(out)]).returncode == 0
    rec = recurrence("gdn")
    tensors = make_inputs(rec, Shape(2, 11, 2, 4, 24, 40), generator=generator)
    h0 = torch.randn(2, 4, 24, 40, generator=generator)
    torch.save({"tensors": tensors, "h0": h0}, tmp_path / "inputs.pt")
    script = textwrap.dedent(
        f"""
        import importlib.abc, importlib.util, os, sys
        class BlockLrdsl(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name == "lrdsl" or name.startswith("lrdsl."):
                    raise ImportError("lrdsl is made unimportable for this test")
        sys.meta_path.insert(0, BlockLrdsl())
        import torch
        if not torch.cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"
        spec = importlib.util.spec_from_file_location("gdn_ops", {str(out)!r})
        mod = importlib.util.module_from_spec(spec)
        sys.modules["gdn_ops"] = mod
        spec.loader.exec_module(mod)
        assert not any(m == "lrdsl" or m.startswith("lrdsl.") for m in sys.modules)
        data = torch.load({str(tmp_path / 'inputs.pt')!r})
        device = "cuda" if torch.cuda.is_available() else "cpu"
        o, ht = mod.recurrent(*[t.to(device) for t in data["tensors"]], initial_state=data["h0"].to(device),
                              output_final_state=True, use_qk_l2norm_in_kernel=True)
        torch.save({{"o": o.cpu(), "ht": ht.cpu()}}, {str(tmp_path / 'outputs.pt')!r})
        """
    )
    result = subprocess.run([sys.executable, "-c", script], env=user_environment(), capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr
    outputs = torch.load(tmp_path / "outputs.pt")
    ref_o, ref_ht = reference.run(rec, *tensors, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert_close(outputs["o"], ref_o, torch.float32, "standalone o")
    assert_close(outputs["ht"], ref_ht, torch.float32, "standalone final state")


def test_check_passes_and_prints_table():
    result = run(["check", "specs/gdn.toml", "--seed", "1", "--shape", "1,20,1,2,16,24"])
    assert result.returncode == 0, result.stdout + result.stderr
    number = r"\d\.\d\de-\d\d"
    gradient = rf"{number} \((q|k|v|g|beta|initial_state)\)"  # the worst gradient and whose it is
    assert re.search(rf"recurrent\s+dense\+h0\+l2norm\s+float32\s+{number}\s+{number}\s+{gradient}", result.stdout)
    for plan in ("fused", "split"):
        for size in (16, 32, 64):
            assert re.search(rf"chunk\[{plan},{size}\]\s+varlen\+h0\s+float16\s+{number}\s+{number}\s+{gradient}",
                             result.stdout)
    # 7 configs x 2 cases x (fp32, fp16; and bf16 on a GPU)
    assert re.search(r"^(28/28|42/42) within tolerance$", result.stdout, re.MULTILINE), result.stdout


def test_check_forward_only_skips_gradients():
    result = run(["check", "specs/deltanet.toml", "--forward-only", "--seed", "1", "--shape", "1,9,1,1,8,8"])
    assert result.returncode == 0, result.stdout + result.stderr
    rows = [line for line in result.stdout.splitlines() if line.startswith(("recurrent", "chunk["))]
    assert rows and all(re.search(r"e-\d\d\s+-\s+\de-03", line) for line in rows), result.stdout


def test_check_prove():
    result = run(["check", "specs/deltanet.toml", "--prove"])
    assert result.returncode == 0, result.stderr
    assert result.stdout.count(": proved") == 5 and "(last chunk of a sequence)" in result.stdout
    assert "gradient entries: proved" in result.stdout


def test_check_prove_key_channel_spec():
    result = run(["check", "specs/gla.toml", "--prove"])
    assert result.returncode == 0, result.stderr
    assert result.stdout.count(": proved") == 5, result.stdout


def test_show_chunk_stage_is_golden():
    result = run(["show", "specs/gdn.toml", "--stage", "chunk"])
    assert result.returncode == 0, result.stderr
    assert result.stdout == (ROOT / "tests" / "golden" / "gdn.chunk.txt").read_text()


def test_show_chunk_of_key_channel_spec():
    result = run(["show", "specs/kda.toml", "--stage", "chunk"])
    assert result.returncode == 0, result.stderr
    assert "KKt_decayed     : C x C = sum_c k_ic k_jc exp2(G_ic - G_jc) where i > j, else 0" in result.stdout
    assert "G_last          : K     = last_row(G)" in result.stdout


def test_show_prints_golden_step_program():
    result = run(["show", "specs/gdn.toml", "--stage", "step"])
    assert result.returncode == 0, result.stderr
    assert result.stdout == (ROOT / "tests" / "golden" / "gdn.step.txt").read_text()


def test_show_module_is_the_compiled_source(tmp_path):
    out = tmp_path / "m.py"
    run(["compile", "specs/simple_gla.toml", "-o", str(out)])
    result = run(["show", "specs/simple_gla.toml", "--stage", "module"])
    assert result.stdout == out.read_text()


def test_bad_spec_gives_one_line_and_no_output_file(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text(Path(spec_path("gdn")).read_text().replace('gate = "scalar"', 'gate = "diagonal"'))
    out = tmp_path / "never.py"
    result = run(["compile", str(bad), "-o", str(out)])
    assert_one_line_error(result, f"{bad}:8:", "recurrence.gate: unknown value 'diagonal'")
    assert not out.exists()
    assert not list(tmp_path.glob(".never.py*")), "no temporary file is left behind"


def test_toml_syntax_error(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('name = "x"\n[recurrence\n')
    assert_one_line_error(run(["check", str(bad)]), f"{bad}:2:", "invalid TOML")


def test_missing_spec_file():
    assert_one_line_error(run(["show", "specs/nope.toml"]), "specs/nope.toml: no such spec file")


def test_unknown_stage():
    assert_one_line_error(run(["show", "specs/gdn.toml", "--stage", "assembly"]), "unknown stage 'assembly'")


def test_output_directory_missing(tmp_path):
    result = run(["compile", "specs/gdn.toml", "-o", str(tmp_path / "no" / "such" / "dir.py")])
    assert_one_line_error(result, "directory does not exist")


def test_check_with_bad_shape_reports_tensor_error():
    result = run(["check", "specs/gdn.toml", "--shape", "1,5,3,4,8,8"])
    assert_one_line_error(result, "gdn.recurrent:", "HV=4 must be a positive multiple of the key heads H=3")


def test_check_with_malformed_shape():
    assert_one_line_error(run(["check", "specs/gdn.toml", "--shape", "1,2,3"]), "--shape takes six")


def readme_commands() -> dict[str, str]:
    """The two commands the README opens with: the main job and the tests."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```sh\n(.*?)```", text, re.S).group(1)
    commands = [line.split("#")[0].strip() for line in block.strip().splitlines()]
    assert len(commands) == 2
    return {"main": commands[0], "tests": commands[1]}


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    assert readme_commands()["tests"] in ci


def test_readme_main_command_runs():
    """`make demo` as the README gives it (it sets up .venv first when that is missing)."""
    command = readme_commands()["main"]
    result = subprocess.run(shlex.split(command), cwd=ROOT, env=user_environment(), capture_output=True, text=True,
                            timeout=1800)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "compiled specs/gdn.toml" in result.stdout
    assert re.search(r"recurrent\s+dense\+h0\+l2norm\s+float32", result.stdout)
    where = "CPU, Triton interpreter" if INTERPRETED else "NVIDIA"
    assert where in result.stdout


@pytest.mark.skipif(HAS_GPU, reason="with a GPU, bench times the training shapes (minutes)")
def test_bench_without_gpu_is_a_one_line_error():
    assert_one_line_error(run(["bench", "specs/gdn.toml", "--backward"]), "bench needs a CUDA GPU")
