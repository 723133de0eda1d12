# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""The clients against the real control plane (`kvpush control-plane` in a subprocess): a whole transfer, errors, tracing."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvpush import errors
from kvpush.client import BrokerClient, ClientConfig, RegistrarClient
from kvpush.dev import sample_engines
from kvpush.registrar.v1 import registrar_service_pb2 as reg_pb
from kvpush.rendezvous.v1 import rendezvous_service_pb2 as rv_pb
from kvpush.rendezvous.v1 import transfer_pb2
from kvpush.services.common.tokens import create_tokens
from kvpush.telemetry import read_spans

IDENTITIES = ("router", "prefill-a", "decode-a", "prefill-b", "prefill-c", "decode-c")


class ControlPlane:
    """A `kvpush control-plane` process on 127.0.0.1 writing its spans to a file; each identity has its own token."""

    def __init__(self, workdir):
        port_file = workdir / "port"
        self.tokens_dir = workdir / "tokens"
        create_tokens(self.tokens_dir, IDENTITIES)
        self.traces = workdir / "traces.jsonl"
        env = {name: value for name, value in os.environ.items() if not name.startswith(("OTEL_", "KVPUSH_"))}
        env.update(OTEL_TRACES_EXPORTER="kvpush_file", KVPUSH_TRACES_FILE=str(self.traces))
        command = [sys.executable, "-m", "kvpush.cli", "control-plane", "--listen", "127.0.0.1:0", "--port-file", str(port_file), "--tokens-dir", str(self.tokens_dir)]
        self.process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 60
        while not port_file.exists():
            if self.process.poll() is not None:
                pytest.fail(f"control plane exited with {self.process.returncode}:\n{self.process.stdout.read()}")
            if time.monotonic() > deadline:
                self.stop()
                pytest.fail("control plane did not announce its port within 60 s")
            time.sleep(0.05)
        self.target = f"127.0.0.1:{int(port_file.read_text())}"

    def token(self, identity: str) -> str:
        return (self.tokens_dir / identity).read_text().strip()

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=5)
        self.process.stdout.close()


@pytest.fixture(scope="module")
def control_plane(tmp_path_factory):
    server = ControlPlane(tmp_path_factory.mktemp("control-plane"))
    yield server
    server.stop()


async def _register(control_plane: ControlPlane, request: reg_pb.RegisterEngineRankRequest, tracer_provider=None) -> tuple[RegistrarClient, BrokerClient]:
    """Registers one engine rank with that engine's token; returns clients that act for the engine."""
    config = ClientConfig(target=control_plane.target, token=control_plane.token(request.rank.engine_id))
    registrar = RegistrarClient(config, tracer_provider=tracer_provider)
    broker = BrokerClient(config, tracer_provider=tracer_provider)
    response = await registrar.register_engine_rank(request)
    assert response.lease_id and not response.engine_token
    return registrar, broker


async def test_a_whole_transfer_through_the_clients(control_plane):
    prefill_registrar, prefill = await _register(control_plane, sample_engines.rank_request("prefill-a", sample_engines.PREFILL))
    decode_registrar, decode = await _register(control_plane, sample_engines.rank_request("decode-a", sample_engines.DECODE))
    try:
        orders = prefill.stream_write_orders(rv_pb.StreamWriteOrdersRequest(engine_id="prefill-a", incarnation="inc-1"))
        events = decode.stream_transfer_events(rv_pb.StreamTransferEventsRequest(engine_id="decode-a", incarnation="inc-1"))
        async with orders, events:
            engines = await decode_registrar.list_engines(reg_pb.ListEnginesRequest())
            assert {"prefill-a", "decode-a"} <= {engine.engine_id for engine in engines.engines}
            registered = await decode.register_destination(sample_engines.destination_request("tr-a", prefill_engine_id="prefill-a", decode_engine_id="decode-a"))
            assert registered.state == transfer_pb2.TRANSFER_STATE_WAITING_FOR_PREFILL
            done = await prefill.report_prefill_done(sample_engines.prefill_done_request("tr-a", prefill_engine_id="prefill-a", decode_engine_id="decode-a"))
            assert done.first_arrival == transfer_pb2.TRANSFER_SIDE_DECODE
            order = await asyncio.wait_for(anext(orders), 10)
            assert order.order.key == transfer_pb2.TransferKey(transfer_id="tr-a", attempt=1)
            assert order.order.destination.engine_id == "decode-a"
            await prefill.report_write_result(sample_engines.write_result_request("tr-a", engine_id="prefill-a"))
            event = await asyncio.wait_for(anext(events), 10)
            assert (event.event.type, event.event.state) == (transfer_pb2.TRANSFER_EVENT_TYPE_COMPLETED, transfer_pb2.TRANSFER_STATE_DONE)
        transfer = (await decode.get_transfer(rv_pb.GetTransferRequest(transfer_id="tr-a"))).transfer
        assert transfer.state == transfer_pb2.TRANSFER_STATE_DONE and transfer.fenced
        assert transfer.timeline[0].kind == transfer_pb2.TIMELINE_ENTRY_KIND_REGISTERED
    finally:
        for client in (prefill_registrar, prefill, decode_registrar, decode):
            await client.close()


