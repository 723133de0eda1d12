# SPDX-License-Identifier: Apache-2.0
"""When a prefill rank's forward will end: what it tells decode ranks ahead of a WRITE.

A decode rank polls NIXL slowly until P says a WRITE to it is due (each of
its polls takes the GIL and the core from its decode forward). A forward
that completes a prefill is most of the time D waits, so P says it near the
forward's end, not at its start: this rank's forwards are timed (binding
the step's metadata to wait_for_save) and the next one's end predicted from
its scheduled tokens. A prediction that comes out late costs a receive at
most D's slow polling interval; an early one some polling.
"""

from __future__ import annotations

# Weight of the newest forward in the running seconds-per-token estimate.
SMOOTHING = 0.2
# Predictions are shortened by this factor: forwards of one size vary by about this much here.
PREDICTION_MARGIN = 0.8


class ForwardTimes:
    """A running estimate of this rank's forward time per scheduled token (single-threaded: the engine thread)."""

    def __init__(self) -> None:
        self.seconds_per_token: float | None = None
        self._started: tuple[float, int] | None = None  # the running forward: (start, its scheduled tokens)

    def started(self, now: float, tokens: int) -> float | None:
        """A forward of `tokens` starts now; returns when it is predicted to end at the earliest (None: no estimate yet)."""
        self._started = (now, tokens) if tokens > 0 else None
        if self.seconds_per_token is None or tokens <= 0:
            return None
        return now + PREDICTION_MARGIN * self.seconds_per_token * tokens

    def ended(self, now: float) -> None:
        """The forward that started last has ended."""
        if self._started is None:
            return
        start, tokens = self._started
        self._started = None
        sample = (now - start) / tokens
        self.seconds_per_token = sample if self.seconds_per_token is None else (1 - SMOOTHING) * self.seconds_per_token + SMOOTHING * sample
