"""lrdsl installs like any library: the specs ship as package data and are found by name.

The wheel test builds lrdsl's wheel from a copy of the source tree, installs it into a fresh
virtual environment (without lrdsl's dependencies: that environment sees torch, triton and the
rest through a .pth file pointing at this interpreter's site directories, so nothing is
downloaded), and from another directory runs lrdsl.load("gdn"), the layer, lrdsl.ops and
`lrdsl compile gdn`.
"""
from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import textwrap
import tomllib
import venv
from pathlib import Path

import pytest

import lrdsl
from lrdsl.errors import SpecError
from lrdsl.spec import resolve_spec, shipped_spec_names

from conftest import ROOT, SPECS

BUILD_OUTPUTS = (".git", ".venv", "__pycache__", "*.egg-info", "build", "dist", ".pytest_cache", ".hypothesis", "out")


def test_every_subpackage_is_listed_in_pyproject():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    on_disk = {
        ".".join(path.relative_to(ROOT).parts)
        for path in [ROOT / "lrdsl", *(ROOT / "lrdsl").rglob("*")]
        if path.is_dir() and path.name != "__pycache__"
        and any(child.suffix in (".py", ".jinja") for child in path.iterdir())
    }
    assert listed == on_disk | {"lrdsl.specs"}


def test_shipped_specs_by_name():
    assert set(shipped_spec_names()) == {path.stem for path in SPECS.glob("*.toml")}
    assert resolve_spec("gdn") == SPECS / "gdn.toml"
    assert resolve_spec("specs/gdn.toml") == Path("specs/gdn.toml")  # a path stays a path
    with pytest.raises(SpecError, match="no shipped spec of that name .shipped: comba, deltanet, gated_deltaproduct, gdn, gdn2, "):
        resolve_spec("gdm")
    assert lrdsl.load("gdn") is lrdsl.load(SPECS / "gdn.toml")


INSTALLED_CHECK = textwrap.dedent('''
    import sys
    from pathlib import Path
    import torch
    import lrdsl
    from lrdsl import reference
    from lrdsl.layers import GatedDeltaNet
    from lrdsl.ops import chunk_gated_delta_rule
    from lrdsl.spec import resolve_spec
    from lrdsl.verification.workloads import relative_error

    assert Path(lrdsl.__file__).resolve().is_relative_to(Path(sys.prefix).resolve()), lrdsl.__file__
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    B, T, H, HV, K, V = 1, 6, 1, 2, 16, 8
    q, k = torch.randn(B, T, H, K), torch.randn(B, T, H, K)
    v, a, b = torch.randn(B, T, HV, V), torch.randn(B, T, HV), torch.randn(B, T, HV)
    A_log, dt_bias = torch.rand(HV), torch.randn(HV)
    x = [t.to(device) for t in (q, k, v, a, b, A_log, dt_bias)]
    o, _ = chunk_gated_delta_rule(*x[:5], use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                  A_log=x[5], dt_bias=x[6], use_beta_sigmoid_in_kernel=True)
    g = -A_log.double().exp() * torch.nn.functional.softplus(a.double() + dt_bias.double())
    ref, _ = reference.run(resolve_spec("gdn"), q, k, v, g, b.double().sigmoid(),
                           use_qk_l2norm_in_kernel=True)
    error = relative_error(o, ref)
    assert error <= 2e-3, error
    gdn = lrdsl.load("gdn")
    o, _ = gdn.chunk(*x[:3], g.float().to(device), x[4].sigmoid(), use_qk_l2norm_in_kernel=True)
    assert relative_error(o, ref) <= 2e-3

    class Config:
        hidden_size, linear_num_key_heads, linear_num_value_heads = 16, 1, 2
        linear_key_head_dim, linear_value_head_dim, linear_conv_kernel_dim = 16, 8, 4
        hidden_act, rms_norm_eps = "silu", 1e-6

    hidden = torch.randn(1, 5, 16, device=device, requires_grad=True)
    out = GatedDeltaNet(Config()).to(device)(hidden)
    out.sum().backward()
    assert out.shape == (1, 5, 16) and torch.isfinite(out).all() and torch.isfinite(hidden.grad).all()
    print("installed lrdsl ok:", lrdsl.__file__, f"ops error {error:.1e}")
''')


def dependency_dirs() -> list[str]:
    """This interpreter's site directories: where torch, triton and lrdsl's other dependencies live."""
    dirs = [*site.getsitepackages(), site.getusersitepackages()]
    return [d for d in dirs if Path(d).is_dir()]