async def test_real_errors_carry_reason_and_field(control_plane):
    registrar, broker = await _register(control_plane, sample_engines.rank_request("prefill-b", sample_engines.PREFILL))
    try:
        with pytest.raises(errors.NotFound) as not_found:
            await registrar.get_engine(reg_pb.GetEngineRequest(engine_id="nobody"))
        assert (not_found.value.reason, not_found.value.field) == (errors.Reason.ENGINE_NOT_FOUND, "engine_id")
        with pytest.raises(errors.InvalidArgument) as invalid:
            await broker.register_destination(rv_pb.RegisterDestinationRequest())
        assert (invalid.value.reason, invalid.value.field) == (errors.Reason.FIELD_REQUIRED, "key.transfer_id")
    finally:
        await registrar.close()
        await broker.close()
    prefill_done = sample_engines.prefill_done_request("tr-b", prefill_engine_id="prefill-b")
    async with BrokerClient(ClientConfig(target=control_plane.target, token=control_plane.token("prefill-a"))) as other_engine:
        with pytest.raises(errors.PermissionDenied) as denied:
            await other_engine.report_prefill_done(prefill_done)
    assert (denied.value.reason, denied.value.field) == (errors.Reason.ENGINE_IDENTITY_MISMATCH, "source.engine_id")
    async with BrokerClient(ClientConfig(target=control_plane.target)) as anonymous:
        with pytest.raises(errors.Unauthenticated) as missing:
            await anonymous.report_prefill_done(prefill_done)
    assert missing.value.reason == errors.Reason.MISSING_CREDENTIALS
    async with RegistrarClient(ClientConfig(target=control_plane.target, token="wrong")) as intruder:
        with pytest.raises(errors.Unauthenticated) as refused:
            await intruder.list_engines(reg_pb.ListEnginesRequest())
    assert refused.value.reason == errors.Reason.BAD_TOKEN


async def test_server_span_is_the_child_of_the_client_span(control_plane):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    clients = [
        *await _register(control_plane, sample_engines.rank_request("prefill-c", sample_engines.PREFILL)),
        *await _register(control_plane, sample_engines.rank_request("decode-c", sample_engines.DECODE), provider),
    ]
    try:
        await clients[-1].register_destination(sample_engines.destination_request("tr-c", prefill_engine_id="prefill-c", decode_engine_id="decode-c"))
    finally:
        for client in clients:
            await client.close()
    (client_span,) = [span for span in exporter.get_finished_spans() if span.name == "kvpush.rpc/RegisterDestination"]
    client_span_id = f"{client_span.context.span_id:016x}"
    deadline = time.monotonic() + 10  # the server's batch processor exports every 200 ms
    while True:
        server_spans = [
            span
            for span in (read_spans(control_plane.traces) if control_plane.traces.exists() else [])
            if span["name"] == "kvpush.rpc/RegisterDestination" and span["parent_span_id"] == client_span_id
        ]
        if server_spans or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.1)
    assert len(server_spans) == 1, "the control plane wrote no SERVER span under the client's span"
    assert server_spans[0]["kind"] == "SERVER"
    assert server_spans[0]["trace_id"] == f"{client_span.context.trace_id:032x}"
    assert client_span.attributes["kvpush.transfer_id"] == "tr-c"
