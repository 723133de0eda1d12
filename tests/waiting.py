# SPDX-License-Identifier: Apache-2.0
"""The one way tests wait for something: poll with a bound, and fail the test (naming what) when the bound passes."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from typing import Any

WAIT_S = 10.0  # the default bound


def wait_for(predicate: Callable[[], Any], timeout: float = WAIT_S, interval: float = 0.1, what: str = "condition") -> Any:
    """Polls predicate() until it returns a truthy value, which it returns; fails the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout:g} s (last: {value!r})")
        time.sleep(interval)


async def eventually(condition: Callable[[], Any], timeout: float = WAIT_S, interval: float = 0.02, what: str = "condition") -> float:
    """Polls condition() (a plain or async callable) until it is truthy; returns the seconds that took; fails the test after `timeout`."""
    start = time.monotonic()
    while True:
        value = condition()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return time.monotonic() - start
        if time.monotonic() - start > timeout:
            raise AssertionError(f"{what} not reached within {timeout:g} s (last: {value!r})")
        await asyncio.sleep(interval)