def test_wheel_installs_into_a_clean_environment_and_runs_from_another_directory(tmp_path):
    source = tmp_path / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(*BUILD_OUTPUTS))
    wheels = tmp_path / "wheels"
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", str(source),
         "-w", str(wheels)], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-3000:]
    assert "deprecat" not in build.stderr.lower(), build.stderr[-3000:]  # the license table form was, at every build
    (wheel,) = wheels.glob("lrdsl-*.whl")
    check_wheel_metadata(wheel)

    environment = tmp_path / "env"
    venv.EnvBuilder(with_pip=False).create(environment)
    python = environment / "bin" / "python"
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    Path(purelib, "lrdsl_test_dependencies.pth").write_text("\n".join(dependency_dirs()) + "\n")
    install = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet",
                              "--no-deps", "--no-index", str(wheel)], capture_output=True, text=True)
    assert install.returncode == 0, install.stderr[-3000:]

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    # a user's shell: no PYTHONPATH, and no TRITON_INTERPRET (import lrdsl turns it on without a GPU)
    env = {name: value for name, value in os.environ.items() if name not in ("PYTHONPATH", "TRITON_INTERPRET")}
    env["LRDSL_CACHE_DIR"] = str(tmp_path / "cache")
    run = subprocess.run([python, "-c", INSTALLED_CHECK], cwd=elsewhere, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "installed lrdsl ok" in run.stdout

    compiled = subprocess.run([environment / "bin" / "lrdsl", "compile", "gdn", "-o", "gdn_ops.py"], cwd=elsewhere,
                              env=env, capture_output=True, text=True)
    assert compiled.returncode == 0, compiled.stderr
    assert "def chunk(" in (elsewhere / "gdn_ops.py").read_text()


def check_wheel_metadata(wheel: Path):
    """What `pip install lrdsl` holds: the license as an SPDX expression with its text shipped,
    the Python versions CI runs, and numpy unpinned: a pin for Triton 3.6's CPU interpreter would
    downgrade numpy for GPU users, so `import lrdsl` refuses that combination instead
    (test_import_refuses_numpy_the_interpreter_cannot_run)."""
    import zipfile

    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        (metadata,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        text = archive.read(metadata).decode()
    assert "License-Expression: Apache-2.0" in text.splitlines()
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), names
    assert f"Requires-Python: >={'.'.join(map(str, declared_python()))}" in text.splitlines()
    assert "Requires-Dist: numpy" in text.splitlines(), [line for line in text.splitlines() if "numpy" in line]


def test_license_file_is_the_apache_license():
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text
    assert tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["license"] == "Apache-2.0"


def declared_python() -> tuple[int, ...]:
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    assert declared.startswith(">="), declared
    return tuple(int(x) for x in declared[2:].split("."))


# Standard-library modules lrdsl imports that older Pythons lack, with the version that added them.
NEWER_STDLIB = {"tomllib": (3, 11)}


def test_declared_python_is_what_the_code_needs_and_ci_runs():
    """requires-python was >= 3.10 while the spec reader imports tomllib (3.11): `lrdsl show gdn`
    failed on 3.10. The declared minimum covers every module lrdsl imports, and `make setup` (CI's
    .venv) is built with that oldest version where it is installed."""
    import ast

    minimum = declared_python()
    for path in (ROOT / "lrdsl").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
            for name in names:
                needed = NEWER_STDLIB.get(name.split(".")[0], (0,))
                assert needed <= minimum, f"{path.relative_to(ROOT)} imports {name} (Python {needed}), declared {minimum}"
    oldest = "python" + ".".join(map(str, minimum))
    chosen = subprocess.run(["make", "-s", "python-version"], cwd=ROOT, capture_output=True, text=True,
                            env={k: v for k, v in os.environ.items() if k != "PYTHON"})
    assert chosen.returncode == 0, chosen.stderr
    assert chosen.stdout.strip() == (oldest if shutil.which(oldest) else "python3")
    assert sys.version_info[:len(minimum)] >= minimum


def test_interpreter_numpy_problem_names_the_combination_that_fails():
    from lrdsl import config

    problem = config.interpreter_numpy_problem("2.4.0", "3.6.0")
    assert problem is not None and "numpy 2.4.0" in problem and 'pip install "numpy<2.4"' in problem
    assert "\n" not in problem
    assert config.interpreter_numpy_problem("2.3.5", "3.6.0") is None
    assert config.interpreter_numpy_problem("2.5.2", "3.7.1") is None  # only the version it was seen on


def test_import_refuses_numpy_the_interpreter_cannot_run():
    """A CPU machine with numpy 2.4 (what a plain `pip install lrdsl` could bring before triton 3.6
    supported it): one line at `import lrdsl`, not a 57-line InterpreterError at the first chunk
    call. The installed numpy's version is faked through importlib.metadata in a fresh process."""
    import os
    import subprocess
    import sys

    program = ("import importlib.metadata as m; real = m.version; "
               "m.version = lambda name: '2.4.0' if name == 'numpy' else real(name); import lrdsl")
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "CUDA_VISIBLE_DEVICES")}
    env["CUDA_VISIBLE_DEVICES"] = ""  # no GPU: import lrdsl turns the interpreter on
    run = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, env=env, cwd=ROOT)
    assert run.returncode != 0
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("lrdsl.errors.LrdslError: Triton") and 'pip install "numpy<2.4"' in last, run.stderr
