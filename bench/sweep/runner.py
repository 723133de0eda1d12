# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""The whole sweep: references, stacks brought up, the modes alternating over the grid, one JSON per run, then the report."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.sweep.grid import Point, Workload, build_grid, make_workload, requests_for
from bench.sweep.load import warm_up
from bench.sweep.measure import kv_geometry
from bench.sweep.report import report, write_json
from bench.sweep.runs import describe, run_point, skipped_result
from bench.sweep.stacks import ModeStack, start_stack
from kvpush.dev.localstack.completions import Completion
from kvpush.dev.localstack.engines import reference_run
from kvpush.dev.localstack.process import interrupt_on_signals


def compute_references(model_dir: Path, workloads: Sequence[Workload], log_dir: Path, prefix_caching: bool = False) -> dict[tuple[Point, int], Completion]:
    """Single-engine greedy outputs of every checked prompt, one reference server per output length (with the sweep's prefix caching)."""
    references: dict[tuple[Point, int], Completion] = {}
    for output_len in sorted({w.point.output_len for w in workloads}):
        keys = [(w.point, i) for w in workloads if w.point.output_len == output_len for i in w.checked]
        prompts = [next(w for w in workloads if w.point == p).prompts[i] for p, i in keys]
        outputs = reference_run(model_dir, prompts, output_len, log_path=log_dir / f"reference-out{output_len}.log", prefix_caching=prefix_caching)
        references.update(zip(keys, outputs))
    return references



def run_sweep(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from kvpush.dev.tinymodel import build_tiny_model, default_model_dir

    results_dir: Path = args.results_dir
    results_dir.mkdir(parents=True, exist_ok=True)
    work = results_dir / "work"
    work.mkdir(exist_ok=True)
    grid = build_grid(args.input_lens, args.qps, args.output_lens, args.iterations)
    workloads = {p: make_workload(p, requests_for(p.qps, args.duration, args.min_requests), args.check_per_run, args.seed, args.shared_prefix)
                 for p in grid}
    total_requests = sum(len(w.prompts) for w in workloads.values()) * len(args.modes)
    print(f"{len(grid)} points x {len(args.modes)} modes, {total_requests} measured requests; results in {results_dir}", flush=True)
    model_dir = build_tiny_model(args.model or default_model_dir(args.model_arch), arch=args.model_arch)
    args.kv_geometry = kv_geometry(json.loads((model_dir / "config.json").read_text()))
    started = time.monotonic()
    print("single-engine references for the checked requests ...", flush=True)
    references = compute_references(model_dir, list(workloads.values()), work, args.prefix_caching)
    print(f"  {len(references)} references in {time.monotonic() - started:.0f} s", flush=True)
    stacks: dict[str, ModeStack] = {}
    failed_start: dict[str, str] = {}
    completed_runs: list[dict[str, Any]] = []

    def bring_up(mode: str) -> None:
        t0 = time.monotonic()
        try:
            timeline = args.results_dir.resolve() / "step-timeline" if args.step_timeline else None
            if timeline is not None:
                timeline.mkdir(parents=True, exist_ok=True)
            stack = start_stack(mode, model_dir, work / mode, args.nixl_as_shipped, args.kvpush_engine_tracing, args.kvpush_extra_config,
                                args.vllm_spin_ms, timeline, args.aux_cpus, args.kvpush_trace_ratio, args.prefix_caching)
        except Exception as exc:  # recorded; the other modes go on
            failed_start[mode] = f"stack did not start: {exc}"[:2000]
            tqdm.write(f"{mode}: {failed_start[mode]}")
            return
        errors = asyncio.run(warm_up(stack.router_url, args.input_lens, args.request_timeout))
        stack.stack.repin()
        stacks[mode] = stack
        idle = {m: s.prefill.idle_cores(2) + s.decode.idle_cores(2) for m, s in stacks.items()} if args.measure_idle else {}
        tqdm.write(f"{mode}: up in {time.monotonic() - t0:.0f} s; warm-up errors: {errors[:2] or 'none'}"
                   + (f"; idle cores P+D per stack: {', '.join(f'{m} {c:.3f}' for m, c in idle.items())}" if idle else ""))

    def run_one(mode: str, point: Point, progress) -> None:
        stack = stacks.get(mode)
        reason = failed_start.get(mode) or (stack.failure if stack else "stack not running")
        if stack is not None and not reason:
            dead = stack.stack.dead_parts()
            if dead:
                stack.failure = reason = f"stack died: {', '.join(dead)}; P log tail:\n{stack.prefill.process.tail(15)}\nD log tail:\n{stack.decode.process.tail(15)}"
        if reason:
            write_json(results_dir / f"{point.run_name(mode)}.json", skipped_result(mode, point, reason, args))
            progress.update(len(workloads[point].prompts))
            return
        progress.set_description(point.run_name(mode))
        result = run_point(stack, list(stacks.values()), workloads[point], references, args, progress)
        write_json(results_dir / f"{point.run_name(mode)}.json", result)
        completed_runs.append(result)
        tqdm.write(describe(result))
        time.sleep(args.settle)

    try:
        with interrupt_on_signals(), tqdm(total=total_requests, unit="req", dynamic_ncols=True, mininterval=1.0) as progress:
            if not args.one_stack_at_a_time:
                for mode in args.modes:
                    bring_up(mode)
                for k, point in enumerate(grid):
                    # The order rotates so no mode always follows the same other one.
                    for mode in args.modes[k % len(args.modes):] + args.modes[:k % len(args.modes)]:
                        run_one(mode, point, progress)
            else:
                for iteration in range(1, args.iterations + 1):
                    shift = (iteration - 1) % len(args.modes)
                    for mode in args.modes[shift:] + args.modes[:shift]:
                        bring_up(mode)
                        for point in (p for p in grid if p.iteration == iteration):
                            run_one(mode, point, progress)
                        if mode in stacks:
                            stacks.pop(mode).stop()
    except KeyboardInterrupt:
        print("\nsweep interrupted; stopping every stack", file=sys.stderr)
        return 130
    finally:
        for stack in stacks.values():
            stack.stop()
    print(f"sweep wall time {(time.monotonic() - started) / 60:.1f} min", flush=True)
    return report(results_dir, args.modes, args.markdown)
