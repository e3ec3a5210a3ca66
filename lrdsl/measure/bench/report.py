"""Output: the table, the ratio summary, JSON (and reading it back), the plot."""
from __future__ import annotations

import importlib
import importlib.util
import json
from dataclasses import asdict

from ...errors import LrdslError
from .shapes import DECODE, DECODE_GRAPH, FORWARD_BACKWARD, LRDSL, MODES
from .peers import FLA
from .timing import _first_line
from .gate import BenchRow


_COLUMNS = (("spec", 10), ("mode", 19), ("shape", 15), ("impl", 15), ("kernel", 32), ("path", 10),
            ("time", 11), ("rate", 16), ("of copy", 7), ("peak MiB", 8), ("kept MiB", 8), ("cold s", 6), ("vs oracle", 9),
            ("vs other", 8), ("peer/lrdsl", 50), ("x pool", 6), ("status", 0))
HEADER = " ".join(f"{name:<{width}}" if width else name for name, width in _COLUMNS)


def format_row(r: BenchRow) -> str:
    def number(value, fmt):
        return "-" if value is None else format(value, fmt)

    if r.ms is None:
        time_text = rate = "-"
    elif r.state_tbps is not None or r.mode in (DECODE, DECODE_GRAPH):
        # beside the card's copy bandwidth where it was measured: state / copy
        bandwidth = number(r.state_tbps, ".2f") + ("" if r.copy_tbps is None else f"/{r.copy_tbps:.2f}")
        time_text, rate = f"{r.ms * 1e3:.1f} us", f"{bandwidth} TB/s"
    else:
        time_text, rate = f"{r.ms:.3f} ms", f"{number(r.tflops, '.1f')} TFLOP/s"
    status = r.status if r.ok else f"FAILED: {r.reason}"
    ratios = " ".join(f"{peer} {value:.2f}" for peer, value in r.ratios.items()) or "-"
    cells = [r.spec, r.mode, r.shape, r.impl, r.kernel, r.path, time_text, rate, number(r.of_copy, ".2f"),
             number(r.peak_mib, ".0f"), number(r.kept_mib, ".0f"), number(r.cold_s, ".1f"), number(r.err_vs_oracle, ".1e"),
             number(r.diff_vs_other, ".1e"), ratios, number(r.vs_pool, ".2f"), status]
    return " ".join(f"{cell:<{width}}" if width else cell for cell, (_, width) in zip(cells, _COLUMNS))


def peers_of(rows: list[BenchRow]) -> list[str]:
    """The peer columns the rows have, in the order they first appear (FLA's Triton kernels first)."""
    return list(dict.fromkeys(r.impl for r in rows if r.impl != LRDSL and r.mode in MODES))


def ratio_summary(rows: list[BenchRow]) -> dict:
    """{(spec, shape): {mode: {peer: ratio | "FAILED"}}} from each group's first lrdsl row (the
    first plan asked for): peer ms / lrdsl ms where both rows are ok, "FAILED" where either
    failed; {} for a mode without peers (no FLA counterpart, or fla-core not installed)."""
    groups: dict = {}
    for r in rows:
        if r.impl != LRDSL or r.mode not in MODES:  # serving rows have no peers
            continue
        modes = groups.setdefault((r.spec, r.shape), {})
        if r.mode in modes:
            continue
        peers = [x.impl for x in rows if x.impl != LRDSL and (x.spec, x.shape, x.mode) == (r.spec, r.shape, r.mode)]
        modes[r.mode] = {peer: r.ratios.get(peer, "FAILED") for peer in dict.fromkeys(peers)}
    return groups


def format_summary(rows: list[BenchRow]) -> str:
    summary = ratio_summary(rows)
    peers = peers_of(rows)
    columns = [(m, p) for m in MODES for p in peers if any(p in v.get(m, {}) for v in summary.values())]
    labels = [f"{m} {p}" for m, p in columns]
    widths = [max(len(label), 8) for label in labels]
    header = f"{'spec':<10} {'shape':<15} " + " ".join(f"{label:>{w}}" for label, w in zip(labels, widths))
    lines = ["peer ms / lrdsl ms (above 1: lrdsl faster)", header, "-" * len(header)]
    for (spec, shape), values in summary.items():
        cells = []
        for (m, p), w in zip(columns, widths):
            value = values.get(m, {}).get(p, "-")
            cells.append(f"{value:>{w}.2f}" if isinstance(value, float) else f"{value:>{w}}")
        alone = "  (no peer)" if not any(values.values()) else ""
        lines.append(f"{spec:<10} {shape:<15} " + " ".join(cells) + alone + _kept_beside(rows, spec, shape))
    return "\n".join(lines)


