# SPDX-License-Identifier: Apache-2.0
"""Broker settings: timeout bound, memory bounds and outbox sizes."""

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
    # outbox_capacity is how many messages wait for one producer rank or
    # decode engine; past it the oldest are dropped.
    outbox_capacity: int = 65_536
    max_text_length: int = 256

    def __post_init__(self) -> None:
        if self.max_timeout_s <= 0 or self.retention_s < 0:
            raise ValueError("max_timeout_s must be positive and retention_s not negative")
        if min(self.max_unsettled_attempts, self.max_retained_attempts, self.outbox_capacity) < 1:
            raise ValueError("attempt caps and outbox capacity must be at least 1")

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
        add_option(parser, "--outbox-capacity", "KVPUSH_OUTBOX_CAPACITY", convert=int, default=65_536, help_text="messages queued per subscriber")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> BrokerConfig:
        return cls(
            max_timeout_s=args.max_timeout,
            max_unsettled_attempts=args.max_attempts,
            retention_s=args.retention,
            max_retained_attempts=args.max_retained_attempts,
            outbox_capacity=args.outbox_capacity,
        )
