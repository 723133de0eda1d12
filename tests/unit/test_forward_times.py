# SPDX-License-Identifier: Apache-2.0
"""ForwardTimes: a prefill rank's prediction of when its running forward ends, from its scheduled tokens."""

from __future__ import annotations

import pytest

from kvpush.connector.forward_times import PREDICTION_MARGIN, SMOOTHING, ForwardTimes


def test_the_first_forward_has_no_prediction_and_teaches_the_rate():
    times = ForwardTimes()
    assert times.started(10.0, 100) is None  # nothing measured yet: D is told at once
    times.ended(10.05)
    assert times.seconds_per_token == pytest.approx(0.0005)
    assert times.started(20.0, 200) == pytest.approx(20.0 + PREDICTION_MARGIN * 0.0005 * 200)


def test_the_rate_follows_newer_forwards_smoothly():
    times = ForwardTimes()
    times.started(0.0, 100)
    times.ended(0.1)  # 1 ms per token
    times.started(1.0, 100)
    times.ended(1.3)  # 3 ms per token
    assert times.seconds_per_token == pytest.approx((1 - SMOOTHING) * 0.001 + SMOOTHING * 0.003)


def test_steps_without_tokens_teach_nothing():
    times = ForwardTimes()
    assert times.started(0.0, 0) is None
    times.ended(5.0)  # an idle step's wait_for_save, or none at all
    assert times.seconds_per_token is None
    times.ended(6.0)  # an end without a start
    assert times.seconds_per_token is None
