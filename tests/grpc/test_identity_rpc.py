# SPDX-License-Identifier: Apache-2.0
"""Identities that can't be borrowed (token mode): every act one identity may not do, tried over real gRPC.

Each caller holds only its own token; the control plane maps it to `router`,
`broker` or an engine id, and an engine-scoped call must come from the
engine it names. (The mTLS equivalents are in test_mtls_rpc.py.)
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
from rpc_harness import CALL_TIMEOUT_S, WAIT_S, FakeEngine, bearer, expect_rpc_error, read, running_control_plane

from kvpush.dev import sample_engines as sample
from kvpush.errors import Reason
from kvpush.registrar.v1 import registrar_service_pb2 as reg_pb
from kvpush.registrar.v1 import registrar_service_pb2_grpc as reg_grpc
from kvpush.rendezvous.v1 import rendezvous_service_pb2 as rv_pb
from kvpush.rendezvous.v1 import rendezvous_service_pb2_grpc as rv_grpc
from kvpush.rendezvous.v1 import transfer_pb2 as tr_pb
from kvpush.services.common.config import ServerConfig
from kvpush.services.registrar.config import RegistrarConfig

T = CALL_TIMEOUT_S
CODE = grpc.StatusCode
DENIED, MISMATCH = CODE.PERMISSION_DENIED, Reason.ENGINE_IDENTITY_MISMATCH


async def _engine(channel: grpc.aio.Channel, engine_id: str) -> reg_pb.Engine:
    return (
        await reg_grpc.RegistrarServiceStub(channel).GetEngine(reg_pb.GetEngineRequest(engine_id=engine_id), metadata=bearer(), timeout=T)
    ).engine


# ----- registration and leases -----


@pytest.mark.parametrize("identity", ["router", "broker"])
@pytest.mark.parametrize("engine_id", ["prefill-0", "router"])
async def test_the_router_and_broker_may_not_register_as_an_engine(channel, identity, engine_id):
    registrar = reg_grpc.RegistrarServiceStub(channel)
    call = registrar.RegisterEngineRank(sample.rank_request(engine_id, sample.PREFILL), metadata=bearer(identity), timeout=T)
    await expect_rpc_error(call, DENIED, MISMATCH, "rank.engine_id")
    assert not (await registrar.ListEngines(reg_pb.ListEnginesRequest(), metadata=bearer(), timeout=T)).engines


async def test_an_engine_may_not_register_as_another(channel):
    registrar = reg_grpc.RegistrarServiceStub(channel)
    call = registrar.RegisterEngineRank(sample.rank_request("decode-0", sample.DECODE), metadata=bearer("prefill-0"), timeout=T)
    await expect_rpc_error(call, DENIED, MISMATCH, "rank.engine_id")


async def test_an_engine_may_not_obtain_anothers_lease_by_registering_its_rank_again(engines):
    prefill, decode = engines
    # Identical to decode-0's registration: before per-identity tokens it returned decode-0's lease.
    call = prefill.registrar.RegisterEngineRank(sample.rank_request("decode-0", sample.DECODE), metadata=prefill.metadata, timeout=T)
    error = await expect_rpc_error(call, DENIED, MISMATCH, "rank.engine_id")
    assert decode.leases[0] not in (error.details() or "")
    again = await decode.registrar.RegisterEngineRank(sample.rank_request("decode-0", sample.DECODE), metadata=decode.metadata, timeout=T)
    assert again.lease_id == decode.leases[0]  # the engine itself still gets its lease back (registration is idempotent)


async def test_an_engine_may_not_evict_another_with_a_new_incarnation(engines):
    prefill, decode = engines
    takeover = sample.rank_request("decode-0", sample.DECODE, incarnation="inc-2")
    await expect_rpc_error(
        prefill.registrar.RegisterEngineRank(takeover, metadata=prefill.metadata, timeout=T), DENIED, MISMATCH, "rank.engine_id"
    )
    engine = await _engine(decode.channel, "decode-0")
    assert (engine.incarnation, engine.state) == ("inc-1", reg_pb.ENGINE_STATE_READY)


@pytest.mark.parametrize("identity", ["decode-0", "router", "broker"])
async def test_only_the_engine_keeps_its_lease_alive(engines, identity):
    prefill, _ = engines
    keep_alive = prefill.registrar.KeepAlive(metadata=bearer(identity), timeout=T)
    if identity == "decode-0":
        await keep_alive.write(reg_pb.KeepAliveRequest(lease_ids=prefill.leases))
    await expect_rpc_error(keep_alive.read(), DENIED, MISMATCH, "lease_ids")
    assert (await _engine(prefill.channel, "prefill-0")).state == reg_pb.ENGINE_STATE_READY  # the refused stream ended no lease


async def test_a_keep_alive_stream_renews_only_its_own_engines_leases(engines):
    prefill, decode = engines
    keep_alive = await prefill.keep_alive()
    await keep_alive.write(reg_pb.KeepAliveRequest(lease_ids=[*prefill.leases, *decode.leases]))
    await expect_rpc_error(keep_alive.read(), DENIED, MISMATCH, "lease_ids")


@pytest.mark.parametrize("identity", ["decode-0", "router", "broker"])
async def test_only_the_engine_deregisters_its_lease(engines, identity):
    prefill, _ = engines
    request = reg_pb.DeregisterEngineRankRequest(lease_id=prefill.leases[0])
    await expect_rpc_error(
        prefill.registrar.DeregisterEngineRank(request, metadata=bearer(identity), timeout=T), DENIED, MISMATCH, "lease_id"
    )
    assert (await _engine(prefill.channel, "prefill-0")).state == reg_pb.ENGINE_STATE_READY
    await prefill.registrar.DeregisterEngineRank(request, metadata=prefill.metadata, timeout=T)


@pytest.mark.parametrize("identity", ["router", "broker"])
async def test_the_router_and_broker_may_not_touch_leases_at_all(channel, identity):
    registrar = reg_grpc.RegistrarServiceStub(channel)
    # Refused before the lease is even looked up: permission comes before existence.
    call = registrar.DeregisterEngineRank(reg_pb.DeregisterEngineRankRequest(lease_id="none"), metadata=bearer(identity), timeout=T)
    await expect_rpc_error(call, DENIED, MISMATCH, "lease_id")


# ----- broker: engine-scoped calls -----


def _engine_calls(broker: rv_grpc.RendezvousServiceStub, metadata) -> dict:
    """Each engine-scoped broker call (made for prefill-0 or decode-0) and the field naming its engine."""
    return {
        "RegisterDestination": (
            lambda: broker.RegisterDestination(sample.destination_request("t1"), metadata=metadata, timeout=T),
            "destination.engine_id",
        ),
        "ReportPrefillDone": (
            lambda: broker.ReportPrefillDone(sample.prefill_done_request("t1"), metadata=metadata, timeout=T),
            "source.engine_id",
        ),
        "ReportWriteResult": (
            lambda: broker.ReportWriteResult(sample.write_result_request("t1"), metadata=metadata, timeout=T),
            "engine_id",
        ),
        "StreamWriteOrders": (
            lambda: broker.StreamWriteOrders(
                rv_pb.StreamWriteOrdersRequest(engine_id="prefill-0", incarnation="inc-1"), metadata=metadata, timeout=T
            ).read(),
            "engine_id",
        ),
        "StreamTransferEvents": (
            lambda: broker.StreamTransferEvents(
                rv_pb.StreamTransferEventsRequest(engine_id="decode-0", incarnation="inc-1"), metadata=metadata, timeout=T
            ).read(),
            "engine_id",
        ),
    }


CALLS = ["RegisterDestination", "ReportPrefillDone", "ReportWriteResult", "StreamWriteOrders", "StreamTransferEvents"]


@pytest.mark.parametrize("identity", ["router", "broker"])
@pytest.mark.parametrize("call", CALLS)
async def test_the_router_and_broker_never_make_engine_calls(engines, identity, call):
    prefill, _ = engines
    make, field = _engine_calls(prefill.broker, bearer(identity))[call]
    await expect_rpc_error(make(), DENIED, MISMATCH, field)


@pytest.mark.parametrize("call", CALLS)
async def test_an_engine_may_not_make_calls_for_another(engines, call):
    prefill, decode = engines
    # Each call names prefill-0 or decode-0; it comes from the other one.
    other = prefill if call in ("RegisterDestination", "StreamTransferEvents") else decode
    make, field = _engine_calls(other.broker, other.metadata)[call]
    await expect_rpc_error(make(), DENIED, MISMATCH, field)


# ----- broker: cancel and query -----


async def test_the_broker_identity_may_neither_cancel_nor_query_transfers(engines):
    prefill, decode = engines
    await decode.broker.RegisterDestination(sample.destination_request("t1"), metadata=decode.metadata, timeout=T)
    key = tr_pb.TransferKey(transfer_id="t1", attempt=1)
    await expect_rpc_error(
        decode.broker.CancelTransfer(rv_pb.CancelTransferRequest(key=key), metadata=bearer("broker"), timeout=T), DENIED, MISMATCH
    )
    await expect_rpc_error(
        decode.broker.GetTransfer(rv_pb.GetTransferRequest(transfer_id="t1"), metadata=bearer("broker"), timeout=T), DENIED, MISMATCH
    )
    transfer = (await decode.broker.GetTransfer(rv_pb.GetTransferRequest(transfer_id="t1"), metadata=prefill.metadata, timeout=T)).transfer
    assert transfer.state == tr_pb.TRANSFER_STATE_WAITING_FOR_PREFILL  # an engine may query; nothing was cancelled


async def test_an_engine_cancels_only_as_itself(channel):
    prefill = await FakeEngine(channel, "prefill-0", sample.PREFILL).register()
    decode = await FakeEngine(channel, "decode-0", sample.DECODE).register()
    other_decode = await FakeEngine(channel, "decode-1", sample.DECODE).register()
    await decode.broker.RegisterDestination(sample.destination_request("t1"), metadata=decode.metadata, timeout=T)
    cancel = rv_pb.CancelTransferRequest(key=tr_pb.TransferKey(transfer_id="t1", attempt=1))
    # decode-1 is a decode engine, but not this attempt's.
    await expect_rpc_error(other_decode.broker.CancelTransfer(cancel, metadata=other_decode.metadata, timeout=T), DENIED, MISMATCH, "key")
    # prefill-1 holds a valid token but is no registered engine (yet, as far as this broker knows): it may retry, and
    # cancels nothing meanwhile.
    await expect_rpc_error(prefill.broker.CancelTransfer(cancel, metadata=bearer("prefill-1"), timeout=T), CODE.UNAVAILABLE,
                           Reason.ENGINE_NOT_FOUND)
    assert (await decode.broker.CancelTransfer(cancel, metadata=decode.metadata, timeout=T)).state == tr_pb.TRANSFER_STATE_CANCELLED
    transfer = (await prefill.broker.GetTransfer(rv_pb.GetTransferRequest(transfer_id="t1"), metadata=bearer(), timeout=T)).transfer
    assert transfer.end_reason == tr_pb.END_REASON_CANCELLED_BY_DECODE


# ----- engine reads -----


@pytest.mark.parametrize("identity", ["router", "broker", "prefill-0", "decode-1"])
async def test_any_identity_may_read_and_watch_engines(engines, identity):
    prefill, _ = engines
    registrar = prefill.registrar
    listing = await registrar.ListEngines(reg_pb.ListEnginesRequest(role=sample.DECODE), metadata=bearer(identity), timeout=T)
    assert [engine.engine_id for engine in listing.engines] == ["decode-0"]
    engine = (await registrar.GetEngine(reg_pb.GetEngineRequest(engine_id="prefill-0"), metadata=bearer(identity), timeout=T)).engine
    assert engine.state == reg_pb.ENGINE_STATE_READY and engine.ranks[0].nixl.agent_metadata
    watch = registrar.WatchEngines(reg_pb.WatchEnginesRequest(), metadata=bearer(identity), timeout=T)
    first = await read(watch)
    assert first.type == reg_pb.ENGINE_EVENT_TYPE_UPSERTED and first.engine.engine_id == "decode-0"
    watch.cancel()


# ----- caps -----


async def test_engines_past_max_engines_are_refused():
    async with running_control_plane(ServerConfig(listen="127.0.0.1:0"), registrar_config=RegistrarConfig(max_engines=2)) as plane:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{plane.port}") as channel:
            await FakeEngine(channel, "prefill-0", sample.PREFILL).register()
            await FakeEngine(channel, "decode-0", sample.DECODE).register()
            third = FakeEngine(channel, "decode-1", sample.DECODE)
            await expect_rpc_error(third.register(), CODE.RESOURCE_EXHAUSTED, Reason.TOO_MANY_ENGINES, "rank.engine_id")
            # A registered engine still replaces its incarnation; leaving makes room.
            replaced = await FakeEngine(channel, "decode-0", sample.DECODE, incarnation="inc-2").register()
            request = reg_pb.DeregisterEngineRankRequest(lease_id=replaced.leases[0])
            await replaced.registrar.DeregisterEngineRank(request, metadata=replaced.metadata, timeout=T)
            await third.register()


async def test_watches_past_max_watches_per_identity_are_refused():
    async with running_control_plane(
        ServerConfig(listen="127.0.0.1:0"), registrar_config=RegistrarConfig(max_watches_per_identity=2)
    ) as plane:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{plane.port}") as channel:
            registrar = reg_grpc.RegistrarServiceStub(channel)

            async def watch(identity: str):
                call = registrar.WatchEngines(reg_pb.WatchEnginesRequest(), metadata=bearer(identity), timeout=T)
                await asyncio.wait_for(call.initial_metadata(), WAIT_S)
                return call

            first, _ = await watch("router"), await watch("router")
            extra = registrar.WatchEngines(reg_pb.WatchEnginesRequest(), metadata=bearer("router"), timeout=T)
            await expect_rpc_error(extra.read(), CODE.RESOURCE_EXHAUSTED, Reason.TOO_MANY_WATCHES)
            other = await watch("prefill-0")  # the cap is per identity
            first.cancel()
            deadline = asyncio.get_running_loop().time() + WAIT_S
            while plane.registrar.watch_count > 2:  # the server notices the cancelled stream
                assert asyncio.get_running_loop().time() < deadline
                await asyncio.sleep(0.01)
            (await watch("router")).cancel()
            other.cancel()
