# SPDX-License-Identifier: Apache-2.0
"""The background thread that owns a worker's NIXL agent and drives a producer or consumer core.

Other threads only put items in its inbox; the thread hands each to the
core, then lets the core run (poll WRITEs, fetch notifications, apply
deadlines) and sleeps until the core's next due time, the poll interval
while transfers are in flight, or the next inbox item.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Protocol

from kvpush.processes import name_os_thread

logger = logging.getLogger(__name__)


class Core(Protocol):
    def handle(self, item: tuple) -> None:
        """Applies one inbox item."""

    def step(self) -> float | None:
        """Makes progress; returns the monotonic time it must run again by (None: only when an item comes)."""

    @property
    def busy(self) -> bool:
        """True while transfers are in flight (then the thread polls at poll_interval_s)."""


class TransferThread:
    """Runs core.handle / core.step on one daemon thread until stopped."""

    def __init__(self, name: str, core: Core, poll_interval_s: float, idle_poll_s: float):
        self.core = core
        self.poll_interval_s = poll_interval_s
        self.idle_poll_s = idle_poll_s
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, item: tuple) -> None:
        self._inbox.put(item)

    def stop(self) -> None:
        self._stop = True
        self._inbox.put(("stop",))
        self._thread.join(timeout=5)

    def _run(self) -> None:
        name_os_thread(self._thread.name)
        due: float | None = None
        while not self._stop:
            try:
                timeout = self.poll_interval_s if self.core.busy else self.idle_poll_s
                if due is not None:
                    timeout = min(timeout, max(0.0, due - time.monotonic()))
                try:
                    item = self._inbox.get(timeout=timeout)
                except queue.Empty:
                    item = None
                while item is not None:
                    if item[0] != "stop":
                        self.core.handle(item)
                    try:
                        item = self._inbox.get_nowait()
                    except queue.Empty:
                        item = None
                due = self.core.step()
            except Exception:  # never let one bad message kill the transfer thread
                logger.exception("kvpush %s: unexpected error", self._thread.name)
                due = None
