# SPDX-License-Identifier: Apache-2.0
"""How long the router's recent attempts took to their first output: what a retry needs left of its request's time.

A retry that starts with less time left than an attempt usually takes
(the median of the last ATTEMPTS_KEPT attempts that got output) would
more often miss its deadline than not, and would then answer with a
deadline error in place of the reason the failed attempt already gave.
Until MIN_ATTEMPTS have been seen no history speaks, and only
RETRY_MIN_LEFT_S is asked for.
"""

from __future__ import annotations

from collections import deque

from kvpush.report.percentiles import percentile

# A retry with less than this left of the request's bounds could only miss its deadline.
RETRY_MIN_LEFT_S = 0.1
ATTEMPTS_KEPT = 128
MIN_ATTEMPTS = 8


class AttemptTimes:
    """The seconds from an attempt's start to its first output, over the last ATTEMPTS_KEPT attempts that had output."""

    def __init__(self) -> None:
        self._seconds: deque[float] = deque(maxlen=ATTEMPTS_KEPT)

    def observe(self, seconds: float) -> None:
        self._seconds.append(seconds)

    def retry_needs_s(self) -> float:
        """What a retry needs left of its request's time to be worth starting."""
        if len(self._seconds) < MIN_ATTEMPTS:
            return RETRY_MIN_LEFT_S
        return max(RETRY_MIN_LEFT_S, percentile(list(self._seconds), 50))
