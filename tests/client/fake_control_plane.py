# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""A scriptable in-process control plane for client tests: records calls, fails on request."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses

import grpc

from kvpush import errors, status
from kvpush.registrar.v1 import registrar_service_pb2 as reg_pb
from kvpush.registrar.v1 import registrar_service_pb2_grpc as reg_grpc
from kvpush.rendezvous.v1 import rendezvous_service_pb2 as rv_pb
from kvpush.rendezvous.v1 import rendezvous_service_pb2_grpc as rv_grpc
from kvpush.rendezvous.v1 import transfer_pb2


@dataclasses.dataclass
class Behaviour:
    """What the fake does; tests set fields before calling."""

    # method -> how many calls of it fail UNAVAILABLE first (ListEngines and RegisterEngineRank)
    unavailable_failures: dict[str, int] = dataclasses.field(default_factory=dict)
    transfer_delay_s: float = 0.0  # GetTransfer sleeps this long
    calls: dict[str, int] = dataclasses.field(default_factory=dict)
    metadata: dict[str, dict[str, str]] = dataclasses.field(default_factory=dict)
    peer_common_names: list[bytes] = dataclasses.field(default_factory=list)
    stream_cancelled: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)

    def record(self, method: str, context: grpc.aio.ServicerContext) -> None:
        self.calls[method] = self.calls.get(method, 0) + 1
        self.metadata[method] = {key: value for key, value in context.invocation_metadata() if isinstance(value, str)}
        self.peer_common_names.extend(context.auth_context().get("x509_common_name", []))

    async def fail_if_due(self, method: str, context: grpc.aio.ServicerContext) -> None:
        if self.unavailable_failures.get(method, 0) > 0:
            self.unavailable_failures[method] -= 1
            await context.abort(grpc.StatusCode.UNAVAILABLE, "restarting")


async def abort(context: grpc.aio.ServicerContext, error: errors.KvpushError) -> None:
    await context.abort_with_status(status.to_status(error))


class FakeRegistrar(reg_grpc.RegistrarServiceServicer):
    def __init__(self, behaviour: Behaviour):
        self.behaviour = behaviour

    async def RegisterEngineRank(self, request, context):
        self.behaviour.record("RegisterEngineRank", context)
        await self.behaviour.fail_if_due("RegisterEngineRank", context)
        return reg_pb.RegisterEngineRankResponse(lease_id=f"lease-{request.rank.engine_id}-{request.rank.tp_rank}")

    async def GetEngine(self, request, context):
        self.behaviour.record("GetEngine", context)
        if request.engine_id == "missing":
            await abort(context, errors.NotFound("engine 'missing' is not registered", reason=errors.Reason.ENGINE_NOT_FOUND, field="engine_id"))
        return reg_pb.GetEngineResponse(engine=reg_pb.Engine(engine_id=request.engine_id, state=reg_pb.ENGINE_STATE_READY))

    async def ListEngines(self, request, context):
        self.behaviour.record("ListEngines", context)
        await self.behaviour.fail_if_due("ListEngines", context)
        return reg_pb.ListEnginesResponse(engines=[reg_pb.Engine(engine_id="decode-0")])

    async def WatchEngines(self, request, context):
        self.behaviour.record("WatchEngines", context)
        for name in ("prefill-0", "decode-0", "decode-1"):
            yield reg_pb.WatchEnginesResponse(type=reg_pb.ENGINE_EVENT_TYPE_UPSERTED, engine=reg_pb.Engine(engine_id=name))

    async def KeepAlive(self, request_iterator, context):
        self.behaviour.record("KeepAlive", context)
        async for request in request_iterator:
            yield reg_pb.KeepAliveResponse(unknown_lease_ids=[lease for lease in request.lease_ids if lease.startswith("gone")])


class FakeBroker(rv_grpc.RendezvousServiceServicer):
    def __init__(self, behaviour: Behaviour):
        self.behaviour = behaviour

    async def RegisterDestination(self, request, context):
        self.behaviour.record("RegisterDestination", context)
        if not request.key.transfer_id:
            await abort(context, errors.InvalidArgument("key.transfer_id is required", reason=errors.Reason.FIELD_REQUIRED, field="key.transfer_id"))
        return rv_pb.RegisterDestinationResponse(state=transfer_pb2.TRANSFER_STATE_WAITING_FOR_PREFILL)

    async def GetTransfer(self, request, context):
        self.behaviour.record("GetTransfer", context)
        await asyncio.sleep(self.behaviour.transfer_delay_s)
        return rv_pb.GetTransferResponse(transfer=transfer_pb2.Transfer(key=transfer_pb2.TransferKey(transfer_id=request.transfer_id, attempt=request.attempt)))

    async def StreamWriteOrders(self, request, context):
        self.behaviour.record("StreamWriteOrders", context)
        if not request.engine_id:
            await abort(context, errors.InvalidArgument("engine_id is required", reason=errors.Reason.FIELD_REQUIRED, field="engine_id"))
        yield rv_pb.StreamWriteOrdersResponse(order=transfer_pb2.WriteOrder(key=transfer_pb2.TransferKey(transfer_id="t-1", attempt=1)))

    async def StreamTransferEvents(self, request, context):
        self.behaviour.record("StreamTransferEvents", context)
        try:
            yield rv_pb.StreamTransferEventsResponse(event=transfer_pb2.TransferEvent(key=transfer_pb2.TransferKey(transfer_id="t-1", attempt=1)))
            await asyncio.Event().wait()  # an idle stream: only the client's cancel ends it
        finally:
            self.behaviour.stream_cancelled.set()


@contextlib.asynccontextmanager
async def serve(behaviour: Behaviour, server_credentials: grpc.ServerCredentials | None = None):
    """Serves both fakes on 127.0.0.1 and yields the target."""
    server = grpc.aio.server()
    reg_grpc.add_RegistrarServiceServicer_to_server(FakeRegistrar(behaviour), server)
    rv_grpc.add_RendezvousServiceServicer_to_server(FakeBroker(behaviour), server)
    if server_credentials is None:
        port = server.add_insecure_port("127.0.0.1:0")
    else:
        port = server.add_secure_port("127.0.0.1:0", server_credentials)
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(grace=None)
