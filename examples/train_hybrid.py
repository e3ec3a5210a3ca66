"""Train a small hybrid Qwen3.5 language model, its linear-attention layers on the backend you pick.

    python examples/train_hybrid.py --tiny --steps 8 --out /tmp/train_hybrid/tiny-lrdsl
    python examples/train_hybrid.py --tiny --steps 8 --backend torch --out /tmp/train_hybrid/tiny-torch
    python examples/train_hybrid.py --steps 500 --out /tmp/train_hybrid/lrdsl
    python examples/train_hybrid.py --steps 500 --backend fla --out /tmp/train_hybrid/fla

The first two run anywhere (on a CPU, lrdsl's kernels in Triton's interpreter: about 40 s); the
full-size model needs a GPU, and so do FLA's backends. `--backend` is one of lrdsl, fla (FLA's
Triton kernels), flashqla (FLA dispatching to FlashQLA) and torch (transformers' torch path);
`--data-seed N` changes only the order of the training windows; `--compile` wraps the model in
torch.compile; `--save-policy` is lrdsl's choice of what its kernels keep for the backward.
`--compare DIR DIR ... --out DIR` reports earlier runs side by side and plots their curves
together. The last line printed is the verdict: "ok" when every loss is finite and the last is
below the first, else "FAILED:" and why (exit status 1).

The model is transformers' Qwen3_5ForCausalLM from a Qwen3_5TextConfig with the released layer
pattern (three linear-attention layers, then one full-attention layer), scaled down to 163M
parameters (`--tiny`: 64 thousand, small enough for lrdsl's kernels on the CPU interpreter).
It starts from random weights drawn from `--seed` and trains with AdamW, in bf16 autocast on a GPU
(fp32 on the CPU), on text every machine has: the Python standard library's own source files, as
bytes (vocabulary 256), windows taken in an order fixed by `--data-seed`, each step without a
cache (use_cache=False: training reads none). Two runs that differ
only in the backend see the same weights and the same batches; two that differ only in
`--data-seed` show how far apart curves drift by chance (the noise floor a backend's gap is held
against).

Backends: `lrdsl` patches every linear-attention layer onto lrdsl (lrdsl.integrations.patch_qwen35;
`--save-policy` picks what its kernels keep for the backward); `fla` runs transformers' layers on
fla-core's chunk_gated_delta_rule with its FlashQLA backend switched off; `flashqla` on the same
function left to dispatch to FlashQLA (fla-core does so on Hopper when flash-qla is installed);
`torch` on transformers' own torch functions, whatever is installed.

DIR/run.json holds {"backend", "losses", "tokens_per_s", "peak_mib", ...} (with --compile also
"compiled_graphs", "graph_breaks" and their reasons); DIR/losses.csv the curve; DIR/loss.png a
plot where matplotlib is installed. --compile with lrdsl needs a GPU: on a CPU torch.compile
would trace Triton's interpreter.
"""
from __future__ import annotations

import argparse
import csv
import importlib.util
import inspect
import json
import math
import os
import sys
import sysconfig
import time
from pathlib import Path

from lrdsl import config

config.use_interpreter_without_gpu()  # before anything imports triton

import torch  # noqa: E402
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig  # noqa: E402
from transformers.models.qwen3_5 import modeling_qwen3_5  # noqa: E402

from lrdsl.integrations import patch_qwen35  # noqa: E402

BACKENDS = ("lrdsl", "fla", "flashqla", "torch")
BYTES = 256  # the vocabulary: one token per byte
# transformers' linear-attention functions, each bound at import to FLA's (or causal-conv1d's)
# where installed, else to its torch function
TRANSFORMERS_FUNCTIONS = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
                          "causal_conv1d_update")


def model_config(tiny: bool) -> Qwen3_5TextConfig:
    """The released layer pattern scaled down. Full size: hidden 1024, 12 layers (9 linear, 3 full
    attention), linear heads 4 keys / 8 values of 128 (Qwen3.5's head dims, lrdsl's and FLA's fast
    shapes), 163M parameters. Tiny: hidden 32, 4 layers, heads of 16."""
    if tiny:
        sizes = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
                     num_key_value_heads=1, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                     linear_key_head_dim=16, linear_value_head_dim=16)
    else:
        sizes = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=8,
                     num_key_value_heads=2, head_dim=128, linear_num_key_heads=4, linear_num_value_heads=8,
                     linear_key_head_dim=128, linear_value_head_dim=128)
    layers = sizes["num_hidden_layers"]
    return Qwen3_5TextConfig(
        vocab_size=BYTES, layer_types=[("full_attention" if i % 4 == 3 else "linear_attention") for i in range(layers)],
        linear_conv_kernel_dim=4, max_position_embeddings=4096, tie_word_embeddings=True,
        pad_token_id=None, bos_token_id=None, eos_token_id=None, **sizes,
    )


