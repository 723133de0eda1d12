# SPDX-License-Identifier: Apache-2.0
"""Refusals over real gRPC: status code, ErrorInfo reason and field; token auth; health, reflection, tracing."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from rpc_harness import CALL_TIMEOUT_S, FakeEngine, bearer, expect_rpc_error, running_control_plane, token_of

from kvpush.dev import sample_engines as sample
from kvpush.errors import Reason
from kvpush.registrar.v1 import registrar_service_pb2 as reg_pb
from kvpush.registrar.v1 import registrar_service_pb2_grpc as reg_grpc
from kvpush.rendezvous.v1 import rendezvous_service_pb2 as rv_pb
from kvpush.rendezvous.v1 import rendezvous_service_pb2_grpc as rv_grpc
from kvpush.services.broker.config import BrokerConfig
from kvpush.services.common.config import ServerConfig

T = CALL_TIMEOUT_S
CODE = grpc.StatusCode


# ----- token auth (what each identity may do: test_identity_rpc.py) -----


async def test_a_call_without_the_token_is_unauthenticated(channel):
    registrar = reg_grpc.RegistrarServiceStub(channel)
    await expect_rpc_error(registrar.ListEngines(reg_pb.ListEnginesRequest(), timeout=T), CODE.UNAUTHENTICATED, Reason.MISSING_CREDENTIALS)
    stream = registrar.WatchEngines(reg_pb.WatchEnginesRequest(), timeout=T)
    await expect_rpc_error(stream.read(), CODE.UNAUTHENTICATED, Reason.MISSING_CREDENTIALS)


@pytest.mark.parametrize(
    "authorization",
    ["Bearer not-a-token", f"Basic {token_of('prefill-0')}", token_of("prefill-0"), "Bearer ", f"Bearer {token_of('prefill-0')}x"],
    ids=["unknown token", "other scheme", "no scheme", "empty token", "token with a suffix"],
)
async def test_a_wrong_token_is_unauthenticated(channel, authorization):
    registrar = reg_grpc.RegistrarServiceStub(channel)
    metadata = (("authorization", authorization),)
    call = registrar.RegisterEngineRank(sample.rank_request("prefill-0", sample.PREFILL), metadata=metadata, timeout=T)
    await expect_rpc_error(call, CODE.UNAUTHENTICATED, Reason.BAD_TOKEN)
    keep_alive = registrar.KeepAlive(metadata=metadata, timeout=T)
    await expect_rpc_error(keep_alive.read(), CODE.UNAUTHENTICATED, Reason.BAD_TOKEN)


async def test_each_identity_is_known_by_its_own_token(engines):
    prefill, decode = engines
    for identity in ("router", "broker", "prefill-0", "decode-0"):
        listing = await prefill.registrar.ListEngines(reg_pb.ListEnginesRequest(role=sample.DECODE), metadata=bearer(identity), timeout=T)
        assert [engine.engine_id for engine in listing.engines] == ["decode-0"]
    # prefill-0's token is prefill-0, whichever engine a call names.
    await expect_rpc_error(
        decode.broker.RegisterDestination(sample.destination_request("t1"), metadata=prefill.metadata, timeout=T),
        CODE.PERMISSION_DENIED,
        Reason.ENGINE_IDENTITY_MISMATCH,
        "destination.engine_id",
    )


# ----- bad inputs -----


def _no_metadata(request: reg_pb.RegisterEngineRankRequest) -> reg_pb.RegisterEngineRankRequest:
    request.nixl.agent_metadata = b""
    return request


def _region_without_address(request: reg_pb.RegisterEngineRankRequest) -> reg_pb.RegisterEngineRankRequest:
    request.layout.regions[3].base_address = 0
    return request


def _bad_role(request: reg_pb.RegisterEngineRankRequest) -> reg_pb.RegisterEngineRankRequest:
    request.rank.role = 0
    return request


@pytest.mark.parametrize(
    "mutate, reason, field",
    [
        (_no_metadata, Reason.FIELD_REQUIRED, "nixl.agent_metadata"),
        (_region_without_address, Reason.FIELD_REQUIRED, "layout.regions[3].base_address"),
        (_bad_role, Reason.FIELD_REQUIRED, "rank.role"),
    ],
)
async def test_bad_registrations(channel, mutate, reason, field):
    registrar = reg_grpc.RegistrarServiceStub(channel)
    call = registrar.RegisterEngineRank(mutate(sample.rank_request("prefill-0", sample.PREFILL)), metadata=bearer("prefill-0"), timeout=T)
    await expect_rpc_error(call, CODE.INVALID_ARGUMENT, reason, field)


async def test_registrar_lookups_and_lease_errors(channel):
    registrar = reg_grpc.RegistrarServiceStub(channel)
    await expect_rpc_error(
        registrar.GetEngine(reg_pb.GetEngineRequest(engine_id="none"), metadata=bearer(), timeout=T),
        CODE.NOT_FOUND,
        Reason.ENGINE_NOT_FOUND,
        "engine_id",
    )
    engine = bearer("prefill-0")
    await expect_rpc_error(
        registrar.DeregisterEngineRank(reg_pb.DeregisterEngineRankRequest(lease_id="none"), metadata=engine, timeout=T),
        CODE.NOT_FOUND,
        Reason.LEASE_NOT_FOUND,
        "lease_id",
    )
    keep_alive = registrar.KeepAlive(metadata=engine, timeout=T)
    await keep_alive.write(reg_pb.KeepAliveRequest())
    await expect_rpc_error(keep_alive.read(), CODE.INVALID_ARGUMENT, Reason.FIELD_REQUIRED, "lease_ids")
    keep_alive = registrar.KeepAlive(metadata=engine, timeout=T)
    await keep_alive.write(reg_pb.KeepAliveRequest(lease_ids=["gone"]))
    assert list((await keep_alive.read()).unknown_lease_ids) == ["gone"]
    keep_alive.cancel()


async def test_conflicting_registration(engines):
    prefill, _ = engines
    changed = sample.rank_request("prefill-0", sample.PREFILL)
    changed.nixl.agent_name = "other"
    await expect_rpc_error(
        prefill.registrar.RegisterEngineRank(changed, metadata=prefill.metadata, timeout=T),
        CODE.ALREADY_EXISTS,
        Reason.CONFLICTING_DUPLICATE,
        "rank",
    )


BROKER_CASES = [
    (
        "block id out of range",
        "destination",
        dict(first_block=999),
        CODE.INVALID_ARGUMENT,
        Reason.BLOCK_ID_OUT_OF_RANGE,
        "destination.blocks[0].block_ids[1]",
    ),
    (
        "wrong block count",
        "destination",
        dict(num_tokens=40, block_size=8),
        CODE.INVALID_ARGUMENT,
        Reason.FIELD_INVALID,
        "destination.blocks[0].block_ids",
    ),
    (
        "unknown prefill engine",
        "destination",
        dict(prefill_engine_id="prefill-9"),
        CODE.NOT_FOUND,
        Reason.ENGINE_NOT_FOUND,
        "prefill_engine_id",
    ),
    (
        "decode engine as prefill",
        "destination",
        dict(prefill_engine_id="decode-0"),
        CODE.FAILED_PRECONDITION,
        Reason.ENGINE_ROLE_MISMATCH,
        "prefill_engine_id",
    ),
    (
        "old incarnation",
        "destination",
        dict(incarnation="inc-0"),
        CODE.FAILED_PRECONDITION,
        Reason.INCARNATION_MISMATCH,
        "destination.incarnation",
    ),
    ("no timeout", "destination", dict(timeout_s=0), CODE.INVALID_ARGUMENT, Reason.FIELD_REQUIRED, "timeout"),
    ("bad transfer id", "destination", dict(transfer_id="t/1"), CODE.INVALID_ARGUMENT, Reason.FIELD_INVALID, "key.transfer_id"),
    (
        "source block out of range",
        "source",
        dict(first_block=1000),
        CODE.INVALID_ARGUMENT,
        Reason.BLOCK_ID_OUT_OF_RANGE,
        "source.blocks[0].block_ids[0]",
    ),
    (
        "named decode engine is prefill",
        "source",
        dict(decode_engine_id="prefill-0"),
        CODE.FAILED_PRECONDITION,
        Reason.ENGINE_ROLE_MISMATCH,
        "decode_engine_id",
    ),
    ("timeout too long", "source", dict(timeout_s=3600), CODE.INVALID_ARGUMENT, Reason.FIELD_OUT_OF_RANGE, "timeout"),
]


@pytest.mark.parametrize("side, change, code, reason, field", [c[1:] for c in BROKER_CASES], ids=[c[0] for c in BROKER_CASES])
async def test_bad_broker_inputs(engines, side, change, code, reason, field):
    prefill, decode = engines
    transfer_id = change.pop("transfer_id", "t1")
    if side == "destination":
        call = decode.broker.RegisterDestination(sample.destination_request(transfer_id, **change), metadata=decode.metadata, timeout=T)
    else:
        call = prefill.broker.ReportPrefillDone(sample.prefill_done_request(transfer_id, **change), metadata=prefill.metadata, timeout=T)
    await expect_rpc_error(call, code, reason, field)


async def test_transfer_state_errors(engines):
    prefill, decode = engines
    broker = decode.broker
    await broker.RegisterDestination(sample.destination_request("t1"), metadata=decode.metadata, timeout=T)
    await expect_rpc_error(
        broker.RegisterDestination(sample.destination_request("t1", first_block=3), metadata=decode.metadata, timeout=T),
        CODE.ALREADY_EXISTS,
        Reason.CONFLICTING_DUPLICATE,
        "key",
    )
    await expect_rpc_error(
        prefill.broker.ReportPrefillDone(sample.prefill_done_request("t1", num_tokens=16), metadata=prefill.metadata, timeout=T),
        CODE.FAILED_PRECONDITION,
        Reason.TOKEN_COUNT_MISMATCH,
        "source.num_tokens",
    )
    await expect_rpc_error(
        prefill.broker.ReportPrefillDone(sample.prefill_done_request("t1", num_tokens=48), metadata=prefill.metadata, timeout=T),
        CODE.FAILED_PRECONDITION,
        Reason.TRANSFER_ENDED,
        "key",
    )
    await expect_rpc_error(
        broker.GetTransfer(rv_pb.GetTransferRequest(transfer_id="t9"), metadata=bearer(), timeout=T),
        CODE.NOT_FOUND,
        Reason.TRANSFER_NOT_FOUND,
        "transfer_id",
    )
    await expect_rpc_error(
        prefill.broker.ReportWriteResult(sample.write_result_request("t1", outcome=0), metadata=prefill.metadata, timeout=T),
        CODE.INVALID_ARGUMENT,
        Reason.FIELD_REQUIRED,
        "outcome",
    )


async def test_too_many_transfers_is_resource_exhausted():
    async with running_control_plane(ServerConfig(listen="127.0.0.1:0"), broker_config=BrokerConfig(max_unsettled_attempts=1)) as plane:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{plane.port}") as channel:
            decode = await FakeEngine(channel, "decode-0", sample.DECODE).register()
            await FakeEngine(channel, "prefill-0", sample.PREFILL).register()
            await decode.broker.RegisterDestination(sample.destination_request("t1"), metadata=decode.metadata, timeout=T)
            await expect_rpc_error(
                decode.broker.RegisterDestination(sample.destination_request("t2"), metadata=decode.metadata, timeout=T),
                CODE.RESOURCE_EXHAUSTED,
                Reason.TOO_MANY_TRANSFERS,
                "key",
            )


async def test_an_oversized_message_is_resource_exhausted():
    async with running_control_plane(ServerConfig(listen="127.0.0.1:0", max_message_bytes=64 * 1024)) as plane:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{plane.port}") as channel:
            request = sample.rank_request("prefill-0", sample.PREFILL)
            request.nixl.agent_metadata = b"x" * (128 * 1024)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await reg_grpc.RegistrarServiceStub(channel).RegisterEngineRank(request, metadata=bearer("prefill-0"), timeout=T)
            assert info.value.code() == CODE.RESOURCE_EXHAUSTED


# ----- health, reflection, tracing -----


async def test_health_is_served_without_a_token_and_reflection_lists_the_services(plane, channel):
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "kvpush.registrar.v1.RegistrarService", "kvpush.rendezvous.v1.RendezvousService"):
        response = await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=T)
        assert response.status == health_pb2.HealthCheckResponse.SERVING, service
    reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
    call = reflection.ServerReflectionInfo(metadata=bearer(), timeout=T)
    await call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
    response = await call.read()
    names = {service.name for service in response.list_services_response.service}
    assert {"kvpush.registrar.v1.RegistrarService", "kvpush.rendezvous.v1.RendezvousService", "grpc.health.v1.Health"} <= names
    await call.done_writing()
    await plane.running.stop(0)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=T)
    assert info.value.code() == CODE.UNAVAILABLE


async def test_rpcs_are_traced_and_only_server_faults_are_errors():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    async with running_control_plane(ServerConfig(listen="127.0.0.1:0"), tracer_provider=provider) as plane:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{plane.port}") as channel:
            prefill = await FakeEngine(channel, "prefill-0", sample.PREFILL).register()
            decode = await FakeEngine(channel, "decode-0", sample.DECODE).register()
            traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
            await decode.broker.RegisterDestination(
                sample.destination_request("t1"), metadata=(*decode.metadata, ("traceparent", traceparent)), timeout=T
            )
            await prefill.broker.ReportPrefillDone(sample.prefill_done_request("t1"), metadata=prefill.metadata, timeout=T)
            with pytest.raises(grpc.aio.AioRpcError):
                await decode.broker.GetTransfer(rv_pb.GetTransferRequest(transfer_id="t9"), metadata=bearer(), timeout=T)
            await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=T)
    spans = {span.name: span for span in exporter.get_finished_spans()}
    assert "kvpush.rpc/Check" not in spans
    register = spans["kvpush.rpc/RegisterDestination"]
    assert register.kind == SpanKind.SERVER
    assert f"{register.context.trace_id:032x}" == "0af7651916cd43dd8448eb211c80319c"
    assert f"{register.parent.span_id:016x}" == "b7ad6b7169203331"
    assert register.attributes["rpc.grpc.status_code"] == 0
    not_found = spans["kvpush.rpc/GetTransfer"]
    assert not_found.attributes["rpc.grpc.status_code"] == CODE.NOT_FOUND.value[0]
    assert not_found.status.status_code == StatusCode.UNSET  # a client fault is not a server error
    rendezvous = spans["broker.rendezvous"]
    assert rendezvous.parent.span_id == register.context.span_id
    assert len(rendezvous.links) == 2


async def test_an_internal_failure_is_internal_not_unknown(plane, channel, monkeypatch):
    def broken(*args):
        raise RuntimeError("boom")

    monkeypatch.setattr(plane.broker, "get_transfer", broken)
    broker = rv_grpc.RendezvousServiceStub(channel)
    await expect_rpc_error(
        broker.GetTransfer(rv_pb.GetTransferRequest(transfer_id="t1"), metadata=bearer(), timeout=T), CODE.INTERNAL, Reason.INTERNAL
    )
