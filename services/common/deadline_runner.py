# SPDX-License-Identifier: Apache-2.0
"""Runs a core's tick() exactly when it next has work, with no fixed polling interval."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from kvpush.clock import Clock

logger = logging.getLogger(__name__)

# After a tick raised, try again this soon rather than never (deadlines must still fire).
_RETRY_AFTER_ERROR_S = 1.0


class DeadlineRunner:
    """Calls tick() (which returns its next due time, monotonic, or None) at that time.

    The core calls wake(t) when something new is due at t; the runner
    re-arms only when t is earlier than what it sleeps towards.
    """

    def __init__(self, tick: Callable[[], float | None], clock: Clock, name: str):
        self._tick = tick
        self._clock = clock
        self._name = name
        self._next: float | None = None
        self._changed = asyncio.Event()

    def wake(self, when: float) -> None:
        if self._next is None or when < self._next:
            self._changed.set()

    async def run(self) -> None:
        while True:
            self._changed.clear()
            try:
                self._next = self._tick()
            except Exception:
                logger.exception("%s tick failed", self._name)
                self._next = self._clock.now() + _RETRY_AFTER_ERROR_S
            timeout = None if self._next is None else max(0.0, self._next - self._clock.now())
            try:
                async with asyncio.timeout(timeout):
                    await self._changed.wait()
            except TimeoutError:
                pass
