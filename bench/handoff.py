# SPDX-License-Identifier: Apache-2.0
"""The control plane's share of TTFT's critical path: prefill done → WRITE posted.

Runs a real local stack (control plane, one P and one D vLLM CPU engine with
kvpush, P pinned to core 0 and D to core 1) twice: with early orders (the
broker forwards each registration to P as soon as it arrives and P matches
locally) and with broker-matched orders (P reports prefill-done and waits for
the broker's order). For every transfer it reads the engines' spans and
takes the time from the end of `p.prefill` (the forward that completed the
prompt; the KV is ready) to the end of `p.write_post` (the WRITE is posted),
under concurrent load, and prints p50/p99 per mode beside the 1 ms p50 target.

    python -m bench.handoff --requests 80 --concurrency 4 --prompt-tokens 256
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from kvpush.localstack.prompts import prompt_token_ids
from kvpush.localstack.stack import Stack, StackSpec
from kvpush.localstack.transfers import dispatch
from kvpush.telemetry import read_spans
from kvpush.tinymodel import build_tiny_model, default_model_dir

TARGET_P50_MS = 1.0
NEEDED_SPANS = ("p.prefill", "p.descriptor_prep", "p.write_post")
SPANS_TIMEOUT_S = 10.0


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def spans_by_transfer(traces: Path) -> dict[str, dict[str, dict]]:
    by_transfer: dict[str, dict[str, dict]] = {}
    for span in read_spans(traces) if traces.exists() else []:
        tid = span["attributes"].get("kvpush.transfer_id")
        if tid:
            by_transfer.setdefault(tid, {})[span["name"]] = span
    return by_transfer


def run_mode(work: Path, model_dir: Path, early_orders: bool, args) -> dict:
    traces = work / "traces.jsonl"
    spec = StackSpec(mode="kvpush", prefill_cpus="0", decode_cpus="1", traces_file=traces, prefill_extra={"early_orders": early_orders},
                     router=False)
    print(f"[{'early' if early_orders else 'broker'}] starting P and D ...", flush=True)
    with Stack(spec, model_dir, work) as stack:
        stack.start()
        prefill, decode = stack.prefill, stack.decode
        for i in range(3):  # warm-up: first requests pay one-time costs
            dispatch(prefill.url, "prefill-0", decode.url, "decode-0", prompt_token_ids(args.prompt_tokens, seed=10_000 + i), 2)
        measured: list[str] = []
        failures: list[str] = []
        lock = threading.Lock()
        counter = iter(range(args.requests))

        def client() -> None:
            for i in counter:
                result = dispatch(prefill.url, "prefill-0", decode.url, "decode-0", prompt_token_ids(args.prompt_tokens, seed=i),
                                  args.output_tokens)
                with lock:
                    (failures if isinstance(result.decode, Exception) else measured).append(result.transfer_id)

        t0 = time.monotonic()
        threads = [threading.Thread(target=client) for _ in range(args.concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=600)
        elapsed = time.monotonic() - t0
        # Read the spans while the engines still run: spans in an engine's
        # export batch when it is stopped would be lost.
        deadline = time.monotonic() + SPANS_TIMEOUT_S
        while True:
            by_transfer = spans_by_transfer(traces)
            if all(all(n in by_transfer.get(tid, {}) for n in NEEDED_SPANS) for tid in measured) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    handoff_ms, wake_ms, prep_ms, post_ms = [], [], [], []
    for tid in measured:
        named = by_transfer.get(tid, {})
        if all(n in named for n in NEEDED_SPANS):
            ready, prep, post = named["p.prefill"]["end_ns"], named["p.descriptor_prep"], named["p.write_post"]
            handoff_ms.append((post["end_ns"] - ready) / 1e6)
            wake_ms.append((prep["start_ns"] - ready) / 1e6)  # until the transfer thread has the source and the order
            prep_ms.append((prep["end_ns"] - prep["start_ns"]) / 1e6)
            post_ms.append((post["end_ns"] - post["start_ns"]) / 1e6)
    return {
        "mode": "early_orders" if early_orders else "broker_orders",
        "requests": len(measured),
        "failures": len(failures),
        "requests_per_s": len(measured) / elapsed,
        "handoff_p50_ms": statistics.median(handoff_ms),
        "handoff_p99_ms": percentile(handoff_ms, 99),
        "handoff_max_ms": max(handoff_ms),
        "samples": len(handoff_ms),
        "match_p50_ms": statistics.median(wake_ms),
        "descriptor_prep_p50_ms": statistics.median(prep_ms),
        "write_post_p50_ms": statistics.median(post_ms),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=80)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--output-tokens", type=int, default=4)
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    args = parser.parse_args(argv)
    model_dir = build_tiny_model(default_model_dir())
    results = []
    with tempfile.TemporaryDirectory(prefix="kvpush-handoff-") as tmp:
        for early in (False, True):
            results.append(run_mode(Path(tmp) / ("early" if early else "broker"), model_dir, early, args))
    print(f"\nprefill done -> WRITE posted, {args.requests} requests x {args.prompt_tokens} tokens, {args.concurrency} in flight")
    print(f"{'mode':<15}{'p50 ms':>9}{'p99 ms':>9}{'max ms':>9}{'req/s':>8}{'failed':>8}   target p50 <= {TARGET_P50_MS} ms"
          "   (p50 of: until matched | descriptor prep | post)")
    for r in results:
        verdict = "met" if r["handoff_p50_ms"] <= TARGET_P50_MS else "NOT met"
        print(f"{r['mode']:<15}{r['handoff_p50_ms']:>9.3f}{r['handoff_p99_ms']:>9.3f}{r['handoff_max_ms']:>9.3f}"
              f"{r['requests_per_s']:>8.1f}{r['failures']:>8}   {verdict:<8}"
              f"   ({r['match_p50_ms']:.3f} | {r['descriptor_prep_p50_ms']:.3f} | {r['write_post_p50_ms']:.3f})")
    before, after = results
    print(f"early orders remove {before['handoff_p50_ms'] - after['handoff_p50_ms']:.3f} ms at p50 "
          f"({before['handoff_p50_ms'] / max(after['handoff_p50_ms'], 1e-9):.1f}x)")
    if args.out:
        args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
