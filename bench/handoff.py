# SPDX-License-Identifier: Apache-2.0
"""The hand-off kvpush owns: prefill end → WRITE posted → KV landed at D → D scheduled.

Runs a real local stack (control plane, one P and one D vLLM CPU engine with
kvpush, P pinned to core 0 and D to core 1, no router) per order mode: early
orders (the broker forwards each registration to P as soon as it arrives and
P matches locally) and broker-matched orders (P reports prefill-done and waits
for the broker's order). For every transfer it reads P's and D's spans and
takes, on one clock, the instants

    prefill end     p.prefill end (the forward that completed the prompt)
    WRITE posted    p.write_post end
    KV landed       d.wait_for_kv end (D's transfer thread counted the last notification)
    D scheduled     d.first_decode_step start (D's first decode step is scheduled)

under open-loop load at each `--qps` (requests evenly spaced), and prints p50/p99
of each segment beside two targets: prefill end → WRITE posted ≤ 1 ms and
prefill end → D scheduled ≤ 2 ms (p50).

    python -m bench.handoff --requests 40 --qps 1,4 --prompt-tokens 256

With `--profile DIR` every process of P and D that runs kvpush threads (the
worker and the engine core) is sampled by py-spy during each load (100 Hz,
non-blocking, `--gil`: a sample counts only for the thread holding the GIL),
and each thread's GIL time per transfer is printed with the frames where
kvpush's threads hold it. Threads that wait, and native threads such as
NIXL's progress thread, hold no GIL and so cost the engine's Python nothing
here; their CPU is in `/proc` (the sweep's per-thread table).
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.pyspy import MISSING as PYSPY_MISSING
from bench.pyspy import RATE_HZ, pyspy_binary, start_profilers, stop_profilers
from kvpush.dev.localstack.prompts import prompt_token_ids
from kvpush.dev.localstack.stack import Stack, StackSpec
from kvpush.dev.localstack.transfers import dispatch
from kvpush.dev.tinymodel import build_tiny_model, default_model_dir
from kvpush.processes import thread_cpu_seconds
from kvpush.report.percentiles import percentile
from kvpush.telemetry import read_spans

TARGET_POSTED_P50_MS = 1.0
TARGET_SCHEDULED_P50_MS = 2.0
NEEDED_SPANS = ("p.prefill", "p.descriptor_prep", "p.write_post", "p.write_transfer", "d.wait_for_kv", "d.first_decode_step")
SPANS_TIMEOUT_S = 10.0
# (name, from, to): each an (span, "start"|"end") instant; the first four add up to `scheduled`.
SEGMENTS = (
    ("until_matched", ("p.prefill", "end"), ("p.descriptor_prep", "start")),
    ("descriptor_prep", ("p.descriptor_prep", "start"), ("p.descriptor_prep", "end")),
    ("write_post", ("p.descriptor_prep", "end"), ("p.write_post", "end")),
    ("write_transfer", ("p.write_post", "end"), ("d.wait_for_kv", "end")),
    ("d_wait_tail", ("d.wait_for_kv", "end"), ("d.first_decode_step", "start")),
    ("posted", ("p.prefill", "end"), ("p.write_post", "end")),
    ("p_saw_done", ("p.write_post", "end"), ("p.write_transfer", "end")),  # beside the chain: P's poll saw the WRITE complete
    ("scheduled", ("p.prefill", "end"), ("d.first_decode_step", "start")),
    # Beside the chain: P's prefill (first scheduled -> its forward's end), where work moved into the forward would show.
    ("prefill", ("p.prefill", "start"), ("p.prefill", "end")),
)


def spans_by_transfer(traces: Path) -> dict[str, dict[str, dict]]:
    by_transfer: dict[str, dict[str, dict]] = {}
    for span in read_spans(traces) if traces.exists() else []:
        tid = span["attributes"].get("kvpush.transfer_id")
        if tid:
            by_transfer.setdefault(tid, {})[span["name"]] = span
    return by_transfer


def segment_samples(named: dict[str, dict]) -> dict[str, float]:
    return {name: (named[to[0]][f"{to[1]}_ns"] - named[frm[0]][f"{frm[1]}_ns"]) / 1e6 for name, frm, to in SEGMENTS}


def runs_kvpush_threads(pid: int) -> bool:
    """Whether a process has a thread kvpush named (kvpush.processes.name_os_thread)."""
    return any(key.split("/", 1)[1].startswith("kvpush") for key in thread_cpu_seconds([pid]))


def profile_summary(out: Path, label: str, transfers: int) -> dict:
    """GIL ms per transfer by (engine, process, thread), and the top frames of kvpush's threads."""
    per_thread: dict[str, float] = collections.Counter()
    frames: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for path in sorted(out.glob(f"{label}-*.txt")):
        role, pid = path.stem.split("-")[-2:]
        for line in path.read_text().splitlines():
            stack, _, count = line.rpartition(" ")
            if not stack or not count.isdigit():
                continue
            thread, *calls = stack.split(";")
            name = thread.split(": ", 1)[-1]
            key = f"{role} {pid} {name}"
            per_thread[key] += int(count)
            if name.startswith("kvpush") and calls:
                frames[key][calls[-1]] += int(count)
    ms_per_sample = 1000 / RATE_HZ
    return {
        "transfers": transfers,
        "gil_ms_per_transfer": {k: v * ms_per_sample / max(transfers, 1) for k, v in per_thread.most_common()},
        "kvpush_top_frames_ms_per_transfer": {k: {f: n * ms_per_sample / max(transfers, 1) for f, n in c.most_common(5)} for k, c in frames.items()},
    }


