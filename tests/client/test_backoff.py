# SPDX-License-Identifier: Apache-2.0
"""The shared reconnect backoff: doubles up to its cap, starts over after reset()."""

from __future__ import annotations

import asyncio

from kvpush.client.backoff import Backoff


def test_delays_double_up_to_the_cap_and_reset_starts_over():
    backoff = Backoff(0.001, 0.003)
    seen = []
    for _ in range(4):
        seen.append(backoff.delay_s)
        asyncio.run(backoff.sleep())
    assert seen == [0.001, 0.002, 0.003, 0.003]
    backoff.reset()
    assert backoff.delay_s == 0.001
