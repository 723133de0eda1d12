# SPDX-License-Identifier: Apache-2.0
"""The broker's Prometheus metrics, in a registry of their own (one per broker, so tests never collide)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvpush.rendezvous.v1 import transfer_pb2

# Rendezvous waits span sub-millisecond (both sides nearly together) to the
# length of a prefill (seconds).
_WAIT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class BrokerMetrics:
    """Counters the core bumps and gauges read from the core at scrape time."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.pending_registrations = Gauge(
            "kvpush_broker_pending_registrations", "Attempts whose decode side registered and prefill-done has not come", registry=r
        )
        self.pending_prefill_dones = Gauge(
            "kvpush_broker_pending_prefill_dones", "Attempts whose prefill-done came and the decode side has not registered", registry=r
        )
        self.live_attempts = Gauge("kvpush_broker_live_attempts", "Attempts not yet in a terminal state", registry=r)
        self.rendezvous = Counter("kvpush_broker_rendezvous", "Attempts whose two sides met", registry=r)
        self.failures = Counter("kvpush_broker_failures", "Attempts that ended FAILED, by end reason", ["reason"], registry=r)
        self.expiries = Counter("kvpush_broker_expiries", "Attempts failed by a deadline", registry=r)
        self.supersessions = Counter("kvpush_broker_supersessions", "Attempts superseded by a newer attempt", registry=r)
        self.orders_sent = Counter("kvpush_broker_orders_sent", "Write orders queued for producer ranks", registry=r)
        self.rendezvous_wait = Histogram(
            "kvpush_broker_rendezvous_wait_seconds", "Time from an attempt's first arrival to its second", buckets=_WAIT_BUCKETS, registry=r
        )
        self.write_duration = Histogram(
            "kvpush_broker_write_seconds", "A producer rank's WRITE, post to completion, as the rank reports it (WRITTEN results)",
            buckets=_WAIT_BUCKETS, registry=r,
        )
        self.shard_members = Gauge("kvpush_broker_shard_members", "Members in the shard map this broker member sees (1 unsharded)", registry=r)
        self.shard_serving = Gauge("kvpush_broker_shard_serving", "1 while this broker member serves its shard, else 0", registry=r)
        self._failures_by_reason: dict[int, Counter] = {}
        # Every reason shows from the start (0): a failures panel has data before the first failure.
        for reason in transfer_pb2.EndReason.values():
            self.failure(reason)

    def failure(self, end_reason: int) -> Counter:
        """The failures counter child for an EndReason (children cached: labels() is slow)."""
        child = self._failures_by_reason.get(end_reason)
        if child is None:
            child = self._failures_by_reason[end_reason] = self.failures.labels(transfer_pb2.EndReason.Name(end_reason))
        return child

    def read_gauges_from(self, pending_registrations: Callable[[], float], pending_prefill_dones: Callable[[], float], live: Callable[[], float]) -> None:
        """Makes the gauges report the core's own counts at scrape time (no per-call cost)."""
        self.pending_registrations.set_function(pending_registrations)
        self.pending_prefill_dones.set_function(pending_prefill_dones)
        self.live_attempts.set_function(live)

    def read_shard_gauges_from(self, members: Callable[[], float], serving: Callable[[], float]) -> None:
        """Makes the shard gauges report the membership's own state at scrape time."""
        self.shard_members.set_function(members)
        self.shard_serving.set_function(serving)
