# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""The engines' TTFT segments as Prometheus metrics: recorded on any thread, merged as vLLM merges connector stats, observed
into real prometheus_client metrics; and the router's two segments."""

from __future__ import annotations

import functools
import threading
import time
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.utils import floatToGoString

from kvpush.connector.segment_recorder import SegmentRecorder
from kvpush.services.router.core import Endpoint, EnginePool
from kvpush.services.router.metrics import RouterMetrics
from kvpush.telemetry.segments import DECODE_SEGMENTS, PREFILL_ARRIVAL_NS, PREFILL_SEGMENTS, SEGMENT_BUCKETS, SEGMENT_METRIC, TIMING_PARAMS

segment_stats = pytest.importorskip("kvpush.connector.segment_stats")  # vLLM's stats classes


def prom_metrics(role: str, registry: CollectorRegistry, engines: int = 1):
    types = {cls: functools.partial(cls, registry=registry) for cls in (Gauge, Counter, Histogram)}
    labels = {engine: ["tiny", str(engine)] for engine in range(engines)}
    return segment_stats.KvpushPromMetrics(SimpleNamespace(kv_transfer_config=None), types, ["model_name", "engine"], labels, role, f"{role}-0")


def count(registry: CollectorRegistry, name: str, **labels: str) -> float:
    value = registry.get_sample_value(name, labels)
    assert value is not None, f"no sample {name}{labels}"
    return value


