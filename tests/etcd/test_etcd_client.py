# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""EtcdClient against a real 3-member etcd: KV, Txn, leases, watches (resume, compaction) and member failures."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from kvpush import errors
from kvpush.etcd.client import (
    Compacted,
    EtcdClient,
    compare_lease,
    compare_value,
    compare_version,
    op_delete,
    op_put,
    prefix_end,
)
from tests.waiting import eventually

WAIT_S = 10.0


async def next_batch(watch):
    async with asyncio.timeout(WAIT_S):
        return await anext(watch)




def test_prefix_end():
    assert prefix_end(b"/a/") == b"/a0"
    assert prefix_end(b"a\xff") == b"b"
    assert prefix_end(b"\xff\xff") == b"\0"


async def test_put_get_prefix_and_delete(etcd, etcd_prefix):
    p = etcd_prefix
    first = await etcd.put(p + b"b", b"2")
    second = await etcd.put(p + b"a", b"1")
    await etcd.put(p[:-1] + b"-outside", b"x")
    assert second > first

    kv = await etcd.get(p + b"a")
    assert (kv.key, kv.value, kv.create_revision, kv.mod_revision, kv.version, kv.lease) == (p + b"a", b"1", second, second, 1, 0)
    assert await etcd.get(p + b"missing") is None

    kvs, revision = await etcd.get_prefix(p)
    assert [(kv.key, kv.value) for kv in kvs] == [(p + b"a", b"1"), (p + b"b", b"2")]
    assert revision >= second

    assert await etcd.delete(p + b"a") == 1
    assert await etcd.delete(p + b"a") == 0
    await etcd.put(p + b"c", b"3")
    assert await etcd.delete(p, prefix=True) == 2
    assert (await etcd.get_prefix(p))[0] == []
    assert await etcd.delete(p[:-1] + b"-outside") == 1


async def test_txn_compares(etcd, etcd_prefix):
    key = etcd_prefix + b"k"
    create = ([compare_version(key, "=", 0)], [op_put(key, b"v1")], [op_put(etcd_prefix + b"lost", b"1")])
    succeeded, revision = await etcd.txn(*create)
    assert succeeded and (await etcd.get(key)).mod_revision == revision
    succeeded, _ = await etcd.txn(*create)
    assert not succeeded and (await etcd.get(etcd_prefix + b"lost")).value == b"1"

    assert (await etcd.txn([compare_value(key, "=", b"v1")], [op_put(key, b"v2")]))[0]
    assert not (await etcd.txn([compare_value(key, "=", b"v1")], [op_put(key, b"v3")]))[0]
    assert (await etcd.txn([compare_value(key, "!=", b"v1"), compare_version(key, ">", 1)], [op_delete(etcd_prefix, prefix=True)]))[0]
    assert (await etcd.get_prefix(etcd_prefix))[0] == []

    lease, _ = await etcd.grant(5)
    await etcd.put(key, b"leased", lease=lease)
    assert not (await etcd.txn([compare_lease(key, "=", lease + 1)], [op_delete(key)]))[0]
    assert (await etcd.txn([compare_lease(key, "=", lease)], [op_delete(key)]))[0]
    await etcd.revoke(lease)


async def test_lease_keepalive_expiry_and_revoke(etcd, etcd_prefix):
    lease, ttl = await etcd.grant(1)
    assert ttl >= 1
    await etcd.put(etcd_prefix + b"a", b"1", lease=lease)
    assert (await etcd.get(etcd_prefix + b"a")).lease == lease
    # Renewed for twice its ttl, the key outlives it ...
    for _ in range(4):
        assert await etcd.keep_alive_once(lease) >= 1
        await asyncio.sleep(0.5)
    assert await etcd.get(etcd_prefix + b"a") is not None
    # ... and goes once renewals stop.
    started = time.monotonic()

    async def key_gone():
        return await etcd.get(etcd_prefix + b"a") is None

    await eventually(key_gone)
    assert time.monotonic() - started < 5
    assert await etcd.time_to_live(lease) == -1
    assert await etcd.keep_alive_once(lease) <= 0

    lease, _ = await etcd.grant(30)
    assert 0 < await etcd.time_to_live(lease) <= 30
    await etcd.put(etcd_prefix + b"b", b"1", lease=lease)
    await etcd.revoke(lease)
    assert await etcd.get(etcd_prefix + b"b") is None
    assert await etcd.time_to_live(lease) == -1
    await etcd.revoke(lease)  # already gone: not an error


async def test_watch_from_a_revision_with_prev_kv(etcd, etcd_prefix):
    p = etcd_prefix
    start = await etcd.put(p + b"a", b"1")
    await etcd.put(p + b"b", b"1")
    watch = etcd.watch_prefix(p, start_revision=start, prev_kv=True)
    try:
        seen = []
        while len(seen) < 2:
            seen += (await next_batch(watch)).events
        assert [(e.type, e.kv.key) for e in seen] == [("PUT", p + b"a"), ("PUT", p + b"b")]
        await etcd.put(p + b"a", b"2")
        await etcd.delete(p + b"b")
        seen = []
        while len(seen) < 2:
            batch = await next_batch(watch)
            seen += batch.events
        put, delete = seen
        assert (put.type, put.kv.value, put.prev_kv.value) == ("PUT", b"2", b"1")
        assert (delete.type, delete.kv.key, delete.prev_kv.value) == ("DELETE", p + b"b", b"1")
        assert batch.revision >= delete.kv.mod_revision
    finally:
        await watch.aclose()


