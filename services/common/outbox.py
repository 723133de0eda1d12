# SPDX-License-Identifier: Apache-2.0
"""A bounded queue that synchronous core code fills and one async stream drains."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Iterable
from typing import Generic, TypeVar

T = TypeVar("T")


class Outbox(Generic[T]):
    """A bounded FIFO: put() never blocks; the consumer awaits wait() and then drain()s.

    When full, put() either drops the oldest item (a slow or absent consumer
    loses old messages, never new ones) or, with close_on_overflow, closes
    the outbox so the consumer must start over (watches, whose snapshot
    replaces what was lost).
    """

    __slots__ = ("capacity", "close_on_overflow", "closed", "dropped", "_items", "_ready")

    def __init__(self, capacity: int, *, close_on_overflow: bool = False):
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self.capacity = capacity
        self.close_on_overflow = close_on_overflow
        self.closed = False
        self.dropped = 0
        self._items: deque[T] = deque()
        self._ready = asyncio.Event()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, item: T) -> bool:
        """Queues item; False when it was not queued or an older item was dropped for it."""
        if self.closed:
            return False
        items = self._items
        queued_whole = True
        if len(items) >= self.capacity:
            if self.close_on_overflow:
                self.dropped += 1
                self.close()
                return False
            items.popleft()
            self.dropped += 1
            queued_whole = False
        items.append(item)
        self._ready.set()
        return queued_whole

    def put_back(self, items: Iterable[T]) -> None:
        """Returns drained but undelivered items to the front, in their order."""
        front = list(items)
        if front:
            self._items.extendleft(reversed(front))
            self._ready.set()

    def drain(self) -> list[T]:
        """Takes every queued item."""
        items = list(self._items)
        self._items.clear()
        if not self.closed:
            self._ready.clear()
        return items

    async def wait(self) -> None:
        """Returns once items are queued or the outbox is closed."""
        await self._ready.wait()

    def wake(self) -> None:
        """Wakes the consumer without queuing anything (it re-checks why it waits)."""
        self._ready.set()

    def close(self) -> None:
        """Wakes the consumer for good; later put()s are refused."""
        self.closed = True
        self._ready.set()
