# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""KeptLease against a real 3-member etcd: renewal, held() when etcd stops answering, loss and revoke on close."""

from __future__ import annotations

import asyncio
import time

from kvpush.etcd.client import EtcdClient
from kvpush.etcd.lease import KeptLease

WAIT_S = 10.0


async def test_renewal_keeps_the_lease_and_its_keys(etcd, etcd_prefix):
    async with KeptLease(etcd, 1) as lease:
        await etcd.put(etcd_prefix + b"k", b"v", lease=lease.id)
        for _ in range(15):  # 3 s: three times the ttl
            assert lease.held()
            await asyncio.sleep(0.2)
        assert (await etcd.get(etcd_prefix + b"k")).lease == lease.id
        assert await etcd.time_to_live(lease.id) >= 0
        assert not lease.lost.is_set()


async def test_close_revokes_the_lease(etcd, etcd_prefix):
    lease = await KeptLease(etcd, 30).start()
    await etcd.put(etcd_prefix + b"k", b"v", lease=lease.id)
    await lease.close()
    assert not lease.held()
    assert await etcd.get(etcd_prefix + b"k") is None
    assert await etcd.time_to_live(lease.id) == -1
    await lease.close()  # twice is harmless


async def test_a_lease_revoked_elsewhere_is_lost(etcd):
    async with KeptLease(etcd, 1) as lease:
        await etcd.revoke(lease.id)
        async with asyncio.timeout(WAIT_S):
            await lease.lost.wait()
        assert not lease.held()


async def test_held_turns_false_within_the_ttl_once_etcd_stops_answering(etcd_cluster, etcd):
    async with KeptLease(etcd, 2) as lease:
        await asyncio.sleep(0.1)
        assert lease.held()
        paused_at = time.monotonic()
        try:
            with etcd_cluster.paused():
                async with asyncio.timeout(WAIT_S):
                    await lease.lost.wait()
                # The last renewal was sent at most ttl / RENEWALS_PER_TTL before the pause.
                assert time.monotonic() - paused_at <= lease.ttl_s + 0.5
                assert not lease.held()
        finally:
            etcd_cluster.wait_healthy()


async def test_a_killed_leader_costs_no_lease(etcd_cluster, etcd):
    # A renewal sent through a follower waits out the election (about a second
    # here) and the lease stays held: only an election longer than
    # ttl - ttl/RENEWALS_PER_TTL gives it up.
    statuses = [await etcd.status(endpoint) for endpoint in etcd_cluster.endpoints]
    leader = next(i for i, status in enumerate(statuses) if status.member_id == status.leader)
    follower = etcd_cluster.endpoints[(leader + 1) % len(etcd_cluster.endpoints)]
    client = EtcdClient([follower], timeout_s=5.0)
    try:
        async with KeptLease(client, 4) as lease:
            etcd_cluster.kill(leader)
            ends = time.monotonic() + lease.ttl_s + 1
            while time.monotonic() < ends:
                assert lease.held(), "the lease was given up during the election"
                await asyncio.sleep(0.05)
            assert await client.time_to_live(lease.id) > 0
    finally:
        await client.close()
        etcd_cluster.restart(leader)
