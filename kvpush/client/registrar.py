# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""Typed async client of kvpush.registrar.v1.RegistrarService."""

from __future__ import annotations

from collections.abc import AsyncIterable

from opentelemetry import trace

from kvpush.client.config import ClientConfig
from kvpush.client.rpc import BidiStreamCall, ServiceClient, StreamCall
from kvpush.registrar.v1 import registrar_service_pb2 as pb
from kvpush.registrar.v1 import registrar_service_pb2_grpc as pb_grpc
from kvpush.telemetry.context import ATTR_ENGINE_ID


class RegistrarClient(ServiceClient):
    """One method per RegistrarService RPC, taking and returning the generated messages.

    Unary calls carry a deadline (timeout_s, default config.default_timeout_s)
    and raise kvpush.errors exceptions; streams return StreamCall objects.
    """

    SERVICE = pb.DESCRIPTOR.services_by_name["RegistrarService"].full_name
    STUB = pb_grpc.RegistrarServiceStub
    RETRY_SAFE = frozenset(
        {
            # Registering the same rank of the same incarnation again is
            # idempotent by protocol.
            "RegisterEngineRank",
            # A repeat after a landed first try finds no lease and answers
            # NOT_FOUND (LEASE_NOT_FOUND): callers treat that as done.
            "DeregisterEngineRank",
            "GetEngine",
            "ListEngines",
        }
    )

    def __init__(self, config: ClientConfig, *, tracer_provider: trace.TracerProvider | None = None):
        super().__init__(config, config.registrar_target or config.target, tracer_provider=tracer_provider)

    async def register_engine_rank(self, request: pb.RegisterEngineRankRequest, *, timeout_s: float | None = None) -> pb.RegisterEngineRankResponse:
        """Registers one engine rank and returns its lease."""
        return await self._unary("RegisterEngineRank", request, timeout_s, {ATTR_ENGINE_ID: request.rank.engine_id})

    def keep_alive(
        self, requests: AsyncIterable[pb.KeepAliveRequest] | None = None, *, timeout_s: float | None = None
    ) -> BidiStreamCall[pb.KeepAliveRequest, pb.KeepAliveResponse]:
        """Opens the lease KeepAlive stream.

        Send renewals either from `requests` or, when it is None, with
        write(). Ending the stream without deregistering ends the leases it
        renewed, so it is never retried here.
        """
        return self._stream(BidiStreamCall, "KeepAlive", requests, timeout_s, {})

    async def deregister_engine_rank(self, request: pb.DeregisterEngineRankRequest, *, timeout_s: float | None = None) -> pb.DeregisterEngineRankResponse:
        """Removes one engine rank and ends its lease."""
        return await self._unary("DeregisterEngineRank", request, timeout_s, {})

    async def get_engine(self, request: pb.GetEngineRequest, *, timeout_s: float | None = None) -> pb.GetEngineResponse:
        """Returns one engine and its registered ranks."""
        return await self._unary("GetEngine", request, timeout_s, {ATTR_ENGINE_ID: request.engine_id})

    async def list_engines(self, request: pb.ListEnginesRequest, *, timeout_s: float | None = None) -> pb.ListEnginesResponse:
        """Lists live engines, optionally of one role."""
        return await self._unary("ListEngines", request, timeout_s, {})

    def watch_engines(self, request: pb.WatchEnginesRequest, *, timeout_s: float | None = None) -> StreamCall[pb.WatchEnginesResponse]:
        """Streams the current engines, then every change; no deadline unless timeout_s is given."""
        return self._stream(StreamCall, "WatchEngines", request, timeout_s, {})
