# SPDX-License-Identifier: Apache-2.0
"""The one reconnect backoff every long-lived kvpush stream uses."""

from __future__ import annotations

import asyncio


class Backoff:
    """Exponential delays between reconnects: `first`, doubling up to `cap`; reset() once a stream delivers again."""

    def __init__(self, first_s: float = 0.05, cap_s: float = 2.0):
        self.first_s = first_s
        self.cap_s = cap_s
        self.delay_s = first_s

    def reset(self) -> None:
        self.delay_s = self.first_s

    async def sleep(self) -> None:
        """Waits the current delay, then doubles it (up to the cap)."""
        await asyncio.sleep(self.delay_s)
        self.delay_s = min(self.delay_s * 2, self.cap_s)
