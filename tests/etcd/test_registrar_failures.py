# SPDX-License-Identifier: Apache-2.0
"""The etcd-backed registrar when things die: an etcd member (SIGKILL) under registrations and renewals, and one replica process (SIGKILL) under its clients and a broker."""

from __future__ import annotations

import asyncio
import time

import grpc
from registrar_replicas import TOKENS, UPSERTED, WAIT_S, T, Watch, bearer, running_replica

from kvpush.dev import sample_engines as sample
from kvpush.dev.localstack.scaled import multi_target
from kvpush.registrar.v1 import registrar_service_pb2 as reg_pb
from kvpush.registrar.v1 import registrar_service_pb2_grpc as reg_grpc
from kvpush.rendezvous.v1 import rendezvous_service_pb2 as rv_pb
from kvpush.rendezvous.v1 import rendezvous_service_pb2_grpc as rv_grpc
from kvpush.rendezvous.v1 import transfer_pb2 as tr_pb
from kvpush.services.common.config import write_private_file
from tests.kvpush_process import KvpushProcess, wait_serving

READY = reg_pb.ENGINE_STATE_READY


async def _leader(etcd, cluster) -> int:
    """The index of the member etcd's members follow."""
    deadline = time.monotonic() + WAIT_S
    while True:
        statuses = [await etcd.status(endpoint) for endpoint in cluster.endpoints]
        for index, member in enumerate(statuses):
            if member.leader and member.member_id == member.leader:
                return index
        assert time.monotonic() < deadline, "no etcd leader"
        await asyncio.sleep(0.1)


async def _renew(replica, engine_id: str, leases: list[str], stop: asyncio.Event, unknown: list[str], failed: list[str]) -> int:
    """Renews leases every 0.3 s until stop, on a KeepAlive stream opened again 0.2 s after a failure as an engine does; returns
    how many renewals answered.

    A stream the replica ended (a renewal etcd could not answer within the
    replica's etcd deadline, or the replica died) lands in failed: with
    grpc.aio, a write after the server ended the call can replace its status
    by INTERNAL "Internal error from Core" (grpc/grpc#36066) or raise
    InvalidStateError, so only the failure is recorded.
    """
    renewals = 0
    while not stop.is_set():
        stream = replica.stub.KeepAlive(metadata=bearer(engine_id), timeout=60)
        try:
            while not stop.is_set():
                await stream.write(reg_pb.KeepAliveRequest(lease_ids=leases))
                response = await asyncio.wait_for(stream.read(), WAIT_S)
                unknown.extend(response.unknown_lease_ids)
                renewals += 1
                await asyncio.sleep(0.3)
        except grpc.aio.AioRpcError as exc:
            failed.append(f"{exc.code().name}: {exc.details()}")
        except (TimeoutError, asyncio.InvalidStateError) as exc:
            failed.append(repr(exc))
        finally:
            stream.cancel()
        if not stop.is_set():
            await asyncio.sleep(0.2)
    return renewals


async def test_an_etcd_member_killed_under_registrations_and_renewals_fails_nothing(etcd_cluster, etcd_prefix, etcd):
    endpoints = etcd_cluster.endpoints
    async with running_replica(endpoints, etcd_prefix) as a, running_replica(endpoints, etcd_prefix) as b:
        leases = [(await a.register(r)).lease_id for r in sample.engine_requests("decode-0", sample.DECODE, tp_size=2, lease_ttl_s=2)]
        stop, unknown, failed = asyncio.Event(), [], []
        renewer = asyncio.create_task(_renew(b, "decode-0", leases, stop, unknown, failed))
        leader = await _leader(etcd, etcd_cluster)
        etcd_cluster.kill(leader)
        try:
            # Registrations through both replicas while etcd elects a new leader, then after.
            for i, (engine_id, role) in enumerate([("prefill-0", sample.PREFILL), ("prefill-1", sample.PREFILL), ("decode-1", sample.DECODE)]):
                await (a if i % 2 else b).register(sample.rank_request(engine_id, role))
            await asyncio.sleep(2.5)  # past decode-0's TTL: only the renewals keep it
            stop.set()
            # The leases live on: no renewal found one gone and renewals went on through the election
            # (at most one stream ended by a renewal the election outlasted, and opened again).
            assert await renewer > 3 and unknown == [] and len(failed) <= 1, (unknown, failed)
            for replica in (a, b):
                for engine_id in ("decode-0", "prefill-0", "prefill-1", "decode-1"):
                    assert (await replica.engine(engine_id)).state == READY, engine_id
        finally:
            stop.set()
            await asyncio.gather(renewer, return_exceptions=True)
            await asyncio.to_thread(etcd_cluster.restart, leader)


