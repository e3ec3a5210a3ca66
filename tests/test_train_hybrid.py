"""examples/train_hybrid.py beyond its documented commands (tests/test_examples.py runs those): on
the same weights and batch, lrdsl's first step equals transformers' torch path's; the data order
is the seed's alone; --compare reports earlier runs."""
from __future__ import annotations

import importlib.util
import inspect
import json

import pytest
import torch

from conftest import ROOT
from lrdsl.verification.workloads import TOLERANCE, relative_error


@pytest.fixture(scope="module")
def train_hybrid():
    spec = importlib.util.spec_from_file_location("train_hybrid", ROOT / "examples" / "train_hybrid.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _first_step(train_hybrid, backend, tokens, dtype=torch.float32):
    model = train_hybrid.build_model(train_hybrid.model_config(tiny=True), seed=3, device="cpu").to(dtype)
    train_hybrid.use_backend(model, backend)
    loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}


PER_HEAD = ("A_log", "dt_bias")  # a layer's per-head parameters: each gradient a sum over every token


def _first_steps(train_hybrid):
    corpus = train_hybrid.stdlib_bytes(1 << 16)
    tokens = next(train_hybrid.batches(corpus, batch=2, seq_len=48, steps=1, data_seed=int(torch.seed() % 2**31)))
    return {name: _first_step(train_hybrid, backend, tokens, dtype) for name, backend, dtype in
            (("exact", "torch", torch.float64), ("torch", "torch", torch.float32), ("lrdsl", "lrdsl", torch.float32))}


def test_lrdsl_first_step_equals_the_torch_path(train_hybrid):
    """Loss and every parameter's gradient but the per-head ones of one step of the tiny hybrid
    model (three linear-attention layers on lrdsl's kernels, one full-attention layer) against
    transformers' own torch functions in fp32 and against the whole model in float64 (the torch
    path), same weights and bytes."""
    runs = _first_steps(train_hybrid)
    (loss_exact, grads_exact), (loss_torch, grads_torch), (loss_lrdsl, grads_lrdsl) = runs.values()
    assert set(grads_lrdsl) == set(grads_torch) == set(grads_exact)
    linear = [name for name in grads_lrdsl if ".linear_attn." in name]
    assert linear and all(grads_lrdsl[name] is not None for name in linear)
    for reference in (loss_exact, loss_torch):
        assert relative_error(loss_lrdsl, reference) <= TOLERANCE[torch.float32]
    for reference in (grads_exact, grads_torch):
        errors = {name: relative_error(grads_lrdsl[name].double(), reference[name].double()) for name in reference
                  if not name.endswith(PER_HEAD)}
        assert max(errors.values()) <= TOLERANCE[torch.float32], sorted(errors.items(), key=lambda e: -e[1])[:3]


def test_lrdsl_first_step_in_fp32_is_within_fp32_tolerance_of_float64(train_hybrid):
    """The loss and every gradient of lrdsl's fp32 step against the same model run in float64.
    transformers' own 'float64' model is no reference here: its linear-attention functions, gate
    and norms cast to fp32 inside. The per-head gradients (A_log, dt_bias) are sums over every
    token whose terms can cancel a thousandfold, which no plain relative tolerance suits; the next
    test holds them against the magnitudes of their terms."""
    seed = int(torch.seed() % 2**31)
    corpus = train_hybrid.stdlib_bytes(1 << 16)
    tokens = next(train_hybrid.batches(corpus, batch=2, seq_len=48, steps=1, data_seed=seed))
    (loss32, grads32), (loss64, grads64) = (_first_step(train_hybrid, "lrdsl", tokens, dtype)
                                            for dtype in (torch.float32, torch.float64))
    assert relative_error(loss32.double(), loss64) <= TOLERANCE[torch.float32]
    errors = {name: relative_error(grads32[name].double(), grads64[name]) for name in grads64
              if not name.endswith(PER_HEAD)}
    assert max(errors.values()) <= TOLERANCE[torch.float32], (seed, sorted(errors.items(), key=lambda e: -e[1])[:3])


def _linear_attention_calls(train_hybrid, monkeypatch, tokens):
    """The inputs and output gradient of every lrdsl recurrence call in one fp32 step of the tiny model."""
    import lrdsl.layers.gated_deltanet as layer_module

    calls, module = [], layer_module.recurrence_module()

    class Recording:
        def __getattr__(self, name):
            return getattr(module, name)

        def chunk(self, *inputs, **options):
            o, state = module.chunk(*inputs, **options)
            call = {"inputs": [x.detach().clone() for x in inputs]}
            o.register_hook(lambda do: call.__setitem__("do", do.detach().clone()))
            calls.append(call)
            return o, state

    monkeypatch.setattr(layer_module, "recurrence_module", Recording)
    _first_step(train_hybrid, "lrdsl", tokens)
    return calls


