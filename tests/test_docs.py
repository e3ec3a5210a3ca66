"""The documents against the code: every Python and shell example in README.md and
specs/README.md runs as written, the facts they list (stages, environment knobs, shipped specs,
the error format) are compared with the code, and docs/design.md is where every design
reference points. An example that changes without its test, or a test without its example,
fails here."""
from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lrdsl import config, reference
from lrdsl.cli import show_stages
from lrdsl.errors import SpecError
from lrdsl.spec import load_spec, parse_spec
from lrdsl.verification.workloads import Shape, make_inputs, relative_error

from conftest import HAS_GPU, INTERPRETED, ROOT
from helpers import assert_close, recurrence
from test_cli import (
    assert_one_line_error,
    assert_rows_stream_with_progress,
    lrdsl_command,
    run_streaming,
    user_environment,
    with_umask,
)

DOCUMENTS = (ROOT / "README.md", ROOT / "specs" / "README.md")


def fenced_blocks(path: Path, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", path.read_text(), re.S | re.M)


def inline_code(path: Path) -> list[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)
    return re.findall(r"`([^`\n]+)`", text)


def shell_examples() -> list[str]:
    """Every command of the documents' sh blocks (comments dropped; `[--x]` gives both forms), and
    every inline `lrdsl ... specs/X.toml ...` that names a real spec (not a placeholder)."""
    commands = []
    for path in DOCUMENTS:
        for block in fenced_blocks(path, "sh"):
            for line in block.splitlines():
                command = line.split("#")[0].strip()
                optional = re.fullmatch(r"(.*?)\s*\[(--[\w-]+)\]", command)
                commands += [optional.group(1), f"{optional.group(1)} {optional.group(2)}"] if optional else [command]
        commands += [c for c in inline_code(path) if re.fullmatch(r"lrdsl \w+ specs/\w+\.toml[^|]*", c)]
    return [c for c in commands if c]


def run_example(command: str, cwd: Path, umask=0o022, timeout=1800) -> subprocess.CompletedProcess:
    """A documented command as a user types it (lrdsl: this environment's console script)."""
    words = shlex.split(command)
    if words[0] == "lrdsl":
        words = lrdsl_command() + words[1:]
    return subprocess.run(words, cwd=cwd, env=user_environment(), capture_output=True, text=True, timeout=timeout,
                          preexec_fn=with_umask(umask))


@pytest.fixture
def user_directory(tmp_path):
    """A working directory with the repository's specs, so that outputs land outside the tree."""
    (tmp_path / "specs").symlink_to(ROOT / "specs")
    return tmp_path


# -- the shell examples, each with what it must do ------------------------------------------------

def check_compile(result, cwd):
    assert result.returncode == 0, result.stderr
    module_file = cwd / "gdn_ops.py"
    assert "wrote gdn_ops.py" in result.stdout
    assert oct(module_file.stat().st_mode & 0o777) == oct(0o644), "umask 022 gives 0644, as for any file"
    assert re.search(r"^def chunk\(", module_file.read_text(), re.M)


def check_show_chunk(result, cwd):
    assert result.returncode == 0, result.stderr
    assert result.stdout == (ROOT / "tests" / "golden" / "gdn.chunk.txt").read_text()


def check_show_qwen35_step(result, cwd):
    assert result.returncode == 0, result.stderr
    assert result.stdout == (ROOT / "tests" / "golden" / "gdn_qwen35.step.txt").read_text()


def check_prove(result, cwd):
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count(": proved") == 5 and "FAILED" not in result.stdout
    assert "gradient entries: proved" in result.stdout


def check_bench(result, cwd):
    assert_one_line_error(result, "bench needs a CUDA GPU")


def check_specs(result, cwd):
    assert result.returncode == 0, result.stderr
    from lrdsl.spec import shipped_spec_names

    assert [line.split()[0] for line in result.stdout.splitlines()[1:]] == list(shipped_spec_names())


def check_memory(result, cwd):
    """The README's figure is what the tool prints (it said 1963 MiB, from before the backward's
    storage reuse, while the tool printed 1835)."""
    assert result.returncode == 0, result.stderr
    printed = float(re.search(r"^  peak (\d+\.\d) MiB at ", result.stdout, re.M).group(1))
    readme = " ".join((ROOT / "README.md").read_text().split())
    documented = re.search(r"`lrdsl memory specs/gdn\.toml`.*?a peak of (\d+) MiB", readme).group(1)
    assert int(documented) == round(printed), (documented, printed)
    kept = re.search(r"^  kept from the forward for the backward [\d.]+ MiB \(([\d.]+) KiB per token\)", result.stdout, re.M)
    documented_kept = re.search(r"what the forward keeps for the backward .*?gdn there: ([\d.]+) KiB under `save_states`, the default", readme)
    assert kept and documented_kept and kept.group(1) == documented_kept.group(1), (kept, documented_kept)


SHELL_EXAMPLES = {
    "lrdsl compile specs/gdn.toml -o gdn_ops.py": check_compile,
    "lrdsl show specs/gdn.toml --stage chunk": check_show_chunk,
    "lrdsl show specs/gdn_qwen35.toml --stage step": check_show_qwen35_step,
    "lrdsl check specs/gdn.toml --prove": check_prove,
    "lrdsl bench specs/gdn.toml": check_bench,
    "lrdsl bench specs/gdn.toml --backward": check_bench,
    "lrdsl specs": check_specs,
    "lrdsl memory specs/gdn.toml": check_memory,
}
# run by their own tests below
LONG_EXAMPLES = ("make demo", "make test", "lrdsl check specs/gdn.toml")
# run on a GPU machine only (tests/test_bench.py checks the phases it runs)
GPU_MACHINE_EXAMPLES = ("bash scripts/bench_peers.sh PHASE",)


def test_every_shell_example_has_a_test():
    assert sorted(shell_examples()) == sorted(list(SHELL_EXAMPLES) + list(LONG_EXAMPLES) + list(GPU_MACHINE_EXAMPLES))


@pytest.mark.parametrize("command", list(SHELL_EXAMPLES))
def test_shell_example(command, user_directory):
    if command.startswith("lrdsl bench") and HAS_GPU:
        pytest.skip("with a GPU, bench times the training shapes (minutes); BENCHMARKS.md has its output")
    SHELL_EXAMPLES[command](run_example(command, user_directory), user_directory)


def test_readme_check_example(user_directory):
    """`lrdsl check specs/gdn.toml`: every kernel config, outputs and gradients, each row as it
    finishes with the time left."""
    status, lines, stderr = run_streaming(shlex.split("lrdsl check specs/gdn.toml")[1:], cwd=user_directory)
    output = "\n".join(line for _, line in lines)
    assert status == 0, output + stderr
    assert_rows_stream_with_progress(lines)
    number = r"\d\.\d\de-\d\d"
    gradient = rf"{number} \((q|k|v|g|beta|initial_state)\)"  # the worst gradient and whose it is
    assert re.search(rf"^recurrent\s+dense\+h0\+l2norm\s+float32\s+{number}\s+{number}\s+{gradient}", output, re.M)
    for plan in ("fused", "split"):
        for size in (16, 32, 64):
            assert re.search(rf"^chunk\[{plan},{size}\]\s+varlen\+h0\s+float16\s+{number}\s+{number}\s+{gradient}",
                             output, re.M), output
    # 7 configs x 2 cases x (fp32, fp16; and bf16 on a GPU)
    assert re.search(r"^(28/28|42/42) within tolerance$", output, re.M), output


def test_ci_runs_the_readme_test_command():
    """`make test` is what CI runs (running it from inside the suite would recurse)."""
    assert "make test" in shell_examples()
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def test_readme_main_command_runs():
    """`make demo` as the README gives it (it sets up .venv first when that is missing)."""
    assert "make demo" in shell_examples()
    result = run_example("make demo", cwd=ROOT, umask=None)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "compiled specs/gdn.toml" in result.stdout
    assert re.search(r"recurrent\s+dense\+h0\+l2norm\s+float32", result.stdout)
    where = "CPU, Triton interpreter" if INTERPRETED else "NVIDIA"
    assert where in result.stdout


# -- the Python examples --------------------------------------------------------------------------

def test_the_documents_have_five_python_examples():
    """The five below (kernels, the layer, the FLA-compatible ops, serving, the 8-bit pool); a new
    example needs a test of its own."""
    assert [len(fenced_blocks(path, "python")) for path in DOCUMENTS] == [5, 0]


def run_as_user(code: str, cwd: Path, inputs: dict, outputs: dict, setup: str = "", after: str = "",
                timeout=900) -> dict:
    """Run a documented example as a user does: a fresh Python process with no test fixtures,
    TRITON_INTERPRET unset (lrdsl must turn the interpreter on itself where there is no GPU),
    `inputs` (the set-up the document leaves to the reader) loaded by torch alone before the
    example, so that the example's own import of lrdsl comes first unless `setup` imports
    something. `after` runs after the example; `outputs` maps names to expressions evaluated
    then. Returns {name: value}."""
    torch.save(inputs, cwd / "example_inputs.pt")
    script = "\n".join([
        "import sys",
        "import torch",
        f"globals().update(torch.load({str(cwd / 'example_inputs.pt')!r}, weights_only=False))",
        setup,
        "assert 'lrdsl' in sys.modules or 'triton' not in sys.modules, 'the set-up imported triton before lrdsl'",
        "# ---- the example, as written",
        code,
        "# ---- after it",
        after,
        f"torch.save({{name: eval(expr) for name, expr in {outputs!r}.items()}}, {str(cwd / 'example_outputs.pt')!r})",
    ])
    (cwd / "example.py").write_text(script)
    environment = user_environment()
    assert "TRITON_INTERPRET" not in environment
    result = subprocess.run([sys.executable, str(cwd / "example.py")], cwd=cwd, env=environment, capture_output=True,
                            text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout + result.stderr
    return torch.load(cwd / "example_outputs.pt", weights_only=False)


GRADIENTS = ("q", "k", "v", "g", "beta", "h0")


def test_readme_python_example(generator, tmp_path):
    example = fenced_blocks(ROOT / "README.md", "python")[0]
    (tmp_path / "specs").symlink_to(ROOT / "specs")
    # ---- set-up the README leaves to the reader: small GDN inputs (B=1, T=20, H=1, HV=2, K=16, V=24),
    # ---- the next token's inputs for decode, and the gradient of o
    rec = recurrence("gdn")
    shape = Shape(1, 20, 1, 2, 16, 24)
    q, k, v, g, beta = (t.requires_grad_() for t in make_inputs(rec, shape, generator=generator))
    h0 = torch.randn(1, 2, 16, 24, generator=generator).requires_grad_()
    do = torch.randn(1, 20, 2, 24, generator=generator)
    q1, k1, v1, g1, beta1 = make_inputs(rec, Shape(1, 1, 1, 2, 16, 24), generator=generator)
    inputs = dict(q=q, k=k, v=v, g=g, beta=beta, h0=h0, do=do, q1=q1, k1=k1, v1=v1, g1=g1, beta1=beta1)
    got = run_as_user(example, tmp_path, inputs, {"o": "o.detach()", "o1": "o1", "ht": "ht",
                                                   **{f"d{name}": f"{name}.grad" for name in GRADIENTS}})

    leaves = [x.detach().double().requires_grad_() for x in (q, k, v, g, beta, h0)]
    ref_o, ref_ht = reference.run(rec, *leaves[:5], initial_state=leaves[5], output_final_state=True,
                                  use_qk_l2norm_in_kernel=True)
    assert_close(got["o"], ref_o, torch.float32, "chunk o")
    ref_grads = torch.autograd.grad((ref_o * do.double()).sum(), leaves)
    for name, ref_grad in zip(GRADIENTS, ref_grads):
        assert_close(got[f"d{name}"], ref_grad, torch.float32, f"gradient of {name}")
    ref_o1, ref_ht1 = reference.run(rec, q1, k1, v1, g1, beta1, initial_state=ref_ht.detach(), output_final_state=True,
                                    use_qk_l2norm_in_kernel=True)
    assert_close(got["o1"], ref_o1, torch.float32, "decode o")
    assert_close(got["ht"], ref_ht1, torch.float32, "decode final state")


# The README's set-up for the layer and ops examples: transformers' objects. Its Qwen3.5 model
# imports triton, so on a machine without a GPU lrdsl is imported first, as the README says.
IMPORT_LRDSL_FIRST = "import lrdsl  # first (the README): before transformers' Qwen3.5 model imports triton"
# the layer example's hf_layer: a stand-in holding transformers' layer's weights (its state_dict)
SAVED_LAYER = "class SavedLayer:\n    def state_dict(self):\n        return weights\nhf_layer = SavedLayer()"


def test_readme_layer_example(generator, tmp_path):
    """The layer example as written, on a tiny Qwen3.5 config, against transformers' own layer
    (its PyTorch path) holding the same weights."""
    from test_layer import randomize, tiny_config
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    example = fenced_blocks(ROOT / "README.md", "python")[1]
    config = tiny_config()
    hf_layer = Qwen3_5GatedDeltaNet(config, layer_idx=0)
    randomize(hf_layer, generator)
    hidden_states = torch.randn(2, 13, config.hidden_size, generator=generator)
    inputs = dict(config=config, weights=hf_layer.state_dict(), hidden_states=hidden_states)
    got = run_as_user(example, tmp_path, inputs, {"out": "out.detach()"},
                      setup=SAVED_LAYER)
    with torch.no_grad():
        expected = hf_layer(hidden_states)
    assert_close(got["out"], expected, torch.float32, "layer output")


def test_readme_ops_example(generator, tmp_path):
    """The ops and integrations example as written: the FLA-named functions compute the oracle's
    recurrence, and the model's layers are transformers' again after unpatch."""
    from test_layer import tiny_config

    example = fenced_blocks(ROOT / "README.md", "python")[2]
    rec = recurrence("gdn")
    q, k, v, g, beta = make_inputs(rec, Shape(1, 20, 1, 2, 16, 24), generator=generator)
    inputs = dict(config=tiny_config(), q=q, k=k, v=v, g=g, beta=beta)
    setup = "\n".join([IMPORT_LRDSL_FIRST, "from transformers import Qwen3_5ForCausalLM",
                       "model = Qwen3_5ForCausalLM(config)"])
    after = "\n".join([
        "from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet",
        "unpatched = all(isinstance(m, Qwen3_5GatedDeltaNet) for m in model.modules() if hasattr(m, 'A_log'))",
        "o, ht = chunk_gated_delta_rule(q=q, k=k, v=v, g=g, beta=beta, output_final_state=True, "
        "use_qk_l2norm_in_kernel=True)",
    ])
    got = run_as_user(example, tmp_path, inputs, {"unpatched": "unpatched", "o": "o", "ht": "ht"}, setup=setup,
                      after=after)
    assert got["unpatched"]
    ref_o, ref_ht = reference.run(rec, q, k, v, g, beta, output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert_close(got["o"], ref_o, torch.float32, "ops chunk o")
    assert_close(got["ht"], ref_ht, torch.float32, "ops chunk final state")


def test_readme_serving_example(generator, tmp_path):
    """The serving example as written: prompts of 6, 0 and 9 tokens prefilled into rows 4, 0, 2 of
    a pool of 5; a decode step and a verify of 4 drafts on slots (2, -1, 4); commit of 3 and 1;
    then a tree of 5 drafts per slot verified, and the paths to draft tokens 4 and 3 committed."""
    example = fenced_blocks(ROOT / "README.md", "python")[3]
    rec = recurrence("gdn")
    P, HV, K, V = 5, 2, 16, 24
    prompt = make_inputs(rec, Shape(1, 15, 1, HV, K, V), generator=generator)
    step = make_inputs(rec, Shape(3, 1, 1, HV, K, V), generator=generator)
    drafts = make_inputs(rec, Shape(3, 4, 1, HV, K, V), generator=generator)
    tree = make_inputs(rec, Shape(3, 5, 1, HV, K, V), generator=generator)
    parents = [[-1, 0, 0, 1, 2], [-1, 0, 1, 2, 3], [-1, -1, 1, 1, 3]]
    inputs = dict(P=P, HV=HV, K=K, V=V, cu_seqlens=torch.tensor([0, 6, 6, 15]), rows=torch.tensor([4, 0, 2]),
                  slots=torch.tensor([2, -1, 4]), num_accepted=torch.tensor([3, 0, 1]),
                  parents=torch.tensor(parents), leaves=torch.tensor([4, 2, 3]))
    for suffix, tensors in (("", prompt), ("1", step), ("4", drafts), ("5", tree)):
        inputs.update({name + suffix: t for name, t in zip(("q", "k", "v", "g", "beta"), tensors)})
    # the README's `mod` (its first example) and no gradients (the README: pool calls have none)
    setup = "import lrdsl\nmod = lrdsl.load('gdn')\ntorch.set_grad_enabled(False)"
    got = run_as_user(example, tmp_path, inputs, {"o": "o", "o1": "o1", "o4": "o4", "o5": "o5", "pool": "pool"},
                      setup=setup)

    states = torch.zeros(P, HV, K, V, dtype=torch.float64)
    ref_o, final = reference.run(rec, *prompt, cu_seqlens=torch.tensor([0, 6, 6, 15]), output_final_state=True)
    states[[4, 0, 2]] = final
    assert_close(got["o"], ref_o, torch.float32, "prefill o")
    ref_o1, final = reference.run(rec, *step, initial_state=states[[2, 0, 4]], output_final_state=True)
    ref_o1[1] = 0  # the padding slot
    assert_close(got["o1"], ref_o1, torch.float32, "decode o")
    states[2], states[4] = final[0], final[2]
    ref_o4, _ = reference.run(rec, *drafts, initial_state=states[[2, 0, 4]])
    ref_o4[1] = 0
    assert_close(got["o4"], ref_o4, torch.float32, "verify o")
    for n, row, accepted in ((0, 2, 3), (2, 4, 1)):  # slot, its row, its accepted drafts
        _, final = reference.run(rec, *[t[n:n + 1, :accepted] for t in drafts], initial_state=states[row][None],
                                 output_final_state=True)
        states[row] = final[0]

    def path(n, node):  # draft tokens from the root of slot n's tree to `node`
        return path(n, parents[n][node]) + [node] if node >= 0 else []

    for n, row in ((0, 2), (2, 4)):
        for node in range(5):
            o, _ = reference.run(rec, *[t[n:n + 1, path(n, node)] for t in tree], initial_state=states[row][None])
            assert_close(got["o5"][n, node], o[0, -1], torch.float32, f"tree verify o, slot {n}, draft token {node}")
    assert not got["o5"][1].any(), "the padding slot's tree"
    for n, row, leaf in ((0, 2, 4), (2, 4, 3)):
        _, final = reference.run(rec, *[t[n:n + 1, path(n, leaf)] for t in tree], initial_state=states[row][None],
                                 output_final_state=True)
        states[row] = final[0]
    assert_close(got["pool"], states, torch.float32, "pool after both commits")


def test_readme_8bit_pool_example(generator, tmp_path):
    """The 8-bit pool example as written: a zero int8 pool is the zero state; one decode step on
    slots (2, -1, 4): o against the oracle, and the rows it wrote, unpacked, within a store's
    rounding (sqrt(K) / 254 of the state, relative) of the oracle's final states."""
    example = fenced_blocks(ROOT / "README.md", "python")[4]
    rec = recurrence("gdn")
    P, HV, K, V = 5, 2, 16, 24
    step = make_inputs(rec, Shape(3, 1, 1, HV, K, V), generator=generator)
    inputs = dict(P=P, HV=HV, K=K, V=V, slots=torch.tensor([2, -1, 4]), q=step[0])
    inputs.update({name + "1": t for name, t in zip(("q", "k", "v", "g", "beta"), step)})
    setup = "import lrdsl\nmod = lrdsl.load('gdn')\ntorch.set_grad_enabled(False)"
    got = run_as_user(example, tmp_path, inputs, {"o1": "o1", "pool": "pool", "states": "mod.unpack_states(pool)"},
                      setup=setup)
    assert got["pool"].dtype == torch.int8 and tuple(got["pool"].shape) == (P, HV, K + 4, V)
    ref_o1, final = reference.run(rec, *step, output_final_state=True)
    ref_o1[1] = 0  # the padding slot
    assert_close(got["o1"], ref_o1, torch.float32, "decode o from the zero rows")
    assert relative_error(got["states"][[2, 4]], final[[0, 2]]) <= K**0.5 / 254
    assert not got["states"][[0, 1, 3]].any(), "rows no slot names stay zero"


def test_readme_varlen_recipe(generator, tmp_path):
    """The README's way to get chunk_indices for a packed batch, used as it says."""
    (recipe,) = [c for c in inline_code(ROOT / "README.md") if "prepare_varlen(" in c]
    (tmp_path / "specs").symlink_to(ROOT / "specs")
    rec = recurrence("gdn")
    tensors = make_inputs(rec, Shape(1, 21, 1, 2, 16, 24), generator=generator)
    cu_seqlens, chunk_size = torch.tensor([0, 4, 4, 21], dtype=torch.int32), 16
    try:  # an expression giving the indices ...
        compile(recipe, "README.md", "eval")
        code = f"chunk_indices = {recipe}"
    except SyntaxError:  # ... or a statement that names them
        code = recipe
    after = ("o, ht = mod.chunk(*tensors, cu_seqlens=cu_seqlens, chunk_size=chunk_size, chunk_indices=chunk_indices, "
             "output_final_state=True)")
    got = run_as_user(code, tmp_path, dict(tensors=tensors, cu_seqlens=cu_seqlens, chunk_size=chunk_size),
                      {"o": "o", "ht": "ht"}, setup="import lrdsl\nmod = lrdsl.load('specs/gdn.toml')", after=after)
    ref_o, ref_ht = reference.run(rec, *tensors, cu_seqlens=cu_seqlens, output_final_state=True)
    assert_close(got["o"], ref_o, torch.float32, "varlen o")
    assert_close(got["ht"], ref_ht, torch.float32, "varlen final state")


# -- facts the documents list ---------------------------------------------------------------------

def test_readme_lists_every_stage():
    text = (ROOT / "README.md").read_text()
    paragraph = re.search(r"The stages, in pipeline order.*?\n\n", text, re.S).group(0)
    assert tuple(re.findall(r"`([a-z_]+)`", paragraph)) == show_stages()


def test_readme_names_every_environment_knob():
    source = Path(config.__file__).read_text()
    knobs = set(re.findall(r'os\.environ\.get\("(\w+)"', source)) - {"XDG_CACHE_HOME"}
    assert knobs == {"LRDSL_CACHE_DIR", "LRDSL_DUMP", "LRDSL_FUZZ_EXAMPLES", "LRDSL_FUZZ_DTYPE", "LRDSL_VERIFY",
                     "TRITON_INTERPRET"}
    readme = (ROOT / "README.md").read_text()
    for knob in knobs:
        assert f"`{knob}`" in readme, knob


def test_annotated_spec_example_is_the_shipped_file():
    (example,) = fenced_blocks(ROOT / "specs" / "README.md", "toml")
    assert example.startswith("# specs/gdn_qwen35.toml")
    shown = recurrence_of(parse_spec(example, "example"))
    shipped = recurrence_of(load_spec(ROOT / "specs" / "gdn_qwen35.toml"))
    assert shown.fingerprint() == shipped.fingerprint()


def recurrence_of(spec):
    from lrdsl.passes.pipeline import run_pipeline

    return run_pipeline(spec, until="recurrence")["recurrence"]


def test_shipped_specs_table_matches_the_specs():
    text = (ROOT / "specs" / "README.md").read_text()
    table = re.search(r"## Shipped specs\n.*?\n(\|.*?)\n\n", text, re.S).group(1)
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in table.splitlines()[2:]]
    listed = {}
    for spec_cell, update, gate, inputs in rows:
        name = re.match(r"`(\w+)\.toml`", spec_cell).group(1)
        bare = re.sub(r"\[.*?\]|\(.*\)", "", inputs)  # shapes and notes are not names
        listed[name] = (update, gate.split(",")[0].strip(), [x.strip() for x in bare.split(",") if x.strip() != "-"])
    assert sorted(listed) == sorted(p.stem for p in (ROOT / "specs").glob("*.toml"))
    for name, (update, gate, inputs) in listed.items():
        rec = recurrence(name)
        assert (update, gate, inputs) == (rec.update.value, rec.gate.value, [i.name for i in rec.inputs]), name


def test_spec_error_example_is_what_lrdsl_prints(tmp_path, monkeypatch):
    text = (ROOT / "specs" / "README.md").read_text()
    documented = re.search(r"^    (specs/mine\.toml:(\d+): .*)$", text, re.M)
    line = int(documented.group(2))
    lines = ['name = "mine"'] + ["# a comment"] * (line - 4) + ["[recurrence]", 'update = "delta"', 'gate = "diagonal"']
    spec_file = tmp_path / "specs" / "mine.toml"
    spec_file.parent.mkdir()
    spec_file.write_text("\n".join(lines) + "\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SpecError) as error:
        load_spec("specs/mine.toml")
    assert str(error.value) == documented.group(1)


# -- docs/design.md -------------------------------------------------------------------------------

TEXT_SUFFIXES = {".py", ".md", ".toml", ".jinja", ".txt", ".cfg", ""}


def repository_text_files() -> list[Path]:
    listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if listed.returncode == 0:
        paths = [ROOT / p for p in listed.stdout.splitlines()]
    else:  # not a git checkout
        paths = [p for p in ROOT.rglob("*") if not {".git", ".venv", ".hypothesis"} & set(p.parts)]
    return [p for p in paths if p.is_file() and p.suffix in TEXT_SUFFIXES]


def design_sections() -> set[str]:
    return set(re.findall(r"^## (\d+)\. ", (ROOT / "docs" / "design.md").read_text(), re.M))


def test_design_references_point_at_existing_sections():
    sections = design_sections()
    assert sections == {str(n) for n in range(1, 10)}
    references = []
    for path in repository_text_files():
        text = path.read_text(errors="replace")
        references += [(path, n) for n in re.findall(r"docs/design\.md (?:§|section )(\d+)", text)]
        if path.name == "design.md":
            references += [(path, n) for n in re.findall(r"§(\d+)", text)]
    assert references, "the code cites the design notes"
    assert [(str(p), n) for p, n in references if n not in sections] == []


def test_no_reference_leaves_the_repository():
    """The repository stands alone: nothing cites design notes kept outside it."""
    outside = ("DESIGN" + ".md", ".." + "/shared", "/work/" + "shared")
    found = [f"{path.relative_to(ROOT)}: {needle}" for path in repository_text_files()
             for needle in outside if needle in path.read_text(errors="replace")]
    assert found == []
