# SPDX-License-Identifier: Apache-2.0
"""Per-RPC metrics over real gRPC: what the control plane's /metrics exposition counts per method and status code."""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from rpc_harness import CALL_TIMEOUT_S, WAIT_S, bearer, read

from kvpush.registrar.v1 import registrar_service_pb2 as reg_pb
from kvpush.registrar.v1 import registrar_service_pb2_grpc as reg_grpc

T = CALL_TIMEOUT_S
REGISTRAR = "kvpush.registrar.v1.RegistrarService"


def exposition(plane) -> dict[tuple[str, frozenset], float]:
    """The registry's /metrics text, parsed: (sample name, labels) → value."""
    text = generate_latest(plane.registry).decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(plane, name: str, **labels: str) -> float:
    return exposition(plane).get((name, frozenset(labels.items())), 0.0)


async def until_handled(plane, rpc_type: str, method: str, code: str) -> None:
    """Waits until the server has counted a stream's end (it ends there after the client sees it)."""
    async with asyncio.timeout(WAIT_S):
        while not value(plane, "grpc_server_handled_total", grpc_type=rpc_type, grpc_service=REGISTRAR, grpc_method=method, grpc_code=code):
            await asyncio.sleep(0.01)


async def test_unary_calls_are_counted_and_timed_per_method_and_code(plane, channel):
    registrar = reg_grpc.RegistrarServiceStub(channel)
    for _ in range(3):
        await registrar.ListEngines(reg_pb.ListEnginesRequest(), metadata=bearer(), timeout=T)
    for call in (
        registrar.GetEngine(reg_pb.GetEngineRequest(engine_id="none"), metadata=bearer(), timeout=T),
        registrar.GetEngine(reg_pb.GetEngineRequest(engine_id="none"), timeout=T),  # no token: refused by auth
    ):
        try:
            await call
        except grpc.aio.AioRpcError:
            pass
    await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=T)

    def labels(method: str, **code: str) -> dict[str, str]:
        return {"grpc_type": "unary", "grpc_service": REGISTRAR, "grpc_method": method, **code}

    assert value(plane, "grpc_server_started_total", **labels("ListEngines")) == 3
    assert value(plane, "grpc_server_handled_total", **labels("ListEngines", grpc_code="OK")) == 3
    assert value(plane, "grpc_server_handling_seconds_count", **labels("ListEngines", grpc_code="OK")) == 3
    assert value(plane, "grpc_server_handling_seconds_sum", **labels("ListEngines", grpc_code="OK")) > 0
    assert value(plane, "grpc_server_started_total", **labels("GetEngine")) == 2
    for code in ("NOT_FOUND", "UNAUTHENTICATED"):
        assert value(plane, "grpc_server_handled_total", **labels("GetEngine", grpc_code=code)) == 1
        assert value(plane, "grpc_server_handling_seconds_count", **labels("GetEngine", grpc_code=code)) == 1
    assert not any(dict(key)["grpc_service"].startswith("grpc.health") for name, key in exposition(plane) if name.startswith("grpc_server_"))
    assert not any(name.startswith("grpc_server_msg_") and dict(key)["grpc_type"] == "unary" for name, key in exposition(plane))


async def test_streams_are_counted_started_ended_by_code_with_their_messages(plane, channel, engines):
    prefill, _ = engines
    keep_alive = await prefill.keep_alive()  # one request, one response
    await keep_alive.write(reg_pb.KeepAliveRequest(lease_ids=prefill.leases))
    await read(keep_alive)
    await keep_alive.done_writing()
    assert await keep_alive.code() == grpc.StatusCode.OK
    await until_handled(plane, "bidi_stream", "KeepAlive", "OK")

    refused = reg_grpc.RegistrarServiceStub(channel).KeepAlive(metadata=prefill.metadata, timeout=T)
    await refused.write(reg_pb.KeepAliveRequest())  # no lease ids: INVALID_ARGUMENT
    assert await refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    await until_handled(plane, "bidi_stream", "KeepAlive", "INVALID_ARGUMENT")

    watch = reg_grpc.RegistrarServiceStub(channel).WatchEngines(reg_pb.WatchEnginesRequest(), metadata=bearer(), timeout=T)
    await read(watch)  # the snapshot of both engines
    watch.cancel()
    await until_handled(plane, "server_stream", "WatchEngines", "CANCELLED")

    def labels(rpc_type: str, method: str, **code: str) -> dict[str, str]:
        return {"grpc_type": rpc_type, "grpc_service": REGISTRAR, "grpc_method": method, **code}

    assert value(plane, "grpc_server_started_total", **labels("bidi_stream", "KeepAlive")) == 2
    assert value(plane, "grpc_server_msg_received_total", **labels("bidi_stream", "KeepAlive")) == 3
    assert value(plane, "grpc_server_msg_sent_total", **labels("bidi_stream", "KeepAlive")) == 2
    assert value(plane, "grpc_server_handled_total", **labels("bidi_stream", "KeepAlive", grpc_code="OK")) == 1
    assert value(plane, "grpc_server_handled_total", **labels("bidi_stream", "KeepAlive", grpc_code="INVALID_ARGUMENT")) == 1
    assert value(plane, "grpc_server_started_total", **labels("server_stream", "WatchEngines")) == 1
    assert value(plane, "grpc_server_msg_sent_total", **labels("server_stream", "WatchEngines")) >= 1
    assert value(plane, "grpc_server_handled_total", **labels("server_stream", "WatchEngines", grpc_code="CANCELLED")) == 1
    assert not any(name.startswith("grpc_server_handling_seconds") and dict(key)["grpc_type"] != "unary" for name, key in exposition(plane))
