# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""RegistrarClient and BrokerClient against a real in-process grpc.aio server."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import time

import grpc
import pytest
from fake_control_plane import Behaviour, serve
from opentelemetry.trace import SpanKind, StatusCode

from kvpush import errors
from kvpush.client import BrokerClient, ClientConfig, RegistrarClient, RetryPolicy
from kvpush.registrar.v1 import registrar_service_pb2 as reg_pb
from kvpush.rendezvous.v1 import rendezvous_service_pb2 as rv_pb
from kvpush.rendezvous.v1 import transfer_pb2

FAST_RETRY = RetryPolicy(max_attempts=5, initial_backoff_s=0.01, max_backoff_s=0.05)




@pytest.fixture
async def fake():
    behaviour = Behaviour()
    async with serve(behaviour) as target:
        yield behaviour, target


async def test_unary_call_carries_the_callers_token_and_traceparent(fake, spans):
    behaviour, target = fake
    provider, exporter = spans
    async with RegistrarClient(ClientConfig(target=target, token="s3cret"), tracer_provider=provider) as registrar:
        await registrar.register_engine_rank(reg_pb.RegisterEngineRankRequest())
        response = await registrar.get_engine(reg_pb.GetEngineRequest(engine_id="decode-0"))

    assert response.engine.engine_id == "decode-0"
    assert behaviour.metadata["RegisterEngineRank"]["authorization"] == "Bearer s3cret"
    seen = behaviour.metadata["GetEngine"]
    assert seen["authorization"] == "Bearer s3cret"
    assert "kvpush-engine-token" not in seen  # the caller's own token is its whole credential
    span = exporter.get_finished_spans()[-1]
    assert span.name == "kvpush.rpc/GetEngine"
    assert span.kind == SpanKind.CLIENT
    assert span.attributes["rpc.service"] == "kvpush.registrar.v1.RegistrarService"
    assert span.attributes["kvpush.engine_id"] == "decode-0"
    assert span.attributes["rpc.grpc.status_code"] == 0
    _, trace_id, span_id, _ = seen["traceparent"].split("-")
    assert (trace_id, span_id) == (f"{span.context.trace_id:032x}", f"{span.context.span_id:016x}")


async def test_error_becomes_kvpush_exception_with_reason_and_field(fake, spans):
    _, target = fake
    provider, exporter = spans
    async with RegistrarClient(ClientConfig(target=target), tracer_provider=provider) as registrar:
        with pytest.raises(errors.NotFound) as raised:
            await registrar.get_engine(reg_pb.GetEngineRequest(engine_id="missing"))
    assert raised.value.reason == errors.Reason.ENGINE_NOT_FOUND
    assert raised.value.field == "engine_id"
    span = exporter.get_finished_spans()[-1]
    assert span.status.status_code == StatusCode.ERROR
    assert span.attributes["rpc.grpc.status_code"] == grpc.StatusCode.NOT_FOUND.value[0]


async def test_unavailable_is_retried_by_grpc_until_success(fake, spans):
    behaviour, target = fake
    provider, exporter = spans
    behaviour.unavailable_failures = {"ListEngines": 2}
    async with RegistrarClient(ClientConfig(target=target, retry=FAST_RETRY), tracer_provider=provider) as registrar:
        response = await registrar.list_engines(reg_pb.ListEnginesRequest())
    assert [engine.engine_id for engine in response.engines] == ["decode-0"]
    assert behaviour.calls["ListEngines"] == 3
    # gRPC's retry machinery, not ours, sent the last attempt: it says how many came before.
    assert behaviour.metadata["ListEngines"]["grpc-previous-rpc-attempts"] == "2"
    (span,) = [span for span in exporter.get_finished_spans() if span.kind == SpanKind.CLIENT]
    assert span.attributes["rpc.grpc.status_code"] == 0


