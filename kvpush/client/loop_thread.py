# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""An asyncio event loop in a daemon thread, for synchronous callers such as vLLM's engine loop."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from kvpush.processes import name_os_thread

logger = logging.getLogger(__name__)

T = TypeVar("T")


class LoopThread:
    """Runs an event loop in a daemon thread; synchronous code hands it coroutines.

    A submitted coroutine runs in a copy of the submitting thread's
    contextvars, so the caller's current OpenTelemetry span is its parent.

        loop = LoopThread("kvpush-control")
        future = loop.submit(broker.register_destination(request))  # returns at once
        response = loop.call(registrar.get_engine(request), timeout_s=2.0)  # blocks
        loop.stop()
    """

    def __init__(self, name: str = "kvpush-loop"):
        self._loop = asyncio.new_event_loop()
        self._stopping = False
        self._lock = threading.Lock()
        started = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(started,), name=name, daemon=True)
        self._thread.start()
        started.wait()

    def _run(self, started: threading.Event) -> None:
        name_os_thread(self._thread.name)
        asyncio.set_event_loop(self._loop)
        self._loop.call_soon(started.set)
        try:
            self._loop.run_forever()
        finally:
            self._loop.close()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def submit(self, coro: Coroutine[Any, Any, T], *, log_errors: bool = True) -> concurrent.futures.Future[T]:
        """Schedules coro on the loop and returns its Future at once.

        With log_errors (the default, for fire-and-forget use) a failure is
        logged when it happens; pass False when the caller reads the Future.

        Raises:
            RuntimeError: the loop thread is stopping or stopped.
        """
        with self._lock:
            if self._stopping:
                coro.close()
                raise RuntimeError("LoopThread is stopped")
            future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        if log_errors:
            future.add_done_callback(_log_failure)
        return future

    def call(self, coro: Coroutine[Any, Any, T], *, timeout_s: float) -> T:
        """Runs coro on the loop and blocks for its result; on timeout cancels it and raises TimeoutError."""
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("LoopThread.call() from its own thread would deadlock; await the coroutine instead")
        future = self.submit(coro, log_errors=False)
        try:
            return future.result(timeout_s)
        except TimeoutError:
            future.cancel()
            raise

    def stop(self, timeout_s: float = 5.0) -> bool:
        """Cancels the loop's tasks, stops the loop and joins the thread, waiting at most timeout_s.

        Tasks get half of timeout_s to finish after cancellation. Returns
        whether the thread ended; it may not when a coroutine blocks the loop
        (the daemon thread then dies with the process).
        """
        if threading.current_thread() is self._thread:
            raise RuntimeError("LoopThread.stop() from its own thread cannot join it")
        with self._lock:
            if not self._stopping:
                self._stopping = True
                if self._thread.is_alive():
                    self._loop.call_soon_threadsafe(self._loop.create_task, self._shutdown(timeout_s / 2))
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.warning("loop thread %s did not end within %.1fs", self._thread.name, timeout_s)
            return False
        return True

    async def _shutdown(self, grace_s: float) -> None:
        tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=grace_s)
            if pending:
                logger.warning("%d tasks ignored cancellation for %.1fs; stopping the loop under them", len(pending), grace_s)
        await self._loop.shutdown_asyncgens()
        self._loop.stop()

    def __enter__(self) -> LoopThread:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def _log_failure(future: concurrent.futures.Future[Any]) -> None:
    if future.cancelled():
        return
    error = future.exception()
    if error is not None:
        logger.warning("background coroutine failed: %s", error, exc_info=error)
