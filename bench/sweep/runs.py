# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""One mode at one point: the measured run's JSON document, a skipped run's, and the one-line description of a run."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import time
from collections.abc import Sequence
from typing import Any

from bench.offcpu import start_offcpu, stop_offcpu
from bench.pyspy import start_profilers, stop_profilers
from bench.sweep.grid import Point, Workload, shared_prefix_len
from bench.sweep.load import run_load
from bench.sweep.measure import (
    histogram_delta,
    histogram_totals,
    kvpush_breakdown,
    kvpush_kv_check,
    router_segments,
    thread_breakdown,
    upstream_kv_check,
    wait_for_spans,
)
from bench.sweep.stacks import DECODE_CPUS, NIXL_POLL_DELAY_US, PREFILL_CPUS, ModeStack
from bench.sweep.summary import check_correctness, stats, summarize
from kvpush.dev.localstack.completions import Completion
from kvpush.processes import thread_cpu_seconds, thread_runqueue_wait_seconds

METRICS_SETTLE_TIMEOUT_S = 5.0


def run_point(stack: ModeStack, stacks: Sequence[ModeStack], workload: Workload, references: dict[tuple[Point, int], Completion],
              args: argparse.Namespace, progress) -> dict[str, Any]:
    """Runs one mode at one point and returns its full result (the JSON document)."""
    point, mode = workload.point, stack.mode
    prefix = point.run_name(mode) + "-"
    moved_threads = stack.stack.repin()
    before = {"P": histogram_totals(stack.prefill.url), "D": histogram_totals(stack.decode.url)}
    cpu_before = {s.mode: s.cpu_seconds() for s in stacks}
    threads_before = {"P": thread_cpu_seconds(stack.prefill.pids()), "D": thread_cpu_seconds(stack.decode.pids())}
    waits_before = {"P": thread_runqueue_wait_seconds(stack.prefill.pids()), "D": thread_runqueue_wait_seconds(stack.decode.pids())}
    offset = stack.spans.offset()

    def done() -> None:
        progress.update(1)

    profilers = start_profilers(stack, args.profile, point.run_name(mode)) if args.profile else []
    offcpu = start_offcpu(list(stacks), stack, args.results_dir / "offcpu", point.run_name(mode)) if args.offcpu else None
    started = time.monotonic()
    wall_minus_monotonic_ns = time.time_ns() - time.monotonic_ns()
    records, wall = asyncio.run(run_load(stack.router_url, workload, mode, args.request_timeout, done))
    ended = time.monotonic()
    stop_offcpu(offcpu)
    stop_profilers(profilers)
    cpu_after = {s.mode: s.cpu_seconds() for s in stacks}
    threads_after = {"P": thread_cpu_seconds(stack.prefill.pids()), "D": thread_cpu_seconds(stack.decode.pids())}
    waits_after = {"P": thread_runqueue_wait_seconds(stack.prefill.pids()), "D": thread_runqueue_wait_seconds(stack.decode.pids())}
    # The engines publish their histograms with scheduler stats; the NIXL counts may trail the last response.
    expected_transfers = len([r for r in records if r.ok])
    deadline = time.monotonic() + METRICS_SETTLE_TIMEOUT_S
    while True:
        after = {"P": histogram_totals(stack.prefill.url), "D": histogram_totals(stack.decode.url)}
        nixl_count = sum(after[e]["nixl_bytes"]["count"] - before[e]["nixl_bytes"]["count"] for e in after)
        if mode == "kvpush" or nixl_count >= expected_transfers or time.monotonic() > deadline:
            break
        time.sleep(0.25)
    engines = {e: histogram_delta(before[e], after[e]) for e in before}
    engine_spans = mode == "kvpush" and args.kvpush_engine_tracing
    trace_ratio = args.kvpush_trace_ratio
    spans = wait_for_spans(stack, offset, prefix, len(records), need_engine_spans=engine_spans, trace_ratio=trace_ratio)
    summary = summarize(records, wall, workload)
    summary["correctness"] = check_correctness(records, workload, references)
    router_side = router_segments(spans, prefix)
    summary["router"] = {key: stats(r[key] for r in router_side.values()) for key in ("router_ttft_ms", "p_leg_ms", "after_p_leg_ms", "d_leg_sent_ms")}
    summary["router"]["retried"] = sum(1 for r in router_side.values() if (r["attempt"] or 1) > 1)
    summary["engines"] = {e: {k: v["mean"] for k, v in d.items()} | {"nixl_transfers": d["nixl_bytes"]["count"]} for e, d in engines.items()}
    summary["cores_used"] = {m: {part: (cpu_after[m][part] - cpu_before[m][part]) / wall for part in cpu_after[m]} for m in cpu_after}
    # CPU per completed request: every process of this mode's P and D group (vLLM's own spin included), its router and
    # (kvpush) its control plane, which the engines' cores share unless --aux-cpus pins them.
    completed = max(summary["completed"], 1)
    summary["cpu_ms_per_request"] = {part: (cpu_after[mode][part] - cpu_before[mode][part]) * 1000 / completed for part in cpu_after[mode]}
    summary["thread_cpu_ms_per_request"] = {part: thread_breakdown(threads_before[part], threads_after[part], completed) for part in ("P", "D")}
    # Time each thread was runnable but kept off its core by others (runqueue wait): what steals a pinned engine's core.
    summary["thread_runqueue_wait_ms_per_request"] = {part: thread_breakdown(waits_before[part], waits_after[part], completed) for part in ("P", "D")}
    summary["threads_repinned"] = moved_threads
    if mode == "kvpush":
        summary["kv_bytes"] = kvpush_kv_check(stack, spans, prefix, point, shared_prefix_len(point.input_len, args.shared_prefix), args.kv_geometry)
        if engine_spans:
            summary["breakdown"] = kvpush_breakdown(spans, prefix, wall_minus_monotonic_ns, trace_ratio)
    else:
        summary["kv_bytes"] = upstream_kv_check(engines, len(records), point, shared_prefix_len(point.input_len, args.shared_prefix),
                                                args.kv_geometry)
    return {
        "mode": mode,
        "point": dataclasses.asdict(point),
        "run": point.run_name(mode),
        "nixl_progress_thread": "as shipped (busy-polling)" if args.nixl_as_shipped else f"poll delay {NIXL_POLL_DELAY_US} us",
        "vllm_reader_spin": "1 s (as shipped)" if args.vllm_spin_ms is None else f"{args.vllm_spin_ms:g} ms",
        "pinning": {"prefill_cpus": PREFILL_CPUS, "decode_cpus": DECODE_CPUS, "aux_cpus": args.aux_cpus or "not pinned"},
        "layout": "one stack at a time" if args.one_stack_at_a_time else "all stacks up, modes alternating per point",
        "kvpush_engine_tracing": args.kvpush_engine_tracing,
        "kvpush_trace_ratio": trace_ratio,
        "kvpush_extra_config": args.kvpush_extra_config,
        "prefix_caching": args.prefix_caching,
        "shared_prefix_tokens": shared_prefix_len(point.input_len, args.shared_prefix),
        # The load's span on CLOCK_MONOTONIC and each engine's process group: where this run is in a step timeline.
        "monotonic_window_s": [started, ended],
        "engine_groups": {"P": stack.prefill.pid, "D": stack.decode.pid},
        "summary": summary,
        "requests": [dict(r.figures(), router=router_side.get(r.request_id)) for r in records],
    }