async def test_a_method_not_retry_safe_is_not_retried(fake):
    class NoListRetries(RegistrarClient):
        RETRY_SAFE = RegistrarClient.RETRY_SAFE - {"ListEngines"}

    behaviour, target = fake
    behaviour.unavailable_failures = {"ListEngines": 1}
    async with NoListRetries(ClientConfig(target=target, retry=FAST_RETRY)) as registrar:
        with pytest.raises(errors.Unavailable):
            await registrar.list_engines(reg_pb.ListEnginesRequest())
        assert behaviour.calls["ListEngines"] == 1
        response = await registrar.list_engines(reg_pb.ListEnginesRequest())
    assert [engine.engine_id for engine in response.engines] == ["decode-0"]


async def test_a_request_larger_than_grpcs_default_retry_buffer_is_retried(fake):
    behaviour, target = fake
    behaviour.unavailable_failures = {"RegisterEngineRank": 1}
    request = reg_pb.RegisterEngineRankRequest()
    request.nixl.agent_metadata = b"x" * (1024 * 1024)  # gRPC buffers 256 KiB for retries unless told more
    async with RegistrarClient(ClientConfig(target=target, retry=FAST_RETRY)) as registrar:
        await registrar.register_engine_rank(request)
    assert behaviour.calls["RegisterEngineRank"] == 2


def test_one_attempt_configures_no_retries():
    service, methods = RegistrarClient.SERVICE, RegistrarClient.RETRY_SAFE
    options = dict(ClientConfig(retry=RetryPolicy(max_attempts=1)).channel_options(service, methods))
    assert "grpc.service_config" not in options
    retrying = dict(ClientConfig(retry=FAST_RETRY).channel_options(service, methods))
    policy = json.loads(retrying["grpc.service_config"])["methodConfig"][0]
    assert {name["method"] for name in policy["name"]} == methods
    assert policy["retryPolicy"]["retryableStatusCodes"] == ["UNAVAILABLE"]


def test_only_a_channel_with_connections_of_its_own_leaves_the_shared_subchannel_pool():
    """The default (every unsharded client) shares connections to an address as before; a broker member's channel does not."""
    assert "grpc.use_local_subchannel_pool" not in dict(ClientConfig().channel_options())
    assert dict(ClientConfig(own_connections=True).channel_options())["grpc.use_local_subchannel_pool"] == 1


async def test_retries_stop_at_max_attempts(fake):
    behaviour, target = fake
    behaviour.unavailable_failures = {"ListEngines": 100}
    config = ClientConfig(target=target, retry=RetryPolicy(max_attempts=3, initial_backoff_s=0.01, max_backoff_s=0.01))
    async with RegistrarClient(config) as registrar:
        with pytest.raises(errors.Unavailable) as raised:
            await registrar.list_engines(reg_pb.ListEnginesRequest())
    assert raised.value.reason == errors.Reason.UNAVAILABLE
    assert behaviour.calls["ListEngines"] == 3


async def test_retries_never_run_past_the_deadline(fake):
    behaviour, target = fake
    behaviour.unavailable_failures = {"ListEngines": 1000}
    config = ClientConfig(target=target, retry=RetryPolicy(max_attempts=1000, initial_backoff_s=0.05, max_backoff_s=0.1))
    async with RegistrarClient(config) as registrar:
        started = time.monotonic()
        with pytest.raises((errors.Unavailable, errors.DeadlineExceeded)):
            await registrar.list_engines(reg_pb.ListEnginesRequest(), timeout_s=0.5)
        elapsed = time.monotonic() - started
    assert behaviour.calls["ListEngines"] > 1
    assert elapsed < 0.5 + 0.5  # slack for a loaded machine; unbounded retries would take seconds


async def test_invalid_argument_is_not_retried(fake):
    behaviour, target = fake
    async with BrokerClient(ClientConfig(target=target, retry=FAST_RETRY)) as broker:
        with pytest.raises(errors.InvalidArgument) as raised:
            await broker.register_destination(rv_pb.RegisterDestinationRequest())
    assert (raised.value.reason, raised.value.field) == (errors.Reason.FIELD_REQUIRED, "key.transfer_id")
    assert behaviour.calls["RegisterDestination"] == 1


