# SPDX-License-Identifier: Apache-2.0
"""Registrar settings: lease bounds, watch queues, caps on engines and watches, and request size limits."""

from __future__ import annotations

import argparse
import dataclasses

from kvpush.services.common.config import add_option


@dataclasses.dataclass(frozen=True)
class RegistrarConfig:
    """Lease bounds (requested TTLs are clamped into [min, max]), caps and per-request limits.

    max_engines and max_watches_per_identity bound what one caller (or a
    leaked credential) can make the registrar hold.
    """

    default_lease_ttl_s: float = 10.0
    min_lease_ttl_s: float = 1.0
    max_lease_ttl_s: float = 60.0
    watch_queue_capacity: int = 10_000
    max_engines: int = 4096
    max_watches_per_identity: int = 64
    max_ranks_per_engine: int = 1024
    max_groups: int = 64
    max_regions: int = 65_536
    max_backends: int = 16
    max_agent_metadata_bytes: int = 4 * 1024 * 1024
    max_text_length: int = 256

    def __post_init__(self) -> None:
        if not 0 < self.min_lease_ttl_s <= self.default_lease_ttl_s <= self.max_lease_ttl_s:
            raise ValueError("lease TTLs must satisfy 0 < min <= default <= max")
        if self.watch_queue_capacity < 1:
            raise ValueError("the watch queue capacity must be at least 1")
        if self.max_engines < 1:
            raise ValueError("--max-engines must be at least 1")
        if self.max_watches_per_identity < 1:
            raise ValueError("--max-watches-per-identity must be at least 1")

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        add_option(parser, "--lease-ttl", "KVPUSH_LEASE_TTL_S", convert=float, default=10.0, help_text="lease length granted when a rank asks for none")
        add_option(parser, "--min-lease-ttl", "KVPUSH_MIN_LEASE_TTL_S", convert=float, default=1.0, help_text="shortest lease granted")
        add_option(parser, "--max-lease-ttl", "KVPUSH_MAX_LEASE_TTL_S", convert=float, default=60.0, help_text="longest lease granted")
        add_option(
            parser,
            "--watch-queue-capacity",
            "KVPUSH_WATCH_QUEUE_CAPACITY",
            convert=int,
            default=10_000,
            help_text="engine events a watcher may fall behind by before its watch is closed",
        )
        add_option(parser, "--max-engines", "KVPUSH_MAX_ENGINES", convert=int, default=4096, help_text="engines registered at once; a new one past it is refused")
        add_option(
            parser,
            "--max-watches-per-identity",
            "KVPUSH_MAX_WATCHES_PER_IDENTITY",
            convert=int,
            default=64,
            help_text="WatchEngines streams one caller identity may hold open",
        )

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RegistrarConfig:
        return cls(
            default_lease_ttl_s=args.lease_ttl,
            min_lease_ttl_s=args.min_lease_ttl,
            max_lease_ttl_s=args.max_lease_ttl,
            watch_queue_capacity=args.watch_queue_capacity,
            max_engines=args.max_engines,
            max_watches_per_identity=args.max_watches_per_identity,
        )
