# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""Typed async client of kvpush.rendezvous.v1.RendezvousService (the broker)."""

from __future__ import annotations

from opentelemetry import trace

from kvpush.client.config import ClientConfig
from kvpush.client.rpc import BidiStreamCall, ServiceClient, StreamCall
from kvpush.rendezvous.v1 import rendezvous_service_pb2 as pb
from kvpush.rendezvous.v1 import rendezvous_service_pb2_grpc as pb_grpc
from kvpush.telemetry.context import ATTR_ENGINE_ID, span_attributes


class BrokerClient(ServiceClient):
    """One method per RendezvousService RPC, taking and returning the generated messages.

    Unary calls carry a deadline (timeout_s, default config.default_timeout_s)
    and raise kvpush.errors exceptions; streams return StreamCall objects.
    """

    SERVICE = pb.DESCRIPTOR.services_by_name["RendezvousService"].full_name
    STUB = pb_grpc.RendezvousServiceStub
    RETRY_SAFE = frozenset(
        {
            # The broker keys every report on (transfer_id, attempt): an
            # identical repeat is idempotent and a conflicting one fails
            # with ALREADY_EXISTS, so a retry can never apply twice.
            "RegisterDestination",
            "ReportPrefillDone",
            "ReportWriteResult",
            "CancelTransfer",
            "GetTransfer",
        }
    )

    def __init__(self, config: ClientConfig, *, tracer_provider: trace.TracerProvider | None = None):
        super().__init__(config, config.broker_target or config.target, tracer_provider=tracer_provider)

    async def register_destination(self, request: pb.RegisterDestinationRequest, *, timeout_s: float | None = None) -> pb.RegisterDestinationResponse:
        """Registers the decode engine's destination blocks for a transfer attempt."""
        attributes = span_attributes(
            request.key.transfer_id, request.key.attempt, engine_id=request.destination.engine_id, client_request_id=request.client_request_id
        )
        return await self._unary("RegisterDestination", request, timeout_s, attributes)

    async def report_prefill_done(self, request: pb.ReportPrefillDoneRequest, *, timeout_s: float | None = None) -> pb.ReportPrefillDoneResponse:
        """Reports that the prefill engine computed a transfer attempt's KV."""
        attributes = span_attributes(request.key.transfer_id, request.key.attempt, engine_id=request.source.engine_id, client_request_id=request.client_request_id)
        return await self._unary("ReportPrefillDone", request, timeout_s, attributes)

    async def report_write_result(self, request: pb.ReportWriteResultRequest, *, timeout_s: float | None = None) -> pb.ReportWriteResultResponse:
        """Reports what a producer rank did with a write order or revocation."""
        attributes = span_attributes(request.key.transfer_id, request.key.attempt, engine_id=request.engine_id)
        return await self._unary("ReportWriteResult", request, timeout_s, attributes)

    async def cancel_transfer(self, request: pb.CancelTransferRequest, *, timeout_s: float | None = None) -> pb.CancelTransferResponse:
        """Cancels a transfer attempt, or every attempt of a transfer (attempt 0)."""
        return await self._unary("CancelTransfer", request, timeout_s, span_attributes(request.key.transfer_id, request.key.attempt))

    async def get_transfer(self, request: pb.GetTransferRequest, *, timeout_s: float | None = None, wait_s: float | None = None) -> pb.GetTransferResponse:
        """Returns a transfer attempt's state and timeline.

        wait_s long-polls: the broker answers when the attempt ends or wait_s
        passes (request.wait is set on a copy); the call's deadline is
        timeout_s (default config.default_timeout_s) on top of the wait.
        """
        if wait_s is not None:
            polled = pb.GetTransferRequest()
            polled.CopyFrom(request)
            polled.wait.FromNanoseconds(int(wait_s * 1e9))
            request = polled
            timeout_s = wait_s + (self.config.default_timeout_s if timeout_s is None else timeout_s)
        return await self._unary("GetTransfer", request, timeout_s, span_attributes(request.transfer_id, request.attempt))

    def stream_write_orders(self, request: pb.StreamWriteOrdersRequest, *, timeout_s: float | None = None) -> StreamCall[pb.StreamWriteOrdersResponse]:
        """Streams write orders, revocations and closures to one producer rank."""
        return self._stream(
            StreamCall, "StreamWriteOrders", request, timeout_s, {ATTR_ENGINE_ID: request.engine_id}
        )

    def engine_reports(self, engine_id: str, *, timeout_s: float | None = None) -> BidiStreamCall[pb.EngineReportsRequest, pb.EngineReportsResponse]:
        """Opens an engine's EngineReports stream: write() batches of per-request messages, read one answer per batch.

        Not retried: after a failed stream the caller resends what was not
        answered (every item is keyed on its attempt, so a repeat is
        idempotent like a retried unary call).
        """
        return self._stream(BidiStreamCall, "EngineReports", None, timeout_s, {ATTR_ENGINE_ID: engine_id})

    def watch_shards(self, *, timeout_s: float | None = None) -> StreamCall[pb.WatchShardsResponse]:
        """Streams the broker's shard map: the whole map now, then again on every change (ShardMap follows it)."""
        return self._stream(StreamCall, "WatchShards", pb.WatchShardsRequest(), timeout_s, {})

    def stream_transfer_events(self, request: pb.StreamTransferEventsRequest, *, timeout_s: float | None = None) -> StreamCall[pb.StreamTransferEventsResponse]:
        """Streams the end of every transfer to one decode engine."""
        return self._stream(
            StreamCall, "StreamTransferEvents", request, timeout_s, {ATTR_ENGINE_ID: request.engine_id}
        )