async def test_deadline_per_call_and_from_config(fake):
    behaviour, target = fake
    behaviour.transfer_delay_s = 10.0
    async with BrokerClient(ClientConfig(target=target, default_timeout_s=0.2)) as broker:
        request = rv_pb.GetTransferRequest(transfer_id="t-1", attempt=1)
        for timeout_s in (None, 0.1):
            started = time.monotonic()
            with pytest.raises(errors.DeadlineExceeded):
                await broker.get_transfer(request, timeout_s=timeout_s)
            assert time.monotonic() - started < 1.0
        behaviour.transfer_delay_s = 0.0
        response = await broker.get_transfer(request, timeout_s=2.0)
    assert response.transfer.key.transfer_id == "t-1"


async def test_unreachable_target_is_unavailable_within_the_deadline():
    with socket.socket() as probe:  # a port nobody listens on once closed
        probe.bind(("127.0.0.1", 0))
        target = f"127.0.0.1:{probe.getsockname()[1]}"
    async with RegistrarClient(ClientConfig(target=target, retry=FAST_RETRY)) as registrar:
        with pytest.raises(errors.Unavailable):
            await registrar.wait_ready(timeout_s=0.3)
        started = time.monotonic()
        with pytest.raises((errors.Unavailable, errors.DeadlineExceeded)):
            await registrar.get_engine(reg_pb.GetEngineRequest(engine_id="decode-0"), timeout_s=0.5)
        assert time.monotonic() - started < 0.5 + 0.5


async def test_server_stream_iterates_to_the_end(fake, spans):
    behaviour, target = fake
    provider, exporter = spans
    async with RegistrarClient(ClientConfig(target=target, token="s3cret"), tracer_provider=provider) as registrar:
        await registrar.wait_ready(timeout_s=5.0)
        events = [event async for event in registrar.watch_engines(reg_pb.WatchEnginesRequest())]
    assert [event.engine.engine_id for event in events] == ["prefill-0", "decode-0", "decode-1"]
    assert behaviour.metadata["WatchEngines"]["authorization"] == "Bearer s3cret"
    span = exporter.get_finished_spans()[-1]
    assert span.name == "kvpush.rpc/WatchEngines"
    assert span.attributes["rpc.grpc.status_code"] == 0
    assert behaviour.metadata["WatchEngines"]["traceparent"].split("-")[2] == f"{span.context.span_id:016x}"


async def test_stream_error_becomes_kvpush_exception(fake):
    _, target = fake
    async with BrokerClient(ClientConfig(target=target)) as broker:
        stream = broker.stream_write_orders(rv_pb.StreamWriteOrdersRequest())
        with pytest.raises(errors.InvalidArgument) as raised:
            await anext(stream)
    assert raised.value.field == "engine_id"


async def test_stream_write_orders_delivers_an_order(fake):
    _, target = fake
    async with BrokerClient(ClientConfig(target=target)) as broker:
        async with broker.stream_write_orders(rv_pb.StreamWriteOrdersRequest(engine_id="prefill-0")) as stream:
            messages = [message async for message in stream]
    assert [message.WhichOneof("message") for message in messages] == ["order"]
    assert messages[0].order.key == transfer_pb2.TransferKey(transfer_id="t-1", attempt=1)


async def test_cancel_ends_an_idle_stream_without_error(fake):
    behaviour, target = fake
    async with BrokerClient(ClientConfig(target=target)) as broker:
        stream = broker.stream_transfer_events(rv_pb.StreamTransferEventsRequest(engine_id="decode-0"))
        received = []

        async def read_all():
            async for response in stream:
                received.append(response)

        reader = asyncio.create_task(read_all())
        while not received:
            await asyncio.sleep(0.01)
        stream.cancel()
        await asyncio.wait_for(reader, 2.0)
        await asyncio.wait_for(behaviour.stream_cancelled.wait(), 2.0)
    assert received[0].event.key.transfer_id == "t-1"


