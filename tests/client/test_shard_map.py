# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""ShardMap and ShardedBrokerClient against real grpc.aio broker members (shard_members) and the unsharded fake."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from fake_control_plane import Behaviour, serve
from shard_members import Cluster, members

from kvpush import errors, shards
from kvpush.client import UNSHARDED, BrokerClient, ClientConfig, ShardedBrokerClient, ShardMap
from kvpush.client.backoff import Backoff
from kvpush.dev.localstack.scaled import multi_target
from kvpush.rendezvous.v1 import rendezvous_service_pb2 as rv_pb
from tests.waiting import eventually

TRANSFERS = [f"xfer-{n}" for n in range(40)]
WAIT_S = 5.0


def shard_map(target: str) -> ShardMap:
    return ShardMap(ClientConfig(target=target, default_timeout_s=2.0), backoff=Backoff(0.01, 0.05))


@contextlib.asynccontextmanager
async def following(target: str):
    """A started ShardMap on target, closed on the way out."""
    followed = shard_map(target)
    try:
        yield followed
    finally:
        await followed.close()


def get(transfer_id: str) -> rv_pb.GetTransferRequest:
    return rv_pb.GetTransferRequest(transfer_id=transfer_id, attempt=1)


async def test_a_broker_without_watch_shards_is_unsharded():
    behaviour = Behaviour()
    async with serve(behaviour) as target:
        sharded = ShardedBrokerClient(ClientConfig(target=target))
        try:
            response = await sharded.get_transfer(get("t-1"))
            assert await sharded.shard_map.wait_ready(WAIT_S)
            assert response.transfer.key.transfer_id == "t-1"
            assert not sharded.shard_map.sharded
            assert sharded.shard_map.members() == {UNSHARDED: target}
            assert sharded.shard_map.owner("t-1") == (UNSHARDED, target)
        finally:
            await sharded.close()


async def test_unsharded_calls_go_to_the_seed_without_waiting_for_the_map():
    cluster = Cluster()
    cluster.answer_watches.clear()  # WatchShards answers nothing until the test says so
    async with members(cluster, ["solo"]) as served:
        seed = served["solo"].address
        sharded = ShardedBrokerClient(ClientConfig(target=seed), shard_map=shard_map(seed))
        try:
            await asyncio.wait_for(sharded.get_transfer(get("t-1")), 2.0)
            assert not sharded.shard_map.ready.is_set()
            cluster.answer_watches.set()
            assert await sharded.shard_map.wait_ready(WAIT_S)
            await sharded.report_write_result(rv_pb.ReportWriteResultRequest(key={"transfer_id": "t-2", "attempt": 1}))
            assert sharded.shard_map.members() == {UNSHARDED: seed}
            assert served["solo"].calls == [("GetTransfer", "t-1"), ("ReportWriteResult", "t-2")]
        finally:
            await sharded.close()
            await sharded.shard_map.close()


async def test_a_sharded_map_sends_each_transfer_to_its_owner_once():
    cluster = Cluster()
    async with members(cluster, ["m0", "m1", "m2"]) as served:
        await cluster.publish(cluster.membership, revision=5)
        async with ShardedBrokerClient(ClientConfig(target=served["m0"].address)) as sharded:
            assert await sharded.shard_map.wait_ready(WAIT_S)
            assert sharded.shard_map.revision == 5
            assert sharded.shard_map.members() == cluster.membership
            for transfer_id in TRANSFERS:
                response = await sharded.get_transfer(get(transfer_id))
                owner = shards.owner(transfer_id, cluster.membership)
                assert response.transfer.detail == owner
                assert sharded.shard_map.owner(transfer_id) == (owner, cluster.membership[owner])
            for member_id, member in served.items():
                assert member.calls == [("GetTransfer", t) for t in TRANSFERS if shards.owner(t, cluster.membership) == member_id]


async def test_not_shard_owner_is_resent_once_to_the_owner_it_names():
    cluster = Cluster()
    async with members(cluster, ["m0", "m1"]) as served:
        # The published map still lacks m1, which the members already count.
        await cluster.publish({"m0": served["m0"].address}, revision=3)
        async with ShardedBrokerClient(ClientConfig(target=served["m0"].address)) as sharded:
            assert await sharded.shard_map.wait_ready(WAIT_S)
            moved = next(t for t in TRANSFERS if shards.owner(t, cluster.membership) == "m1")
            request = rv_pb.CancelTransferRequest(key={"transfer_id": moved, "attempt": 1})
            await sharded.cancel_transfer(request)
            assert served["m0"].calls == [("CancelTransfer", moved)]
            assert served["m1"].calls == [("CancelTransfer", moved)]

            # Two members that each name the other: one resend, then the refusal.
            served["m0"].view = {"m1": served["m1"].address}
            served["m1"].view = {"m0": served["m0"].address}
            with pytest.raises(errors.FailedPrecondition) as refused:
                await sharded.get_transfer(get(moved))
            assert refused.value.reason == errors.Reason.NOT_SHARD_OWNER
            assert refused.value.metadata["owner_member_id"] == "m0"
            assert [call for member in served.values() for call in member.calls].count(("GetTransfer", moved)) == 2


