# SPDX-License-Identifier: Apache-2.0
"""A bounded queue that synchronous core code fills and one async stream drains."""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Generic, TypeVar

T = TypeVar("T")


class Outbox(Generic[T]):
    """A bounded FIFO: put() never blocks; the consumer awaits wait() and then drain()s.

    Nothing queued is ever dropped: an outbox that would overflow closes
    instead (counted in `dropped`), so its consumer's stream ends and the
    subscriber starts over with a fresh snapshot or resync.
    """

    __slots__ = ("capacity", "closed", "dropped", "_exempt", "_items", "_ready")

    def __init__(self, capacity: int | None):
        """capacity None: unbounded until limit() (a resync fills it first)."""
        if capacity is not None and capacity < 1:
            raise ValueError("capacity must be at least 1")
        self.capacity = capacity
        self.closed = False
        self.dropped = 0
        self._exempt = 0  # leading items queued before limit() (a resync): they do not count against capacity
        self._items: deque[T] = deque()
        self._ready = asyncio.Event()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, item: T) -> bool:
        """Queues item; False when it was not queued (closed, or full: then the outbox closes)."""
        if self.closed:
            return False
        if self.capacity is not None and len(self._items) - self._exempt >= self.capacity:
            self.dropped += 1
            self.close()
            return False
        self._items.append(item)
        self._ready.set()
        return True

    def limit(self, capacity: int) -> None:
        """Bounds what is queued from now on to capacity; what is queued already (a resync) never overflows it."""
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self.capacity, self._exempt = capacity, len(self._items)

    def drain(self) -> list[T]:
        """Takes every queued item."""
        items = list(self._items)
        self._items.clear()
        self._exempt = 0
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
