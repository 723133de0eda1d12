# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""ShardMap and ShardedBrokerClient against `kvpush broker --etcd` members as real processes on the session's etcd."""

from __future__ import annotations

import signal
import time

import grpc
from sharded_brokers import LEASE_TTL_S, WAIT_S, T, deployment

from kvpush import shards
from kvpush.client import ClientConfig, ShardedBrokerClient, ShardMap
from kvpush.client.backoff import Backoff
from kvpush.dev import sample_engines as sample
from kvpush.dev.localstack.scaled import multi_target
from kvpush.rendezvous.v1 import rendezvous_service_pb2 as rv_pb
from kvpush.rendezvous.v1 import transfer_pb2 as tr_pb
from tests.waiting import eventually

TRANSFERS = [f"t{n}" for n in range(12)]




async def held_by(plane, member_id: str, transfer_id: str) -> bool:
    """Whether member_id holds an attempt of transfer_id (asked directly, as the router)."""
    try:
        await plane.stub(member_id).GetTransfer(rv_pb.GetTransferRequest(transfer_id=transfer_id, attempt=1), metadata=plane.bearer("router"), timeout=T)
    except grpc.aio.AioRpcError:
        return False
    return True


async def test_the_sharded_client_reaches_each_owner_and_follows_a_member_that_dies(tmp_path, etcd_cluster, etcd_prefix):
    async with deployment(tmp_path, etcd_cluster.endpoints, etcd_prefix) as plane:
        await plane.start_brokers("b1", "b2", "b3")
        addresses = {member_id: service.address for member_id, service in plane.brokers.items()}
        # The seed is every member: the map stream goes on through another when one dies.
        config = ClientConfig(target=multi_target(addresses.values()), token=plane.token("decode-0"), default_timeout_s=T)
        shard_map = ShardMap(config, backoff=Backoff(0.02, 0.2))
        changes: list[tuple[dict, dict]] = []
        shard_map.add_listener(lambda added, removed: changes.append((added, removed)))
        async with ShardedBrokerClient(config, shard_map=shard_map) as client:
            # Before any map, a call goes to the seed; a member that is not the owner redirects it.
            early = await client.register_destination(sample.destination_request("early"))
            assert early.state == tr_pb.TRANSFER_STATE_WAITING_FOR_PREFILL
            assert await held_by(plane, shards.owner("early", addresses), "early")

            assert await shard_map.wait_ready(WAIT_S)
            await eventually(lambda: shard_map.members() == addresses)
            assert shard_map.sharded and shard_map.revision > 0
            for transfer_id in TRANSFERS:
                answer = await client.register_destination(sample.destination_request(transfer_id))
                assert answer.state == tr_pb.TRANSFER_STATE_WAITING_FOR_PREFILL
                assert shard_map.owner(transfer_id) == (shards.owner(transfer_id, addresses), addresses[shards.owner(transfer_id, addresses)])
                assert await held_by(plane, shard_map.owner(transfer_id)[0], transfer_id)

            # b3 dies: its lease lapses, the map drops it, its transfers go to their next owners.
            b3_client = client.client_for(addresses["b3"])
            await plane.brokers["b3"].kill()
            await eventually(lambda: "b3" not in shard_map.members(), LEASE_TTL_S + WAIT_S)
            remaining = {member_id: address for member_id, address in addresses.items() if member_id != "b3"}
            assert shard_map.members() == remaining
            assert changes[-1] == ({}, {"b3": addresses["b3"]})
            await eventually(lambda: b3_client._channel is None)  # the client of a member that left is closed
            moved = next(t for t in (f"m{n}" for n in range(100)) if shards.owner(t, addresses) == "b3")
            answer = await client.register_destination(sample.destination_request(moved))
            assert answer.state == tr_pb.TRANSFER_STATE_WAITING_FOR_PREFILL
            assert await held_by(plane, shards.owner(moved, remaining), moved)


