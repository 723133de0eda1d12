# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""The sweep's report: per-point tables, the kvpush breakdown, every mode from outside, and the targets.

Reads the per-run JSON files `python -m bench.sweep` writes (`<mode>_qps<q>_in<in>_out<out>_iter<i>.json`)
and prints them as text tables (and Markdown), with the targets judged on the pooled p50s.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from bench.sweep.measure import THREAD_FLOOR_MS
from kvpush.report.breakdown import SEGMENTS
from kvpush.report.percentiles import percentile

# Targets of the push-vs-pull study on this machine.
TARGET_TTFT_RATIO_AT_HIGH_LOAD = 1.5  # against the better upstream mode
TARGET_CPU_RATIO = 0.8  # engine CPU per request, kvpush over upstream push, on P and on D
TARGET_HANDOFF_OVERHEAD_MS = 5.0
# The hand-off kvpush owns (prefill end → WRITE posted → KV landed → D's first step starts), p50, at these points.
TARGET_OWNED_HANDOFF_MS = 2.0
OWNED_HANDOFF_INPUT_LEN = 256
OWNED_HANDOFF_MAX_QPS = 4.0
# The threads only kvpush's engines run (the thread part of "process/thread"): its own, and gRPC's event engine, which
# upstream's engines do not load. The CPU target's bound takes them out of kvpush's engines.
KVPUSH_THREAD_PREFIXES = ("kvpush-", "event_engine")
# Of those, the threads that only tracing runs: the connector's span builder and the span exporter (kvpush.telemetry).
TRACING_THREAD_PREFIXES = ("kvpush-spans-", "kvpush-otel-exp")


def write_json(path: Path, document: dict[str, Any]) -> None:
    path.write_text(json.dumps(document, indent=1, default=str), encoding="utf-8")


def load_results(results_dir: Path) -> list[dict[str, Any]]:
    documents = []
    for path in sorted(results_dir.glob("*_qps*_in*_out*_iter*.json")):
        documents.append(json.loads(path.read_text()))
    return documents


