# SPDX-License-Identifier: Apache-2.0
"""The RegistrarService servicer: authorizes, then hands reads and watches to the Directory and writes to its lease authority.

The lease authority is a RegistrarCore's (LocalLeases, answering at once) or
etcd's (EtcdLeases); both raise kvpush errors only.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import grpc

from kvpush.errors import Reason, Unavailable
from kvpush.registrar.v1 import registrar_service_pb2 as reg_pb
from kvpush.registrar.v1 import registrar_service_pb2_grpc as reg_grpc
from kvpush.services.common.auth import Authenticator
from kvpush.services.common.rpc import drain_to_stream, rpc_method
from kvpush.services.registrar.directory import Directory

SERVICE_NAME = reg_pb.DESCRIPTOR.services_by_name["RegistrarService"].full_name


class LeaseAuthority(Protocol):
    """What registers, renews and ends ranks' leases; the directory shows the result."""

    async def register(self, request: reg_pb.RegisterEngineRankRequest) -> reg_pb.RegisterEngineRankResponse: ...

    async def keep_alive(self, lease_ids: Iterable[str], caller_engine_id: str) -> reg_pb.KeepAliveResponse: ...

    async def deregister(self, lease_id: str, caller_engine_id: str) -> reg_pb.DeregisterEngineRankResponse: ...


class RegistrarServicer(reg_grpc.RegistrarServiceServicer):
    def __init__(self, directory: Directory, leases: LeaseAuthority, auth: Authenticator):
        self._directory = directory
        self._leases = leases
        self._auth = auth

    @rpc_method
    async def RegisterEngineRank(self, request: reg_pb.RegisterEngineRankRequest, context: grpc.aio.ServicerContext) -> reg_pb.RegisterEngineRankResponse:
        self._auth.engine_caller(context, request.rank.engine_id, "rank.engine_id")
        return await self._leases.register(request)

    @rpc_method
    async def KeepAlive(self, request_iterator, context: grpc.aio.ServicerContext) -> None:
        caller = self._auth.engine_identity(context, "lease_ids")
        async for request in request_iterator:
            await context.write(await self._leases.keep_alive(request.lease_ids, caller))

    @rpc_method
    async def DeregisterEngineRank(self, request: reg_pb.DeregisterEngineRankRequest, context: grpc.aio.ServicerContext) -> reg_pb.DeregisterEngineRankResponse:
        return await self._leases.deregister(request.lease_id, self._auth.engine_identity(context, "lease_id"))

    @rpc_method
    async def GetEngine(self, request: reg_pb.GetEngineRequest, context: grpc.aio.ServicerContext) -> reg_pb.GetEngineResponse:
        return reg_pb.GetEngineResponse(engine=self._directory.describe_engine(request.engine_id))

    @rpc_method
    async def ListEngines(self, request: reg_pb.ListEnginesRequest, context: grpc.aio.ServicerContext) -> reg_pb.ListEnginesResponse:
        return reg_pb.ListEnginesResponse(engines=self._directory.list_engines(request.role))

    @rpc_method
    async def WatchEngines(self, request: reg_pb.WatchEnginesRequest, context: grpc.aio.ServicerContext) -> None:
        subscription = self._directory.watch(request.role, self._auth.identity(context), request.start_revision)
        try:
            # Initial metadata tells the watcher the watch exists: whatever
            # changes from now on reaches it.
            await context.send_initial_metadata(())
            await drain_to_stream(subscription.outbox, context, lambda: True)
        finally:
            self._directory.unwatch(subscription)
        if subscription.outbox.dropped:
            raise Unavailable("the watch fell too far behind; watch again for a fresh snapshot", reason=Reason.UNAVAILABLE)