def test_per_head_gradients_against_the_float64_oracle(train_hybrid, monkeypatch):
    """On each linear-attention layer's own inputs and output gradient from a training step, the
    gradients of A_log and dt_bias from lrdsl's fp32 kernels against the float64 oracle, beside
    transformers' fp32 torch path on the same inputs.

    Each is a sum over every token of the layer, d dt_bias = sum_t d_a_t and d A_log = sum_t
    d_a_t softplus(x_t) / sigmoid(x_t) (x = a + dt_bias), whose terms can cancel to 1/2500 of their
    magnitudes (a draw of this test). fp32 rounding of the terms then shows in the sum magnified
    that much, so the error of each head's gradient is held against the sum of its terms'
    magnitudes: within fp32's tolerance of it for lrdsl (seen: at most 7e-6 of it; 1.4e-6 to
    2.4e-3 as a plain relative error), and no further than the torch path's (seen: 3e-2 to 8.5 of
    it; 4.5e-5 to 4.7e-2 relative: its chunked gate gradient is a difference of cumulative sums,
    off in absolute terms where strong decays leave the true one near 0)."""
    from transformers.models.qwen3_5 import modeling_qwen3_5

    import lrdsl
    from lrdsl import reference

    spec = ROOT / "specs" / "gdn_qwen35.toml"
    torch_chunk = inspect.unwrap(modeling_qwen3_5.torch_chunk_gated_delta_rule)
    corpus = train_hybrid.stdlib_bytes(1 << 16)
    seed = int(torch.seed() % 2**31)
    calls = _linear_attention_calls(train_hybrid, monkeypatch, next(train_hybrid.batches(corpus, 2, 48, 1, seed)))
    assert len(calls) == 3 and all("do" in call for call in calls)
    module = lrdsl.load(spec)

    def lrdsl_fp32(q, k, v, a, b, A_log, dt_bias):
        return module.chunk(q, k, v, a, b, A_log, dt_bias, use_qk_l2norm_in_kernel=True)[0]

    def torch_path_fp32(q, k, v, a, b, A_log, dt_bias):  # the layer's gate and beta, then its chunk function
        g = -A_log.exp() * torch.nn.functional.softplus(a + dt_bias)
        group = v.shape[2] // q.shape[2]
        q, k = q.repeat_interleave(group, dim=2), k.repeat_interleave(group, dim=2)
        return torch_chunk(q, k, v, g=g, beta=b.sigmoid(), use_qk_l2norm_in_kernel=True)[0]

    def oracle(q, k, v, a, b, A_log, dt_bias):
        return reference.run(spec, q, k, v, a, b, A_log, dt_bias, use_qk_l2norm_in_kernel=True)[0]

    def gradients(run, call, dtype, wrt):  # wrt: positions of a, A_log, dt_bias (3, 5, 6)
        inputs = [x.to(dtype).requires_grad_() for x in call["inputs"]]
        return torch.autograd.grad(run(*inputs), [inputs[i] for i in wrt], call["do"].to(dtype))

    worst = {"lrdsl": 0.0, "torch path": 0.0}  # per head: |error| / the sum of its terms' magnitudes
    for call in calls:
        d_a, d_A_log, d_dt_bias = gradients(oracle, call, torch.float64, (3, 5, 6))
        x = (call["inputs"][3] + call["inputs"][6]).double()
        magnitudes = ((d_a * torch.nn.functional.softplus(x) / torch.sigmoid(x)).abs().sum((0, 1)),
                      d_a.abs().sum((0, 1)))
        for name, run in (("lrdsl", lrdsl_fp32), ("torch path", torch_path_fp32)):
            got = gradients(run, call, torch.float32, (5, 6))
            for x, y, magnitude in zip(got, (d_A_log, d_dt_bias), magnitudes):
                worst[name] = max(worst[name], float(((x.double() - y).abs() / magnitude).max()))
    assert worst["lrdsl"] <= TOLERANCE[torch.float32], (seed, worst)
    assert worst["lrdsl"] <= worst["torch path"], (seed, worst)


