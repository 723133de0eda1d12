# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""The router's Prometheus metrics, in a registry of their own (served on the router's /metrics)."""

from __future__ import annotations

import functools
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvpush.services.router.core import FAILURE_REASONS, LEG_FAILED, EnginePool
from kvpush.services.router.failures import LEG_CAUSES
from kvpush.services.router.legs import DECODE, PREFILL
from kvpush.telemetry.segments import PREFILL_ARRIVAL_NS, SEGMENT_BUCKETS, SEGMENT_HELP, SEGMENT_METRIC, TIMING_PARAMS

# TTFT has the segments' buckets: a TTFT p50 and the segments' p50s are read off the same bounds.
_TTFT_BUCKETS = SEGMENT_BUCKETS


class RouterMetrics:
    """Counters the proxy bumps, the TTFT histogram and per-engine in-flight gauges read from the pools."""

    def __init__(self, pools: tuple[EnginePool, ...], registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.requests = Counter("kvpush_router_requests", "Client requests answered, by API path and HTTP status", ["path", "status"], registry=r)
        self.leg_failures = Counter("kvpush_router_leg_failures", "Failed prefill or decode legs, by leg and cause", ["leg", "cause"], registry=r)
        for leg in (PREFILL, DECODE):
            for cause in LEG_CAUSES:
                self.leg_failures.labels(leg, cause)  # every series shows from the start (0)
        self.retries = Counter("kvpush_router_retries", "Dispatches retried with a new attempt after a leg failed", registry=r)
        self.retries_skipped = Counter(
            "kvpush_router_retries_skipped", "Retries not made because too little was left of the request's deadline", registry=r
        )
        self.cancel_failures = Counter("kvpush_router_cancel_failures", "CancelTransfer calls that did not succeed", registry=r)
        self.failed_requests = Counter(
            "kvpush_router_failed_requests",
            "Client requests that failed, by reason: a kvpush EndReason name or a router-side cause (core.ROUTER_REASONS)",
            ["reason"],
            registry=r,
        )
        # Every reason shows from the start (0), and nothing outside the set becomes a label.
        self._failed_by_reason = {reason: self.failed_requests.labels(reason) for reason in FAILURE_REASONS}
        self.ttft = Histogram(
            "kvpush_router_time_to_first_token_seconds", "Client request received to first streamed output sent", buckets=_TTFT_BUCKETS, registry=r
        )
        # Per-segment histograms, always on whatever the trace sampling: the P leg and what follows it.
        self.prefill_leg = Histogram(
            "kvpush_router_prefill_leg_seconds", "Prefill leg sent to P's answer (successful legs)", buckets=_TTFT_BUCKETS, registry=r
        )
        self.after_prefill_leg = Histogram(
            "kvpush_router_after_prefill_leg_seconds",
            "P's answer to the first output sent (the hand-off, D's wait for its KV and its first decode step), when P answered first",
            buckets=_TTFT_BUCKETS, registry=r,
        )
        # The router's two segments of TTFT's critical path; P and D export the others on their own /metrics.
        segments = Histogram(SEGMENT_METRIC, SEGMENT_HELP, ["role", "segment"], buckets=SEGMENT_BUCKETS, registry=r)
        self.segment_dispatch = segments.labels("router", "router_to_p")
        self.segment_relay = segments.labels("router", "router_overhead")
        in_flight = Gauge("kvpush_router_legs_in_flight", "Legs being served, by engine", ["role", "engine_id", "url"], registry=r)
        for pool in pools:
            for endpoint in pool.endpoints:
                in_flight.labels(pool.role, endpoint.engine_id, endpoint.url).set_function(functools.partial(pool.in_flight, endpoint))

    def dispatched(self, started_ns: int, prefill_answer: dict[str, Any]) -> None:
        """Observes router_to_p: the request's arrival here to its prefill leg's arrival at P, which P's answer tells
        (by P's wall clock: never negative across skewed hosts). Answers from engines that do not tell count nothing."""
        params = prefill_answer.get("kv_transfer_params") if isinstance(prefill_answer, dict) else None
        timing = params.get(TIMING_PARAMS) if isinstance(params, dict) else None
        arrival_ns = timing.get(PREFILL_ARRIVAL_NS) if isinstance(timing, dict) else None
        if isinstance(arrival_ns, int):
            self.segment_dispatch.observe(max(arrival_ns - started_ns, 0) / 1e9)

    def failed(self, reason: str) -> None:
        """Counts one failed request; a reason outside FAILURE_REASONS (a newer broker's EndReason) counts as LEG_FAILED."""
        self._failed_by_reason.get(reason, self._failed_by_reason[LEG_FAILED]).inc()
