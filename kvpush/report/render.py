# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""Renders a Breakdown: a text table, a self-contained HTML page (inline SVG, no script, no network) and a PNG."""

from __future__ import annotations

import html
from pathlib import Path

from kvpush.report.breakdown import SEGMENTS, Breakdown, RequestBreakdown, Row

# One color per segment, in chain order (a qualitative palette readable on white).
COLORS = ("#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#9c755f", "#ff9da7")
SEGMENT_COLORS = dict(zip((s.name for s in SEGMENTS), COLORS))

CHART_WIDTH = 760  # px of the bar area
LABEL_WIDTH = 220
BAR_HEIGHT = 18
BAR_GAP = 6


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def text_table(result: Breakdown) -> str:
    """The p50/p90/mean per segment, TTFT and hand-off overhead, then the detail spans, as aligned text."""
    complete = sum(r.complete for r in result.requests)
    lines = [f"Critical path to the first token of {len(result.requests)} routed requests ({complete} with every segment), milliseconds"]
    if result.excluded:
        lines.append("left out: " + ", ".join(f"{count} x {reason}" for reason, count in sorted(result.excluded.items())))
    width = max(len(row.label) for row in result.rows() + result.detail_rows()) + 2

    def render(row: Row, indent: str = "") -> str:
        return f"{indent}{row.label:<{width - len(indent)}}{_ms(row.p50):>9}{_ms(row.p90):>9}{_ms(row.mean):>9}{row.count:>5}"

    lines.append(f"{'segment':<{width}}{'p50':>9}{'p90':>9}{'mean':>9}{'n':>5}")
    rows = result.rows()
    lines += [render(row) for row in rows[: len(SEGMENTS)]]
    lines.append("-" * (width + 32))
    lines += [render(row) for row in rows[len(SEGMENTS):]]
    lines.append("measured spans beside the chain:")
    lines += [render(row, "  ") for row in result.detail_rows()]
    return "\n".join(lines)


def _table_html(rows: list[Row], caption: str) -> str:
    body = "".join(
        f"<tr><td>{html.escape(r.label)}</td><td>{_ms(r.p50)}</td><td>{_ms(r.p90)}</td><td>{_ms(r.mean)}</td><td>{r.count}</td></tr>" for r in rows
    )
    return f"<table><caption>{html.escape(caption)}</caption><tr><th>segment</th><th>p50 ms</th><th>p90 ms</th><th>mean ms</th><th>n</th></tr>{body}</table>"


def _request_label(index: int, request: RequestBreakdown) -> str:
    name = request.client_request_id or request.transfer_id or request.trace_id
    return f"#{index + 1} {name[:24]}"


def _stacked_svg(requests: list[RequestBreakdown]) -> str:
    """One horizontal bar per request, its segments stacked in chain order, on a common ms scale."""
    totals = [sum(v for v in r.segments.values() if v is not None) for r in requests]
    scale = CHART_WIDTH / max(max(totals, default=0.0), 1e-9)
    height = len(requests) * (BAR_HEIGHT + BAR_GAP) + BAR_GAP
    parts = [f'<svg id="stacked" class="chart" xmlns="http://www.w3.org/2000/svg" width="{LABEL_WIDTH + CHART_WIDTH + 80}" height="{height}">']
    for index, (request, total) in enumerate(zip(requests, totals)):
        y = BAR_GAP + index * (BAR_HEIGHT + BAR_GAP)
        parts.append(f'<text x="0" y="{y + BAR_HEIGHT - 4}" font-size="12">{html.escape(_request_label(index, request))}</text>')
        x = float(LABEL_WIDTH)
        for segment in SEGMENTS:
            value = request.segments[segment.name]
            if value is None:
                continue
            width = value * scale
            parts.append(
                f'<rect class="segment" data-segment="{segment.name}" data-request="{index}" x="{x:.2f}" y="{y}" width="{width:.2f}" '
                f'height="{BAR_HEIGHT}" fill="{SEGMENT_COLORS[segment.name]}"><title>{html.escape(segment.label)}: {value:.2f} ms</title></rect>'
            )
            x += width
        note = "" if request.ttft_ms is not None else " to D's first step (not streamed: no TTFT)"
        parts.append(f'<text x="{x + 4:.2f}" y="{y + BAR_HEIGHT - 4}" font-size="11">{total:.1f} ms{note}</text>')
    parts.append("</svg>")
    return "".join(parts)