async def test_a_member_leaving_moves_its_transfers_and_closes_its_client():
    cluster = Cluster()
    async with members(cluster, ["m0", "m1", "m2"]) as served:
        await cluster.publish(cluster.membership, revision=5)
        changes = []
        async with ShardedBrokerClient(ClientConfig(target=served["m0"].address)) as sharded:
            sharded.shard_map.add_listener(lambda added, removed: changes.append((added, removed)))
            assert await sharded.shard_map.wait_ready(WAIT_S)
            lost = [t for t in TRANSFERS if shards.owner(t, cluster.membership) == "m2"]
            await sharded.get_transfer(get(lost[0]))
            m2_client = sharded.client_for(served["m2"].address)

            everyone = dict(cluster.membership)
            gone = cluster.membership.pop("m2")
            await cluster.publish(cluster.membership, revision=6)
            await eventually(lambda: sharded.shard_map.revision == 6)
            # First the seed alone gives way to the whole map, then m2 leaves.
            assert changes == [(everyone, {UNSHARDED: served["m0"].address}), ({}, {"m2": gone})]
            await eventually(lambda: m2_client._channel is None)  # closed after its grace
            served["m2"].calls.clear()
            for transfer_id in lost:
                response = await sharded.get_transfer(get(transfer_id))
                assert response.transfer.detail == shards.owner(transfer_id, cluster.membership)
            assert served["m2"].calls == []


async def test_a_broken_stream_reconnects_and_an_older_map_is_ignored():
    cluster = Cluster()
    async with members(cluster, ["m0", "m1"]) as served:
        both = dict(cluster.membership)
        await cluster.publish(both, revision=7)
        async with following(served["m0"].address) as followed:
            assert await followed.wait_ready(WAIT_S)
            # A member that lags behind answers the reconnected stream with an older map: kept out.
            await cluster.break_streams()
            await cluster.publish({"m0": both["m0"]}, revision=4)
            await asyncio.sleep(0.2)
            assert followed.revision == 7
            assert followed.members() == both
            await cluster.publish({"m1": both["m1"]}, revision=8)
            await eventually(lambda: followed.revision == 8)
            assert followed.members() == {"m1": both["m1"]}
            assert followed.owner("anything") == ("m1", both["m1"])


async def test_a_multi_address_seed_follows_the_map_through_the_member_that_answers():
    cluster = Cluster()
    async with members(cluster, ["m0", "m1"]) as served:
        await cluster.publish(cluster.membership, revision=2)
        seed = multi_target([member.address for member in served.values()])
        async with following(seed) as followed:
            assert await followed.wait_ready(WAIT_S)
            assert followed.members() == cluster.membership


async def test_unimplemented_after_a_sharded_map_does_not_stop_following():
    """Only a broker from before WatchShards answers UNIMPLEMENTED; once a sharded map came, such an answer is from whatever
    else now listens on an address, and a map left unfollowed would route to a dead member for ever."""
    cluster = Cluster()
    async with members(cluster, ["m0", "m1"]) as served:
        both = dict(cluster.membership)
        await cluster.publish(both, revision=3)
        async with following(served["m0"].address) as followed:
            assert await followed.wait_ready(WAIT_S)
            cluster.watch_unimplemented = True
            await cluster.break_streams()
            await asyncio.sleep(0.2)  # several reconnections answered UNIMPLEMENTED
            cluster.watch_unimplemented = False
            await cluster.publish({"m0": both["m0"]}, revision=4)
            await eventually(lambda: followed.revision == 4)
            assert followed.members() == {"m0": both["m0"]}


async def test_a_stream_whose_channel_closes_under_its_reader_fails_instead_of_cancelling_the_reader():
    """gRPC hands the reader of a call it cancelled (its channel closed) a CancelledError: a follower loop catching stream
    failures would end with it, silently. The reader's own cancellation still propagates."""
    cluster = Cluster()
    async with members(cluster, ["m0"]) as served:
        await cluster.publish(cluster.membership, revision=1)
        client = BrokerClient(ClientConfig(target=served["m0"].address, default_timeout_s=2.0))
        stream = client.watch_shards()
        assert (await anext(stream)).revision == 1

        async def read_on():
            async for _ in stream:
                pass

        reader = asyncio.ensure_future(read_on())
        await asyncio.sleep(0.05)
        await client.close(0)
        with pytest.raises(errors.KvpushError) as failed:
            await asyncio.wait_for(reader, WAIT_S)
        assert failed.value.code == "CANCELLED"

        client = BrokerClient(ClientConfig(target=served["m0"].address, default_timeout_s=2.0))
        stream = client.watch_shards()
        reader = asyncio.ensure_future(read_on())
        await asyncio.sleep(0.05)
        reader.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reader
        await client.close(0)
