# SPDX-License-Identifier: Apache-2.0
"""Broker settings: timeout bound, fencing timing, memory bounds and stream queue sizes."""

from __future__ import annotations

import argparse
import dataclasses

from kvpush.services.common.config import add_option


@dataclasses.dataclass(frozen=True)
class BrokerConfig:
    """Bounds on what the broker accepts and remembers."""

    # max_timeout_s caps RegisterDestination/ReportPrefillDone timeouts.
    max_timeout_s: float = 600.0
    # max_unsettled_attempts caps attempts still live or waiting to be fenced.
    max_unsettled_attempts: int = 200_000
    # retention_s keeps settled attempts (answers to repeats, tombstones
    # refusing late or superseded messages) this long after they settle.
    retention_s: float = 60.0
    # max_retained_attempts caps settled attempts kept, oldest dropped first.
    max_retained_attempts: int = 500_000
    # outbox_capacity is how many messages may wait for one stream; past it
    # the stream is closed and its subscriber resyncs on its next stream.
    outbox_capacity: int = 65_536
    max_text_length: int = 256
    # Fencing timing (docs/design.md, "Fencing"). max_clock_skew_s bounds the
    # difference between any two hosts' wall clocks; write_timeout_s is how
    # long a posted WRITE may take before its rank aborts it; stream_lease_s
    # is how long a producer rank acts on orders after the last message its
    # stream brought; fence_margin_s covers an abort's own latency and clock
    # rate drift.
    max_clock_skew_s: float = 0.25
    write_timeout_s: float = 3.0
    stream_lease_s: float = 3.0
    fence_margin_s: float = 1.0

    def __post_init__(self) -> None:
        if self.max_timeout_s <= 0 or self.retention_s < 0:
            raise ValueError("max_timeout_s must be positive and retention_s not negative")
        if min(self.max_unsettled_attempts, self.max_retained_attempts, self.outbox_capacity) < 1:
            raise ValueError("attempt caps and outbox capacity must be at least 1")
        if self.max_clock_skew_s < 0 or min(self.write_timeout_s, self.fence_margin_s) <= 0:
            raise ValueError("max_clock_skew_s must not be negative; write_timeout_s and fence_margin_s must be positive")
        if self.stream_lease_s <= self.max_clock_skew_s:
            raise ValueError(f"stream_lease_s ({self.stream_lease_s:g}) must exceed max_clock_skew_s ({self.max_clock_skew_s:g})")

    @property
    def startup_grace_s(self) -> float:
        """How long a new broker vouches for no fencing: a predecessor's orders may be acted on that long."""
        return self.stream_lease_s + self.write_timeout_s + self.fence_margin_s

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        add_option(parser, "--max-timeout", "KVPUSH_MAX_TIMEOUT_S", convert=float, default=600.0, help_text="longest transfer timeout accepted")
        add_option(
            parser,
            "--max-attempts",
            "KVPUSH_MAX_ATTEMPTS",
            convert=int,
            default=200_000,
            help_text="most transfer attempts live or awaiting fencing at once",
        )
        add_option(parser, "--retention", "KVPUSH_RETENTION_S", convert=float, default=60.0, help_text="seconds ended attempts are remembered")
        add_option(
            parser,
            "--max-retained-attempts",
            "KVPUSH_MAX_RETAINED_ATTEMPTS",
            convert=int,
            default=500_000,
            help_text="most ended attempts remembered",
        )
        add_option(parser, "--outbox-capacity", "KVPUSH_OUTBOX_CAPACITY", convert=int, default=65_536, help_text="messages queued per stream before it is reset")
        add_option(parser, "--max-clock-skew", "KVPUSH_MAX_CLOCK_SKEW_S", convert=float, default=0.25, help_text="largest wall-clock difference between hosts")
        add_option(parser, "--write-timeout", "KVPUSH_WRITE_TIMEOUT_S", convert=float, default=3.0, help_text="seconds a posted WRITE may take before it is aborted")
        add_option(parser, "--stream-lease", "KVPUSH_STREAM_LEASE_S", convert=float, default=3.0, help_text="seconds a producer acts on orders after its stream's last message")
        add_option(parser, "--fence-margin", "KVPUSH_FENCE_MARGIN_S", convert=float, default=1.0, help_text="slack added to every fencing bound")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> BrokerConfig:
        return cls(
            max_timeout_s=args.max_timeout,
            max_unsettled_attempts=args.max_attempts,
            retention_s=args.retention,
            max_retained_attempts=args.max_retained_attempts,
            outbox_capacity=args.outbox_capacity,
            max_clock_skew_s=args.max_clock_skew,
            write_timeout_s=args.write_timeout,
            stream_lease_s=args.stream_lease,
            fence_margin_s=args.fence_margin,
        )