async def _accepted(broker: rv_grpc.RendezvousServiceStub, transfer_id: str, decode_engine_id: str) -> None:
    """Sends RegisterDestination until the broker knows the engines (its mirror of the registrar may lag)."""
    request = sample.destination_request(transfer_id, decode_engine_id=decode_engine_id)
    deadline = time.monotonic() + WAIT_S
    while True:
        try:
            await broker.RegisterDestination(request, metadata=bearer(decode_engine_id), timeout=T)
            return
        except grpc.aio.AioRpcError as exc:
            assert exc.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE), exc.details()
            assert time.monotonic() < deadline, f"the broker never knew {decode_engine_id}: {exc.details()}"
            await asyncio.sleep(0.1)


async def test_one_replica_killed_leaves_the_other_its_clients_and_the_broker_serving(tmp_path, etcd_cluster, etcd_prefix):
    tokens_dir = tmp_path / "tokens"
    tokens_dir.mkdir(mode=0o700)
    for identity, token in TOKENS.items():  # the tokens bearer() presents
        write_private_file(tokens_dir / identity, token + "\n")
    shared = ("--tokens-dir", str(tokens_dir))
    etcd_args = ("--etcd", ",".join(etcd_cluster.endpoints), "--etcd-prefix", etcd_prefix.decode(), "--min-lease-ttl", "1")
    a = KvpushProcess(tmp_path, "registrar-a", "registrar", *shared, *etcd_args)
    b = KvpushProcess(tmp_path, "registrar-b", "registrar", *shared, *etcd_args)
    broker = None
    try:
        await asyncio.gather(a.start(), b.start())
        # The broker follows whichever replica its multi-address target reaches (the first while it lives).
        broker = await KvpushProcess(tmp_path, "broker", "broker", *shared, "--registrar", multi_target([a.address, b.address])).start()
        async with (
            grpc.aio.insecure_channel(a.address) as channel_a,
            grpc.aio.insecure_channel(b.address) as channel_b,
            grpc.aio.insecure_channel(broker.address) as broker_channel,
        ):
            for channel in (channel_a, channel_b):
                await wait_serving(channel, "kvpush.registrar.v1.RegistrarService")
            stub_a, stub_b = reg_grpc.RegistrarServiceStub(channel_a), reg_grpc.RegistrarServiceStub(channel_b)
            prefill = await stub_a.RegisterEngineRank(sample.rank_request("prefill-0", sample.PREFILL, lease_ttl_s=2), metadata=bearer("prefill-0"), timeout=T)
            await stub_b.RegisterEngineRank(sample.rank_request("decode-0", sample.DECODE), metadata=bearer("decode-0"), timeout=T)
            keep_alive = stub_a.KeepAlive(metadata=bearer("prefill-0"), timeout=60)
            await keep_alive.write(reg_pb.KeepAliveRequest(lease_ids=[prefill.lease_id]))
            assert not (await asyncio.wait_for(keep_alive.read(), WAIT_S)).unknown_lease_ids
            watch = await Watch(_ReplicaStub(stub_b)).opened()
            await wait_serving(broker_channel, "kvpush.rendezvous.v1.RendezvousService")
            rendezvous = rv_grpc.RendezvousServiceStub(broker_channel)
            await _accepted(rendezvous, "t0", "decode-0")
            try:
                assert len([await watch.next() for _ in range(2)]) == 2  # the snapshot
                await a.kill()
                # The rank's KeepAlive reconnects to b and keeps its lease past its TTL.
                keep_alive.cancel()
                stop, unknown, failed = asyncio.Event(), [], []
                renewer = asyncio.create_task(_renew(_ReplicaStub(stub_b), "prefill-0", [prefill.lease_id], stop, unknown, failed))
                await asyncio.sleep(2.5)
                stop.set()
                assert await renewer > 3 and unknown == [] and failed == []
                engines = (await stub_b.ListEngines(reg_pb.ListEnginesRequest(), metadata=bearer("router"), timeout=T)).engines
                assert [(e.engine_id, e.state) for e in engines] == [("decode-0", READY), ("prefill-0", READY)]
                # b's own watcher never noticed; it sees what comes next.
                await stub_b.RegisterEngineRank(sample.rank_request("decode-1", sample.DECODE), metadata=bearer("decode-1"), timeout=T)
                event = await watch.next()
                assert (event.type, event.engine.engine_id, event.engine.state) == (UPSERTED, "decode-1", READY)
                # The broker follows b now: it knows the engine registered after a died.
                await _accepted(rendezvous, "t1", "decode-1")
            finally:
                await watch.close()
    finally:
        statuses = [await service.stop() for service in (broker, b) if service is not None]
        await a.stop()
    assert statuses == [0, 0]


