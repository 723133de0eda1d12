# SPDX-License-Identifier: Apache-2.0
"""The registrar's Prometheus gauges, read from the core at scrape time."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Gauge

from kvpush.services.registrar.directory import Directory


def register_registrar_metrics(registry: CollectorRegistry, core: Directory) -> None:
    """Adds gauges for the core's engines, leased ranks and watches to registry."""
    Gauge("kvpush_registrar_engines", "Engine incarnations with at least one registered rank", registry=registry).set_function(lambda: core.engine_count)
    Gauge("kvpush_registrar_leased_ranks", "Registered engine ranks holding a lease", registry=registry).set_function(lambda: core.lease_count)
    Gauge("kvpush_registrar_watches", "Open WatchEngines subscriptions", registry=registry).set_function(lambda: core.watch_count)