def print_profile(label: str, summary: dict) -> None:
    print(f"\npy-spy --gil, {label}: ms holding the GIL per transfer ({summary['transfers']} transfers; {1000 / RATE_HZ:g} ms per sample)")
    for key, ms in summary["gil_ms_per_transfer"].items():
        if ms >= 0.05:
            print(f"  {key:<60}{ms:>9.2f}")
    for key, top in summary["kvpush_top_frames_ms_per_transfer"].items():
        print(f"  top frames of {key}:")
        for frame, ms in top.items():
            print(f"    {ms:>7.2f}  {frame}")


def run_load(stack: Stack, qps: float, args) -> tuple[list[str], int, float]:
    """Open loop: `args.requests` transfers sent `1/qps` apart, each on its own thread; (measured ids, failures, seconds)."""
    prefill, decode = stack.prefill, stack.decode
    measured: list[str] = []
    failures = [0]
    lock = threading.Lock()

    def one(i: int) -> None:
        result = dispatch(prefill.url, "prefill-0", decode.url, "decode-0", prompt_token_ids(args.prompt_tokens, seed=int(qps * 1000) * 1000 + i),
                          args.output_tokens)
        with lock:
            if isinstance(result.decode, Exception) or isinstance(result.prefill, Exception):
                failures[0] += 1
            else:
                measured.append(result.transfer_id)

    t0 = time.monotonic()
    threads = []
    for i in range(args.requests):
        time.sleep(max(0.0, t0 + i / qps - time.monotonic()))
        thread = threading.Thread(target=one, args=(i,))
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join(timeout=600)
    return measured, failures[0], time.monotonic() - t0


