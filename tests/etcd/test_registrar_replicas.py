# SPDX-License-Identifier: Apache-2.0
"""Two registrar replicas on one real 3-member etcd: writes through one, reads and watches on the other, the same events and reasons as the local registrar."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from registrar_replicas import REMOVED, UPSERTED, T, Watch, bearer, running_replica

from kvpush.dev import sample_engines as sample
from kvpush.registrar.v1 import registrar_service_pb2 as reg_pb
from kvpush.services.registrar.directory import RemovalReason
from tests.waiting import eventually

PARTIAL, READY, GONE = reg_pb.ENGINE_STATE_PARTIAL, reg_pb.ENGINE_STATE_READY, reg_pb.ENGINE_STATE_GONE


@pytest.fixture
async def replicas(etcd_cluster, etcd_prefix):
    async with running_replica(etcd_cluster.endpoints, etcd_prefix) as a, running_replica(etcd_cluster.endpoints, etcd_prefix) as b:
        yield a, b


async def test_registered_on_one_replica_read_and_watched_on_the_other(replicas):
    a, b = replicas
    watch = await Watch(b).opened()
    try:
        first, second = [await a.register(r) for r in sample.engine_requests("decode-0", sample.DECODE, tp_size=2)]
        assert await watch.take(2) == [(UPSERTED, "decode-0", "inc-1", PARTIAL, ""), (UPSERTED, "decode-0", "inc-1", READY, "")]
        engine = (await b.stub.GetEngine(reg_pb.GetEngineRequest(engine_id="decode-0"), metadata=bearer("router"), timeout=T)).engine
        assert engine.state == READY and [r.rank.tp_rank for r in engine.ranks] == [0, 1]
        assert first.lease_id != second.lease_id and b.replica.directory.lease_engine(first.lease_id) == "decode-0"
        # Written through a: a reads its own write at once.
        assert (await a.engine("decode-0")).state == READY

        # Leases granted by a are renewed and ended through b.
        keep_alive = b.stub.KeepAlive(metadata=bearer("decode-0"), timeout=T)
        await keep_alive.write(reg_pb.KeepAliveRequest(lease_ids=[first.lease_id, second.lease_id]))
        renewed = await keep_alive.read()
        assert not renewed.unknown_lease_ids and renewed.expire_time.seconds > 0
        keep_alive.cancel()
        request = reg_pb.DeregisterEngineRankRequest(lease_id=second.lease_id)
        after = (await b.stub.DeregisterEngineRank(request, metadata=bearer("decode-0"), timeout=T)).engine
        assert after.state == PARTIAL and [r.rank.tp_rank for r in after.ranks] == [0]
        request = reg_pb.DeregisterEngineRankRequest(lease_id=first.lease_id)
        after = (await b.stub.DeregisterEngineRank(request, metadata=bearer("decode-0"), timeout=T)).engine
        assert after.state == GONE
        assert await watch.take(2) == [
            (UPSERTED, "decode-0", "inc-1", PARTIAL, RemovalReason.DEREGISTERED),
            (REMOVED, "decode-0", "inc-1", GONE, RemovalReason.DEREGISTERED),
        ]
        await eventually(lambda: _gone(a, "decode-0"))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await b.stub.DeregisterEngineRank(request, metadata=bearer("decode-0"), timeout=T)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        await watch.close()


async def _gone(replica, engine_id: str) -> bool:
    return await replica.engine(engine_id) is None


async def test_a_lapsed_lease_is_removed_on_every_replica(replicas):
    a, b = replicas
    removals = {name: [] for name in "ab"}
    for name, replica in zip("ab", replicas, strict=True):
        replica.replica.directory.add_removal_listener(lambda *args, seen=removals[name]: seen.append(args))
    watches = [await Watch(r).opened() for r in replicas]
    try:
        await a.register(sample.rank_request("prefill-0", sample.PREFILL, lease_ttl_s=1))
        for watch in watches:
            assert await watch.take(1) == [(UPSERTED, "prefill-0", "inc-1", READY, "")]
        # Nothing renews it: etcd ends the lease, and every replica says why.
        for watch in watches:
            assert await watch.take(1) == [(REMOVED, "prefill-0", "inc-1", GONE, RemovalReason.LEASE_EXPIRED)]
        assert removals == {name: [("prefill-0", "inc-1", RemovalReason.LEASE_EXPIRED)] for name in "ab"}
    finally:
        for watch in watches:
            await watch.close()


async def test_a_new_incarnation_through_either_replica_replaces_the_old(replicas):
    a, b = replicas
    old = [await a.register(r) for r in sample.engine_requests("decode-0", sample.DECODE, tp_size=2)]
    watches = [await Watch(r).opened() for r in replicas]
    try:
        for watch in watches:
            await watch.take(1)  # the snapshot
        await b.register(sample.rank_request("decode-0", sample.DECODE, incarnation="inc-2", tp_size=2))
        for watch in watches:
            assert await watch.take(2) == [
                (REMOVED, "decode-0", "inc-1", GONE, RemovalReason.REPLACED),
                (UPSERTED, "decode-0", "inc-2", PARTIAL, ""),
            ]
        keep_alive = a.stub.KeepAlive(metadata=bearer("decode-0"), timeout=T)
        await keep_alive.write(reg_pb.KeepAliveRequest(lease_ids=[lease.lease_id for lease in old]))
        assert list((await keep_alive.read()).unknown_lease_ids) == [lease.lease_id for lease in old]
        keep_alive.cancel()
    finally:
        for watch in watches:
            await watch.close()


async def test_identity_and_agreement_rules_hold_across_replicas(replicas):
    a, b = replicas
    request = sample.rank_request("decode-0", sample.DECODE, tp_size=2)
    lease = (await a.register(request)).lease_id
    assert (await b.register(request)).lease_id == lease  # a repeat through the other replica is the same registration

    async def refused(call, code):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call
        assert info.value.code() == code, info.value.details()

    changed = sample.rank_request("decode-0", sample.DECODE, tp_size=2)
    changed.nixl.agent_metadata = b"other"
    await refused(b.register(changed), grpc.StatusCode.ALREADY_EXISTS)
    await refused(b.register(sample.rank_request("decode-0", sample.DECODE, tp_rank=1, tp_size=4)), grpc.StatusCode.FAILED_PRECONDITION)
    await refused(b.register(sample.rank_request("decode-0", sample.PREFILL, tp_rank=1, tp_size=2)), grpc.StatusCode.FAILED_PRECONDITION)
    # Another engine may neither renew nor end decode-0's lease, through either replica.
    for replica in replicas:
        keep_alive = replica.stub.KeepAlive(metadata=bearer("prefill-0"), timeout=T)
        await keep_alive.write(reg_pb.KeepAliveRequest(lease_ids=[lease]))
        await refused(keep_alive.read(), grpc.StatusCode.PERMISSION_DENIED)
        deregister = replica.stub.DeregisterEngineRank(reg_pb.DeregisterEngineRankRequest(lease_id=lease), metadata=bearer("prefill-0"), timeout=T)
        await refused(deregister, grpc.StatusCode.PERMISSION_DENIED)
    # A lease that names nothing is no one's: unknown, not refused.
    keep_alive = b.stub.KeepAlive(metadata=bearer("prefill-0"), timeout=T)
    await keep_alive.write(reg_pb.KeepAliveRequest(lease_ids=["not-a-lease", "7fffffff"]))
    assert list((await keep_alive.read()).unknown_lease_ids) == ["not-a-lease", "7fffffff"]
    keep_alive.cancel()
    assert (await b.engine("decode-0")).state == PARTIAL


async def test_replicas_racing_cannot_admit_conflicting_ranks(replicas):
    a, b = replicas
    for attempt in range(5):
        engine_id = "decode-1" if attempt % 2 else "decode-0"
        incarnation = f"race-{attempt}"
        # The same rank with other metadata, and another rank of another size, through both replicas at once.
        first = sample.rank_request(engine_id, sample.DECODE, incarnation=incarnation, tp_size=2)
        second = sample.rank_request(engine_id, sample.DECODE, incarnation=incarnation, tp_size=2)
        second.nixl.agent_metadata = b"other"
        third = sample.rank_request(engine_id, sample.DECODE, incarnation=incarnation, tp_rank=3, tp_size=4)
        results = await asyncio.gather(a.register(first), b.register(second), b.register(third), return_exceptions=True)
        admitted = [r for r in results if not isinstance(r, BaseException)]
        assert len(admitted) == 1, results
        assert all(r.code() in (grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.FAILED_PRECONDITION) for r in results if isinstance(r, BaseException))
        await eventually(lambda engine_id=engine_id, incarnation=incarnation: _ranks_are(b, engine_id, incarnation, 1))
        assert len((await a.engine(engine_id)).ranks) == 1


async def _ranks_are(replica, engine_id: str, incarnation: str, count: int) -> bool:
    engine = await replica.engine(engine_id)
    return engine is not None and engine.incarnation == incarnation and len(engine.ranks) == count


async def test_a_watch_resumes_on_another_replica_from_its_last_revision(replicas):
    a, b = replicas
    prefill = await a.register(sample.rank_request("prefill-0", sample.PREFILL))
    watch = await Watch(a).opened()
    snapshot = await watch.next()
    await a.register(sample.rank_request("decode-0", sample.DECODE))
    seen = await watch.next()
    assert seen.engine.engine_id == "decode-0" and seen.revision > snapshot.revision
    await watch.close()
    # While nobody watches, prefill-0 leaves; the watcher resumes on b where it stopped.
    request = reg_pb.DeregisterEngineRankRequest(lease_id=prefill.lease_id)
    await b.stub.DeregisterEngineRank(request, metadata=bearer("prefill-0"), timeout=T)
    resumed = await Watch(b, start_revision=seen.revision + 1).opened()
    try:
        event = await resumed.next()
        assert (event.type, event.engine.engine_id, event.reason) == (REMOVED, "prefill-0", RemovalReason.DEREGISTERED)
        assert event.revision > seen.revision and resumed.pending() == 0
    finally:
        await resumed.close()
    # A revision older than what b holds gets a fresh snapshot, ended by SNAPSHOT_END.
    fresh = await Watch(b, start_revision=1).opened()
    try:
        events = [await fresh.next(), await fresh.next()]
        assert [(e.type, e.engine.engine_id) for e in events] == [(UPSERTED, "decode-0"), (reg_pb.ENGINE_EVENT_TYPE_SNAPSHOT_END, "")]
        assert events[0].revision == events[1].revision >= event.revision  # the snapshot's revision, on each of its events
    finally:
        await fresh.close()


async def test_a_mirror_whose_history_was_compacted_lists_again_and_reports_the_difference(replicas, etcd):
    a, b = replicas
    kept = await a.register(sample.rank_request("decode-0", sample.DECODE))
    leaving = await a.register(sample.rank_request("prefill-0", sample.PREFILL))
    await eventually(lambda: _ranks_are(b, "prefill-0", "inc-1", 1))
    removed: list[tuple[str, str, str]] = []
    b.replica.directory.add_removal_listener(lambda *args: removed.append(args))
    # b stops following (as if its watch broke), a changes etcd, etcd compacts that history away.
    await b.stop_following()
    await a.stub.DeregisterEngineRank(reg_pb.DeregisterEngineRankRequest(lease_id=leaving.lease_id), metadata=bearer("prefill-0"), timeout=T)
    await a.register(sample.rank_request("prefill-1", sample.PREFILL))
    _, revision = await etcd.get_prefix(b"/")
    await etcd.compact(revision)
    watch = await Watch(b).opened()
    b.follow()
    try:
        await eventually(lambda: _ranks_are(b, "prefill-1", "inc-1", 1))
        assert await b.engine("prefill-0") is None and b.replica.directory.lease_engine(kept.lease_id) == "decode-0"
        assert removed == [("prefill-0", "inc-1", RemovalReason.LEASE_EXPIRED)]  # its departure key went with the history
        await watch.take(2)  # the snapshot
        assert sorted(await watch.take(2)) == [
            (UPSERTED, "prefill-1", "inc-1", READY, ""),
            (REMOVED, "prefill-0", "inc-1", GONE, RemovalReason.LEASE_EXPIRED),
        ]
    finally:
        await watch.close()