class _ReplicaStub:
    """What Watch and _renew need of a replica: its stub."""

    def __init__(self, stub: reg_grpc.RegistrarServiceStub):
        self.stub = stub


async def test_every_replica_down_for_five_seconds_expires_no_engine_and_fails_no_transfer(tmp_path, etcd_cluster, etcd_prefix):
    """Both replicas killed at once for 5 s: no rank is renewed and none is ended meanwhile; a rank's etcd lease outlives
    its 2 s TTL by the outage grace (6 s), so when the replicas are back the engine's renewals find its lease, the broker
    never heard of a departure and the transfer waiting on the engine still waits."""
    tokens_dir = tmp_path / "tokens"
    tokens_dir.mkdir(mode=0o700)
    for identity, token in TOKENS.items():
        write_private_file(tokens_dir / identity, token + "\n")
    shared = ("--tokens-dir", str(tokens_dir))
    etcd_args = ("--etcd", ",".join(etcd_cluster.endpoints), "--etcd-prefix", etcd_prefix.decode(), "--min-lease-ttl", "1")
    replicas = [KvpushProcess(tmp_path, f"registrar-{name}", "registrar", *shared, *etcd_args) for name in "ab"]
    broker = None
    try:
        await asyncio.gather(*(replica.start() for replica in replicas))
        target = multi_target([replica.address for replica in replicas])
        broker = await KvpushProcess(tmp_path, "broker", "broker", *shared, "--registrar", target).start()
        async with grpc.aio.insecure_channel(target) as channel, grpc.aio.insecure_channel(broker.address) as broker_channel:
            await wait_serving(channel, "kvpush.registrar.v1.RegistrarService")
            stub = reg_grpc.RegistrarServiceStub(channel)
            prefill = await stub.RegisterEngineRank(sample.rank_request("prefill-0", sample.PREFILL, lease_ttl_s=2), metadata=bearer("prefill-0"), timeout=T)
            await stub.RegisterEngineRank(sample.rank_request("decode-0", sample.DECODE), metadata=bearer("decode-0"), timeout=T)
            await wait_serving(broker_channel, "kvpush.rendezvous.v1.RendezvousService")
            rendezvous = rv_grpc.RendezvousServiceStub(broker_channel)
            await _accepted(rendezvous, "t0", "decode-0")
            stop, unknown, failed = asyncio.Event(), [], []  # renewals fail while both replicas are down: failed is not asserted on
            renewers = [asyncio.create_task(_renew(_ReplicaStub(stub), "prefill-0", [prefill.lease_id], stop, unknown, failed))]
            try:
                await asyncio.sleep(1.0)
                await asyncio.gather(*(replica.kill() for replica in replicas))
                await asyncio.sleep(5.0)
                await asyncio.gather(*(replica.restart() for replica in replicas))
                for replica in replicas:
                    await wait_serving(replica.channel, "kvpush.registrar.v1.RegistrarService")
                await asyncio.sleep(2.0)  # renewals through the restarted replicas, past the rank's TTL
            finally:
                stop.set()
                renewed = await asyncio.gather(*renewers)
            assert unknown == [] and all(renewed), (unknown, renewed)
            # Read through a restarted replica's own channel: the shared one may still be backing off from the outage.
            restarted = reg_grpc.RegistrarServiceStub(replicas[0].channel)
            engines = (await restarted.ListEngines(reg_pb.ListEnginesRequest(), metadata=bearer("router"), timeout=T)).engines
            assert ("prefill-0", READY) in [(e.engine_id, e.state) for e in engines]
            transfer = (await rendezvous.GetTransfer(rv_pb.GetTransferRequest(transfer_id="t0", attempt=1), metadata=bearer("router"), timeout=T)).transfer
            assert transfer.state == tr_pb.TRANSFER_STATE_WAITING_FOR_PREFILL, transfer
    finally:
        statuses = [await service.stop() for service in (broker, *replicas) if service is not None]
    assert statuses == [0, 0, 0]