def skipped_result(mode: str, point: Point, reason: str, args: argparse.Namespace) -> dict[str, Any]:
    return {"mode": mode, "point": dataclasses.asdict(point), "run": point.run_name(mode), "skipped": reason,
            "nixl_progress_thread": "as shipped (busy-polling)" if args.nixl_as_shipped else f"poll delay {NIXL_POLL_DELAY_US} us"}


def describe(result: dict[str, Any]) -> str:
    s = result["summary"]
    correct = "ok" if s["correctness"]["ok"] else f"MISMATCH {s['correctness']['passed']}/{s['correctness']['checked']}"
    kv = "ok" if s["kv_bytes"]["ok"] else "BAD"
    ttft, tpot = s["ttft_ms"]["p50"], s["tpot_ms"]["p50"]
    return (f"{result['run']:<44} TTFT p50 {ttft if ttft is None else round(ttft, 1)!s:>7} ms  TPOT p50 "
            f"{tpot if tpot is None else round(tpot, 2)!s:>6} ms  done {s['completed']}/{s['requests']}  "
            f"kept up {s['sustained_share']:.2f}  correct {correct}  kv {kv}  CPU/req P {s['cpu_ms_per_request']['P']:.0f} "
            f"D {s['cpu_ms_per_request']['D']:.0f} ms")
