# SPDX-License-Identifier: Apache-2.0
"""Registrar settings: lease bounds, watch queues, caps on engines and watches, request size limits (the etcd it may run on: kvpush.etcd.settings)."""

from __future__ import annotations

import dataclasses

from kvpush.settings import Settings, setting


@dataclasses.dataclass(frozen=True)
class RegistrarConfig(Settings):
    """Lease bounds (requested TTLs are clamped into [min, max]), caps and per-request limits.

    max_engines and max_watches_per_identity bound what one caller (or a
    leaked credential) can make the registrar hold.
    """

    default_lease_ttl_s: float = setting(
        10.0, flag="--lease-ttl", env="KVPUSH_LEASE_TTL_S", convert=float, help="lease length granted when a rank asks for none"
    )
    min_lease_ttl_s: float = setting(1.0, flag="--min-lease-ttl", env="KVPUSH_MIN_LEASE_TTL_S", convert=float, help="shortest lease granted")
    max_lease_ttl_s: float = setting(60.0, flag="--max-lease-ttl", env="KVPUSH_MAX_LEASE_TTL_S", convert=float, help="longest lease granted")
    watch_queue_capacity: int = setting(
        10_000,
        flag="--watch-queue-capacity",
        env="KVPUSH_WATCH_QUEUE_CAPACITY",
        convert=int,
        at_least=1,
        help="engine events a watcher may fall behind by before its watch is closed",
    )
    watch_history: int = setting(
        1000,
        flag="--watch-history",
        env="KVPUSH_WATCH_HISTORY",
        convert=int,
        at_least=1,
        help="latest engine changes kept so a watch can resume from a revision instead of a fresh snapshot",
    )
    max_engines: int = setting(
        4096, flag="--max-engines", env="KVPUSH_MAX_ENGINES", convert=int, at_least=1, help="engines registered at once; a new one past it is refused"
    )
    max_watches_per_identity: int = setting(
        64,
        flag="--max-watches-per-identity",
        env="KVPUSH_MAX_WATCHES_PER_IDENTITY",
        convert=int,
        at_least=1,
        help="WatchEngines streams one caller identity may hold open",
    )
    # outage_grace_s (etcd-backed replicas): a rank's etcd lease outlives its
    # own TTL by this much, and a replica ends a rank that stopped renewing
    # itself, so every replica may be down this long without a rank lapsing.
    outage_grace_s: int = setting(
        6, flag="--outage-grace", env="KVPUSH_REGISTRAR_OUTAGE_GRACE_S", convert=int, at_least=1,
        help="seconds every registrar replica may be down at once without an engine's ranks lapsing (etcd-backed replicas)",
    )
    max_ranks_per_engine: int = 1024
    max_groups: int = 64
    max_regions: int = 65_536
    max_backends: int = 16
    max_agent_metadata_bytes: int = 4 * 1024 * 1024
    max_text_length: int = 256

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 < self.min_lease_ttl_s <= self.default_lease_ttl_s <= self.max_lease_ttl_s:
            raise ValueError("lease TTLs must satisfy 0 < min <= default <= max")

