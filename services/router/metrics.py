# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""The router's Prometheus metrics, in a registry of their own (served on the router's /metrics)."""

from __future__ import annotations

import functools

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvpush.services.router.core import FAILURE_REASONS, LEG_FAILED, EnginePool

# TTFT spans a few milliseconds (tiny prompts, idle engines) to the queueing
# of an overloaded pair (tens of seconds).
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class RouterMetrics:
    """Counters the proxy bumps, the TTFT histogram and per-engine in-flight gauges read from the pools."""

    def __init__(self, pools: tuple[EnginePool, ...], registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.requests = Counter("kvpush_router_requests", "Client requests answered, by API path and HTTP status", ["path", "status"], registry=r)
        self.leg_failures = Counter("kvpush_router_leg_failures", "Failed prefill or decode legs, by leg and cause", ["leg", "cause"], registry=r)
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
        in_flight = Gauge("kvpush_router_legs_in_flight", "Legs being served, by engine", ["role", "engine_id", "url"], registry=r)
        for pool in pools:
            for endpoint in pool.endpoints:
                in_flight.labels(pool.role, endpoint.engine_id, endpoint.url).set_function(functools.partial(pool.in_flight, endpoint))

    def failed(self, reason: str) -> None:
        """Counts one failed request; a reason outside FAILURE_REASONS (a newer broker's EndReason) counts as LEG_FAILED."""
        self._failed_by_reason.get(reason, self._failed_by_reason[LEG_FAILED]).inc()
