# SPDX-License-Identifier: Apache-2.0
"""What a retry needs left of its request's time: the median of recent attempts to their first output, once there are enough."""

from __future__ import annotations

from kvpush.services.router.attempt_times import ATTEMPTS_KEPT, MIN_ATTEMPTS, RETRY_MIN_LEFT_S, AttemptTimes


def test_without_enough_history_a_retry_needs_only_the_minimum():
    times = AttemptTimes()
    for _ in range(MIN_ATTEMPTS - 1):
        times.observe(2.0)
    assert times.retry_needs_s() == RETRY_MIN_LEFT_S


def test_a_retry_needs_the_median_of_the_recent_attempts_and_old_ones_age_out():
    times = AttemptTimes()
    for seconds in [0.2] * 5 + [0.3] * 5 + [9.0] * 3:
        times.observe(seconds)
    assert times.retry_needs_s() == 0.3
    for _ in range(ATTEMPTS_KEPT):
        times.observe(0.01)
    assert times.retry_needs_s() == RETRY_MIN_LEFT_S  # never less than the minimum