def build_model(model_config: Qwen3_5TextConfig, seed: int, device) -> Qwen3_5ForCausalLM:
    """Random weights from `seed` (the same on every backend: patching shares the parameters)."""
    torch.manual_seed(seed)
    return Qwen3_5ForCausalLM(model_config).to(device)


def stdlib_bytes(limit: int) -> torch.Tensor:
    """The first `limit` bytes of the Python standard library's .py files, in sorted path order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts:
            continue
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= limit:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)[:limit]), dtype=torch.uint8).long()


def batches(corpus: torch.Tensor, batch: int, seq_len: int, steps: int, data_seed: int):
    """`steps` batches of `batch` windows of `seq_len` bytes, the windows in an order `data_seed`
    fixes (each window once before any repeats)."""
    windows = (len(corpus) - 1) // seq_len
    if windows < batch:
        raise SystemExit(f"train_hybrid.py: the corpus has {windows} windows of {seq_len} bytes, fewer than --batch {batch}")
    order = torch.randperm(windows, generator=torch.Generator().manual_seed(data_seed))
    for step in range(steps):
        picked = order[(torch.arange(batch) + step * batch) % windows]
        yield torch.stack([corpus[i * seq_len:(i + 1) * seq_len] for i in picked.tolist()])


def use_backend(model: Qwen3_5ForCausalLM, backend: str, save_policy: str | None = None) -> str:
    """Point the model's linear-attention layers at `backend`; returns a line saying what runs."""
    if backend == "lrdsl":
        patch_qwen35(model)
        for layer in model.model.layers:
            if hasattr(layer, "linear_attn"):
                layer.linear_attn.save_policy = save_policy
        return f"lrdsl (save_policy {save_policy or 'default'})"
    if save_policy is not None:
        raise SystemExit("train_hybrid.py: --save-policy is lrdsl's (its kernels' choice of what to keep)")
    if backend == "torch":
        # transformers bound these to FLA's where fla-core is installed; its torch functions are
        # what the decorators wrap
        for name in TRANSFORMERS_FUNCTIONS:
            setattr(modeling_qwen3_5, name, inspect.unwrap(getattr(modeling_qwen3_5, name)))
        return "transformers' torch functions"
    if importlib.util.find_spec("fla") is None:
        raise SystemExit(f"train_hybrid.py: --backend {backend} needs fla-core (pip install fla-core)")
    # fla-core importable now means importable when transformers bound its functions (at import)
    if backend == "fla":
        os.environ["FLA_FLASH_QLA"] = "0"  # fla-core's switch for its FlashQLA backend, read at every call
        return "fla-core's Triton kernels (FlashQLA switched off)"
    if importlib.util.find_spec("flash_qla") is None:
        raise SystemExit("train_hybrid.py: --backend flashqla needs the flash-qla package")
    return "fla-core's dispatch (FlashQLA on Hopper)"