async def test_keep_alive_with_writes_and_with_an_iterator(fake):
    _, target = fake
    async with RegistrarClient(ClientConfig(target=target)) as registrar:
        stream = registrar.keep_alive()
        await stream.write(reg_pb.KeepAliveRequest(lease_ids=["lease-1", "gone-2"]))
        first = await anext(stream)
        await stream.done_writing()
        rest = [response async for response in stream]

        async def renewals():
            for lease in ("gone-a", "lease-b"):
                yield reg_pb.KeepAliveRequest(lease_ids=[lease])

        from_iterator = [list(response.unknown_lease_ids) async for response in registrar.keep_alive(renewals())]
    assert list(first.unknown_lease_ids) == ["gone-2"]
    assert rest == []
    assert from_iterator == [["gone-a"], []]


def test_targets_per_service_override_the_shared_one():
    config = ClientConfig(target="cp:1", registrar_target="reg:2")
    assert RegistrarClient(config).target == "reg:2"
    assert BrokerClient(config).target == "cp:1"


@pytest.mark.parametrize(
    "make",
    [
        lambda: ClientConfig(target=""),
        lambda: ClientConfig(client_cert_path="client.pem"),
        lambda: ClientConfig(default_timeout_s=0),
        lambda: RetryPolicy(max_attempts=0),
        lambda: RetryPolicy(initial_backoff_s=2.0, max_backoff_s=1.0),
    ],
    ids=["no-target", "cert-without-key", "zero-timeout", "zero-attempts", "backoff-order"],
)
def test_invalid_config_is_rejected(make):
    with pytest.raises(ValueError):
        make()


def _openssl(workdir, *args: str) -> None:
    subprocess.run(["openssl", *args], cwd=workdir, check=True, capture_output=True, timeout=30)


@pytest.fixture
def mtls_files(tmp_path):
    """A CA, a server certificate for 127.0.0.1 and a client certificate for CN prefill-0 (P-256 keys: fast to make)."""
    new_key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl(tmp_path, "req", "-x509", *new_key, "-keyout", "ca.key", "-out", "ca.pem", "-days", "1", "-subj", "/CN=kvpush-test-ca")
    extensions = {"server": "subjectAltName=IP:127.0.0.1", "client": "extendedKeyUsage=clientAuth"}
    for name, common_name in (("server", "127.0.0.1"), ("client", "prefill-0")):
        (tmp_path / f"{name}.ext").write_text(extensions[name] + "\n")
        _openssl(tmp_path, "req", *new_key, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={common_name}")
        _openssl(tmp_path, "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-out", f"{name}.pem", "-days", "1", "-extfile", f"{name}.ext")
    return tmp_path


async def test_mutual_tls_presents_the_client_certificate(mtls_files):
    behaviour = Behaviour()
    server_key, server_cert, ca = ((mtls_files / name).read_bytes() for name in ("server.key", "server.pem", "ca.pem"))
    credentials = grpc.ssl_server_credentials([(server_key, server_cert)], root_certificates=ca, require_client_auth=True)
    async with serve(behaviour, credentials) as target:
        config = ClientConfig(
            target=target,
            ca_cert_path=str(mtls_files / "ca.pem"),
            client_cert_path=str(mtls_files / "client.pem"),
            client_key_path=str(mtls_files / "client.key"),
        )
        async with RegistrarClient(config) as registrar:
            response = await registrar.get_engine(reg_pb.GetEngineRequest(engine_id="decode-0"), timeout_s=5.0)
        async with RegistrarClient(ClientConfig(target=target, ca_cert_path=str(mtls_files / "ca.pem"), retry=RetryPolicy(max_attempts=1))) as anonymous:
            with pytest.raises(errors.Unavailable):
                await anonymous.get_engine(reg_pb.GetEngineRequest(engine_id="decode-0"), timeout_s=5.0)
    assert response.engine.engine_id == "decode-0"
    assert behaviour.peer_common_names == [b"prefill-0"]
