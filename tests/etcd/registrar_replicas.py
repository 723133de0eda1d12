# SPDX-License-Identifier: Apache-2.0
"""Shared by the etcd-backed registrar tests: in-process replicas on 127.0.0.1:0 over the session's etcd, and calls as an identity."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses

import grpc
from prometheus_client import CollectorRegistry

from kvpush.clock import SystemClock
from kvpush.etcd.settings import EtcdSettings
from kvpush.registrar.v1 import registrar_service_pb2 as reg_pb
from kvpush.registrar.v1 import registrar_service_pb2_grpc as reg_grpc
from kvpush.services.common.auth import Authenticator
from kvpush.services.common.config import ServerConfig
from kvpush.services.common.server import Service, build_server
from kvpush.services.common.tokens import BROKER_IDENTITY, ROUTER_IDENTITY, IdentityTokens
from kvpush.services.registrar import servicer as registrar_servicer
from kvpush.services.registrar.config import RegistrarConfig
from kvpush.services.registrar.replica import EtcdReplica
from tests.grpc.rpc_harness import Inbox

IDENTITIES = (ROUTER_IDENTITY, BROKER_IDENTITY, "prefill-0", "prefill-1", "decode-0", "decode-1")
TOKENS = {identity: f"test-token-{identity}" for identity in IDENTITIES}  # every identity's own token
T = 5.0  # every unary call's deadline
WAIT_S = 10.0  # the longest a test waits for anything
UPSERTED = reg_pb.ENGINE_EVENT_TYPE_UPSERTED
REMOVED = reg_pb.ENGINE_EVENT_TYPE_REMOVED
CONFIG = RegistrarConfig(default_lease_ttl_s=10.0, min_lease_ttl_s=1.0)


def tokens() -> IdentityTokens:
    return IdentityTokens(TOKENS)


def bearer(identity: str) -> tuple[tuple[str, str], ...]:
    """Call metadata authenticating as identity."""
    return (("authorization", f"Bearer {TOKENS[identity]}"),)


@dataclasses.dataclass
class Replica:
    """A started replica: its core parts, its port and a channel to it."""

    replica: EtcdReplica
    port: int
    channel: grpc.aio.Channel
    follower: asyncio.Task | None = None

    expiry: asyncio.Task | None = None

    def follow(self) -> None:
        """Starts the mirror following etcd, and ending ranks whose engines stopped renewing (as `kvpush registrar` does)."""
        self.follower = asyncio.create_task(self.replica.mirror.run())
        if self.expiry is None:
            self.expiry = asyncio.create_task(self.replica.leases.expire_silent_ranks())

    async def stop_following(self) -> None:
        """Stops the mirror (as a broken watch would), leaving the directory as it is."""
        if self.follower is not None:
            self.follower.cancel()
            await asyncio.gather(self.follower, return_exceptions=True)
            self.follower = None

    @property
    def stub(self) -> reg_grpc.RegistrarServiceStub:
        return reg_grpc.RegistrarServiceStub(self.channel)

    async def register(self, request: reg_pb.RegisterEngineRankRequest) -> reg_pb.RegisterEngineRankResponse:
        return await self.stub.RegisterEngineRank(request, metadata=bearer(request.rank.engine_id), timeout=T)

    async def engine(self, engine_id: str) -> reg_pb.Engine | None:
        engines = (await self.stub.ListEngines(reg_pb.ListEnginesRequest(), metadata=bearer(ROUTER_IDENTITY), timeout=T)).engines
        return next((e for e in engines if e.engine_id == engine_id), None)


@contextlib.asynccontextmanager
async def running_replica(endpoints: list[str], prefix: bytes, config: RegistrarConfig = CONFIG):
    """A replica serving RegistrarService once its mirror synced; stopped on exit."""
    replica = EtcdReplica(config, EtcdSettings(endpoints=tuple(endpoints), prefix=prefix.decode()), SystemClock())
    servicer = registrar_servicer.RegistrarServicer(replica.directory, replica.leases, Authenticator(mtls=False))
    running = await build_server(
        ServerConfig(listen="127.0.0.1:0"),
        [Service(registrar_servicer.SERVICE_NAME, reg_grpc.add_RegistrarServiceServicer_to_server, servicer)],
        registry=CollectorRegistry(),
        tokens=tokens(),
    )
    started = None
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            started = Replica(replica, running.port, channel)
            started.follow()
            await asyncio.wait_for(replica.mirror.synced.wait(), WAIT_S)
            yield started
    finally:
        replica.directory.close()
        await running.stop(0)
        if started is not None:
            await started.stop_following()
            if started.expiry is not None:
                started.expiry.cancel()
                await asyncio.gather(started.expiry, return_exceptions=True)
        await replica.client.close()


class Watch(Inbox):
    """A WatchEngines stream read in the background (tests/grpc/rpc_harness' Inbox)."""

    def __init__(self, replica: Replica, identity: str = ROUTER_IDENTITY, **request):
        super().__init__(replica.stub.WatchEngines(reg_pb.WatchEnginesRequest(**request), metadata=bearer(identity), timeout=60))

    async def opened(self) -> Watch:
        await asyncio.wait_for(self.call.initial_metadata(), WAIT_S)
        return self

    async def next(self, timeout: float = WAIT_S) -> reg_pb.WatchEnginesResponse:
        return await super().next(timeout)

    async def take(self, count: int, timeout: float = WAIT_S) -> list[tuple[int, str, str, int, str]]:
        """The next count events as (type, engine_id, incarnation, state, reason)."""
        events = [await self.next(timeout) for _ in range(count)]
        return [(e.type, e.engine.engine_id, e.engine.incarnation, e.engine.state, e.reason) for e in events]

    def pending(self) -> int:
        return self._messages.qsize()


