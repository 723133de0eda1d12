# SPDX-License-Identifier: Apache-2.0
"""Draws the sweep's panels as in the seed study: a metric's p50 against QPS, one panel per input length, one line per mode.

Reads the `<mode>_qps<q>_in<in>_out<out>_iter<i>.json` files `python -m bench.sweep`
wrote. Each marker is the p50 over the requests of every iteration of that
point (as `bench.sweep --report-only` prints it); the bar through it spans
the iterations' own p50s; a hollow marker means that mode did not keep up
with the offered load there. One row of panels per output length.

    python bench/plot_sweep.py --results-dir runs/sweep --metric ttft [--out ttft.png] [--log-y]

Needs matplotlib (`pip install 'kvpush[report]'`).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

from kvpush.report.percentiles import percentile

METRICS = {"ttft": ("ttft_ms", "TTFT p50 (ms)"), "tpot": ("tpot_ms", "TPOT p50 (ms)")}
MODE_STYLES = {
    "kvpush": ("kvpush (KvpushConnector, push)", "#d62728", "o"),
    "upstream-push": ("upstream push (NixlPushConnector)", "#1f77b4", "s"),
    "pull": ("upstream pull (NixlConnector)", "#2ca02c", "^"),
}


def load(results_dir: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(results_dir.glob("*_qps*_in*_out*_iter*.json"))]


def series(documents: list[dict], key: str) -> dict[tuple[int, int, str], list[tuple[float, float, float, float, bool]]]:
    """(output_len, input_len, mode) → [(qps, pooled p50, lowest and highest iteration p50, kept up)] sorted by QPS."""
    runs: dict[tuple[int, int, str, float], list[dict]] = defaultdict(list)
    for d in documents:
        if "summary" in d:
            p = d["point"]
            runs[(p["output_len"], p["input_len"], d["mode"], p["qps"])].append(d)
    lines: dict[tuple[int, int, str], list[tuple[float, float, float, float, bool]]] = defaultdict(list)
    for (output_len, input_len, mode, qps), group in sorted(runs.items()):
        values = [r[key] for d in group for r in d["requests"] if r[key] is not None and not r["error"]]
        per_iteration = [d["summary"][key]["p50"] for d in group if d["summary"][key]["p50"] is not None]
        if not values:
            continue
        kept_up = all(d["summary"]["sustained"] for d in group)
        lines[(output_len, input_len, mode)].append((qps, percentile(values, 50), min(per_iteration), max(per_iteration), kept_up))
    return lines


def plot(documents: list[dict], metric: str, out: Path, log_y: bool, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display here
    import matplotlib.pyplot as plt

    key, ylabel = METRICS[metric]
    lines = series(documents, key)
    output_lens = sorted({o for o, _, _ in lines})
    input_lens = sorted({i for _, i, _ in lines})
    figure, axes = plt.subplots(len(output_lens), len(input_lens), figsize=(4.6 * len(input_lens), 3.8 * len(output_lens)), squeeze=False)
    for row, output_len in enumerate(output_lens):
        for col, input_len in enumerate(input_lens):
            ax = axes[row][col]
            for mode, (label, color, marker) in MODE_STYLES.items():
                points = lines.get((output_len, input_len, mode))
                if not points:
                    continue
                qps = [p[0] for p in points]
                p50 = [p[1] for p in points]
                errors = [[p[1] - p[2] for p in points], [p[3] - p[1] for p in points]]
                ax.errorbar(qps, p50, yerr=errors, color=color, marker=None, capsize=3, linewidth=1.6, label=label)
                for q, v, _, _, kept_up in points:
                    ax.plot([q], [v], marker=marker, color=color, markersize=6, markerfacecolor=color if kept_up else "white")
            ax.set_xscale("log", base=2)
            ax.set_xticks(sorted({p[0] for pts in lines.values() for p in pts}))
            ax.get_xaxis().set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
            if log_y:
                ax.set_yscale("log")
                # Plain numbers (30, 40, 100) rather than 3x10^1 on the log axis.
                plain = matplotlib.ticker.FuncFormatter(lambda value, _pos: f"{value:g}")
                ax.yaxis.set_major_formatter(plain)
                ax.yaxis.set_minor_formatter(plain)
            ax.set_title(f"input {input_len} tokens, output {output_len}")
            ax.set_xlabel("QPS (Poisson arrivals)")
            ax.set_ylabel(ylabel)
            ax.grid(True, alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    figure.legend(handles, labels, loc="lower center", ncol=len(labels), bbox_to_anchor=(0.5, 0.0))
    figure.suptitle(title)
    figure.tight_layout(rect=(0, 0.06, 1, 0.96))
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=110)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results-dir", type=Path, required=True)
    parser.add_argument("--metric", choices=sorted(METRICS), default="ttft")
    parser.add_argument("--out", type=Path, help="PNG to write (default <results-dir>/<metric>.png)")
    parser.add_argument("--log-y", action="store_true", help="logarithmic y axis (saturated points dwarf the rest)")
    parser.add_argument("--title", default=None)
    args = parser.parse_args(argv)
    documents = load(args.results_dir)
    if not any("summary" in d for d in documents):
        print(f"plot_sweep: no sweep results in {args.results_dir}", file=sys.stderr)
        return 1
    out = args.out or args.results_dir / f"{args.metric}.png"
    title = args.title or f"{args.metric.upper()} p50 vs QPS, 1P1D tiny Qwen3 on 2 vCPUs (hollow: did not keep up)"
    try:
        plot(documents, args.metric, out, args.log_y, title)
    except ImportError as exc:
        print(f"plot_sweep: {exc} (pip install 'kvpush[report]')", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