def run_orders(work: Path, model_dir: Path, early_orders: bool, args) -> list[dict]:
    traces = work / "traces.jsonl"
    spec = StackSpec(mode="kvpush", prefill_cpus="0", decode_cpus="1", traces_file=traces, router=False,
                     kvpush_extra=args.kvpush_extra, prefill_extra={"early_orders": early_orders})
    orders = "early" if early_orders else "broker"
    print(f"[{orders}] starting P and D ...", flush=True)
    results = []
    with Stack(spec, model_dir, work) as stack:
        stack.start()
        for i in range(3):  # warm-up: first requests pay one-time costs
            dispatch(stack.prefill.url, "prefill-0", stack.decode.url, "decode-0", prompt_token_ids(args.prompt_tokens, seed=10_000 + i), 2)
        for qps in args.qps:
            label = f"{orders}-qps{qps:g}"
            profilers = start_profilers(stack, args.profile, label, gil=True, only=runs_kvpush_threads) if args.profile else []
            measured, failures, elapsed = run_load(stack, qps, args)
            stop_profilers(profilers)
            # Read the spans while the engines still run: spans in an engine's
            # export batch when it is stopped would be lost.
            deadline = time.monotonic() + SPANS_TIMEOUT_S
            while True:
                by_transfer = spans_by_transfer(traces)
                if all(all(n in by_transfer.get(tid, {}) for n in NEEDED_SPANS) for tid in measured) or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            samples: dict[str, list[float]] = {name: [] for name, _, _ in SEGMENTS}
            for tid in measured:
                named = by_transfer.get(tid, {})
                if all(n in named for n in NEEDED_SPANS):
                    for name, value in segment_samples(named).items():
                        samples[name].append(value)
            row = {"orders": orders, "qps": qps, "requests": len(measured), "failures": failures,
                   "requests_per_s": len(measured) / elapsed, "samples": len(samples["scheduled"])}
            for name, values in samples.items():
                row[f"{name}_p50_ms"] = statistics.median(values) if values else None
                row[f"{name}_p99_ms"] = percentile(values, 99) if values else None
            print(f"[{orders}] QPS {qps:g}: {len(measured)} transfers, {row['samples']} with every span", flush=True)
            if args.profile:
                row["profile"] = profile_summary(args.profile, label, len(measured))
                print_profile(label, row["profile"])
            results.append(row)
    return results


def qps_list(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"--qps needs positive numbers separated by commas, not {text!r}")
    return values


def orders_list(text: str) -> list[str]:
    values = [v.strip() for v in text.split(",") if v.strip()]
    if not values or set(values) - {"early", "broker"}:
        raise argparse.ArgumentTypeError(f"--orders takes early and/or broker separated by commas, not {text!r}")
    return values


def json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"--kvpush-extra is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("--kvpush-extra must be a JSON object")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=40, help="transfers measured per QPS")
    parser.add_argument("--qps", type=qps_list, default=[1.0, 4.0], help="offered loads, open loop, one run each (e.g. 1,4)")
    parser.add_argument("--orders", type=orders_list, default=["broker", "early"], help="order modes to run: early,broker")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--output-tokens", type=int, default=4)
    parser.add_argument("--kvpush-extra", type=json_object, default={}, help="kv_connector_extra_config of both engines, JSON")
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    parser.add_argument("--profile", type=Path, help="sample P's and D's processes with py-spy into this folder during each load")
    args = parser.parse_args(argv)
    if args.profile and pyspy_binary() is None:
        parser.error(f"--profile {PYSPY_MISSING}")
    model_dir = build_tiny_model(default_model_dir())
    results = []
    with tempfile.TemporaryDirectory(prefix="kvpush-handoff-") as tmp:
        for orders in args.orders:
            results += run_orders(Path(tmp) / orders, model_dir, orders == "early", args)
    print(f"\nhand-off, {args.prompt_tokens}-token prompts, p50 (p99) ms; targets: prefill end -> WRITE posted <= {TARGET_POSTED_P50_MS} ms,"
          f" prefill end -> D scheduled <= {TARGET_SCHEDULED_P50_MS} ms")
    names = [name for name, _, _ in SEGMENTS]
    print(f"{'orders':<8}{'QPS':>6}{'req/s':>7}{'failed':>7}" + "".join(f"{n:>18}" for n in names) + "   verdict")
    for r in results:
        cells = "".join(f"{r[f'{n}_p50_ms']:>9.3f} ({r[f'{n}_p99_ms']:>6.2f})" if r["samples"] else f"{'-':>18}" for n in names)
        posted_met = r["samples"] and r["posted_p50_ms"] <= TARGET_POSTED_P50_MS
        scheduled_met = r["samples"] and r["scheduled_p50_ms"] <= TARGET_SCHEDULED_P50_MS
        print(f"{r['orders']:<8}{r['qps']:>6g}{r['requests_per_s']:>7.1f}{r['failures']:>7}{cells}"
              f"   posted {'met' if posted_met else 'NOT met'}, scheduled {'met' if scheduled_met else 'NOT met'}")
    if args.out:
        options = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        args.out.write_text(json.dumps({"args": options, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