def _waterfall_svg(index: int, request: RequestBreakdown) -> str:
    """The request's segments on its own time axis, one row each, offset by when they start."""
    # A segment is present only where both its instants are (breakdown.py).
    present = [(s, value, start) for s in SEGMENTS if (value := request.segments[s.name]) is not None and (start := request.instants[s.start]) is not None]
    end = max(((start - request.start_ns) / 1e6 + value for _, value, start in present), default=0.0)
    scale = CHART_WIDTH / max(end, 1e-9)
    height = len(SEGMENTS) * (BAR_HEIGHT + 2) + 4
    parts = [f'<svg class="waterfall chart" data-request="{index}" xmlns="http://www.w3.org/2000/svg" width="{LABEL_WIDTH + CHART_WIDTH + 80}" height="{height}">']
    for row, segment in enumerate(SEGMENTS):
        y = 2 + row * (BAR_HEIGHT + 2)
        parts.append(f'<text x="0" y="{y + BAR_HEIGHT - 4}" font-size="11">{html.escape(segment.label)}</text>')
        value, start = request.segments[segment.name], request.instants[segment.start]
        if value is None or start is None:
            parts.append(f'<text x="{LABEL_WIDTH}" y="{y + BAR_HEIGHT - 4}" font-size="11" fill="#888">no span</text>')
            continue
        offset = (start - request.start_ns) / 1e6
        x, width = LABEL_WIDTH + offset * scale, value * scale
        parts.append(
            f'<rect class="waterfall-bar" data-segment="{segment.name}" x="{x:.2f}" y="{y}" width="{max(width, 0.5):.2f}" height="{BAR_HEIGHT}" '
            f'fill="{SEGMENT_COLORS[segment.name]}"><title>{html.escape(segment.label)}: {offset:.2f} → {offset + value:.2f} ms</title></rect>'
        )
        parts.append(f'<text x="{x + max(width, 0.5) + 4:.2f}" y="{y + BAR_HEIGHT - 4}" font-size="11">{value:.2f}</text>')
    parts.append("</svg>")
    return "".join(parts)


def html_report(result: Breakdown, title: str, sources: list[str]) -> str:
    """A self-contained page: percentile tables, the stacked breakdown across requests and one waterfall per request."""
    legend = "".join(
        f'<span class="key"><span class="swatch" style="background:{SEGMENT_COLORS[s.name]}"></span>{html.escape(s.label)}</span>' for s in SEGMENTS
    )
    waterfalls = "".join(
        f"<h3>{html.escape(_request_label(i, r))} <small>TTFT {_ms(r.ttft_ms)} ms · transfer {html.escape(r.transfer_id)} attempt {r.attempt}"
        f"{' · clocks clamped' if r.clamped else ''}</small></h3>{_waterfall_svg(i, r)}"
        for i, r in enumerate(result.requests)
    )
    excluded = ", ".join(f"{count} x {html.escape(reason)}" for reason, count in sorted(result.excluded.items())) or "none"
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>
body {{ font-family: sans-serif; margin: 24px; color: #222; }}
table {{ border-collapse: collapse; margin: 12px 0 24px; }}
caption {{ text-align: left; font-weight: bold; padding-bottom: 4px; }}
td, th {{ border: 1px solid #ccc; padding: 3px 10px; text-align: right; }}
td:first-child, th:first-child {{ text-align: left; }}
.key {{ display: inline-block; margin-right: 14px; font-size: 12px; }}
.swatch {{ display: inline-block; width: 12px; height: 12px; margin-right: 4px; vertical-align: middle; }}
h3 small {{ font-weight: normal; color: #666; }}
</style></head><body>
<h1>{html.escape(title)}</h1>
<p>{len(result.requests)} routed requests from {html.escape(", ".join(sources))}; left out: {excluded}.
Segments are consecutive instants on the critical path from the router receiving a request to its first token leaving the router, so they add up to TTFT.</p>
{_table_html(result.rows(), "Critical-path segments, TTFT and hand-off overhead")}
{_table_html(result.detail_rows(), "Measured spans beside the chain")}
<h2>Breakdown across requests</h2>
<div class="legend">{legend}</div>
{_stacked_svg(result.requests)}
<h2>Per-request waterfall</h2>
{waterfalls}
</body></html>
"""


def write_png(result: Breakdown, path: Path, title: str) -> None:
    """The stacked breakdown per request and the p50/p90 per segment, as one PNG (needs matplotlib: extra `report`)."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display here
    import matplotlib.pyplot as plt

    requests = result.requests
    figure, (stacked, percentiles) = plt.subplots(1, 2, figsize=(14, max(4.0, 0.4 * len(requests) + 3.0)), gridspec_kw={"width_ratios": [3, 2]})
    labels = [_request_label(i, r) for i, r in enumerate(requests)]
    left = [0.0] * len(requests)
    for segment in SEGMENTS:
        values = [r.segments[segment.name] or 0.0 for r in requests]
        stacked.barh(labels, values, left=left, color=SEGMENT_COLORS[segment.name], label=segment.label)
        left = [a + b for a, b in zip(left, values)]
    stacked.invert_yaxis()
    stacked.set_xlabel("ms from the router receiving the request")
    stacked.set_title("breakdown across requests")
    stacked.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=3)
    rows = result.rows()[: len(SEGMENTS)]
    positions = range(len(rows))
    percentiles.barh([p - 0.2 for p in positions], [r.p50 or 0.0 for r in rows], height=0.4, label="p50", color="#4e79a7")
    percentiles.barh([p + 0.2 for p in positions], [r.p90 or 0.0 for r in rows], height=0.4, label="p90", color="#f28e2b")
    percentiles.set_yticks(list(positions), [r.label for r in rows], fontsize=7)
    percentiles.invert_yaxis()
    percentiles.set_xlabel("ms")
    percentiles.set_title("per segment")
    percentiles.legend(fontsize=8)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
