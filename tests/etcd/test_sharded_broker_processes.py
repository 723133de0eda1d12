# SPDX-License-Identifier: Apache-2.0
"""`kvpush broker --etcd` members as real processes on a real 3-member etcd, beside an in-memory `kvpush registrar`."""

from __future__ import annotations

import asyncio

import grpc
from sharded_brokers import LEASE_TTL_S, NOT_SERVING, SERVING, T, deployment, map_until, next_map, until_health

from kvpush import status
from kvpush.dev import sample_engines as sample
from kvpush.errors import Reason
from kvpush.etcd.client import EtcdClient
from kvpush.rendezvous.v1 import rendezvous_service_pb2 as rv_pb
from kvpush.rendezvous.v1 import transfer_pb2 as tr_pb
from kvpush.services.broker.etcd_membership import brokers_prefix
from tests.sharding import owned_by


def refusal(error: grpc.aio.AioRpcError) -> tuple[grpc.StatusCode, str, dict[str, str]]:
    info = status.error_info(error)
    return error.code(), info.reason, dict(info.metadata)


async def test_members_share_one_map_and_send_each_transfer_to_its_owner(tmp_path, etcd_cluster, etcd_prefix):
    async with deployment(tmp_path, etcd_cluster.endpoints, etcd_prefix) as plane:
        await plane.start_brokers("b1", "b2", "b3")
        addresses = {member_id: service.address for member_id, service in plane.brokers.items()}
        for member_id in addresses:
            watch = plane.watch(member_id)
            shards_map, _ = await map_until(watch, lambda m: len(m) == 3)
            assert shards_map == addresses
            watch.cancel()
        decode = plane.bearer("decode-0")
        transfer_id = owned_by("b2", addresses)
        with_b1 = plane.stub("b1").RegisterDestination(sample.destination_request(transfer_id), metadata=decode, timeout=T)
        try:
            await with_b1
            raise AssertionError("a non-owner accepted the registration")
        except grpc.aio.AioRpcError as error:
            code, reason, metadata = refusal(error)
        assert (code, reason) == (grpc.StatusCode.FAILED_PRECONDITION, Reason.NOT_SHARD_OWNER)
        assert (metadata["owner_member_id"], metadata["owner_address"], metadata["fenced"]) == ("b2", addresses["b2"], "false")
        answer = await plane.stub("b2").RegisterDestination(sample.destination_request(transfer_id), metadata=decode, timeout=T)
        assert answer.state == tr_pb.TRANSFER_STATE_WAITING_FOR_PREFILL
        # The same refusal per item on an engine's report stream, which every member accepts.
        reports = plane.stub("b1").EngineReports(metadata=plane.bearer("prefill-0"), timeout=30)
        await reports.write(rv_pb.EngineReportsRequest(engine_id="prefill-0", prefill_done=[sample.prefill_done_request(transfer_id)]))
        (item,) = (await asyncio.wait_for(reports.read(), T)).prefill_done
        assert (item.error.reason, item.error.metadata["owner_member_id"], item.error.metadata["owner_address"]) == (
            Reason.NOT_SHARD_OWNER, "b2", addresses["b2"]
        )
        reports.cancel()
        try:
            await plane.stub("b3").GetTransfer(rv_pb.GetTransferRequest(transfer_id=transfer_id), metadata=plane.bearer("router"), timeout=T)
            raise AssertionError("a non-owner answered")
        except grpc.aio.AioRpcError as error:
            assert refusal(error)[1:] == (Reason.NOT_SHARD_OWNER, {"owner_member_id": "b2", "owner_address": addresses["b2"], "field": "transfer_id"})
        # A member that stops leaves the map first (revoking its lease): the others drop it at once, not a lease ttl later.
        watch = plane.watch("b1")
        await map_until(watch, lambda m: len(m) == 3)
        (_, took), _ = await asyncio.gather(map_until(watch, lambda m: "b3" not in m, timeout=LEASE_TTL_S + 3), plane.brokers["b3"].stop())
        assert took < LEASE_TTL_S / 2 and plane.brokers["b3"].process.returncode == 0
        watch.cancel()


