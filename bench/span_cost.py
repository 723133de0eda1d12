# SPDX-License-Identifier: Apache-2.0
"""What the connector's tracing costs an engine per request, at 100 %, 10 % and 0 % sampling.

Drives the connector's real span recorder (kvpush.connector.spans.Spans)
with the segments one request records in P and D (12 spans), under a real
SDK tracer provider with the exporters the engines use (a BatchSpanProcessor
and kvpush's OTLP-JSON file exporter). The router's sampling decision is
reproduced the way `parentbased_traceidratio` makes it (random trace ids,
sampled flag when the id falls under the ratio), so the engines' parent-based
sampler follows it. Printed per request: time on the hot path (the emit calls
on the engine and transfer threads) and all CPU of the process (recording,
building, encoding and writing the spans), with the spread over repetitions.

    python -m bench.span_cost [--requests 5000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBased

from kvpush.connector.spans import Spans
from kvpush.telemetry import read_spans, trace_id_ratio_sampled
from kvpush.telemetry.file_exporter import OtlpJsonLinesFileExporter

P_SEGMENTS = ("p.queue", "p.prefill", "p.descriptor_prep", "p.write_post", "p.order_delivery", "p.write_transfer", "p.prefill_done_report",
              "p.completion")
D_SEGMENTS = ("d.alloc_to_register", "d.register_rpc", "d.wait_for_kv", "d.first_decode_step")
RATIOS = (1.0, 0.1, 0.0)


@dataclass
class Request:
    transfer_id: str
    attempt: int
    traceparent: str
    client_request_id: str


def traceparents(count: int, ratio: float, rng: random.Random) -> list[str]:
    """The routers' traceparents: sampled like TraceIdRatioBased(ratio) decides on the trace id's low 64 bits."""
    out = []
    for _ in range(count):
        trace_id = rng.getrandbits(128) or 1
        flags = "01" if trace_id_ratio_sampled(f"{trace_id:032x}", ratio) else "00"
        out.append(f"00-{trace_id:032x}-{rng.getrandbits(64) or 1:016x}-{flags}")
    return out


def run_once(ratio: float, requests: int, seed: int, directory: Path) -> tuple[float, float, int]:
    """(hot-path µs per request, process CPU µs per request, spans written)."""
    path = directory / f"spans-{ratio:g}-{seed}.jsonl"
    provider = TracerProvider(sampler=ParentBased(ALWAYS_ON))
    # A queue that holds the whole run: this loop records far faster than an engine does, and no span may be dropped.
    processor = BatchSpanProcessor(OtlpJsonLinesFileExporter(path), max_queue_size=requests * (len(P_SEGMENTS) + len(D_SEGMENTS)) + 1)
    provider.add_span_processor(processor)
    prefill, decode = Spans("prefill-0", "prefill", provider), Spans("decode-0", "decode", provider)
    parents = traceparents(requests, ratio, random.Random(seed))
    cpu0 = time.process_time()
    hot_ns = 0
    for i, traceparent in enumerate(parents):
        request = Request(f"transfer-{i}", 1, traceparent, f"client-{i}")
        now = time.time_ns()
        t0 = time.perf_counter_ns()
        for name in P_SEGMENTS:
            prefill.emit(name, now, now + 1000, request, links=(traceparent,) if name == "p.order_delivery" else (), bytes=65536)
        for name in D_SEGMENTS:
            decode.emit(name, now, now + 1000, request, producers=1)
        hot_ns += time.perf_counter_ns() - t0
    prefill.flush()
    decode.flush()
    processor.force_flush()
    cpu_s = time.process_time() - cpu0
    provider.shutdown()
    written = len(read_spans(path)) if path.exists() else 0
    return hot_ns / requests / 1000, cpu_s / requests * 1e6, written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=5000, help="requests per repetition")
    parser.add_argument("--repeats", type=int, default=5, help="repetitions per sampling ratio (ratios alternate)")
    args = parser.parse_args(argv)
    spans_per_request = len(P_SEGMENTS) + len(D_SEGMENTS)
    results: dict[float, list[tuple[float, float, int]]] = {r: [] for r in RATIOS}
    with tempfile.TemporaryDirectory(prefix="kvpush-span-cost-") as tmp:
        for repeat in range(args.repeats):
            for ratio in RATIOS:
                results[ratio].append(run_once(ratio, args.requests, repeat, Path(tmp)))
    print(f"connector tracing cost per request ({spans_per_request} spans when sampled; {args.requests} requests x {args.repeats} "
          "repetitions; median [min-max] over repetitions)")
    print(f"{'sampling':>9} {'hot path µs/req':>22} {'process CPU µs/req':>24} {'spans written/req':>18}")
    for ratio in RATIOS:
        hot, cpu, written = zip(*results[ratio])
        print(f"{ratio:>9.0%} {statistics.median(hot):>9.1f} [{min(hot):.1f}-{max(hot):.1f}] {statistics.median(cpu):>11.1f} "
              f"[{min(cpu):.1f}-{max(cpu):.1f}] {statistics.median(written) / args.requests:>18.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