def test_the_data_order_is_the_seed_s(train_hybrid):
    corpus = train_hybrid.stdlib_bytes(1 << 16)
    first = torch.cat(list(train_hybrid.batches(corpus, 4, 32, 3, data_seed=1)))
    again = torch.cat(list(train_hybrid.batches(corpus, 4, 32, 3, data_seed=1)))
    other = torch.cat(list(train_hybrid.batches(corpus, 4, 32, 3, data_seed=2)))
    assert torch.equal(first, again) and not torch.equal(first, other)
    assert first.shape == (12, 32) and first.dtype == torch.long and int(first.max()) < train_hybrid.BYTES


def test_compare_reports_each_run(train_hybrid, tmp_path, capsys):
    for name, losses in (("a", [5.0, 4.0, 3.0]), ("b", [5.0, 4.5, 3.5])):
        (tmp_path / name).mkdir()
        run = {"backend": name, "losses": losses, "tokens_per_s": 100.0, "peak_mib": None, "data_seed": 0}
        (tmp_path / name / "run.json").write_text(json.dumps(run))
    assert train_hybrid.main(["--compare", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert [line.split(": ")[1] for line in printed] == ["a data seed 0", "b data seed 0"]
    assert "final loss 3.0000" in printed[0] and "final loss 3.5000" in printed[1]
    assert "gap to" not in printed[0] and printed[1].endswith(f"gap to {tmp_path / 'a'} 0.5000")
    # the plot of both curves and the second's gap to the first (where matplotlib is installed)
    assert (tmp_path / "loss.png").exists() == (importlib.util.find_spec("matplotlib") is not None)


def test_curve_gap_is_the_mean_distance_of_the_smoothed_second_halves(train_hybrid):
    flat = [3.0] * 40
    assert train_hybrid.curve_gap(flat, [3.25] * 40) == pytest.approx(0.25)
    # noise within each 10-step window averages out; a gap in the first half does not count
    noisy = [3.0 + (0.5 if i % 2 else -0.5) for i in range(40)]
    assert train_hybrid.curve_gap(flat, noisy) == pytest.approx(0.0)
    early = [9.0] * 20 + [3.0] * 20
    assert train_hybrid.curve_gap(flat, early) == pytest.approx(0.0)
    assert train_hybrid.final_loss([5.0] * 90 + [1.0] * 10) == pytest.approx(1.0)


def test_the_verdict_names_what_failed(train_hybrid):
    assert train_hybrid.verdict([5.0, 4.0]) == "ok"
    assert train_hybrid.verdict([5.0, float("nan")]) == "FAILED: a loss is not finite"
    assert train_hybrid.verdict([4.0, 4.5]) == "FAILED: the loss did not fall (4.0000 -> 4.5000)"


def test_an_interrupted_run_still_writes_its_steps(train_hybrid, tmp_path, monkeypatch, capsys):
    """Ctrl-C (or `timeout -s INT` around a GPU run) stops the loop; run.json keeps the steps done."""
    learning_rate = train_hybrid.learning_rate

    def stop_at_step_3(step, steps, peak):
        if step == 3:
            raise KeyboardInterrupt
        return learning_rate(step, steps, peak)

    monkeypatch.setattr(train_hybrid, "learning_rate", stop_at_step_3)
    code = train_hybrid.main(["--tiny", "--backend", "torch", "--steps", "10", "--out", str(tmp_path)])
    run = json.loads((tmp_path / "run.json").read_text())
    assert code == 130 and run["interrupted"] is True and len(run["losses"]) == 3 and run["steps"] == 10
    assert "over 3 steps (interrupted; 10 asked for)" in capsys.readouterr().out


def test_compile_counts_name_graphs_and_breaks(train_hybrid):
    """--compile runs record what torch.compile did (run.json's compiled_graphs, graph_breaks and
    the reasons), read off dynamo's counters: here one function with one graph break."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()

    def broken(x):
        x = x * 2
        torch._dynamo.graph_break()
        return x + 1

    assert torch.equal(torch.compile(broken, backend="eager")(torch.ones(3)), torch.full((3,), 3.0))
    counts = train_hybrid.compile_counts()
    assert counts["compiled_graphs"] == 2 and counts["graph_breaks"] == 1
    assert len(counts["graph_break_reasons"]) == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is the CPU's")
def test_compile_of_lrdsl_on_the_cpu_is_refused_in_one_line(train_hybrid, tmp_path, capsys):
    assert train_hybrid.main(["--tiny", "--compile", "--steps", "1", "--out", str(tmp_path)]) == 2
    error = capsys.readouterr().err.strip()
    assert "\n" not in error and error.startswith("train_hybrid.py: --compile with --backend lrdsl needs a GPU")
