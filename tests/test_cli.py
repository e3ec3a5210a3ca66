"""The command line as a user runs it: subprocesses, exit codes, one-line errors, files on disk."""
from __future__ import annotations

import ast
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from lrdsl import reference
from lrdsl.cli import main
from lrdsl.passes.pipeline import STAGES
from lrdsl.verification.workloads import TOLERANCE, Shape, make_inputs, relative_error

from conftest import HAS_GPU, INTERPRETED, ROOT
from helpers import assert_close, recurrence, spec_path

LRDSL_SCRIPT = Path(sys.executable).parent / "lrdsl"
CANNOT_WRITE = 73  # the exit status of an output that cannot be written (lrdsl/cli.py lists them all)


def lrdsl_command() -> list[str]:
    return [str(LRDSL_SCRIPT)] if LRDSL_SCRIPT.exists() else [sys.executable, "-m", "lrdsl"]


def user_environment(**extra) -> dict:
    """The environment a user's shell has: without the TRITON_INTERPRET the test process set."""
    environment = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return {**environment, **extra}


def with_umask(mask: int | None):
    """A preexec_fn giving the child process `mask` as its umask (None: the test's own)."""
    return None if mask is None else (lambda: os.umask(mask))


def run(args: list[str], cwd=ROOT, env=None, timeout=600, umask=None) -> subprocess.CompletedProcess:
    full_env = user_environment(**(env or {}))
    return subprocess.run(lrdsl_command() + args, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout,
                          preexec_fn=with_umask(umask))


def run_streaming(args: list[str], cwd=ROOT, umask=None, timeout=1800):
    """Run lrdsl, noting when each stdout line arrives. Returns (status, [(seconds, line)], stderr)."""
    start = time.monotonic()
    process = subprocess.Popen(lrdsl_command() + args, cwd=cwd, env=user_environment(), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, preexec_fn=with_umask(umask))
    lines = [(time.monotonic() - start, line.rstrip("\n")) for line in process.stdout]
    status = process.wait(timeout=timeout)
    stderr = process.stderr.read()
    process.stdout.close()
    process.stderr.close()
    return status, lines, stderr


ROW = re.compile(r"^(recurrent|chunk\[\w+,\d+\])\s")
PROGRESS = re.compile(r"\[(\d+)/(\d+), (about \d+(m\d\ds|s) left|\d+(m\d\ds|s) in all)\]$")
INTERPRETER_NOTE = "note: on the CPU the kernels run in Triton's interpreter"


def assert_rows_stream_with_progress(lines: list[tuple[float, str]]):
    """Each row printed as it finished, with a count and an estimate of the time left; on the CPU,
    one note that the interpreter's times mean nothing."""
    text = [line for _, line in lines]
    assert sum(line.startswith(INTERPRETER_NOTE) for line in text) == (1 if INTERPRETED else 0), "\n".join(text)
    rows = [(seconds, line) for seconds, line in lines if ROW.match(line)]
    assert len(rows) >= 2, "\n".join(text)
    counts = [PROGRESS.search(line) for _, line in rows]
    assert all(counts), "\n".join(line for _, line in rows)
    assert [int(m.group(1)) for m in counts] == list(range(1, len(rows) + 1))
    assert {int(m.group(2)) for m in counts} == {len(rows)}
    assert "left" in counts[0].group(3) and "in all" in counts[-1].group(3)
    # streamed: the last row comes well after the first (all at once, they would come together)
    assert rows[-1][0] - rows[0][0] > 1.0, rows


def assert_one_line_error(result: subprocess.CompletedProcess, *fragments: str, status: int = 2):
    assert result.returncode == status, (result.returncode, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, f"expected one error line, got:\n{result.stderr}"
    assert lines[0].startswith("lrdsl: error: ")
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in lines[0]


def test_compile_writes_standalone_module(tmp_path):
    out = tmp_path / "gdn_ops.py"
    result = run(["compile", "specs/gdn.toml", "-o", str(out)], umask=0o022)
    assert result.returncode == 0, result.stderr
    assert f"wrote {out}" in result.stdout
    assert oct(out.stat().st_mode & 0o777) == oct(0o644), "the umask decides the mode, as for any file"
    tree = ast.parse(out.read_text())
    imported, optional = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try) and [ast.unparse(h.type) for h in node.handlers] == ["ImportError"]:
            optional |= {n.module for n in node.body if isinstance(n, ast.ImportFrom)}  # lrdsl's InputError, where installed
            continue
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module not in optional:
            imported.add(node.module.split(".")[0])
    assert imported == {"torch", "triton"}
    assert optional == {"lrdsl.errors"}


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


