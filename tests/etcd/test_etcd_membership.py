# SPDX-License-Identifier: Apache-2.0
"""EtcdMembership against a real 3-member etcd: joining, leaving, a lost lease or key, and etcd going silent."""

from __future__ import annotations

import asyncio
import contextlib

from kvpush.etcd.client import EtcdClient
from kvpush.services.broker.etcd_membership import EtcdMembership, brokers_prefix
from tests.waiting import eventually

WAIT_S = 10.0
TTL_S = 2


@contextlib.asynccontextmanager
async def member(endpoints, prefix: bytes, member_id: str, *, client: EtcdClient | None = None, listener=None):
    """A running EtcdMembership on its own client (or client); left (lease revoked) on exit. listener hears every change from its start."""
    client = client or EtcdClient(endpoints, timeout_s=2.0)
    membership = EtcdMembership(client, member_id=member_id, prefix=prefix.decode(), lease_ttl_s=TTL_S, max_backoff_s=0.5)
    membership.address = f"127.0.0.1:{1000 + len(member_id)}"
    if listener is not None:
        membership.add_listener(lambda: listener(membership))
    task = asyncio.create_task(membership.run())
    try:
        yield membership
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await membership.close()
        await client.close()




async def test_members_see_each_other_and_a_leaving_member_drops_out_at_once(etcd_cluster, etcd_prefix):
    async with member(etcd_cluster.endpoints, etcd_prefix, "a") as a:
        changes = []
        a.add_listener(lambda: changes.append(a.revision))
        await eventually(a.serving)
        async with member(etcd_cluster.endpoints, etcd_prefix, "bb") as b:
            await eventually(lambda: b.serving() and set(a.members()) == {"a", "bb"})
            assert dict(a.members()) == dict(b.members()) == {"a": "127.0.0.1:1001", "bb": "127.0.0.1:1002"}
            assert b.owner("t1") == a.owner("t1") in ("a", "bb")
            joined_at = a.revision
        # Leaving revokes the lease: the others drop it without waiting for a ttl.
        assert await eventually(lambda: set(a.members()) == {"a"}, timeout=TTL_S) < TTL_S
        assert a.revision > joined_at and changes == sorted(changes)


async def test_a_lost_lease_stops_serving_and_the_member_joins_again_by_itself(etcd_cluster, etcd_prefix, etcd):
    async with member(etcd_cluster.endpoints, etcd_prefix, "a") as a:
        await eventually(a.serving)
        key = brokers_prefix(etcd_prefix.decode()) + b"a"
        first_lease = (await etcd.get(key)).lease
        seen = []
        a.add_listener(lambda: seen.append(a.serving()))
        await etcd.revoke(first_lease)  # as if etcd expired it
        await eventually(lambda: False in seen)
        await eventually(a.serving)
        assert (await etcd.get(key)).lease not in (0, first_lease)
        # Its key deleted behind its back: it writes it again under a new lease.
        second_lease = (await etcd.get(key)).lease
        await etcd.delete(key)
        await eventually(lambda: seen.count(False) >= 2)
        await eventually(a.serving)
        assert (await etcd.get(key)).lease not in (0, second_lease)


async def test_a_member_cut_off_from_etcd_stops_serving_within_its_ttl_and_rejoins(etcd_cluster, etcd_prefix):
    async with member(etcd_cluster.endpoints, etcd_prefix, "a") as a:
        await eventually(a.serving)
        with etcd_cluster.paused():
            assert await eventually(lambda: not a.serving(), timeout=TTL_S + 0.5) <= TTL_S + 0.1
        await asyncio.to_thread(etcd_cluster.wait_healthy)
        await eventually(a.serving, timeout=15.0)


async def test_a_restarted_member_takes_its_key_over_from_its_old_lease(etcd_cluster, etcd_prefix, etcd):
    key = brokers_prefix(etcd_prefix.decode()) + b"a"
    old_lease, _ = await etcd.grant(TTL_S)
    await etcd.put(key, b"", lease=old_lease)  # a previous incarnation's key, its lease not yet expired
    async with member(etcd_cluster.endpoints, etcd_prefix, "a") as a:
        await eventually(a.serving)
        await asyncio.sleep(TTL_S + 0.5)  # the old lease expires: the key is the new lease's now
        assert a.serving() and (await etcd.get(key)).lease != old_lease


async def test_losing_one_etcd_member_costs_the_membership_nothing(etcd_cluster, etcd_prefix):
    async with member(etcd_cluster.endpoints, etcd_prefix, "a") as a:
        await eventually(a.serving)
        lapses = []
        a.add_listener(lambda: lapses.append(a.serving()) if not a.serving() else None)
        await asyncio.to_thread(etcd_cluster.kill, 0)  # the member its client talks to first
        try:
            async with member(etcd_cluster.endpoints, etcd_prefix, "bb"):
                await eventually(lambda: set(a.members()) == {"a", "bb"})
                for _ in range(20):  # a lease ttl and then some: renewals go to the others
                    assert a.serving()
                    await asyncio.sleep(0.1)
        finally:
            await asyncio.to_thread(etcd_cluster.restart, 0)
        assert lapses == []


async def test_its_previous_key_lapsing_as_it_joins_does_not_evict_it(etcd_cluster, etcd_prefix, etcd):
    """A member serves from its own put on (the map it read just before, plus itself) and follows the watch from that read:
    a deletion between the read and the put, its previous incarnation's lease lapsing, is not a deletion of its new key."""
    key = brokers_prefix(etcd_prefix.decode()) + b"a"
    old_lease, _ = await etcd.grant(TTL_S)
    await etcd.put(key, b"", lease=old_lease)
    client = EtcdClient(etcd_cluster.endpoints, timeout_s=2.0)
    real_put = client.put

    async def put(k, v, *, lease=0):
        if k == key:
            await etcd.revoke(old_lease)  # lapses after the member read the map, before its own put
        return await real_put(k, v, lease=lease)

    client.put = put
    history = []
    async with member(etcd_cluster.endpoints, etcd_prefix, "a", client=client, listener=lambda m: history.append(m.serving())) as a:
        await eventually(a.serving)
        await asyncio.sleep(1.0)  # the watch delivered the old key's deletion meanwhile
        assert a.serving()
        assert False not in history[history.index(True):], history
        assert (await etcd.get(key)).lease not in (0, old_lease)
