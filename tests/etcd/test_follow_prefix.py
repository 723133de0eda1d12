# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""follow_prefix against a real 3-member etcd: it lists, applies each change once, and lists again after a compaction."""

from __future__ import annotations

import asyncio
import contextlib

from kvpush.client.backoff import Backoff
from kvpush.etcd.follow import follow_prefix

WAIT_S = 10.0


class Follower:
    """What a mirror keeps: the keys and values under the prefix, from listings and watch batches."""

    def __init__(self, client, prefix: bytes):
        self.client, self.prefix = client, prefix
        self.values: dict[bytes, bytes] = {}
        self.listings: list[int] = []
        self.applied: list[tuple[str, bytes]] = []
        self.changed = asyncio.Event()

    async def relist(self) -> int:
        kvs, revision = await self.client.get_prefix(self.prefix)
        self.values = {kv.key: kv.value for kv in kvs}
        self.listings.append(revision)
        self.changed.set()
        return revision

    def apply(self, batch) -> None:
        for event in batch.events:
            self.applied.append((event.type, event.kv.key))
            if event.type == "PUT":
                self.values[event.kv.key] = event.kv.value
            else:
                self.values.pop(event.kv.key, None)
        self.changed.set()

    async def until(self, predicate) -> None:
        async with asyncio.timeout(WAIT_S):
            while not predicate():
                self.changed.clear()
                await self.changed.wait()


@contextlib.asynccontextmanager
async def following(follower: Follower, revision: int | None = None):
    task = asyncio.create_task(follow_prefix(follower.client, follower.prefix, relist=follower.relist, apply=follower.apply,
                                             backoff=Backoff(0.05, 0.2), revision=revision))
    try:
        yield task
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_lists_first_then_applies_each_change_once(etcd, etcd_prefix):
    await etcd.put(etcd_prefix + b"a", b"1")
    follower = Follower(etcd, etcd_prefix)
    async with following(follower):
        await follower.until(lambda: follower.listings)
        await etcd.put(etcd_prefix + b"b", b"2")
        await etcd.delete(etcd_prefix + b"a")
        await follower.until(lambda: follower.values == {etcd_prefix + b"b": b"2"})
    assert len(follower.listings) == 1
    assert follower.applied == [("PUT", etcd_prefix + b"b"), ("DELETE", etcd_prefix + b"a")]


async def test_a_revision_compacted_away_is_answered_by_listing_again(etcd, etcd_prefix):
    old = await etcd.put(etcd_prefix + b"a", b"1")
    await etcd.put(etcd_prefix + b"a", b"2")
    current = await etcd.put(etcd_prefix + b"c", b"3")
    await etcd.compact(current)
    follower = Follower(etcd, etcd_prefix)
    async with following(follower, revision=old):  # as if its watch had broken right after `old`
        await follower.until(lambda: follower.listings)
        assert follower.listings[0] >= current
        assert follower.values == {etcd_prefix + b"a": b"2", etcd_prefix + b"c": b"3"}
        await etcd.put(etcd_prefix + b"d", b"4")
        await follower.until(lambda: etcd_prefix + b"d" in follower.values)
    assert follower.applied == [("PUT", etcd_prefix + b"d")]
