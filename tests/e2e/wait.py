# SPDX-License-Identifier: Apache-2.0
"""Polling with a bound, for the engine tests."""

from __future__ import annotations

import time


def wait_for(predicate, timeout: float, interval: float = 0.1, what: str = "condition"):
    """Polls predicate() until it returns a truthy value; raises TimeoutError naming `what`."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not reached within {timeout:g} s (last: {value!r})")
        time.sleep(interval)