async def test_a_hung_first_member_is_left_for_another_at_once_and_dropped_when_etcd_drops_it(tmp_path, etcd_cluster, etcd_prefix):
    """SIGSTOP of the member every client follows first: it keeps its connections open and says nothing. The map is
    followed on another member within a few heartbeats, so the member leaves every client's map as soon as etcd drops
    it (its lease), not when it wakes; its transfers go to their next owners meanwhile."""
    async with deployment(tmp_path, etcd_cluster.endpoints, etcd_prefix) as plane:
        await plane.start_brokers("b1", "b2", "b3")
        addresses = {member_id: service.address for member_id, service in plane.brokers.items()}
        config = ClientConfig(target=addresses["b1"], token=plane.token("decode-0"), default_timeout_s=1.0)
        shard_map = ShardMap(config, backoff=Backoff(0.02, 0.2))
        async with ShardedBrokerClient(config, shard_map=shard_map) as client:
            assert await shard_map.wait_ready(WAIT_S)
            await eventually(lambda: shard_map.members() == addresses)
            hung = plane.brokers["b1"].process
            hung.signal(signal.SIGSTOP)
            try:
                paused_at = time.monotonic()
                await eventually(lambda: shard_map.followed != addresses["b1"], 3.0)
                left_after_s = time.monotonic() - paused_at
                await eventually(lambda: "b1" not in shard_map.members(), LEASE_TTL_S + 3.0)
                dropped_after_s = time.monotonic() - paused_at
                # Silence is noticed in SILENT_HEARTBEATS intervals (1 s) and etcd drops a member 2-3 s after its last renewal.
                assert left_after_s < 2.0 and dropped_after_s < LEASE_TTL_S + 2.0, (left_after_s, dropped_after_s)
                moved = next(t for t in (f"h{n}" for n in range(100)) if shards.owner(t, addresses) == "b1")
                answer = await client.register_destination(sample.destination_request(moved))
                assert answer.state == tr_pb.TRANSFER_STATE_WAITING_FOR_PREFILL
                assert await held_by(plane, shards.owner(moved, {m: a for m, a in addresses.items() if m != "b1"}), moved)
            finally:
                hung.signal(signal.SIGCONT)


async def test_a_client_leaving_a_hung_member_for_another_hung_one_moves_on_again(tmp_path, etcd_cluster, etcd_prefix):
    """Two of three members hung at once: the member the client turns to next says nothing either, and a new stream's
    first map is awaited only as long as a known member's silence bound, so it reaches the third within a few seconds."""
    async with deployment(tmp_path, etcd_cluster.endpoints, etcd_prefix) as plane:
        await plane.start_brokers("b1", "b2", "b3")
        addresses = {member_id: service.address for member_id, service in plane.brokers.items()}
        config = ClientConfig(target=addresses["b1"], token=plane.token("decode-0"), default_timeout_s=1.0)
        shard_map = ShardMap(config, backoff=Backoff(0.02, 0.2))
        async with ShardedBrokerClient(config, shard_map=shard_map) as client:
            assert await shard_map.wait_ready(WAIT_S)
            await eventually(lambda: shard_map.members() == addresses)
            # A call to every member: the process holds a connection to each, as an engine does, so a stream opened on a
            # hung member rides an open connection and hears nothing (no connect or handshake to fail).
            for member_id in addresses:
                owned = next(t for t in (f"c{n}" for n in range(100)) if shards.owner(t, addresses) == member_id)
                await client.register_destination(sample.destination_request(owned))
            # The client turns to the next address after the one it leaves (kvpush.client.shard_map): hang that one too.
            ring = sorted(addresses.values())
            turned_to = ring[(ring.index(addresses["b1"]) + 1) % len(ring)]
            by_address = {address: member_id for member_id, address in addresses.items()}
            (last,) = set(addresses) - {"b1", by_address[turned_to]}
            hung = [plane.brokers[m].process for m in ("b1", by_address[turned_to])]
            for process in hung:
                process.signal(signal.SIGSTOP)
            try:
                paused_at = time.monotonic()
                await eventually(lambda: shard_map.followed == addresses[last], 5.0)
                assert time.monotonic() - paused_at < 4.0
                await eventually(lambda: set(shard_map.members()) == {last}, LEASE_TTL_S + 3.0)
            finally:
                for process in hung:
                    process.signal(signal.SIGCONT)
