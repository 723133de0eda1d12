# SPDX-License-Identifier: Apache-2.0
"""Shared by the sharded-broker process tests: `kvpush registrar` (in memory) and `kvpush broker --etcd` members as real processes (tests/kvpush_process.py).

Calls carry the calling identity's token.
"""

from __future__ import annotations

import asyncio
import contextlib
import pathlib
import time

import grpc
from grpc_health.v1 import health_pb2

from kvpush.dev import sample_engines as sample
from kvpush.registrar.v1 import registrar_service_pb2_grpc as reg_grpc
from kvpush.rendezvous.v1 import rendezvous_service_pb2 as rv_pb
from kvpush.rendezvous.v1 import rendezvous_service_pb2_grpc as rv_grpc
from kvpush.services.broker import servicer as broker_servicer
from kvpush.services.common.tokens import create_tokens
from tests.kvpush_process import KvpushProcess

IDENTITIES = ("router", "broker", "prefill-0", "decode-0")
T = 5.0  # every unary call's deadline
WAIT_S = 10.0  # the longest a test waits for anything else
LEASE_TTL_S = 2
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class Deployment:
    """A registrar and broker members on the session's etcd under one prefix, with a tokens dir for every identity."""

    def __init__(self, workdir: pathlib.Path, etcd_endpoints: list[str], prefix: str):
        self.workdir = workdir
        self.tokens_dir = workdir / "tokens"
        create_tokens(self.tokens_dir, IDENTITIES)
        self.etcd = ",".join(etcd_endpoints)
        self.prefix = prefix
        self.registrar: KvpushProcess | None = None
        self.brokers: dict[str, KvpushProcess] = {}

    def token(self, identity: str) -> str:
        return (self.tokens_dir / identity).read_text().strip()

    def bearer(self, identity: str) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.token(identity)}"),)

    async def start_registrar(self) -> None:
        self.registrar = KvpushProcess(self.workdir, "registrar", "registrar", "--tokens-dir", str(self.tokens_dir), "--lease-ttl", "60")
        await self.registrar.start()
        stub = reg_grpc.RegistrarServiceStub(self.registrar.channel)
        for engine_id, role in (("prefill-0", sample.PREFILL), ("decode-0", sample.DECODE)):
            await stub.RegisterEngineRank(sample.rank_request(engine_id, role), metadata=self.bearer(engine_id), timeout=T)

    def broker_service(self, member_id: str, *args: str) -> KvpushProcess:
        """A member; `--engine-silence 0` unless args set it, since these tests open engine streams to some members only."""
        silence = () if "--engine-silence" in args else ("--engine-silence", "0")
        return KvpushProcess(
            self.workdir, member_id, "broker",
            "--tokens-dir", str(self.tokens_dir), "--registrar", self.registrar.address,
            "--etcd", self.etcd, "--etcd-prefix", self.prefix, "--member-id", member_id, "--shard-lease-ttl", str(LEASE_TTL_S),
            *silence, *args,
        )

    async def start_brokers(self, *member_ids: str, args: dict[str, tuple[str, ...]] | None = None) -> None:
        """Starts the members at once and waits until every one serves and every running member's map lists them all.

        A member serves once its own key is in its map; the others' keys reach it through its etcd watch a
        moment later, and until then it takes itself for the owner of their transfers too. args: extra flags by member.
        """
        services = [self.broker_service(member_id, *(args or {}).get(member_id, ())) for member_id in member_ids]
        await asyncio.gather(*(service.start() for service in services))
        for service in services:
            self.brokers[service.name] = service
        for service in services:
            await until_health(service, SERVING)
        running = set(self.brokers)
        for member_id in running:
            call = self.watch(member_id)
            try:
                await map_until(call, lambda shards: running <= set(shards))
            finally:
                call.cancel()

    def stub(self, member_id: str) -> rv_grpc.RendezvousServiceStub:
        return rv_grpc.RendezvousServiceStub(self.brokers[member_id].channel)

    def watch(self, member_id: str) -> grpc.aio.UnaryStreamCall:
        return self.stub(member_id).WatchShards(rv_pb.WatchShardsRequest(), metadata=self.bearer("router"), timeout=60.0)

    async def stop(self) -> None:
        for service in [*self.brokers.values(), self.registrar]:
            if service is not None:
                await service.stop()


@contextlib.asynccontextmanager
async def deployment(workdir: pathlib.Path, etcd_endpoints: list[str], prefix: bytes):
    started = Deployment(workdir, etcd_endpoints, prefix.decode())
    try:
        await started.start_registrar()
        yield started
    finally:
        await started.stop()


async def until_health(service: KvpushProcess, wanted: int, timeout: float = WAIT_S) -> float:
    """Waits (bounded) until the member's RendezvousService health is wanted; returns how long that took."""
    start = time.monotonic()
    while (status := await service.health(broker_servicer.SERVICE_NAME)) != wanted:
        assert time.monotonic() - start < timeout, f"{service.name} health {status} after {timeout}s:\n{service.process.tail()}"
        await asyncio.sleep(0.05)
    return time.monotonic() - start


async def next_map(call: grpc.aio.UnaryStreamCall, timeout: float = WAIT_S) -> dict[str, str]:
    """The next shard map a WatchShards stream sends, as {member_id: address}."""
    response = await asyncio.wait_for(call.read(), timeout)
    assert response is not grpc.aio.EOF, "the shard map stream ended"
    return {shard.member_id: shard.address for shard in response.shards}


async def map_until(call: grpc.aio.UnaryStreamCall, predicate, timeout: float = WAIT_S) -> tuple[dict[str, str], float]:
    """Reads maps until one satisfies predicate; returns it and how long that took."""
    start = time.monotonic()
    while not predicate(shards := await next_map(call, max(0.01, timeout - (time.monotonic() - start)))):
        pass
    return shards, time.monotonic() - start