async def test_resuming_after_the_first_batch_of_a_long_backlog_misses_nothing(etcd, etcd_prefix):
    # etcd sends a watch's backlog 1000 revisions at a time, each response
    # with the current revision in its header: resuming from that would skip
    # the rest. WatchBatch.revision is the last event's.
    _, start = await etcd.get_prefix(etcd_prefix)
    keys = [etcd_prefix + b"%04d" % n for n in range(1100)]
    for chunk in range(0, len(keys), 100):
        await asyncio.gather(*(etcd.put(key, b"") for key in keys[chunk:chunk + 100]))
    async with contextlib.aclosing(etcd.watch_prefix(etcd_prefix, start_revision=start + 1)) as watch:
        first = await next_batch(watch)
    assert len(first.events) < len(keys)
    seen = [event.kv.key for event in first.events]
    async with contextlib.aclosing(etcd.watch_prefix(etcd_prefix, start_revision=first.revision + 1)) as watch:
        while len(seen) < len(keys):
            seen += [event.kv.key for event in (await next_batch(watch)).events]
    assert sorted(seen) == keys
    await etcd.delete(etcd_prefix, prefix=True)


async def test_watch_resumes_on_another_member_after_its_member_dies(etcd_cluster, etcd, etcd_prefix):
    p = etcd_prefix
    # The watching client talks to member 1 first.
    order = [etcd_cluster.endpoints[i] for i in (1, 0, 2)]
    watcher = EtcdClient(order, timeout_s=5.0)
    _, revision = await etcd.get_prefix(p)
    # The watch opens on the first read; from revision + 1, the put below is
    # in it whichever comes first.
    watch = watcher.watch_prefix(p, start_revision=revision + 1)
    try:
        await etcd.put(p + b"a", b"1")
        last = await next_batch(watch)
        assert [e.kv.key for e in last.events] == [p + b"a"]
        etcd_cluster.kill(1)
        with pytest.raises(errors.Unavailable):
            await next_batch(watch)
        await etcd.put(p + b"b", b"1")  # while no watch is open
        await watch.aclose()
        watch = watcher.watch_prefix(p, start_revision=last.revision + 1)
        batch = await next_batch(watch)
        assert [(e.type, e.kv.key) for e in batch.events] == [("PUT", p + b"b")]
    finally:
        await watch.aclose()
        await watcher.close()
        etcd_cluster.restart(1)


async def test_watch_from_a_compacted_revision_raises_compacted(etcd, etcd_prefix):
    old = await etcd.put(etcd_prefix + b"a", b"1")
    await etcd.put(etcd_prefix + b"a", b"2")
    current = await etcd.put(etcd_prefix + b"a", b"3")
    await etcd.compact(current)
    watch = etcd.watch_prefix(etcd_prefix, start_revision=old)
    with pytest.raises(Compacted) as raised:
        await next_batch(watch)
    assert raised.value.compact_revision == current
    await watch.aclose()


async def test_client_keeps_working_while_the_leader_is_killed(etcd_cluster, etcd, etcd_prefix):
    # The client talks to the leader first; killing it (an election follows)
    # must not fail a call.
    statuses = [await etcd.status(endpoint) for endpoint in etcd_cluster.endpoints]
    leader = next(i for i, status in enumerate(statuses) if status.member_id == status.leader)
    client = EtcdClient(etcd_cluster.endpoints[leader:] + etcd_cluster.endpoints[:leader], timeout_s=5.0)
    written = []

    async def writer():
        for n in range(200):
            await client.put(etcd_prefix + b"k", str(n).encode())
            written.append(n)
            await asyncio.sleep(0.005)

    try:
        task = asyncio.create_task(writer())
        await eventually(lambda: asyncio.sleep(0, len(written) >= 20), interval=0.01)
        etcd_cluster.kill(leader)
        async with asyncio.timeout(30):
            await task
        assert (await client.get(etcd_prefix + b"k")).value == b"199"
        assert (await client.txn([compare_version(etcd_prefix + b"k", ">", 0)], [op_delete(etcd_prefix + b"k")]))[0]
    finally:
        await client.close()
        etcd_cluster.restart(leader)


async def test_status_names_the_leader(etcd_cluster, etcd):
    statuses = [await etcd.status(endpoint) for endpoint in etcd_cluster.endpoints]
    leaders = {status.leader for status in statuses}
    assert len(leaders) == 1 and leaders <= {status.member_id for status in statuses}
    assert all(status.version.startswith("3.") and status.errors == [] for status in statuses)


async def test_calls_move_on_from_a_member_that_stopped_answering(etcd_cluster, etcd_prefix):
    # Member 0 is paused (connected, silent): a retried call gives it its
    # share of the deadline (1 s of 3 s) and is answered by the next member.
    client = EtcdClient(etcd_cluster.endpoints, timeout_s=3.0)
    try:
        await client.put(etcd_prefix + b"k", b"1")
        etcd_cluster.pause(0)
        started = time.monotonic()
        assert (await client.get(etcd_prefix + b"k")).value == b"1"
        assert time.monotonic() - started < 3.0
        # Later calls start at the member that answered.
        started = time.monotonic()
        assert (await client.txn([compare_value(etcd_prefix + b"k", "=", b"1")], [op_delete(etcd_prefix + b"k")]))[0]
        assert time.monotonic() - started < 1.0
    finally:
        await client.close()
        etcd_cluster.resume(0)
        etcd_cluster.wait_healthy()
