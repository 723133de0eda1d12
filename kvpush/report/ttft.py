# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""`kvpush ttft-report`: the TTFT breakdown of routed requests from OTLP trace files.

Reads kvpush's OTLP/JSON-lines files or an OpenTelemetry Collector `file`
exporter's output (several files are joined, so P, D, broker and router
may each have their own), prints the p50/p90 table and optionally writes
the HTML report, the PNG charts and the per-request numbers as JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from kvpush.report.breakdown import breakdown
from kvpush.report.render import html_report, text_table, write_png
from kvpush.telemetry import read_spans


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("traces", nargs="+", type=Path, help="OTLP/JSON-lines trace files")
    parser.add_argument("--html", type=Path, help="write the HTML report (self-contained) here")
    parser.add_argument("--png", type=Path, help="write the charts as PNG here (needs matplotlib: pip install 'kvpush[report]')")
    parser.add_argument("--json", type=Path, help="write every request's instants, segments and details here")
    parser.add_argument("--request-id-prefix", default="", help="only requests whose X-Request-Id starts with this (e.g. to leave out warm-up)")
    parser.add_argument("--title", default="kvpush TTFT breakdown", help="title of the HTML page and the PNG")


def run(args: argparse.Namespace) -> int:
    spans = []
    for path in args.traces:
        try:
            spans += read_spans(path)
        except (OSError, ValueError) as exc:
            print(f"kvpush ttft-report: {exc}", file=sys.stderr)
            return 2
    result = breakdown(spans, request_id_prefix=args.request_id_prefix)
    if not result.requests:
        excluded = f" ({', '.join(f'{n} x {reason}' for reason, n in result.excluded.items())} left out)" if result.excluded else ""
        print(f"kvpush ttft-report: no served router.request spans in {', '.join(map(str, args.traces))}{excluded}; "
              "was the router exporting traces (OTEL_TRACES_EXPORTER / KVPUSH_TRACES_FILE)?", file=sys.stderr)
        return 1
    print(text_table(result))
    if args.html:
        args.html.write_text(html_report(result, args.title, [str(p) for p in args.traces]), encoding="utf-8")
    if args.png:
        try:
            write_png(result, args.png, args.title)
        except ImportError as exc:
            print(f"kvpush ttft-report: cannot write {args.png}: {exc} (pip install 'kvpush[report]')", file=sys.stderr)
            return 2
    if args.json:
        records = [{**dataclasses.asdict(r), "ttft_ms": r.ttft_ms, "handoff_overhead_ms": r.handoff_overhead_ms} for r in result.requests]
        args.json.write_text(json.dumps({"requests": records, "excluded": result.excluded}, indent=1), encoding="utf-8")
    return 0