def pooled(documents: Sequence[dict[str, Any]], key: str) -> float | None:
    """p50 over every request of the documents' runs (iterations pooled)."""
    values = [r[key] for d in documents for r in d["requests"] if r[key] is not None and not r["error"]]
    return percentile(values, 50) if values else None


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def _fmt(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def point_table(documents: Sequence[dict[str, Any]], modes: Sequence[str]) -> list[dict[str, Any]]:
    """One row per (input, output, QPS): pooled p50s per mode, per-iteration p50s, ratios and checks."""
    groups: dict[tuple[int, int, float], dict[str, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for d in documents:
        p = d["point"]
        groups[(p["input_len"], p["output_len"], p["qps"])][d["mode"]].append(d)
    rows = []
    for (input_len, output_len, qps), by_mode in sorted(groups.items()):
        row: dict[str, Any] = {"input_len": input_len, "output_len": output_len, "qps": qps, "modes": {}}
        for mode in modes:
            runs = [d for d in by_mode.get(mode, []) if "summary" in d]
            skipped = [d["skipped"] for d in by_mode.get(mode, []) if "skipped" in d]
            row["modes"][mode] = {
                "runs": len(runs),
                "skipped": skipped[:1],
                "ttft_p50_ms": pooled(runs, "ttft_ms"),
                "tpot_p50_ms": pooled(runs, "tpot_ms"),
                "ttft_p50_per_iteration": [d["summary"]["ttft_ms"]["p50"] for d in runs],
                "tpot_p50_per_iteration": [d["summary"]["tpot_ms"]["p50"] for d in runs],
                "sustained": bool(runs) and all(d["summary"]["sustained"] for d in runs),
                "correct": bool(runs) and all(d["summary"]["correctness"]["ok"] for d in runs),
                "kv_ok": bool(runs) and all(d["summary"]["kv_bytes"]["ok"] for d in runs),
                "failed_requests": sum(d["summary"]["failed"] for d in runs),
            }
            if mode == "kvpush" and runs:
                for name in ("handoff_overhead", "owned_handoff"):
                    row["modes"][mode][f"{name}_p50_ms_per_iteration"] = [
                        d["summary"]["breakdown"]["rows"].get(name, {}).get("p50") for d in runs if "breakdown" in d["summary"]]
        kv = row["modes"].get("kvpush", {})
        upstream = [row["modes"][m]["ttft_p50_ms"] for m in ("upstream-push", "pull") if m in row["modes"] and row["modes"][m]["ttft_p50_ms"] is not None]
        best_upstream = min(upstream) if upstream else None
        row["best_upstream_ttft_p50_ms"] = best_upstream
        row["ttft_ratio_best_upstream_over_kvpush"] = ratio(best_upstream, kv.get("ttft_p50_ms"))
        row["tpot_ratio_kvpush_over_upstream_push"] = ratio(kv.get("tpot_p50_ms"), row["modes"].get("upstream-push", {}).get("tpot_p50_ms"))
        rows.append(row)
    return rows


def kvpush_breakdown_table(documents: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per point: mean over iterations of each kvpush segment's p50 (ms)."""
    groups: dict[tuple[int, int, float], list[dict[str, Any]]] = defaultdict(list)
    for d in documents:
        if d["mode"] == "kvpush" and "breakdown" in d.get("summary", {}):
            p = d["point"]
            groups[(p["input_len"], p["output_len"], p["qps"])].append(d["summary"]["breakdown"]["rows"])
    table = []
    names = [s.name for s in SEGMENTS] + ["ttft", "handoff_overhead"]
    for (input_len, output_len, qps), runs in sorted(groups.items()):
        cells = {}
        for name in names:
            values = [r[name]["p50"] for r in runs if r.get(name, {}).get("p50") is not None]
            cells[name] = sum(values) / len(values) if values else None
        table.append({"input_len": input_len, "output_len": output_len, "qps": qps, "segments_p50_ms": cells})
    return table


def measured_kv_bytes(kv: dict[str, Any]) -> float | None:
    """Bytes a run moved per request: upstream's NIXL metric per request; kvpush's broker figure when every transfer wrote the same."""
    if "bytes_per_request" in kv:
        return kv["bytes_per_request"]
    values = kv.get("distinct_values") or []
    return values[0] if len(values) == 1 else None


def upstream_side_table(documents: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per point and mode: router P leg, TTFT after the P leg, engine queue/prefill means (ms; mean over iterations)."""
    groups: dict[tuple[int, int, float, str], list[dict[str, Any]]] = defaultdict(list)
    iterations: dict[tuple[int, int, float, str], list[int]] = defaultdict(list)
    for d in sorted(documents, key=lambda d: d["point"]["iteration"]):
        if "summary" in d:
            p = d["point"]
            groups[(p["input_len"], p["output_len"], p["qps"], d["mode"])].append(d["summary"])
            iterations[(p["input_len"], p["output_len"], p["qps"], d["mode"])].append(p["iteration"])

    def mean(values: Iterable[float | None]) -> float | None:
        present = [v for v in values if v is not None]
        return sum(present) / len(present) if present else None

    table = []
    for (input_len, output_len, qps, mode), runs in sorted(groups.items()):
        table.append({
            "input_len": input_len, "output_len": output_len, "qps": qps, "mode": mode,
            "p_leg_p50_ms": mean(r["router"]["p_leg_ms"]["p50"] for r in runs),
            "after_p_leg_p50_ms": mean(r["router"]["after_p_leg_ms"]["p50"] for r in runs),
            "p_queue_mean_ms": mean(r["engines"]["P"]["queue_s"] for r in runs),
            "p_prefill_mean_ms": mean(r["engines"]["P"]["prefill_s"] for r in runs),
            "d_queue_mean_ms": mean(r["engines"]["D"]["queue_s"] for r in runs),
            "d_prefill_mean_ms": mean(r["engines"]["D"]["prefill_s"] for r in runs),
            "kv_bytes_per_request": mean(measured_kv_bytes(r["kv_bytes"]) for r in runs),
            "cores_p": mean(r["cores_used"][mode]["P"] for r in runs),
            "cores_d": mean(r["cores_used"][mode]["D"] for r in runs),
            "cores_other_stacks": mean(sum(sum(parts.values()) for m, parts in r["cores_used"].items() if m != mode) for r in runs),
            "cpu_ms_per_request_p": mean(r.get("cpu_ms_per_request", {}).get("P") for r in runs),
            "cpu_ms_per_request_d": mean(r.get("cpu_ms_per_request", {}).get("D") for r in runs),
            "cpu_ms_per_request_router": mean(r.get("cpu_ms_per_request", {}).get("router") for r in runs),
            "cpu_ms_per_request_control_plane": mean(r.get("cpu_ms_per_request", {}).get("control_plane") for r in runs),
            "cpu_ms_per_request_per_iteration": {part: [r.get("cpu_ms_per_request", {}).get(part) for r in runs] for part in ("P", "D")},
            "iterations": iterations[(input_len, output_len, qps, mode)],  # which iteration each per-iteration entry is (a skipped run leaves a gap)
            "runs": len(runs),
            "thread_cpu_ms_per_request": per_thread(runs),
            "thread_runqueue_wait_ms_per_request": per_thread(runs, "thread_runqueue_wait_ms_per_request"),
        })
    return table


def per_thread(runs: Sequence[dict[str, Any]], field: str = "thread_cpu_ms_per_request") -> dict[str, dict[str, list[float]]]:
    """{engine: {process/thread: ms per request of each iteration}} of a per-thread field (CPU, or runqueue wait), where a thread had any."""
    threads: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in runs:
        for engine, used in r.get(field, {}).items():
            for thread, ms in used.items():
                threads[engine][thread].append(ms)
    return {engine: dict(used) for engine, used in threads.items()}


def targets(rows: Sequence[dict[str, Any]], modes: Sequence[str], side: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
    """The targets, judged on the pooled p50s of this one results directory; with the outside view (side), the TTFT ratio's bounds."""
    verdict: dict[str, Any] = {}
    if not {"kvpush", "upstream-push", "pull"} <= set(modes):
        return {"note": "targets need all three modes"}
    below_both = [r for r in rows if all(r["modes"][m]["ttft_p50_ms"] is not None for m in ("kvpush", "upstream-push", "pull"))]
    misses = [r for r in below_both if not r["modes"]["kvpush"]["ttft_p50_ms"] < min(r["modes"]["upstream-push"]["ttft_p50_ms"], r["modes"]["pull"]["ttft_p50_ms"])]
    verdict["ttft_below_both_everywhere"] = {"met": not misses and bool(below_both), "points": len(below_both),
                                              "missed_at": [(r["input_len"], r["output_len"], r["qps"]) for r in misses]}
    high = []
    for key in sorted({(r["input_len"], r["output_len"]) for r in rows}):
        series = [r for r in rows if (r["input_len"], r["output_len"]) == key]
        all_keep_up = [r for r in series if all(r["modes"][m]["sustained"] for m in ("kvpush", "upstream-push", "pull"))]
        top = max(all_keep_up, key=lambda r: r["qps"]) if all_keep_up else None
        highest = max(series, key=lambda r: r["qps"])
        high.append({
            "input_len": key[0], "output_len": key[1],
            "highest_qps_all_modes_keep_up": top["qps"] if top else None,
            "ratio_there": top["ttft_ratio_best_upstream_over_kvpush"] if top else None,
            "highest_qps": highest["qps"],
            "ratio_at_highest_qps": highest["ttft_ratio_best_upstream_over_kvpush"],
            **(ttft_ratio_bounds(top, side) if top else {}),
        })
    verdict["ttft_ratio_at_high_load"] = {
        "target": TARGET_TTFT_RATIO_AT_HIGH_LOAD,
        "met": all(h["ratio_there"] is not None and h["ratio_there"] >= TARGET_TTFT_RATIO_AT_HIGH_LOAD for h in high) and bool(high),
        "per_series": high,
    }
    tpot = [r for r in rows if r["tpot_ratio_kvpush_over_upstream_push"] is not None]
    worse = [r for r in tpot if r["tpot_ratio_kvpush_over_upstream_push"] > 1.0]
    verdict["tpot_no_worse_than_upstream_push"] = {"met": not worse and bool(tpot), "points": len(tpot),
                                                   "worse_at": [(r["input_len"], r["output_len"], r["qps"], round(r["tpot_ratio_kvpush_over_upstream_push"], 3)) for r in worse]}
    overheads = [(r, v) for r in rows for v in r["modes"]["kvpush"].get("handoff_overhead_p50_ms_per_iteration", []) if v is not None]
    over = sorted({(r["input_len"], r["output_len"], r["qps"]) for r, v in overheads if v > TARGET_HANDOFF_OVERHEAD_MS})
    verdict["handoff_overhead_p50"] = {"target_ms": TARGET_HANDOFF_OVERHEAD_MS, "met": not over and bool(overheads), "runs": len(overheads),
                                       "above_target_at": over}
    judged = [(r, v) for r in rows if r["input_len"] == OWNED_HANDOFF_INPUT_LEN and r["qps"] <= OWNED_HANDOFF_MAX_QPS
              for v in r["modes"]["kvpush"].get("owned_handoff_p50_ms_per_iteration", []) if v is not None]
    verdict["owned_handoff_p50"] = {
        "target_ms": TARGET_OWNED_HANDOFF_MS, "input_len": OWNED_HANDOFF_INPUT_LEN, "max_qps": OWNED_HANDOFF_MAX_QPS,
        "met": bool(judged) and all(v <= TARGET_OWNED_HANDOFF_MS for _, v in judged),
        "per_run": [(r["input_len"], r["output_len"], r["qps"], round(v, 2)) for r, v in judged],
    }
    return verdict


def ttft_ratio_bounds(row: dict[str, Any], side: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """How high the TTFT ratio at this point could go: with kvpush's P leg (router → P's answer) the shortest any mode had, and with
    only one decode step (kvpush's TPOT p50) after it.

    kvpush's P does a request's prefill plus its WRITE; no mode's P does less than the prefill, so the shortest P leg of the modes is
    a floor for kvpush's (at saturation it is P's queue and prefill), and the first token still needs D's forward after it.
    """
    legs = {s["mode"]: s for s in side if (s["input_len"], s["output_len"], s["qps"]) == (row["input_len"], row["output_len"], row["qps"])}
    best = row.get("best_upstream_ttft_p50_ms")
    timed = {mode: s["p_leg_p50_ms"] for mode, s in legs.items() if s["p_leg_p50_ms"] is not None}
    after = legs.get("kvpush", {}).get("after_p_leg_p50_ms")
    step = row["modes"]["kvpush"].get("tpot_p50_ms")
    if best is None or not timed or after is None or step is None:
        return {}
    shortest_mode = min(timed, key=timed.get)
    shortest = timed[shortest_mode]
    return {"shortest_p_leg_ms": shortest, "shortest_p_leg_mode": shortest_mode, "kvpush_after_p_leg_ms": after,
            "kvpush_tpot_ms": step, "bound_with_shortest_p_leg": ratio(best, shortest + after),
            "bound_with_one_decode_step_after_it": ratio(best, shortest + step)}


def kvpush_thread_cpu_ms(kv: dict[str, Any], engine: str, prefixes: tuple[str, ...] = KVPUSH_THREAD_PREFIXES) -> float | None:
    """ms per request of the threads only kvpush's engines run (or those of `prefixes`), mean over the runs (a run lists a
    thread only if it had at least THREAD_FLOOR_MS per request)."""
    threads = kv.get("thread_cpu_ms_per_request", {}).get(engine)
    if not threads or not kv.get("runs"):
        return None
    return sum(sum(ms) for name, ms in threads.items() if name.partition("/")[2].startswith(prefixes)) / kv["runs"]


def by_iteration(side_row: dict[str, Any], engine: str) -> dict[int, float | None]:
    """A side row's CPU per request of one engine, keyed by iteration: two modes' runs pair by iteration, whichever were skipped."""
    values = side_row.get("cpu_ms_per_request_per_iteration", {}).get(engine, [])
    return dict(zip(side_row.get("iterations", range(1, len(values) + 1)), values))


def cpu_verdict(side: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Engine CPU per request, kvpush over upstream push, for P and D at every point both ran."""
    by_point: dict[tuple[int, int, float], dict[str, dict[str, Any]]] = defaultdict(dict)
    for s in side:
        by_point[(s["input_len"], s["output_len"], s["qps"])][s["mode"]] = s
    ratios = []
    for point, modes in sorted(by_point.items()):
        kv, up = modes.get("kvpush"), modes.get("upstream-push")
        if kv is None or up is None:
            continue
        entry: dict[str, Any] = {"point": point}
        for e in ("p", "d"):
            used, baseline = kv[f"cpu_ms_per_request_{e}"], up[f"cpu_ms_per_request_{e}"]
            own = kvpush_thread_cpu_ms(kv, e.upper())
            entry[e] = used / baseline if used is not None and baseline else None
            # The bound: kvpush's engines with its own threads costing nothing, i.e. vLLM's work in them against upstream push's.
            entry[f"{e}_without_kvpush_threads"] = (used - own) / baseline if entry[e] is not None and own is not None else None
            entry[f"{e}_tracing_threads_ms"] = kvpush_thread_cpu_ms(kv, e.upper(), TRACING_THREAD_PREFIXES)
            used_by, baseline_by = (by_iteration(modes, e.upper()) for modes in (kv, up))
            entry[f"{e}_per_iteration"] = [
                used_by[i] / baseline_by[i] if used_by.get(i) is not None and baseline_by.get(i) else None for i in sorted(used_by.keys() | baseline_by.keys())]
        ratios.append(entry)
    judged = [r for r in ratios if r["p"] is not None and r["d"] is not None]
    return {"target": TARGET_CPU_RATIO, "met": bool(judged) and all(r["p"] <= TARGET_CPU_RATIO and r["d"] <= TARGET_CPU_RATIO for r in judged),
            "ratios": ratios}


def render_table(headers: Sequence[str], rows: Sequence[Sequence[str]], markdown: bool) -> str:
    """Right-aligned text columns, or a Markdown table."""
    if markdown:
        lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---:" for _ in headers) + "|"]
        return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])
    widths = [max(len(h), *(len(row[i]) for row in rows)) + 2 for i, h in enumerate(headers)]
    return "\n".join("".join(cell.rjust(w) for cell, w in zip(line, widths)) for line in [headers, *rows])


def report_tables(documents: Sequence[dict[str, Any]], modes: Sequence[str], markdown: bool) -> tuple[str, dict[str, Any]]:
    """The report as text (or Markdown) and the figures behind it (written to summary.json)."""
    rows = point_table(documents, modes)
    out = ["TTFT / TPOT p50 (ms; the requests of all iterations pooled). ratio = better upstream TTFT / kvpush TTFT; "
           "TPOT kv/up = kvpush TPOT / upstream-push TPOT; * = did not keep up with the offered load; ! = correctness or KV-bytes check failed",
           ""]
    headers = ["in", "out", "QPS"] + [f"{m} {k}" for m in modes for k in ("TTFT", "TPOT")] + ["ratio", "TPOT kv/up"]
    cells = []
    for r in rows:
        line = [str(r["input_len"]), str(r["output_len"]), f"{r['qps']:g}"]
        for m in modes:
            c = r["modes"][m]
            flag = ("" if c["sustained"] else "*") + ("" if c["correct"] and c["kv_ok"] else "!")
            line += [_fmt(c["ttft_p50_ms"]) + flag if c["runs"] else "skipped", _fmt(c["tpot_p50_ms"], 2)]
        line += [_fmt(r["ttft_ratio_best_upstream_over_kvpush"], 2), _fmt(r["tpot_ratio_kvpush_over_upstream_push"], 2)]
        cells.append(line)
    out.append(render_table(headers, cells, markdown))
    breakdown_rows = kvpush_breakdown_table(documents)
    if breakdown_rows:
        names = [s.name for s in SEGMENTS] + ["ttft", "handoff_overhead"]
        out += ["", "kvpush TTFT breakdown from its spans: p50 per segment (ms; mean of the iterations' p50s). Router-side TTFT; "
                "handoff_overhead = TTFT - P prefill - D first decode step", ""]
        out.append(render_table(["in", "out", "QPS", *names],
                                [[str(b["input_len"]), str(b["output_len"]), f"{b['qps']:g}", *(_fmt(b["segments_p50_ms"][n], 2) for n in names)]
                                 for b in breakdown_rows], markdown))
    side = upstream_side_table(documents)
    out += ["", "Every mode from outside the engines (ms; mean over iterations): router P leg p50 (router send -> P's answer), "
            "TTFT after the P leg p50, vLLM's queue/prefill histogram means per engine, KV bytes per request, "
            "cores used during the run by this mode's P and D and by the other stacks' processes, CPU per request of "
            "this mode's P, D, router and control plane (kvpush's only)", ""]
    out.append(render_table(
        ["in", "out", "QPS", "mode", "P leg", "TTFT after P leg", "P queue", "P prefill", "D queue", "D prefill", "KV B/req", "P cores", "D cores",
         "other stacks cores", "P CPU ms/req", "D CPU ms/req", "router CPU ms/req", "control plane CPU ms/req"],
        [[str(s["input_len"]), str(s["output_len"]), f"{s['qps']:g}", s["mode"], _fmt(s["p_leg_p50_ms"]), _fmt(s["after_p_leg_p50_ms"]),
          _fmt(s["p_queue_mean_ms"]), _fmt(s["p_prefill_mean_ms"]), _fmt(s["d_queue_mean_ms"]), _fmt(s["d_prefill_mean_ms"]),
          _fmt(s["kv_bytes_per_request"], 0), _fmt(s["cores_p"], 2), _fmt(s["cores_d"], 2), _fmt(s["cores_other_stacks"], 3),
          _fmt(s["cpu_ms_per_request_p"]), _fmt(s["cpu_ms_per_request_d"]), _fmt(s["cpu_ms_per_request_router"]),
          _fmt(s["cpu_ms_per_request_control_plane"])] for s in side],
        markdown))
    verdict = targets(rows, modes, side)
    verdict["engine_cpu_per_request"] = cpu_verdict(side)
    out += ["", *verdict_lines(verdict)]
    correctness = {m: all(r["modes"][m]["correct"] for r in rows if r["modes"][m]["runs"]) for m in modes}
    kv_ok = {m: all(r["modes"][m]["kv_ok"] for r in rows if r["modes"][m]["runs"]) for m in modes}
    out.append(f"correctness vs the single engine (every run): {correctness}; KV bytes as expected (every run): {kv_ok}")
    figures = {"points": rows, "kvpush_breakdown": breakdown_rows, "outside_view": side, "targets": verdict, "correctness": correctness,
               "kv_bytes_ok": kv_ok}
    return "\n".join(out), figures


def _iterations(values: Sequence[float | None] | None) -> str:
    return " / ".join(_fmt(v, 2) for v in values or ())


def cpu_verdict_lines(verdict: dict[str, Any]) -> list[str]:
    """The engine-CPU target as sentences (it needs only kvpush and upstream push)."""
    cpu = verdict.get("engine_cpu_per_request")
    if cpu is None:
        return []
    met = "met" if cpu["met"] else "NOT met"
    return [
        f"target: engine CPU per request, kvpush <= {cpu['target']}x upstream push's on P and D: {met} "
        f"(kvpush/upstream-push (in, out, QPS): P, D (per iteration): "
        + "; ".join(f"{r['point']}: {_fmt(r['p'], 2)} ({_iterations(r.get('p_per_iteration'))}), {_fmt(r['d'], 2)} ({_iterations(r.get('d_per_iteration'))})"
                    for r in cpu["ratios"]) + ")",
        "  bound: the same with kvpush's own threads (kvpush-*, gRPC's event_engine) costing nothing: "
        + "; ".join(f"{r['point']}: {_fmt(r.get('p_without_kvpush_threads'), 2)}, {_fmt(r.get('d_without_kvpush_threads'), 2)}" for r in cpu["ratios"]),
        f"  of kvpush's own threads, tracing's (kvpush-spans-*, kvpush-otel-exp; a thread under {THREAD_FLOOR_MS:g} ms per request is not counted), "
        "ms per request, P, D: "
        + "; ".join(f"{r['point']}: {_fmt(r.get('p_tracing_threads_ms'), 2)}, {_fmt(r.get('d_tracing_threads_ms'), 2)}" for r in cpu["ratios"]),
    ]


def verdict_lines(verdict: dict[str, Any]) -> list[str]:
    """The targets as sentences."""
    if "note" in verdict:
        return [f"targets: {verdict['note']}", *cpu_verdict_lines(verdict)]

    def met(ok: bool) -> str:
        return "met" if ok else "NOT met"

    below = verdict["ttft_below_both_everywhere"]
    lines = [f"target: kvpush p50 TTFT below both upstream modes at every point: {met(below['met'])} "
             f"({below['points'] - len(below['missed_at'])} of {below['points']} points; missed at (in, out, QPS) {below['missed_at']})"]
    high = verdict["ttft_ratio_at_high_load"]
    lines.append(f"target: >= {high['target']}x better than the better upstream mode at the highest load all modes keep up with: {met(high['met'])}")
    for h in high["per_series"]:
        lines.append(f"  in {h['input_len']} out {h['output_len']}: highest QPS all modes keep up {h['highest_qps_all_modes_keep_up']}, ratio "
                     f"{_fmt(h['ratio_there'], 2)}; at the grid's highest QPS {h['highest_qps']:g}: {_fmt(h['ratio_at_highest_qps'], 2)}")
        if "bound_with_shortest_p_leg" in h:
            lines.append(f"    bound there: {_fmt(h['bound_with_shortest_p_leg'], 2)} with kvpush's P leg at the shortest any mode had "
                         f"({h['shortest_p_leg_mode']}, {_fmt(h['shortest_p_leg_ms'])} ms) and its {_fmt(h['kvpush_after_p_leg_ms'])} ms after it; "
                         f"{_fmt(h['bound_with_one_decode_step_after_it'], 2)} with only one decode step ({_fmt(h['kvpush_tpot_ms'])} ms) after it")
    tpot = verdict["tpot_no_worse_than_upstream_push"]
    lines.append(f"target: kvpush TPOT p50 no worse than upstream push's anywhere: {met(tpot['met'])} "
                 f"(worse at {len(tpot['worse_at'])} of {tpot['points']} points; (in, out, QPS, ratio): {tpot['worse_at']})")
    lines += cpu_verdict_lines(verdict)
    overhead = verdict["handoff_overhead_p50"]
    lines.append(f"target: kvpush hand-off overhead p50 <= {overhead['target_ms']} ms: {met(overhead['met'])} "
                 f"(above it in {len(overhead['above_target_at'])} points of {overhead['runs']} runs' p50s)")
    owned = verdict["owned_handoff_p50"]
    lines.append(f"target: the hand-off kvpush owns (prefill end -> D's first decode step starts) p50 <= {owned['target_ms']} ms at "
                 f"{owned['input_len']} tokens, QPS <= {owned['max_qps']:g}: {met(owned['met'])} "
                 f"(per run (in, out, QPS, ms): {owned['per_run'] or 'no such run'})")
    return lines


def report(results_dir: Path, modes: Sequence[str], markdown: Path | None = None) -> int:
    """Prints the tables and the targets; writes summary.json, points.json (the tables' figures) and, when asked, the tables as Markdown."""
    documents = load_results(results_dir)
    if not documents:
        print(f"no results in {results_dir}", file=sys.stderr)
        return 1
    modes = [m for m in modes if any(d["mode"] == m for d in documents)]
    text, figures = report_tables(documents, modes, markdown=False)
    print("\n" + text)
    if markdown is not None:
        markdown.write_text(report_tables(documents, modes, markdown=True)[0] + "\n", encoding="utf-8")
    summaries = [{k: v for k, v in d.items() if k != "requests"} for d in documents]
    for s in summaries:
        if "summary" in s:
            s["summary"] = dict(s["summary"], correctness={k: v for k, v in s["summary"]["correctness"].items() if k != "outcomes"})
    write_json(results_dir / "summary.json", {**figures, "runs": summaries})
    # The tables' figures alone, rounded: small enough to keep beside the docs.
    write_json(results_dir / "points.json", rounded(figures))
    return 0


def rounded(value: Any, digits: int = 2) -> Any:
    """`value` with every float rounded to `digits` decimals (dicts, lists and tuples walked)."""
    if isinstance(value, float):
        return round(value, digits)
    if isinstance(value, dict):
        return {k: rounded(v, digits) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [rounded(v, digits) for v in value]
    return value


