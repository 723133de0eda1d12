# SPDX-License-Identifier: Apache-2.0
"""Shared by the sharded-broker tests: transfer ids a given member owns, and waiting (bounded) for a condition."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Collection

from kvpush import shards

WAIT_S = 10.0  # the longest eventually() waits by default


def owned(member: str, members: Collection[str], count: int = 1, prefix: str = "t") -> list[str]:
    """The first count transfer ids of prefix0, prefix1, ... that member owns among members (kvpush.shards.owner)."""
    ids = (f"{prefix}{i}" for i in itertools.count())
    return list(itertools.islice((transfer_id for transfer_id in ids if shards.owner(transfer_id, members) == member), count))


def owned_by(member: str, members: Collection[str], prefix: str = "t", skip: int = 0) -> str:
    """The transfer id after the first skip ones that member owns among members."""
    return owned(member, members, skip + 1, prefix)[-1]


async def eventually(condition: Callable[[], bool], timeout_s: float = WAIT_S) -> None:
    """Polls condition until it holds; fails the test when it has not within timeout_s."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)
