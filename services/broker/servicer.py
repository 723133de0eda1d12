# SPDX-License-Identifier: Apache-2.0
"""The RendezvousService servicer: authorizes, then hands each call to the BrokerCore."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc
from opentelemetry import context as otel_context

from kvpush import status
from kvpush.errors import Internal, InvalidArgument, KvpushError, Reason
from kvpush.rendezvous.v1 import rendezvous_service_pb2 as rv_pb
from kvpush.rendezvous.v1 import rendezvous_service_pb2_grpc as rv_grpc
from kvpush.services.broker.core import BrokerCore
from kvpush.services.broker.membership import SHARD_MAP_HEARTBEAT_S, shard_map
from kvpush.services.common import validation
from kvpush.services.common.auth import Authenticator
from kvpush.services.common.rpc import drain_to_stream, rpc_method
from kvpush.telemetry import extract_context

logger = logging.getLogger(__name__)

# The longest GetTransfer.wait honoured.
MAX_GET_TRANSFER_WAIT_S = 600.0

SERVICE_NAME = rv_pb.DESCRIPTOR.services_by_name["RendezvousService"].full_name


class BrokerServicer(rv_grpc.RendezvousServiceServicer):
    def __init__(self, core: BrokerCore, auth: Authenticator):
        self._core = core
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
            async with asyncio.timeout(wait_s):
                await waiter
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
        return self._core.cancel(request.key, self._auth.transfer_caller(context), request.detail)

    @rpc_method
    async def EngineReports(self, requests, context: grpc.aio.ServicerContext) -> None:
        identity = self._auth.engine_identity(context, "engine_id")  # once per stream
        engine_id = None
        async for batch in requests:
            if engine_id is None:
                if not self._auth.acting_for(identity, batch.engine_id, "engine_id"):
                    raise InvalidArgument(f"engine_id {batch.engine_id!r} is not a valid engine id", reason=Reason.FIELD_INVALID, field="engine_id")
                engine_id = batch.engine_id
            elif batch.engine_id != engine_id:
                raise InvalidArgument(f"engine_id changed from {engine_id!r} to {batch.engine_id!r} on one stream",
                                      reason=Reason.FIELD_INVALID, field="engine_id")
            await context.write(self._answer_batch(identity, batch))

    def _answer_batch(self, identity: str, batch: rv_pb.EngineReportsRequest) -> rv_pb.EngineReportsResponse:
        """Applies every item as its unary call would, in order; a refused item gets its status, the others go on."""
        response = rv_pb.EngineReportsResponse()
        core, act_for = self._core, self._auth.acting_for
        for item in batch.registrations:
            answer = response.registrations.add(key=item.key)
            with _item_errors(answer):
                caller = act_for(identity, item.destination.engine_id, "destination.engine_id")
                answer.response.CopyFrom(core.register_destination(item, caller, _trace_context(item)))
        for item in batch.prefill_done:
            answer = response.prefill_done.add(key=item.key)
            with _item_errors(answer):
                caller = act_for(identity, item.source.engine_id, "source.engine_id")
                answer.state = core.report_prefill_done(item, caller, _trace_context(item)).state
        for item in batch.write_results:
            answer = response.write_results.add(key=item.key)
            with _item_errors(answer):
                answer.state = core.report_write_result(item, act_for(identity, item.engine_id, "engine_id")).state
        for item in batch.cancels:
            answer = response.cancels.add(key=item.key)
            with _item_errors(answer):
                answer.response.CopyFrom(core.cancel(item.key, identity, item.detail))
        return response

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

    @rpc_method
    async def WatchShards(self, request: rv_pb.WatchShardsRequest, context: grpc.aio.ServicerContext) -> None:
        self._auth.identity(context)  # any authenticated caller may read the map
        outbox = self._core.watch_shards()
        try:
            # A sharded member repeats its map while it holds still: a caller that hears nothing knows the member is hung.
            sharded = self._core.membership.revision > 0
            await drain_to_stream(outbox, context, lambda: True, heartbeat=(lambda: shard_map(self._core.membership)) if sharded else None,
                                  heartbeat_interval_s=SHARD_MAP_HEARTBEAT_S)
        finally:
            self._core.unwatch_shards(outbox)
        # The stream ended: a member that stopped serving says so; otherwise (overflow, shutdown) the caller watches again.
        self._core.check_serving()


def _trace_context(item) -> otel_context.Context:
    """The request's trace context: the item's own in a batch, else the call's."""
    return extract_context(item.trace_context) if item.trace_context else otel_context.get_current()


@contextlib.contextmanager
def _item_errors(answer):
    """Turns an item's failure into its answer's ItemError (an unexpected one into INTERNAL, logged)."""
    try:
        yield
    except KvpushError as err:
        status.to_item_error(err, answer.error)
    except Exception:
        logger.exception("EngineReports item %s failed", answer.key)
        status.to_item_error(Internal("internal error; see the server log", reason=Reason.INTERNAL), answer.error)
