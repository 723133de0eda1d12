# SPDX-License-Identifier: Apache-2.0
"""The RendezvousService servicer: authorizes, then hands each call to the BrokerCore."""

from __future__ import annotations

import asyncio

import grpc
from opentelemetry import context as otel_context

from kvpush.engine.v1 import engine_pb2
from kvpush.errors import PermissionDenied, Reason
from kvpush.rendezvous.v1 import rendezvous_service_pb2 as rv_pb
from kvpush.rendezvous.v1 import rendezvous_service_pb2_grpc as rv_grpc
from kvpush.services.broker.core import Actor, BrokerCore, EngineDirectory
from kvpush.services.common import validation
from kvpush.services.common.auth import Authenticator
from kvpush.services.common.rpc import drain_to_stream, rpc_method

# The longest GetTransfer.wait honoured.
MAX_GET_TRANSFER_WAIT_S = 600.0

SERVICE_NAME = rv_pb.DESCRIPTOR.services_by_name["RendezvousService"].full_name


class BrokerServicer(rv_grpc.RendezvousServiceServicer):
    def __init__(self, core: BrokerCore, directory: EngineDirectory, auth: Authenticator):
        self._core = core
        self._directory = directory
        self._auth = auth
        # GetTransfer long polls waiting for an attempt to end, by (transfer_id, attempt).
        self._end_waiters: dict[tuple[str, int], list[asyncio.Future]] = {}
        core.add_end_listener(self._on_end)

    def _on_end(self, transfer_id: str, attempt: int) -> None:
        for waiter in self._end_waiters.pop((transfer_id, attempt), ()):
            if not waiter.done():
                waiter.set_result(None)

    async def _wait_for_end(self, transfer_id: str, attempt: int, wait_s: float) -> None:
        """Returns when the attempt (0: the newest) ends or wait_s passes."""
        attempt = attempt or self._core.newest_attempt(transfer_id)
        if not attempt or self._core.is_ended(transfer_id, attempt):
            return
        key = (transfer_id, attempt)
        waiter = asyncio.get_running_loop().create_future()
        self._end_waiters.setdefault(key, []).append(waiter)
        try:
            await asyncio.wait_for(waiter, wait_s)
        except TimeoutError:
            pass
        finally:
            waiters = self._end_waiters.get(key)
            if waiters is not None and waiter in waiters:
                waiters.remove(waiter)
                if not waiters:
                    del self._end_waiters[key]

    @rpc_method
    async def RegisterDestination(self, request: rv_pb.RegisterDestinationRequest, context: grpc.aio.ServicerContext) -> rv_pb.RegisterDestinationResponse:
        caller = self._auth.engine_caller(context, request.destination.engine_id, "destination.engine_id")
        return self._core.register_destination(request, caller, otel_context.get_current())

    @rpc_method
    async def ReportPrefillDone(self, request: rv_pb.ReportPrefillDoneRequest, context: grpc.aio.ServicerContext) -> rv_pb.ReportPrefillDoneResponse:
        caller = self._auth.engine_caller(context, request.source.engine_id, "source.engine_id")
        return self._core.report_prefill_done(request, caller, otel_context.get_current())

    @rpc_method
    async def ReportWriteResult(self, request: rv_pb.ReportWriteResultRequest, context: grpc.aio.ServicerContext) -> rv_pb.ReportWriteResultResponse:
        caller = self._auth.engine_caller(context, request.engine_id, "engine_id")
        return self._core.report_write_result(request, caller)

    @rpc_method
    async def CancelTransfer(self, request: rv_pb.CancelTransferRequest, context: grpc.aio.ServicerContext) -> rv_pb.CancelTransferResponse:
        engine_id = self._auth.transfer_caller(context)
        if engine_id is None:
            return self._core.cancel(request.key, Actor.ROUTER, request.detail)
        engine = self._directory.get_engine(engine_id)
        if engine is None:
            raise PermissionDenied(f"{engine_id!r} is neither the router nor a registered engine", reason=Reason.ENGINE_IDENTITY_MISMATCH)
        actor = Actor.PREFILL if engine.role == engine_pb2.ENGINE_ROLE_PREFILL else Actor.DECODE
        return self._core.cancel(request.key, actor, request.detail, engine_id)

    @rpc_method
    async def GetTransfer(self, request: rv_pb.GetTransferRequest, context: grpc.aio.ServicerContext) -> rv_pb.GetTransferResponse:
        self._auth.transfer_caller(context)  # the router and engines may query any transfer; `broker` none
        if request.HasField("wait"):
            wait_s = validation.non_negative_seconds(request.wait, "wait", MAX_GET_TRANSFER_WAIT_S)
            self._core.get_transfer(request.transfer_id, request.attempt)  # refuses an unknown attempt before waiting
            remaining = context.time_remaining()
            if remaining is not None:
                wait_s = min(wait_s, max(remaining - 0.05, 0.0))  # answer before the caller's deadline
            await self._wait_for_end(request.transfer_id, request.attempt, wait_s)
        return rv_pb.GetTransferResponse(transfer=self._core.get_transfer(request.transfer_id, request.attempt))

    @rpc_method
    async def StreamWriteOrders(self, request: rv_pb.StreamWriteOrdersRequest, context: grpc.aio.ServicerContext) -> None:
        caller = self._auth.engine_caller(context, request.engine_id, "engine_id")
        subscription = self._core.subscribe_producer(request, caller)
        try:
            # Initial metadata tells the rank its subscription is in place.
            await context.send_initial_metadata(())
            # Heartbeats keep the rank's stream lease alive while no order flows.
            await drain_to_stream(
                subscription.outbox, context, lambda: subscription.active,
                heartbeat=self._core.heartbeat, heartbeat_interval_s=self._core.heartbeat_interval_s,
            )
        finally:
            self._core.unsubscribe(subscription)

    @rpc_method
    async def StreamTransferEvents(self, request: rv_pb.StreamTransferEventsRequest, context: grpc.aio.ServicerContext) -> None:
        caller = self._auth.engine_caller(context, request.engine_id, "engine_id")
        subscription = self._core.subscribe_decode(request, caller)
        try:
            await context.send_initial_metadata(())
            await drain_to_stream(subscription.outbox, context, lambda: subscription.active)
        finally:
            self._core.unsubscribe(subscription)