def test_observations_from_many_threads_are_drained_once_each():
    recorder = SegmentRecorder()

    def record(n: int) -> None:
        for _ in range(500):
            recorder.segment("handoff", 0, 1_000_000 * (n + 1))
            recorder.outcome("written", 10)

    threads = [threading.Thread(target=record, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    data = recorder.drain()
    assert data is not None
    assert sorted(set(data["segments"]["handoff"])) == [0.001, 0.002, 0.003, 0.004]
    assert len(data["segments"]["handoff"]) == 2000
    assert data["outcomes"] == {"written": 2000} and data["bytes"] == 20_000
    assert recorder.drain() is None, "nothing twice, and nothing recorded means no stats"


def test_a_negative_interval_counts_as_zero():
    recorder = SegmentRecorder()
    recorder.segment("d_wait_tail", 2_000, 1_000)  # instants of two processes, a skewed clock
    assert recorder.drain()["segments"] == {"d_wait_tail": [0.0]}


def test_ranks_and_steps_merge_as_vllm_merges_them():
    first, second = SegmentRecorder(), SegmentRecorder()
    first.segment("handoff", 0, 2_000_000)
    first.outcome("written", 100)
    second.segment("handoff", 0, 4_000_000)
    second.segment("write_transfer", 0, 1_000_000)
    second.outcome("failed")
    merged = segment_stats.KvpushConnectorStats(data=first.drain()).aggregate(segment_stats.KvpushConnectorStats(data=second.drain()))
    assert merged.data["segments"] == {"handoff": [0.002, 0.004], "write_transfer": [0.001]}
    assert merged.data["outcomes"] == {"written": 1, "failed": 1} and merged.data["bytes"] == 100
    assert merged.reduce() == {"handoff mean ms": 3.0, "write_transfer mean ms": 1.0, "failed": 1, "written": 1, "bytes written": 100}
    merged.reset()
    assert merged.is_empty()
    # The API server rebuilds the stats from the payload alone (a partial one from an older engine included).
    from kvpush.connector.connector import KvpushConnector

    assert KvpushConnector.build_kv_connector_stats({"outcomes": {"written": 2}}).reduce() == {"written": 2}
    assert KvpushConnector.build_kv_connector_stats(None).is_empty()


def test_receive_instants_from_ranks_keep_the_latest():
    received = segment_stats.KvReceivedTimes({"a": 5, "b": 9}).aggregate(segment_stats.KvReceivedTimes({"a": 7, "c": 1}))
    assert received.received_ns == {"a": 7, "b": 9, "c": 1}


@pytest.mark.parametrize(("role", "segments"), [("prefill", PREFILL_SEGMENTS), ("decode", DECODE_SEGMENTS)])
def test_every_series_of_a_role_shows_before_its_first_request(role, segments):
    registry = CollectorRegistry()
    prom_metrics(role, registry, engines=2)
    for engine in ("0", "1"):
        labels = {"model_name": "tiny", "engine": engine, "role": role, "engine_id": f"{role}-0"}
        for segment in segments:
            assert count(registry, SEGMENT_METRIC + "_count", **labels, segment=segment) == 0
        for outcome in segment_stats.OUTCOMES[role]:
            assert count(registry, "kvpush_transfers_total", **labels, outcome=outcome) == 0
    other = DECODE_SEGMENTS if role == "prefill" else PREFILL_SEGMENTS
    assert registry.get_sample_value(SEGMENT_METRIC + "_count", {"model_name": "tiny", "engine": "0", "role": role,
                                                                 "engine_id": f"{role}-0", "segment": other[0]}) is None


def test_prefill_observations_reach_the_histograms_and_counters():
    registry = CollectorRegistry()
    metrics = prom_metrics("prefill", registry)
    recorder = SegmentRecorder()
    recorder.segment("p_queue", 0, 1_000_000)
    recorder.segment("p_prefill", 0, 20_000_000)
    recorder.segment("handoff", 0, 2_000_000)
    recorder.segment("write_transfer", 0, 500_000)  # D's segment: not a label value of P's
    recorder.segment("not_a_segment", 0, 1)  # a newer engine's segment: not a new label value here
    recorder.outcome("written", 4096)
    recorder.outcome("revoked")
    metrics.observe(recorder.drain(), 0)
    labels = {"model_name": "tiny", "engine": "0", "role": "prefill", "engine_id": "prefill-0"}
    assert count(registry, SEGMENT_METRIC + "_sum", **labels, segment="p_prefill") == pytest.approx(0.02)
    above = min(bound for bound in SEGMENT_BUCKETS if bound >= 0.02)
    below = max(bound for bound in SEGMENT_BUCKETS if bound < 0.02)
    assert count(registry, SEGMENT_METRIC + "_bucket", **labels, segment="p_prefill", le=floatToGoString(above)) == 1
    assert count(registry, SEGMENT_METRIC + "_bucket", **labels, segment="p_prefill", le=floatToGoString(below)) == 0
    assert count(registry, "kvpush_transfers_total", **labels, outcome="written") == 1
    assert count(registry, "kvpush_transfers_total", **labels, outcome="revoked") == 1
    assert count(registry, "kvpush_transfer_bytes_total", **labels) == 4096
    assert registry.get_sample_value(SEGMENT_METRIC + "_count", {**labels, "segment": "not_a_segment"}) is None
    assert registry.get_sample_value(SEGMENT_METRIC + "_count", {**labels, "segment": "write_transfer"}) is None


def test_decode_output_is_measured_when_the_api_server_gets_the_step():
    registry = CollectorRegistry()
    metrics = prom_metrics("decode", registry)
    recorder = SegmentRecorder()
    recorder.kv_wait(0, 30_000_000)
    recorder.segment("write_transfer", 0, 400_000)
    recorder.segment("d_first_decode_step", 0, 5_000_000)
    recorder.first_step_done(time.time_ns() - 3_000_000)  # the engine core finished the step 3 ms ago
    recorder.outcome("received")
    metrics.observe(recorder.drain(), 0)
    labels = {"model_name": "tiny", "engine": "0", "role": "decode", "engine_id": "decode-0"}
    output = count(registry, SEGMENT_METRIC + "_sum", **labels, segment="d_output")
    assert 0.003 <= output < 1.0
    assert count(registry, "kvpush_decode_kv_wait_seconds_sum", **labels) == pytest.approx(0.03)
    assert count(registry, SEGMENT_METRIC + "_sum", **labels, segment="write_transfer") == pytest.approx(0.0004)
    assert count(registry, "kvpush_transfers_total", **labels, outcome="received") == 1


def router_metrics() -> RouterMetrics:
    pools = (EnginePool("prefill", [Endpoint("http://p:1", "p")], "round_robin"), EnginePool("decode", [Endpoint("http://d:1", "d")], "round_robin"))
    return RouterMetrics(pools, CollectorRegistry())


@pytest.mark.parametrize(("answer", "observed"), [
    ({"kv_transfer_params": {TIMING_PARAMS: {PREFILL_ARRIVAL_NS: 1_004_000_000}}}, 0.004),
    ({"kv_transfer_params": {TIMING_PARAMS: {PREFILL_ARRIVAL_NS: 999_000_000}}}, 0.0),  # P's clock behind the router's
    ({"kv_transfer_params": None}, None),  # an engine that does not tell
    ({"kv_transfer_params": {TIMING_PARAMS: {PREFILL_ARRIVAL_NS: "soon"}}}, None),
    ({"choices": []}, None),
    ([], None),
])
def test_the_router_measures_its_dispatch_from_what_p_tells(answer, observed):
    metrics = router_metrics()
    metrics.dispatched(1_000_000_000, answer)
    labels = {"role": "router", "segment": "router_to_p"}
    assert metrics.registry.get_sample_value(SEGMENT_METRIC + "_count", labels) == (0 if observed is None else 1)
    assert metrics.registry.get_sample_value(SEGMENT_METRIC + "_sum", labels) == pytest.approx(observed or 0.0)
