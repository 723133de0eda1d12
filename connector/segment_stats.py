# SPDX-License-Identifier: Apache-2.0
"""The engine's TTFT segments and transfer outcomes as Prometheus metrics, through vLLM's connector stats.

Segments are recorded where they happen (scheduler, engine thread,
transfer threads) as plain numbers, whatever the trace sampling. vLLM asks
each role's connector for its stats every step (`get_kv_connector_stats`),
merges the workers' and the scheduler's, and hands them to its API server,
where `KvpushPromMetrics` observes them into histograms served on the
engine's own `/metrics`. With `--disable-log-stats` vLLM moves no stats and
the engine exports none of these.

D's first decode step ends in the engine core; the token then travels to the
API server, and `d_output` is that trip: the API server observes it when the
stats of the step arrive, which is when that step's outputs arrive.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from kvpush.connector.segment_recorder import (
    BYTES_KEY,
    FIRST_STEPS_KEY,
    KV_WAIT_KEY,
    OUTCOMES,
    OUTCOMES_KEY,
    SEGMENTS_KEY,
    empty_observations,
    is_empty,
)
from kvpush.telemetry.segments import DECODE_SEGMENTS, PREFILL_SEGMENTS, SEGMENT_BUCKETS, SEGMENT_HELP, SEGMENT_METRIC


@dataclass
class KvpushConnectorStats(KVConnectorStats):
    """The observations of one interval, merged across ranks (aggregate) and steps (the logger's accumulator)."""

    data: dict[str, Any] = field(default_factory=empty_observations)

    def reset(self) -> None:
        self.data = empty_observations()

    def aggregate(self, other: KVConnectorStats) -> KvpushConnectorStats:
        mine, theirs = self.data, {**empty_observations(), **other.data}
        for name, values in theirs[SEGMENTS_KEY].items():
            mine[SEGMENTS_KEY].setdefault(name, []).extend(values)
        mine[KV_WAIT_KEY].extend(theirs[KV_WAIT_KEY])
        for outcome, count in theirs[OUTCOMES_KEY].items():
            mine[OUTCOMES_KEY][outcome] = mine[OUTCOMES_KEY].get(outcome, 0) + count
        mine[BYTES_KEY] += theirs[BYTES_KEY]
        mine[FIRST_STEPS_KEY].extend(theirs[FIRST_STEPS_KEY])
        return self

    def reduce(self) -> dict[str, int | float]:
        """For vLLM's periodic log line: each segment's mean in ms, the outcomes and the bytes."""
        reduced: dict[str, int | float] = {}
        for name, values in sorted(self.data[SEGMENTS_KEY].items()):
            if values:
                reduced[f"{name} mean ms"] = round(1000 * sum(values) / len(values), 3)
        for outcome, count in sorted(self.data[OUTCOMES_KEY].items()):
            reduced[outcome] = count
        if self.data[BYTES_KEY]:
            reduced["bytes written"] = self.data[BYTES_KEY]
        return reduced

    def is_empty(self) -> bool:
        return is_empty({**empty_observations(), **self.data})


@dataclass
class KvReceivedTimes(KVConnectorWorkerMetadata):
    """D: when each decode rank saw a request's last notification (wall ns), for the scheduler's d_wait_tail."""

    received_ns: dict[str, int] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KvReceivedTimes:
        # The latest rank's notification is when the KV is in.
        for req_id, ns in getattr(other, "received_ns", {}).items():
            self.received_ns[req_id] = max(ns, self.received_ns.get(req_id, 0))
        return self


class KvpushPromMetrics(KVConnectorPromMetrics):
    """The engine's kvpush histograms and counters, labelled with vLLM's labels plus the engine's role and kvpush engine id."""

    def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str], per_engine_labelvalues: dict[int, list[object]],
                 role: str, engine_id: str):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        names = [*labelnames, "role", "engine_id"]
        segment_names = PREFILL_SEGMENTS if role == "prefill" else DECODE_SEGMENTS
        segments = self._histogram_cls(name=SEGMENT_METRIC, documentation=SEGMENT_HELP, buckets=SEGMENT_BUCKETS, labelnames=[*names, "segment"])
        transfers = self._counter_cls(name="kvpush_transfers", documentation="Transfers this engine's ranks ended, by outcome (P: WRITEs, D: receives)",
                                      labelnames=[*names, "outcome"])
        # Children made once per engine (labels() is slow) and at start, so every series shows from the first scrape.
        self._segments: dict[int, dict[str, Any]] = {}
        self._outcomes: dict[int, dict[str, Any]] = {}
        self._kv_wait: dict[int, Any] = {}
        self._bytes: dict[int, Any] = {}
        kv_wait = bytes_written = None
        if role == "decode":
            kv_wait = self._histogram_cls(name="kvpush_decode_kv_wait_seconds", buckets=SEGMENT_BUCKETS, labelnames=names,
                                          documentation="D: blocks allocated to the last notification of their KV (runs beside P's prefill, off the critical path)")
        else:
            bytes_written = self._counter_cls(name="kvpush_transfer_bytes", documentation="Bytes this engine's ranks WROTE to decode engines", labelnames=names)
        for engine, values in per_engine_labelvalues.items():
            labels = [*values, role, engine_id]
            self._segments[engine] = {name: segments.labels(*labels, name) for name in segment_names}
            self._outcomes[engine] = {outcome: transfers.labels(*labels, outcome) for outcome in OUTCOMES[role]}
            if kv_wait is not None:
                self._kv_wait[engine] = kv_wait.labels(*labels)
            if bytes_written is not None:
                self._bytes[engine] = bytes_written.labels(*labels)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        data = {**empty_observations(), **transfer_stats_data}
        segments = self._segments[engine_idx]
        for name, values in data[SEGMENTS_KEY].items():
            child = segments.get(name)
            if child is not None:
                for seconds in values:
                    child.observe(seconds)
        if data[FIRST_STEPS_KEY] and "d_output" in segments:
            now_ns = time.time_ns()
            for end_ns in data[FIRST_STEPS_KEY]:
                segments["d_output"].observe(max(now_ns - end_ns, 0) / 1e9)
        kv_wait = self._kv_wait.get(engine_idx)
        if kv_wait is not None:
            for seconds in data[KV_WAIT_KEY]:
                kv_wait.observe(seconds)
        outcomes = self._outcomes[engine_idx]
        for outcome, count in data[OUTCOMES_KEY].items():
            if outcome in outcomes:
                outcomes[outcome].inc(count)
        if data[BYTES_KEY] and engine_idx in self._bytes:
            self._bytes[engine_idx].inc(data[BYTES_KEY])