def test_check_prove_forward_only_proves_the_forward_only(capsys):
    assert main(["check", spec_path("deltanet"), "--prove", "--forward-only"]) == 0
    out = capsys.readouterr().out
    assert out.count(": proved") == 3 and "entries of O and the exit state: proved" in out
    assert "backward" not in out and "gradient entries" not in out


def test_check_prove_key_channel_spec():
    result = run(["check", "specs/gla.toml", "--prove"])
    assert result.returncode == 0, result.stderr
    assert result.stdout.count(": proved") == 5, result.stdout


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


def test_show_help_lists_every_stage(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["show", "--help"])
    assert exit_.value.code == 0
    help_text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines anywhere
    for stage in STAGES + ("module",):
        assert re.search(rf"[ ,]{stage}[,( ]", help_text), (stage, help_text)


@pytest.mark.parametrize("stage", ["backward_plan", "backward_stages"])
def test_show_accepts_dashes_for_underscores(stage, capsys):
    assert main(["show", spec_path("gdn"), "--stage", stage]) == 0
    underscored = capsys.readouterr().out
    assert main(["show", spec_path("gdn"), "--stage", stage.replace("_", "-")]) == 0
    assert capsys.readouterr().out == underscored and underscored.strip()


def test_show_into_a_closed_pipe_ends_quietly():
    """`lrdsl show ... | head`: the reader goes away; lrdsl stops without a traceback."""
    process = subprocess.Popen(lrdsl_command() + ["show", "specs/gdn.toml", "--stage", "module"], cwd=ROOT,
                               env=user_environment(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    process.stdout.close()  # before lrdsl has written anything: its first write finds no reader
    status = process.wait(timeout=600)
    stderr = process.stderr.read()
    process.stderr.close()
    assert stderr == "" and status == 141, (status, stderr)  # 128 + SIGPIPE, as the shell reports it


def test_output_directory_missing(tmp_path):
    result = run(["compile", "specs/gdn.toml", "-o", str(tmp_path / "no" / "such" / "dir.py")])
    assert_one_line_error(result, "directory does not exist", status=CANNOT_WRITE)


def test_check_with_bad_shape_reports_tensor_error():
    result = run(["check", "specs/gdn.toml", "--shape", "1,5,3,4,8,8"])
    assert_one_line_error(result, "gdn.recurrent:", "HV=4 must be a positive multiple of the key heads H=3")


def test_check_with_malformed_shape():
    assert_one_line_error(run(["check", "specs/gdn.toml", "--shape", "1,2,3"]), "--shape takes six")


def test_check_with_an_empty_shape():
    assert_one_line_error(run(["check", "specs/gdn.toml", "--shape", "0,4,1,1,8,8"]),
                          "--shape 0,4,1,1,8,8: B must be at least 1, got 0")


@pytest.mark.parametrize("shape, field", [("1,0,1,1,8,8", "T"), ("1,4,0,1,8,8", "H"), ("1,4,1,0,8,8", "HV"),
                                          ("1,4,1,1,0,8", "K"), ("1,4,1,1,8,-3", "V")])
def test_check_names_the_empty_dimension(shape, field, capsys):
    assert main(["check", spec_path("gdn"), "--shape", shape]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"lrdsl: error: --shape {shape}: {field} must be at least 1")


@pytest.mark.skipif(HAS_GPU, reason="with a GPU, bench times the training shapes (minutes)")
def test_bench_without_gpu_is_a_one_line_error():
    assert_one_line_error(run(["bench", "specs/gdn.toml", "--backward"]), "bench needs a CUDA GPU")


def test_demo_streams_rows_with_progress_and_honours_the_umask(tmp_path):
    out_dir = tmp_path / "out"
    status, lines, stderr = run_streaming(
        ["demo", "specs/linear_attn.toml", "--output-dir", str(out_dir), "--shape", "1,5,1,1,8,8", "--seed", "3"],
        umask=0o022,
    )
    assert status == 0, "\n".join(line for _, line in lines) + stderr
    assert_rows_stream_with_progress(lines)
    (module_file,) = out_dir.glob("*.py")
    assert oct(module_file.stat().st_mode & 0o777) == oct(0o644)


PROFILE_SCRIPT = ROOT / "scripts" / "profile_fwd_bwd.py"


def assert_one_profile_error(status: int, stderr: str, fragment: str):
    lines = stderr.strip().splitlines()
    assert status == 2 and len(lines) == 1, stderr
    assert lines[0].startswith("profile_fwd_bwd.py: error: ") and fragment in lines[0] and "Traceback" not in stderr


def test_profile_script_without_a_gpu_is_one_line():
    environment = user_environment(CUDA_VISIBLE_DEVICES="")  # no GPU, even on a GPU machine
    result = subprocess.run([sys.executable, str(PROFILE_SCRIPT), "1", "64", "1", "2"], cwd=ROOT, env=environment,
                            capture_output=True, text=True, timeout=600)
    assert_one_profile_error(result.returncode, result.stderr, "needs a CUDA GPU")


def test_profile_script_with_bad_arguments_is_one_line():
    result = subprocess.run([sys.executable, str(PROFILE_SCRIPT), "4", "4096"], cwd=ROOT, env=user_environment(),
                            capture_output=True, text=True, timeout=600)
    assert_one_profile_error(result.returncode, result.stderr, "expected four positive integers B T H HV")


@pytest.mark.parametrize("arguments, fragment", [
    (["gdn"], "needs a CUDA GPU"),
    (["gdn", "--blocks", "32,x"], "--blocks must be comma-separated positive integers, got '32,x'"),
])
def test_decode_sweep_script_errors_are_one_line(arguments, fragment):
    script = ROOT / "scripts" / "sweep_decode.py"
    environment = user_environment(CUDA_VISIBLE_DEVICES="")  # no GPU, even on a GPU machine
    result = subprocess.run([sys.executable, str(script), *arguments], cwd=ROOT, env=environment, capture_output=True,
                            text=True, timeout=600)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith("sweep_decode.py: error: ") and fragment in lines[0], lines


def test_profile_script_without_fla_core_is_one_line(monkeypatch, capsys):
    """Past the GPU check (pretended here), a machine without fla-core gets one line too."""
    import runpy

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "fla", None)  # `import fla...` raises ImportError
    script = runpy.run_path(str(PROFILE_SCRIPT))  # defines main() without running it
    status = script["main"](["1", "64", "1", "2"])
    assert_one_profile_error(status, capsys.readouterr().err, "needs fla-core")


def test_show_takes_a_shipped_spec_by_name(tmp_path):
    """`lrdsl show gdn` from any directory finds the shipped spec, as load and compile do."""
    result = run(["show", "gdn", "--stage", "recurrence"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("recurrence gdn")


STALLS_SCRIPT = ROOT / "scripts" / "ncu_stalls.py"


def test_ncu_stall_summary_of_a_sass_view(tmp_path):
    """scripts/ncu_stalls.py on the CSV layout of Nsight Compute's SASS source view (a small
    one written here): the samples summed by reason and by opcode, predicated opcodes included."""
    header = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed",
              "stall_long_sb", "stall_barrier", "stall_long_sb (Not Issued)"]
    rows = [["Kernel Name", "k_kernel"], header,
            ["0x10", "      LDG.E.128 R4, desc[UR4][R2.64]", "10", "32", "0", "10", "0"],
            ["0x20", "      @!P0 HMMA.16816.F32.BF16 R8, R4, R6, R8", "30", "32", "30", "0", "9"],
            ["0x30", "      HMMA.16816.F32.BF16 R8, R4, R6, R8", "60", "32", "40", "20", "9"]]
    path = tmp_path / "sass.csv"
    path.write_text("\n".join(",".join(f'"{cell}"' for cell in row) for row in rows) + "\n")
    result = subprocess.run([sys.executable, str(STALLS_SCRIPT), str(path)], cwd=ROOT, env=user_environment(),
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    out = result.stdout.splitlines()
    assert out[0] == "k_kernel: 3 instructions, 100 stall samples"
    assert out[1].split() == ["long_sb", "70.0", "%"] and out[2].split() == ["barrier", "30.0", "%"]
    hmma = next(line for line in out if "HMMA" in line)
    assert hmma.split()[:2] == ["90.0", "%"] and "[long_sb 78 %, barrier 22 %]" in hmma


REPLAY_SCRIPT = ROOT / "scripts" / "replay_bf16.py"


def _script_module(name: str):
    """scripts/NAME.py imported as a module (the scripts folder is not a package)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_replay_rounds_fp32_to_bf16_as_torch_does(generator):
    """scripts/replay_bf16.py's fp32 -> bf16 rounding (what the GPU does; the interpreter
    truncates) gives torch's bit patterns: random values over many binades, exact ties (odd and
    even kept parts), values that carry into the exponent, subnormals, signed zeros, infinities,
    the largest finite values and NaN."""
    replay = _script_module("replay_bf16")
    random = torch.randn(4096, generator=generator) * torch.exp2(torch.randint(-130, 120, (4096,), generator=generator).float())
    kept = torch.randint(0, 2**15, (512,), generator=generator, dtype=torch.int32) << 16
    ties = (kept | 0x8000).view(torch.float32)  # exactly halfway: odd and even kept parts
    special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), 3.3895314e38, -3.3895314e38, 1e-40, -1e-42,
                            1.0 + 2**-8, 1.0 + 3 * 2**-8, 2.0 - 2**-9, 2.0 - 2**-23, float("nan")])
    values = torch.cat([random, ties, special])
    got = torch.from_numpy(replay.round_to_bfloat16_bits(values.numpy()).view("int16"))
    expected = values.to(torch.bfloat16).view(torch.int16)
    finite = ~torch.isnan(values)
    assert torch.equal(got[finite], expected[finite])
    assert torch.isnan(got[~finite].view(torch.bfloat16)).all()


def test_replay_draws_as_the_gpu_tests_draw():
    """scripts/replay_bf16.py's draw() gives the inputs tests/test_gpu.py's _gradients draws from
    a seed, and with after_forward those of a test that runs a _forward case first on the same
    generator (test_gpu_large_and_odd_head_dims), so a failing seed replays on the CPU."""
    replay = _script_module("replay_bf16")
    rec = recurrence("gdn")
    shape = Shape(1, 20, 1, 2, 8, 8)

    def as_the_tests_draw(seed, forward_first):
        generator = torch.Generator().manual_seed(seed)
        drawn = []
        for _ in range(2 if forward_first else 1):  # _inputs(): the spec's inputs, then h0
            drawn = [*make_inputs(rec, shape, dtype=torch.bfloat16, generator=generator, normalize_keys=False),
                     torch.randn(shape.B, shape.HV, shape.K, shape.V, generator=generator)]
        d_o = torch.randn(shape.B, shape.T, shape.HV, shape.V, generator=generator)
        return drawn, d_o, torch.randn(drawn[-1].shape, generator=generator)

    for forward_first in (False, True):
        tensors, h0, d_o, d_ht = replay.draw(rec, shape, 5, after_forward=forward_first)
        expected, expected_d_o, expected_d_ht = as_the_tests_draw(5, forward_first)
        got = [*tensors, h0, d_o, d_ht]
        assert all(torch.equal(a, b) for a, b in zip(got, [*expected, expected_d_o, expected_d_ht], strict=True))
    assert not torch.equal(replay.draw(rec, shape, 5)[1], replay.draw(rec, shape, 5, after_forward=True)[1])


@pytest.mark.skipif(not INTERPRETED, reason="replays on the CPU interpreter")
def test_replay_bf16_reports_each_gradient_and_where_its_error_lies():
    """The script as a user runs it, on a small gdn case: every gradient's error against the
    float64 oracle within bf16's tolerance (the inputs are bf16; the interpreter rounds to nearest
    and the dots take bf16 operands here, as on the GPU), and where the largest share of each
    per-token gradient's error lies."""
    result = subprocess.run([sys.executable, str(REPLAY_SCRIPT), "specs/gdn.toml", "--seed", "7", "--shape", "1,40,1,2,32,32",
                             "--chunk-size", "16"], cwd=ROOT, env=user_environment(), capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("gdn seed 7 shape 1,40,1,2,32,32: bf16 rounded to nearest, bf16 operands, precision input, o ")
    errors = {line.split()[0]: float(line.split()[1]) for line in lines[1:]}
    assert list(errors) == ["d_q", "d_k", "d_v", "d_g", "d_beta", "d_h0"]
    assert all(0 < e <= TOLERANCE[torch.bfloat16] for e in errors.values()), errors
    where = [line for line in lines[1:] if "most at token" in line]
    assert len(where) == 5 and all(re.search(r"most at token \d+, head [01]: \d+% of it", line) for line in where), where


@pytest.mark.skipif(not INTERPRETED, reason="replays on the CPU interpreter")
@pytest.mark.parametrize("chunk_size", [32, 64])
def test_bf16_gate_gradients_of_key_channel_gates_hold_at_larger_chunk_sizes(chunk_size, generator):
    """kda_fused_gate's gate gradient in bf16, from d_o alone, computed as a GPU computes it (the
    replay script): on an H100 d_a grew with the chunk size to 9.6e-3 at C = 64, over bf16's
    8e-3 (replayed here at seed 1: 8.9e-3). The gate's gradient sums the backward's decayed
    products over the chunk with terms that cancel, and one bf16 rounding of each decayed tile
    survived it; from C = 32 on the tiles go to the dots as two 16-bit parts (3.1e-3 at that
    seed; at C = 16, where one part is kept for speed, 5.1e-3)."""
    seed = generator.initial_seed() % 2**31
    result = subprocess.run([sys.executable, str(REPLAY_SCRIPT), "specs/kda_fused_gate.toml", "--seed", str(seed),
                             "--shape", "1,256,1,2,128,128", "--chunk-size", str(chunk_size), "--no-final-gradient"],
                            cwd=ROOT, env=user_environment(), capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr
    errors = {line.split()[0]: float(line.split()[1]) for line in result.stdout.splitlines()[1:]}
    per_token = {name: e for name, e in errors.items() if name not in ("d_A_log", "d_dt_bias")}
    assert set(per_token) == {"d_q", "d_k", "d_v", "d_a", "d_b", "d_h0"}
    assert all(0 < e <= TOLERANCE[torch.bfloat16] for e in per_token.values()), f"seed {seed}: {errors}"


def test_autotune_results_travel_between_machines_per_gpu_model(tmp_path):
    """scripts/autotune_cache.py: results collected from one Triton cache under the GPU model's
    folder seed another machine's empty cache at the same <hash>/<kernel>.autotune.json places,
    and only for that model; compiled kernels and other files stay behind."""
    cache = _script_module("autotune_cache")

    first = tmp_path / "first"
    for key, kernel in [("a1", "chunk_fwd_kernel_o"), ("b2", "recompute_w_u_fwd_kernel")]:
        (first / key).mkdir(parents=True)
        (first / key / f"{kernel}.autotune.json").write_text(f'{{"key": "{key}", "configs_timings": []}}')
        (first / key / f"{kernel}.cubin").write_bytes(b"\0" * 8)
    store = tmp_path / "store"
    assert cache.collect(store, "NVIDIA H200", first) == 2
    assert sorted(p.relative_to(store).as_posix() for p in store.rglob("*") if p.is_file()) == [
        "NVIDIA_H200/a1/chunk_fwd_kernel_o.autotune.json", "NVIDIA_H200/b2/recompute_w_u_fwd_kernel.autotune.json"]

    second = tmp_path / "second"
    assert cache.seed(store, "NVIDIA H100 80GB HBM3", second) == 0 and not second.exists()
    assert cache.seed(store, "NVIDIA H200", second) == 2
    assert (second / "a1" / "chunk_fwd_kernel_o.autotune.json").read_text() == '{"key": "a1", "configs_timings": []}'
    assert not list(second.rglob("*.cubin"))
    assert cache.collect(store, "NVIDIA H200", tmp_path / "absent") == 0


# -- spec paths UTF-8 cannot encode -------------------------------------------------------------

# (file name as the OS stores it, extra environment): Latin-1 bytes, which are not UTF-8; and a
# UTF-8 name under a C locale that Python honours (no UTF-8 mode, no locale coercion), where the
# file system encoding is ASCII. Either way Python hands lrdsl a str holding surrogates.
ODD_NAMES = {
    "latin1_bytes": (b"sp\xe9c_latin1.toml", {}),
    "c_locale": ("spéc_c_locale.toml".encode(), {"LC_ALL": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0"}),
}
ODD_NAME_COMMANDS = {
    "compile": lambda spec, tmp: ["compile", spec, "-o", str(tmp / "out.py")],
    "show": lambda spec, tmp: ["show", spec, "--stage", "spec"],
    "show_module": lambda spec, tmp: ["show", spec, "--stage", "module"],
    "check": lambda spec, tmp: ["check", spec, "--forward-only", "--chunk-size", "16", "--shape", "1,3,1,1,4,4"],
    "demo": lambda spec, tmp: ["demo", spec, "--output-dir", str(tmp / "out"), "--shape", "1,3,1,1,4,4"],
}


@pytest.mark.parametrize("command", list(ODD_NAME_COMMANDS))
@pytest.mark.parametrize("naming", list(ODD_NAMES))
def test_spec_path_that_utf8_cannot_encode(naming, command, tmp_path):
    """Any file name the OS accepts works: once such a name reached the module text and its
    digest, every command ended in UnicodeEncodeError."""
    name, extra = ODD_NAMES[naming]
    spec_file = os.fsencode(tmp_path) + b"/" + name
    with open(spec_file, "wb") as handle:
        handle.write(Path(spec_path("linear_attn")).read_bytes())
    environment = user_environment(LRDSL_CACHE_DIR=str(tmp_path / "cache"), **extra)
    args = [os.fsencode(a) for a in ODD_NAME_COMMANDS[command](os.fsdecode(spec_file), tmp_path)]
    args[1] = spec_file  # the name as bytes: the child decodes it by its own locale
    result = subprocess.run([os.fsencode(a) for a in lrdsl_command()] + args, cwd=ROOT, env=environment,
                            capture_output=True, timeout=600)
    stderr = result.stderr.decode(errors="replace")
    assert result.returncode == 0, stderr
    assert "Traceback" not in stderr and "Error" not in stderr, stderr
    assert result.stdout.strip(), "the command printed its result"


# -- outputs that cannot be written, Ctrl-C ----------------------------------------------------

def file_size_limit(limit: int):
    """A preexec_fn: files the child writes stop at `limit` bytes, as on a full file system (the
    write fails with EFBIG; Python ignores SIGXFSZ)."""
    def limit_files():
        import resource

        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return limit_files


def files_under(directory: Path) -> list[str]:
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*"))


def assert_nothing_written(directory: Path, before: list[str]):
    assert files_under(directory) == before, "no file (nor a temporary one) is left half-written"


def test_compile_into_a_path_whose_parent_is_a_file(tmp_path):
    (tmp_path / "a_file").write_text("")
    result = run(["compile", "specs/linear_attn.toml", "-o", str(tmp_path / "a_file" / "out.py")])
    assert_one_line_error(result, f"cannot write {tmp_path / 'a_file' / 'out.py'} (", status=CANNOT_WRITE)
    assert_nothing_written(tmp_path, ["a_file"])


def test_compile_onto_a_full_file_system_keeps_the_old_file(tmp_path):
    out = tmp_path / "out.py"
    out.write_text("# the module compiled yesterday\n")
    full_env = user_environment(LRDSL_CACHE_DIR=str(tmp_path / "cache"))
    result = subprocess.run(lrdsl_command() + ["compile", "specs/linear_attn.toml", "-o", str(out)], cwd=ROOT,
                            env=full_env, capture_output=True, text=True, timeout=600,
                            preexec_fn=file_size_limit(16 * 1024))
    assert_one_line_error(result, f"cannot write {out} (File too large)", status=CANNOT_WRITE)
    assert out.read_text() == "# the module compiled yesterday\n"
    assert_nothing_written(tmp_path, ["out.py"])


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only directory anyway")
def test_compile_into_a_directory_without_write_permission(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    try:
        result = run(["compile", "specs/linear_attn.toml", "-o", str(locked / "out.py")])
    finally:
        locked.chmod(0o700)
    assert_one_line_error(result, "(Permission denied)", status=CANNOT_WRITE)
    assert_nothing_written(tmp_path, ["locked"])


def test_demo_into_a_directory_whose_parent_is_a_file(tmp_path):
    (tmp_path / "a_file").write_text("")
    result = run(["demo", "specs/linear_attn.toml", "--output-dir", str(tmp_path / "a_file" / "out"),
                  "--shape", "1,3,1,1,4,4"])
    assert_one_line_error(result, f"cannot write {tmp_path / 'a_file' / 'out' / 'linear_attn_ops.py'} (",
                          status=CANNOT_WRITE)
    assert_nothing_written(tmp_path, ["a_file"])


def test_ctrl_c_during_check_is_one_line_and_status_130():
    process = subprocess.Popen(lrdsl_command() + ["check", "specs/gdn.toml"], cwd=ROOT, env=user_environment(),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in process.stdout:  # interrupt it mid-run: once the first row is out
            if ROW.match(line):
                break
        process.send_signal(signal.SIGINT)
        status = process.wait(timeout=600)
        stderr = process.stderr.read()
    finally:
        process.kill()
        process.stdout.close()
        process.stderr.close()
    assert (status, stderr) == (130, "lrdsl: interrupted\n")


# -- lrdsl cache ---------------------------------------------------------------------------------

def test_cache_info_prune_and_clear(tmp_path, monkeypatch):
    """A cache holding an entry this lrdsl serves, one another build made, a damaged one, a
    temporary file a killed writer left (two hours old), one a live writer is filling, and a
    file that is not lrdsl's: info shows each; prune removes the stale three; clear the rest of
    lrdsl's entries; the live writer's file and the stranger stay."""
    from lrdsl.runtime import cache, loader

    directory = tmp_path / "cache"
    monkeypatch.setenv("LRDSL_CACHE_DIR", str(directory))
    monkeypatch.setattr(loader, "_loaded", {})
    import lrdsl

    lrdsl.load(spec_path("linear_attn"))
    (served,) = directory.glob("linear_attn_*.py")
    source = loader.generate(spec_path("linear_attn"))[0]
    other_key = "ab" * 32
    monkeypatch.setattr(cache, "build_fingerprint", lambda: "0" * 16)  # as another lrdsl writes it
    (directory / cache.entry_name("linear_attn", other_key)).write_text(cache.entry_text(source, other_key))
    (directory / "gdn_0123456789abcdef0123.py").write_text(served.read_text()[:1000])  # cut short
    abandoned = directory / f".{served.name}.k1ll3d.tmp"
    abandoned.write_text(source[:500])
    two_hours_ago = time.time() - 7200
    os.utime(abandoned, (two_hours_ago, two_hours_ago))
    writing = directory / f".{served.name}.l1v3.tmp"
    writing.write_text(source[:500])
    (directory / "notes.txt").write_text("mine")
    environment = {"LRDSL_CACHE_DIR": str(directory)}

    info = run(["cache", "info"], env=environment)
    assert info.returncode == 0 and info.stderr == "", info.stderr
    lines = info.stdout.splitlines()
    assert lines[0] == f"module cache {directory}"
    states = {line.split()[0]: line for line in lines[1:] if line.startswith("  ")}
    assert set(states) == {served.name, f"linear_attn_{other_key[:20]}.py", "gdn_0123456789abcdef0123.py",
                           abandoned.name, writing.name}
    assert states[served.name].endswith("served by this lrdsl")
    assert states[f"linear_attn_{other_key[:20]}.py"].endswith("made by another lrdsl, torch or triton")
    assert "damaged: truncated or edited" in states["gdn_0123456789abcdef0123.py"]
    assert states[abandoned.name].endswith("left by a writer that stopped")
    assert states[writing.name].endswith("being written")
    assert any(line.startswith("entries: 3 files") for line in lines), lines
    assert any(line.startswith("stale ") and ": 3 files" in line for line in lines), lines

    prune = run(["cache", "prune"], env=environment)
    assert prune.returncode == 0 and prune.stdout.startswith("removed 3 files"), prune.stdout + prune.stderr
    assert sorted(p.name for p in directory.iterdir()) == sorted([served.name, writing.name, "notes.txt"])

    clear = run(["cache", "clear"], env=environment)
    assert clear.returncode == 0 and clear.stdout.startswith("removed 1 file,"), clear.stdout + clear.stderr
    assert sorted(p.name for p in directory.iterdir()) == sorted([writing.name, "notes.txt"])


def test_cache_info_of_a_cache_not_made_yet(tmp_path):
    result = run(["cache", "info"], env={"LRDSL_CACHE_DIR": str(tmp_path / "none")})
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[0] == f"module cache {tmp_path / 'none'} (not created yet)"
    assert not (tmp_path / "none").exists()


# -- discovery and the measuring tools as subcommands (issue 44) -------------------------------------

def test_version():
    """Before: `lrdsl --version` was an argparse error."""
    import lrdsl

    result = run(["--version"])
    assert result.returncode == 0 and result.stdout.strip() == f"lrdsl {lrdsl.__version__}", result.stderr


def test_specs_lists_every_shipped_spec_with_its_summary():
    """Before: no command listed the shipped specs (`lrdsl specs` was an argparse error)."""
    from lrdsl.spec import load_spec_by_name, shipped_spec_names

    result = run(["specs"], cwd=ROOT.parent)
    assert result.returncode == 0, result.stderr
    for name in shipped_spec_names():
        assert re.search(rf"^  {name} +{re.escape(load_spec_by_name(name).summary)}$", result.stdout, re.M), name


def test_every_spec_argument_has_help_and_demo_defaults_to_the_shipped_name():
    """Before: `spec` had no help text, and demo's default was the checkout path specs/gdn.toml,
    which an installed lrdsl run elsewhere does not have."""
    from lrdsl.cli import build_parser

    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices
    for name, command in commands.items():
        for action in command._actions:
            if action.dest in ("spec", "specs"):
                assert action.help, f"lrdsl {name}: {action.dest} has no help text"
    assert parser.parse_args(["demo"]).spec == "gdn"


@pytest.mark.parametrize("args, fragment", [
    (["check", "gdn", "--plan", "nope"], "--plan: gdn has no chunk plan 'nope'; plans: split, fused"),
    (["check", "gdn", "--chunk-size", "128"], "--chunk-size: 128 is not one of gdn's chunk sizes (16, 32, 64)"),
])
def test_check_refuses_plan_and_chunk_size_before_the_header(args, fragment):
    """Before: the header printed, then the error."""
    result = run(args)
    assert_one_line_error(result, fragment)
    assert result.stdout == ""


TOOL_ERRORS = [
    (["memory", "gdn", "--save-policy", "nope"], "--save-policy: gdn has no save policy 'nope'"),
    (["memory", "gdn", "--chunk-size", "128"], "--chunk-size: 128 is not one of gdn's chunk sizes (16, 32, 64)"),
    (["memory", "specs/nosuch.toml"], "specs/nosuch.toml: "),
    (["memory", "gdn", "--shape", "1,2,3"], "--shape takes six positive integers"),
    (["resources", "gdn", "--chunk-size", "128"], "--chunk-size: 128 is not one of gdn's chunk sizes (16, 32, 64)"),
    (["resources", "gdn", "--chunk-size", "big"], "--chunk-size takes a chunk size or 'default'"),
    (["resources", "nosuch"], "nosuch: no such spec file, and no shipped spec of that name"),
    (["resources", "gdn", "--launch", "nope=1,2,3"], "unknown kernel role 'nope'"),
]


@pytest.mark.parametrize("args, fragment", TOOL_ERRORS)
def test_memory_and_resources_say_bad_input_in_one_line(args, fragment):
    """`lrdsl memory|resources` and `python -m lrdsl.measure.memory|resources` alike. Before: tracebacks
    (unknown save policy, chunk size 128, a missing spec), and no such subcommands."""
    assert_one_line_error(run(args), fragment)
    if args[1:2] != ["gdn"] or args[2:3] == ["--chunk-size"]:  # python -m: a case of each kind (CI's time)
        result = subprocess.run([sys.executable, "-m", f"lrdsl.measure.{args[0]}", *args[1:]], cwd=ROOT, env=user_environment(),
                                capture_output=True, text=True, timeout=600)
        assert_one_line_error(result, fragment)


def test_memory_subcommand_prints_the_peak():
    result = run(["memory", "gdn", "--shape", "1,64,1,2,16,16", "--no-backward"])
    assert result.returncode == 0, result.stderr
    assert re.search(r"^  peak \d+\.\d MiB at ", result.stdout, re.M), result.stdout


@pytest.mark.skipif(HAS_GPU, reason="with a GPU there is no interpreter to turn on")
def test_import_lrdsl_turns_the_interpreter_on_or_says_why_it_cannot():
    """Without a GPU, `import lrdsl` sets TRITON_INTERPRET=1 (before: only the CLI and the examples
    did, so the README's Python failed on a CPU); where triton was imported first it is too late,
    and one warning line says so and what to do."""
    script = "import os, lrdsl; print(os.environ.get('TRITON_INTERPRET'))"
    first = subprocess.run([sys.executable, "-c", script], env=user_environment(), capture_output=True, text=True,
                           timeout=600)
    assert first.returncode == 0 and first.stdout.strip() == "1" and first.stderr == "", first.stderr
    late = subprocess.run([sys.executable, "-c", "import triton; " + script], env=user_environment(), capture_output=True,
                          text=True, timeout=600)
    assert late.returncode == 0 and late.stdout.strip() == "None", late.stdout + late.stderr
    (line,) = late.stderr.strip().splitlines()
    assert "InterpreterWarning: no GPU, and triton was imported before lrdsl" in line and "import lrdsl first" in line


def test_gate_gradient_at_strong_decay_in_a_fresh_interpreter(tmp_path, generator):
    """As a user trains Gated DeltaProduct (two update steps per token) where every token forgets
    strongly (g = -20): lrdsl.load, chunk(), backward, in a process of its own. The gate's
    gradient summed the pairs of one token's two steps (decay 1) in and out again; their rounding
    swamped it: d_g 0.8-5.2 off the oracle, now about 1e-5."""
    rec = recurrence("gated_deltaproduct")
    tensors = list(make_inputs(rec, Shape(1, 40, 1, 2, 16, 16), generator=generator))
    names = ["q", "k", "v"] + [i.name for i in rec.inputs]
    tensors[names.index("g")] = torch.full_like(tensors[names.index("g")], -20.0)
    d_o = torch.randn(1, 40, 2, 16, generator=generator)
    torch.save({"tensors": tensors, "d_o": d_o}, tmp_path / "inputs.pt")
    script = textwrap.dedent(
        f"""
        import os, torch
        if not torch.cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"
        import lrdsl
        mod = lrdsl.load({str(ROOT / 'specs' / 'gated_deltaproduct.toml')!r})
        data = torch.load({str(tmp_path / 'inputs.pt')!r})
        device = "cuda" if torch.cuda.is_available() else "cpu"
        leaves = [t.to(device).requires_grad_() for t in data["tensors"]]
        o, _ = mod.chunk(*leaves)
        (o * data["d_o"].to(device)).sum().backward()
        torch.save([t.grad.cpu() for t in leaves], {str(tmp_path / 'grads.pt')!r})
        """
    )
    result = subprocess.run([sys.executable, "-c", script], env=user_environment(), capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr
    grads = torch.load(tmp_path / "grads.pt")
    refs = [t.double().requires_grad_() for t in tensors]
    ref_o, _ = reference.run(rec, *refs)
    (ref_o * d_o.double()).sum().backward()
    for name, grad, ref in zip(names, grads, refs):
        error = relative_error(grad, ref.grad)
        assert error <= TOLERANCE[torch.float32], f"d_{name}: {error:.2e} off the float64 oracle"