def _kept_beside(rows: list[BenchRow], spec: str, shape: str) -> str:
    """What each implementation's forward keeps for the backward in the group's forward +
    backward rows (measured on a GPU): a speed ratio bought with held memory shows beside it."""
    kept = {}
    for r in rows:
        if (r.spec, r.shape, r.mode) == (spec, shape, FORWARD_BACKWARD) and r.kept_mib is not None:
            kept.setdefault(r.impl, r.kept_mib)
    if not kept:
        return ""
    return "  kept MiB " + ", ".join(f"{impl} {mib:.0f}" for impl, mib in kept.items())


def to_json(rows: list[BenchRow]) -> str:
    return json.dumps([asdict(r) for r in rows], indent=1)


def rows_from_json(path) -> list[BenchRow]:
    """The rows a --json file holds (runs split over several processes are combined this way).
    Files written before the peers had columns of their own (one "fla-core" row per group, a
    single "ratio") are read as the column their path names."""
    try:
        records = json.loads(open(path).read())
        return [BenchRow(**record) for record in _with_peer_columns(records)]
    except OSError as exc:
        raise LrdslError(f"--from-json {path}: {exc.strerror}") from None
    except (ValueError, TypeError, AttributeError, KeyError) as exc:
        raise LrdslError(f"--from-json {path}: not rows written by lrdsl bench --json ({_first_line(exc)})") from None


def _with_peer_columns(records: list) -> list:
    """Old records made new: the "fla-core" row is the column of the code it ran (its path),
    and an lrdsl row's "ratio" the ratio to that column."""
    if not any("ratio" in record for record in records):
        return records
    column = {}
    for record in records:
        if record["impl"] == FLA:
            column[(record["spec"], record["shape"], record["mode"])] = record["path"] if record["path"] not in ("-", "unknown") else FLA
    upgraded = []
    for record in records:
        record = dict(record)
        ratio = record.pop("ratio", None)
        if record["impl"] == FLA:
            record["impl"] = column[(record["spec"], record["shape"], record["mode"])]
        elif ratio is not None:
            record["ratios"] = {column[(record["spec"], record["shape"], record["mode"])]: ratio}
        upgraded.append(record)
    return upgraded


def require_matplotlib() -> None:
    """--plot's one dependency, checked before any GPU time is spent."""
    if importlib.util.find_spec("matplotlib") is None:
        raise LrdslError("--plot needs matplotlib, which is not installed (pip install matplotlib)")


def plot_ratios(rows: list[BenchRow], path) -> None:
    """A PNG: per spec, peer ms / lrdsl ms per shape, one bar per mode and peer, a line at 1.0
    (parity)."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")  # files only: no display
    import matplotlib.pyplot as plt

    summary = ratio_summary(rows)
    specs = list(dict.fromkeys(spec for spec, _ in summary))
    if not specs:
        raise LrdslError("--plot: no lrdsl rows to plot")
    peers = peers_of(rows)
    series = [(m, p) for m in MODES for p in peers if any(p in v.get(m, {}) for v in summary.values())]
    widest = max(sum(1 for s, _ in summary if s == spec) for spec in specs)
    bars = max([sum(len(v) for v in values.values()) for values in summary.values()] + [1])
    fig, axes = plt.subplots(len(specs), 1, figsize=(max(6.0, 0.4 * bars * widest + 4), 3.4 * len(specs)), squeeze=False)
    width = 0.8 / bars
    colors = {key: f"C{i}" for i, key in enumerate(series)}
    for ax, spec in zip(axes[:, 0], specs):
        shapes = [shape for s, shape in summary if s == spec]
        top = 1.0
        for j, shape in enumerate(shapes):
            present = [(m, p) for m, p in series if p in summary[(spec, shape)].get(m, {})]  # side by side
            for i, (mode, peer) in enumerate(present):
                value = summary[(spec, shape)][mode][peer]
                x = j + (i - (len(present) - 1) / 2) * width
                if isinstance(value, float):
                    ax.bar(x, value, width, color=colors[(mode, peer)])
                    ax.annotate(f"{value:.2f}", (x, value), ha="center", va="bottom", fontsize=7)
                    top = max(top, value)
                else:
                    ax.annotate(value, (x, 0), ha="center", va="bottom", rotation=90, fontsize=7,
                                color=colors[(mode, peer)])
            if not present:
                ax.annotate("no peer", (j, 0), ha="center", va="bottom", fontsize=7)
        ax.axhline(1.0, color="black", linestyle="--", linewidth=1)
        ax.set_xticks(range(len(shapes)))
        ax.set_xticklabels(shapes)
        ax.set_xlim(-0.6, len(shapes) - 0.4)
        ax.set_ylim(0, top * 1.15)
        ax.set_ylabel("peer ms / lrdsl ms")
        ax.set_title(f"{spec}: above 1, lrdsl is faster")
        own = [(m, p) for m, p in series if any(p in summary[(spec, shape)].get(m, {}) for shape in shapes)]
        if own:  # a spec without peers has only its "no peer" notes
            ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=colors[key]) for key in own],
                      labels=[f"{m} vs {p}" for m, p in own], fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