def learning_rate(step: int, steps: int, peak: float) -> float:
    """Linear warm-up over the first 5 % of the steps, then a cosine down to a tenth."""
    warmup = max(1, steps // 20)
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def train(args) -> dict:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    precision = args.precision or ("bf16" if device == "cuda" else "fp32")
    model_cfg = model_config(args.tiny)
    model = build_model(model_cfg, args.seed, device)
    runs = use_backend(model, args.backend, args.save_policy)
    parameters = sum(p.numel() for p in model.parameters())
    print(f"{args.backend}: {runs}; {parameters / 1e6:.2f}M parameters on {device}, {precision}", file=sys.stderr)
    step_fn = torch.compile(model) if args.compile else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    corpus = stdlib_bytes(args.corpus_bytes)
    autocast = torch.autocast(device, dtype=torch.bfloat16, enabled=precision == "bf16")
    losses, timed_tokens, timed_seconds = [], 0, 0.0
    # the first steps compile (lrdsl's kernels, FLA's autotuning, torch.compile): not in tokens/s
    untimed = min(5, args.steps // 5)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    model.train()
    interrupted = False
    try:
        for step, tokens in enumerate(batches(corpus, args.batch, args.seq_len, args.steps, args.data_seed)):
            tokens = tokens.to(device)
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(step, args.steps, args.lr)
            started = time.perf_counter()
            with autocast:
                # no cache: a training step reads none, and with one transformers builds a fresh
                # cache every step whose lazily set entries torch.compile guards on (a recompile
                # per layer, past its recompile limit)
                loss = step_fn(input_ids=tokens, labels=tokens, use_cache=False).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            value = loss.item()  # synchronises: the step's time is its own
            if step >= untimed:
                timed_seconds += time.perf_counter() - started
                timed_tokens += tokens.numel()
            losses.append(value)
            rate = timed_tokens / timed_seconds if timed_seconds else float("nan")
            print(f"\rstep {step + 1}/{args.steps}  loss {value:.4f}  {rate:,.0f} tokens/s", end="", file=sys.stderr)
            if not math.isfinite(value):
                break  # the verdict says so; the run so far is still written
    except KeyboardInterrupt:  # Ctrl-C, or `timeout -s INT`: the steps so far are still written
        interrupted = True
    print(file=sys.stderr)
    return {
        "backend": args.backend, "runs": runs, "losses": losses, "interrupted": interrupted,
        "tokens_per_s": timed_tokens / timed_seconds if timed_seconds else None,
        **(compile_counts() if args.compile else {}),
        "peak_mib": torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else None,
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "precision": precision, "compile": args.compile, "save_policy": args.save_policy, "steps": args.steps,
        "seed": args.seed, "data_seed": args.data_seed, "batch": args.batch, "seq_len": args.seq_len, "lr": args.lr,
        "tiny": args.tiny, "parameters": parameters, "torch": torch.__version__,
    }


def compile_counts() -> dict:
    """What torch.compile did over the run: graphs compiled (more than the model's graphs means
    recompiles) and graph breaks, with the reasons of the most frequent."""
    from torch._dynamo.utils import counters

    breaks = counters["graph_break"]
    return {"compiled_graphs": counters["stats"]["unique_graphs"], "graph_breaks": sum(breaks.values()),
            "graph_break_reasons": [reason.splitlines()[0][:200] for reason, _ in breaks.most_common(5)]}


def write_run(run: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "run.json").write_text(json.dumps(run, indent=1) + "\n")
    with open(out / "losses.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["step", "loss"])
        writer.writerows(enumerate(run["losses"], start=1))
    plot([run], out / "loss.png")
    print(f"wrote {out / 'run.json'}", file=sys.stderr)


def plot(runs: list[dict], path: Path) -> None:
    """The runs' loss curves in one PNG (nothing where matplotlib is not installed). With several
    runs a second panel shows each one's curve minus the first's, both averaged over windows of 10
    steps: the curves themselves overlap at this scale."""
    if importlib.util.find_spec("matplotlib") is None:
        print(f"matplotlib is not installed: no {path.name}", file=sys.stderr)
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = 2 if len(runs) > 1 else 1
    figure, axes = plt.subplots(panels, 1, figsize=(7, 4 * panels), squeeze=False)
    for index, run in enumerate(runs):
        label = f"{run['backend']} (data seed {run['data_seed']})"
        axes[0][0].plot(range(1, len(run["losses"]) + 1), run["losses"], label=label, linewidth=1, color=f"C{index}")
    axes[0][0].set_xlabel("step")
    axes[0][0].set_ylabel("loss (nats per byte)")
    axes[0][0].legend()
    if panels == 2:
        window, first = 10, runs[0]
        for index, run in enumerate(runs[1:], start=1):
            steps = min(len(first["losses"]), len(run["losses"])) // window * window
            mean = lambda losses, i: sum(losses[i:i + window]) / window  # noqa: E731
            gaps = [mean(run["losses"], i) - mean(first["losses"], i) for i in range(0, steps, window)]
            axes[1][0].plot([i + window for i in range(0, steps, window)], gaps, linewidth=1, color=f"C{index}",
                            label=f"{run['backend']} (data seed {run['data_seed']})")
        axes[1][0].axhline(0, color="grey", linewidth=0.5)
        axes[1][0].set_xlabel("step")
        axes[1][0].set_ylabel(f"minus {first['backend']} (data seed {first['data_seed']}), {window}-step means")
        axes[1][0].legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    print(f"wrote {path}", file=sys.stderr)


def final_loss(losses: list[float]) -> float:
    """The mean of a run's last 10 % of losses (one step's loss is noisy)."""
    tail = losses[-max(1, len(losses) // 10):]
    return sum(tail) / len(tail)


def curve_gap(a: list[float], b: list[float]) -> float:
    """The mean |difference| of two loss curves over the second half of their common steps,
    each first averaged over windows of 10 steps (what a plot shows, not one batch's noise)."""
    steps = min(len(a), len(b))
    window = max(1, min(10, steps // 4))
    smooth = [[sum(c[i:i + window]) / window for i in range(0, steps - window + 1, window)] for c in (a, b)]
    half = smooth[0][len(smooth[0]) // 2:], smooth[1][len(smooth[1]) // 2:]
    return sum(abs(x - y) for x, y in zip(*half)) / len(half[0])


def compare(directories: list[str], out: Path) -> None:
    """The final losses of earlier runs side by side, each run's gap to the first (curve_gap), and
    one plot. Two runs that differ only in --data-seed give the noise floor a backend's gap is held
    against."""
    runs = [json.loads((Path(d) / "run.json").read_text()) for d in directories]
    for directory, run in zip(directories, runs):
        gap = f", gap to {directories[0]} {curve_gap(runs[0]['losses'], run['losses']):.4f}" if run is not runs[0] else ""
        print(f"{directory}: {run['backend']} data seed {run['data_seed']}: final loss {final_loss(run['losses']):.4f}, "
              f"{run['tokens_per_s'] or float('nan'):,.0f} tokens/s, peak {run['peak_mib'] or float('nan'):,.0f} MiB{gap}")
    out.mkdir(parents=True, exist_ok=True)
    plot(runs, out / "loss.png")


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=BACKENDS, default="lrdsl")
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--out", required=True, help="the folder run.json, losses.csv and loss.png go to")
    parser.add_argument("--tiny", action="store_true", help="a model small enough for the CPU interpreter")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model")
    parser.add_argument("--save-policy", default=None, help="lrdsl only: what its kernels keep for the backward")
    parser.add_argument("--precision", choices=("bf16", "fp32"), default=None,
                        help="bf16: autocast (the GPU's default); fp32 (the CPU's)")
    parser.add_argument("--seed", type=int, default=0, help="the weights' seed")
    parser.add_argument("--data-seed", type=int, default=0, help="the order of the training windows")
    parser.add_argument("--batch", type=int, default=None, help="sequences per step (default 16; tiny 2)")
    parser.add_argument("--seq-len", type=int, default=None, help="bytes per sequence (default 2048; tiny 32)")
    parser.add_argument("--lr", type=float, default=None, help="peak learning rate (default 1e-3; tiny 1e-2)")
    parser.add_argument("--corpus-bytes", type=int, default=64 << 20)
    parser.add_argument("--compare", nargs="+", metavar="DIR", help="instead: report earlier runs and plot them together")
    args = parser.parse_args(argv)
    args.batch = args.batch or (2 if args.tiny else 16)
    args.seq_len = args.seq_len or (32 if args.tiny else 2048)
    args.lr = args.lr or (1e-2 if args.tiny else 1e-3)
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    return args


def refusal(args) -> str | None:
    """Why this run cannot start here (one line), or None."""
    if torch.cuda.is_available():
        return None
    if args.backend in ("fla", "flashqla"):
        return (f"train_hybrid.py: --backend {args.backend} needs a GPU (FLA's kernels run on CUDA); "
                "use --backend lrdsl or torch on a CPU")
    if not args.tiny:
        return ("train_hybrid.py: the full-size model needs a GPU (on a CPU Triton's interpreter would take "
                "days); run it with --tiny")
    if args.compile and args.backend == "lrdsl":
        return ("train_hybrid.py: --compile with --backend lrdsl needs a GPU (on a CPU torch.compile would "
                "trace Triton's interpreter itself); drop --compile, or use --backend torch")
    return None


def verdict(losses: list[float]) -> str:
    if not all(math.isfinite(x) for x in losses):
        return "FAILED: a loss is not finite"
    if len(losses) > 1 and not losses[-1] < losses[0]:
        return f"FAILED: the loss did not fall ({losses[0]:.4f} -> {losses[-1]:.4f})"
    return "ok"


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.compare:
        compare(args.compare, Path(args.out))
        return 0
    reason = refusal(args)
    if reason is not None:
        print(reason, file=sys.stderr)
        return 2
    run = train(args)
    write_run(run, Path(args.out))
    losses = run["losses"]
    rate = f"{run['tokens_per_s']:,.0f} tokens/s" if run["tokens_per_s"] else "tokens/s not measured"
    if not losses:
        print(f"{args.backend}: interrupted before the first step finished")
        return 1
    cut = f" (interrupted; {args.steps} asked for)" if run["interrupted"] else ""
    print(f"{args.backend}: loss {losses[0]:.4f} -> {losses[-1]:.4f} over {len(losses)} steps{cut}, {rate}")
    if args.compile:
        print(f"torch.compile: {run['compiled_graphs']} graphs compiled, {run['graph_breaks']} graph breaks"
              + "".join(f"\n  break: {reason}" for reason in run["graph_break_reasons"]))
    line = verdict(losses)
    print(line)
    if line != "ok":
        return 1
    return 130 if run["interrupted"] else 0  # 130: the shell's code for a run stopped by SIGINT


if __name__ == "__main__":
    sys.exit(main())