async def test_a_killed_member_drops_out_after_its_lease_ttl_and_rejoins_when_restarted(tmp_path, etcd_cluster, etcd_prefix):
    async with deployment(tmp_path, etcd_cluster.endpoints, etcd_prefix) as plane:
        await plane.start_brokers("b1", "b2")
        watch = plane.watch("b1")
        await map_until(watch, lambda m: set(m) == {"b1", "b2"})
        await plane.brokers["b2"].kill()
        shards_map, took = await map_until(watch, lambda m: "b2" not in m, timeout=LEASE_TTL_S + 3)
        assert shards_map == {"b1": plane.brokers["b1"].address}
        assert took > LEASE_TTL_S / 2  # its key went with its lease, not at once
        # b1 owns everything now, b2's transfers too.
        decode = plane.bearer("decode-0")
        events = plane.stub("b1").StreamTransferEvents(
            rv_pb.StreamTransferEventsRequest(engine_id="decode-0", incarnation="inc-1"), metadata=decode, timeout=60
        )
        await asyncio.wait_for(events.initial_metadata(), T)
        moving = owned_by("b2", ("b1", "b2"))
        await plane.stub("b1").RegisterDestination(sample.destination_request(moving), metadata=decode, timeout=T)
        etcd = EtcdClient(etcd_cluster.endpoints)
        try:
            assert await etcd.get(brokers_prefix(plane.prefix) + b"b2") is None
        finally:
            await etcd.close()
        # Restarted with the same member id (on a new port), it rejoins by itself and owns its transfers again.
        await plane.start_brokers("b2")
        shards_map, _ = await map_until(watch, lambda m: "b2" in m)
        assert shards_map == {"b1": plane.brokers["b1"].address, "b2": plane.brokers["b2"].address}
        # The attempt b1 held for a transfer that is b2's again ends, so that no two members serve it.
        event = (await asyncio.wait_for(events.read(), T)).event
        assert (event.key.transfer_id, event.type, event.reason) == (moving, tr_pb.TRANSFER_EVENT_TYPE_FAILED, tr_pb.END_REASON_BROKER_SHARD_MOVED)
        answer = await plane.stub("b2").RegisterDestination(sample.destination_request(moving, 2), metadata=decode, timeout=T)
        assert answer.state == tr_pb.TRANSFER_STATE_WAITING_FOR_PREFILL
        watch.cancel()
        events.cancel()


async def test_a_member_cut_off_from_etcd_stops_serving_and_ends_its_attempts_then_serves_again(tmp_path, etcd_cluster, etcd_prefix):
    async with deployment(tmp_path, etcd_cluster.endpoints, etcd_prefix) as plane:
        await plane.start_brokers("b1")
        broker, decode = plane.stub("b1"), plane.bearer("decode-0")
        events = broker.StreamTransferEvents(rv_pb.StreamTransferEventsRequest(engine_id="decode-0", incarnation="inc-1"), metadata=decode, timeout=60)
        await asyncio.wait_for(events.initial_metadata(), T)
        await broker.RegisterDestination(sample.destination_request("t1"), metadata=decode, timeout=T)
        watch = plane.watch("b1")
        assert set(await next_map(watch)) == {"b1"}
        with etcd_cluster.paused():
            took = await until_health(plane.brokers["b1"], NOT_SERVING, timeout=LEASE_TTL_S + 2)
            assert took <= LEASE_TTL_S + 1
            event = (await asyncio.wait_for(events.read(), T)).event
            assert (event.key.transfer_id, event.type, event.reason) == ("t1", tr_pb.TRANSFER_EVENT_TYPE_FAILED, tr_pb.END_REASON_BROKER_SHARD_LOST)
            try:
                await broker.RegisterDestination(sample.destination_request("t2"), metadata=decode, timeout=T)
                raise AssertionError("a member that is not serving answered")
            except grpc.aio.AioRpcError as error:
                assert refusal(error)[:2] == (grpc.StatusCode.UNAVAILABLE, Reason.BROKER_SHARD_LOST)
            # Its map stream ends the same way, after the map heartbeats it sent while it still served.
            try:
                for _ in range(4 * (LEASE_TTL_S + 2)):
                    await asyncio.wait_for(watch.read(), T)
                raise AssertionError("a member that is not serving kept sending its map")
            except grpc.aio.AioRpcError as error:
                assert refusal(error)[:2] == (grpc.StatusCode.UNAVAILABLE, Reason.BROKER_SHARD_LOST)
        await asyncio.to_thread(etcd_cluster.wait_healthy)
        await until_health(plane.brokers["b1"], SERVING, timeout=15)
        answer = await broker.RegisterDestination(sample.destination_request("t2"), metadata=decode, timeout=T)
        assert answer.state == tr_pb.TRANSFER_STATE_WAITING_FOR_PREFILL
        events.cancel()
