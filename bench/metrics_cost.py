# SPDX-License-Identifier: Apache-2.0
"""What the per-segment Prometheus metrics cost each request, in each process that pays it.

Runs the real recording and observing code in process, one request's worth
at a time, as the engines and the router run it:

* P's engine (engine thread and transfer thread): recording p_queue,
  p_prefill, hand-off and the WRITE's outcome, then vLLM's per-step
  drain into `KvpushConnectorStats` and the merge with the scheduler's;
* P's API server: `KvpushPromMetrics.observe` of that request's stats;
* D's engine: recording the KV wait, the WRITE, wait tail, first decode
  step, its end and the receive's outcome, then the drain and merge;
* D's API server: the observe (d_output included);
* the router: router_to_p read from P's answer, and the relay;
* P's transfer thread: the notification telling a decode rank when the
  WRITE was posted (a real NIXL agent to another in this process, over
  UCX; one per producer rank per request).

Each arm is timed over many requests and repeated; prints the median per
request, the drain and merge counted once per request (vLLM drains once per
step, whatever the number of requests in it). Not included: vLLM's cost of
carrying the stats (a few dict entries more in its per-step msgpack
message).

    python -m bench.metrics_cost [--requests 20000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable
from types import SimpleNamespace

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvpush.connector.nixl_agent import KvAgent
from kvpush.connector.notification import posted_notification
from kvpush.connector.segment_recorder import SegmentRecorder
from kvpush.connector.segment_stats import KvpushConnectorStats, KvpushPromMetrics
from kvpush.services.router.core import Endpoint, EnginePool
from kvpush.services.router.metrics import RouterMetrics
from kvpush.telemetry.segments import PREFILL_ARRIVAL_NS, TIMING_PARAMS

MS = 1_000_000  # ns


def prom_metrics(role: str) -> KvpushPromMetrics:
    registry = CollectorRegistry()
    types = {cls: functools.partial(cls, registry=registry) for cls in (Gauge, Counter, Histogram)}
    return KvpushPromMetrics(SimpleNamespace(kv_transfer_config=None), types, ["model_name", "engine"], {0: ["tiny", "0"]}, role, f"{role}-0")


def prefill_engine(recorder: SegmentRecorder, now: int) -> KvpushConnectorStats | None:
    recorder.segment("p_queue", now - 12 * MS, now - 11 * MS)
    recorder.segment("p_prefill", now - 11 * MS, now - MS)
    recorder.segment("handoff", now - MS, now - MS // 2)
    recorder.outcome("written", 524_288)
    worker = recorder.drain()
    assert worker is not None
    return KvpushConnectorStats(data=worker).aggregate(KvpushConnectorStats())


def decode_engine(recorder: SegmentRecorder, now: int) -> KvpushConnectorStats | None:
    recorder.kv_wait(now - 15 * MS, now - 5 * MS)
    recorder.segment("write_transfer", now - 6 * MS, now - 5 * MS)
    recorder.outcome("received")
    recorder.segment("d_wait_tail", now - 5 * MS, now - 3 * MS)
    recorder.segment("d_first_decode_step", now - 3 * MS, now)
    recorder.first_step_done(now)
    worker = recorder.drain()
    assert worker is not None
    return KvpushConnectorStats(data=worker).aggregate(KvpushConnectorStats())


def nixl_pair() -> tuple[KvAgent, KvAgent, str]:
    """Two connected NIXL agents (P's and D's), past the connection set-up a first WRITE would pay."""
    p, d = KvAgent("metrics-cost-p", ["UCX"], "DRAM"), KvAgent("metrics-cost-d", ["UCX"], "DRAM")
    peer = p.add_peer(d.metadata())
    d.add_peer(p.metadata())
    p.warm_up(peer)
    deadline = time.monotonic() + 30
    while not d.notifications():
        p.notifications()  # UCX connects as both agents make progress
        if time.monotonic() > deadline:
            raise RuntimeError("the two NIXL agents did not connect within 30 s")
        time.sleep(0.01)
    return p, d, peer


def per_request_s(run: Callable[[], object], requests: int) -> float:
    t0 = time.perf_counter()
    for _ in range(requests):
        run()
    return (time.perf_counter() - t0) / requests


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    now = time.time_ns()
    p_stats, d_stats = prefill_engine(SegmentRecorder(), now), decode_engine(SegmentRecorder(), now)
    assert p_stats is not None and d_stats is not None
    p_prom, d_prom = prom_metrics("prefill"), prom_metrics("decode")
    pools = (EnginePool("prefill", [Endpoint("http://p:1", "p")], "round_robin"), EnginePool("decode", [Endpoint("http://d:1", "d")], "round_robin"))
    router = RouterMetrics(pools, CollectorRegistry())
    answer = {"choices": [{"text": "x"}], "kv_transfer_params": {TIMING_PARAMS: {PREFILL_ARRIVAL_NS: now + 2 * MS}}}

    def router_request() -> None:
        router.dispatched(now, answer)
        router.ttft.observe(0.03)
        router.segment_relay.observe(0.0003)

    p_agent, d_agent, peer = nixl_pair()
    posted = posted_notification("xfer-" + "0" * 32, 1, 0, now)
    sent = 0

    def posted_notice() -> None:
        nonlocal sent
        p_agent.send_notif(peer, posted)
        sent += 1
        if sent % 100 == 0:
            d_agent.notifications()  # D takes them as it would, so none pile up

    arms: dict[str, Callable[[], object]] = {
        "P engine: record 4, drain, merge": functools.partial(prefill_engine, SegmentRecorder(), now),
        "P API server: observe": lambda: p_prom.observe(p_stats.data, 0),
        "D engine: record 6, drain, merge": functools.partial(decode_engine, SegmentRecorder(), now),
        "D API server: observe": lambda: d_prom.observe(d_stats.data, 0),
        "router: dispatch, TTFT, relay": router_request,
        "P transfer thread: posted notification": posted_notice,
    }
    print(f"{args.requests} requests x {args.repeats} repeats per arm; medians per request, and the range over the repeats")
    total = 0.0
    for name, run in arms.items():
        repeats = [per_request_s(run, args.requests) for _ in range(args.repeats)]
        median = statistics.median(repeats)
        total += median
        print(f"{name:40s} {median * 1e6:7.2f} us  (repeats {min(repeats) * 1e6:.2f}-{max(repeats) * 1e6:.2f})")
    print(f"{'all processes together':40s} {total * 1e6:7.2f} us per request")
    deadline = time.monotonic() + 5  # let D take what is still on its way before the agents go
    while time.monotonic() < deadline and (d_agent.notifications() or p_agent.notifications()):
        time.sleep(0.05)
    p_agent.close()
    d_agent.close()


if __name__ == "__main__":
    main()
