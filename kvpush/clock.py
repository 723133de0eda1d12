# SPDX-License-Identifier: Apache-2.0
"""Time sources: cores read time only through a Clock, so tests can drive it."""

from __future__ import annotations

import time
from typing import Protocol

from google.protobuf import duration_pb2, timestamp_pb2


class Clock(Protocol):
    """A monotonic clock for deadlines plus the wall clock for timestamps."""

    def now(self) -> float:
        """Monotonic seconds; only differences mean anything."""

    def wall(self) -> float:
        """Seconds since the Unix epoch."""


class SystemClock:
    """The process's real clocks."""

    now = staticmethod(time.monotonic)
    wall = staticmethod(time.time)


class ManualClock:
    """A clock that moves only when a test advances it; wall time moves with it."""

    def __init__(self, start: float = 1000.0, wall_start: float = 1_767_225_600.0):
        self._now = start
        self._wall_offset = wall_start - start

    def now(self) -> float:
        return self._now

    def wall(self) -> float:
        return self._now + self._wall_offset

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("a clock never runs backwards")
        self._now += seconds


def wall_at(clock: Clock, monotonic: float) -> float:
    """The wall time at which the monotonic clock reads `monotonic`."""
    return clock.wall() + (monotonic - clock.now())


def timestamp(epoch_seconds: float) -> timestamp_pb2.Timestamp:
    """A Timestamp proto for epoch seconds (at or after the epoch)."""
    seconds = int(epoch_seconds)
    return timestamp_pb2.Timestamp(seconds=seconds, nanos=int((epoch_seconds - seconds) * 1e9))


def duration(seconds: float) -> duration_pb2.Duration:
    """A Duration proto for seconds (negative values become zero)."""
    whole, nanos = divmod(int(seconds * 1e9), 1_000_000_000) if seconds > 0 else (0, 0)
    return duration_pb2.Duration(seconds=whole, nanos=nanos)
