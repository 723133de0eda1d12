# SPDX-License-Identifier: Apache-2.0
"""Shared by the gRPC tests: in-process control planes on 127.0.0.1:0 and fake engines that talk to them through real stubs.

In token mode every identity has its own token (token_of); FakeEngine calls
carry its engine's, bearer() the router's by default.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses

import grpc
import pytest

from kvpush import status
from kvpush.dev import sample_engines as sample
from kvpush.errors import ERROR_DOMAIN
from kvpush.registrar.v1 import registrar_service_pb2 as reg_pb
from kvpush.registrar.v1 import registrar_service_pb2_grpc as reg_grpc
from kvpush.rendezvous.v1 import rendezvous_service_pb2 as rv_pb
from kvpush.rendezvous.v1 import rendezvous_service_pb2_grpc as rv_grpc
from kvpush.services import control_plane
from kvpush.services.broker.config import BrokerConfig
from kvpush.services.common.config import ServerConfig
from kvpush.services.common.tokens import BROKER_IDENTITY, ROUTER_IDENTITY, IdentityTokens
from kvpush.services.registrar.config import RegistrarConfig

# The identities the in-process control planes know.
IDENTITIES = (ROUTER_IDENTITY, BROKER_IDENTITY, "prefill-0", "prefill-1", "decode-0", "decode-1")
CALL_TIMEOUT_S = 5.0  # every unary call's deadline
STREAM_TIMEOUT_S = 30.0  # every stream's deadline: no test stream outlives it
WAIT_S = 5.0  # the longest a test waits for any message


async def expect_rpc_error(call, code: grpc.StatusCode, reason: str, field: str = "") -> grpc.aio.AioRpcError:
    """Awaits call and checks it failed with code and an ErrorInfo of reason and field."""
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    error = info.value
    assert error.code() == code, f"{error.code()}: {error.details()}"
    error_info = status.error_info(error)
    assert error_info is not None, "the status carries no ErrorInfo"
    assert (error_info.reason, error_info.domain, error_info.metadata.get("field", "")) == (reason, ERROR_DOMAIN, field)
    return error


async def read(call, timeout: float = WAIT_S):
    """The next message of a stream, within timeout (a timeout cancels the call)."""
    message = await asyncio.wait_for(call.read(), timeout)
    assert message is not grpc.aio.EOF, "the stream ended"
    return message


class Inbox:
    """Reads a stream in the background, so a test can also check that nothing arrived."""

    def __init__(self, call):
        self.call = call
        self._messages: asyncio.Queue = asyncio.Queue()
        self._reader = asyncio.create_task(self._read_all())

    async def _read_all(self) -> None:
        async for message in self.call:
            self._messages.put_nowait(message)

    async def next(self, timeout: float = WAIT_S):
        return await asyncio.wait_for(self._messages.get(), timeout)

    async def nothing_for(self, seconds: float) -> bool:
        await asyncio.sleep(seconds)
        return self._messages.empty()

    async def close(self) -> None:
        self.call.cancel()
        self._reader.cancel()
        await asyncio.gather(self._reader, return_exceptions=True)


def token_of(identity: str) -> str:
    """The test token of identity (every identity has its own)."""
    return f"test-token-{identity}"


def identity_tokens() -> IdentityTokens:
    return IdentityTokens({identity: token_of(identity) for identity in IDENTITIES})


def bearer(identity: str = ROUTER_IDENTITY) -> tuple[tuple[str, str], ...]:
    """Call metadata authenticating as identity (the router by default)."""
    return (("authorization", f"Bearer {token_of(identity)}"),)


@dataclasses.dataclass
class FakeEngine:
    """One engine's ranks, registered over gRPC; its calls carry its own token (token_of(engine_id) unless given)."""

    channel: grpc.aio.Channel
    engine_id: str
    role: int
    tp_size: int = 1
    incarnation: str = "inc-1"
    token: str = ""
    leases: list[str] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        self.token = self.token or token_of(self.engine_id)

    @property
    def registrar(self) -> reg_grpc.RegistrarServiceStub:
        return reg_grpc.RegistrarServiceStub(self.channel)

    @property
    def broker(self) -> rv_grpc.RendezvousServiceStub:
        return rv_grpc.RendezvousServiceStub(self.channel)

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.token}"),)

    async def register(self, **kwargs) -> FakeEngine:
        for request in sample.engine_requests(self.engine_id, self.role, tp_size=self.tp_size, incarnation=self.incarnation, **kwargs):
            response = await self.registrar.RegisterEngineRank(request, metadata=self.metadata, timeout=CALL_TIMEOUT_S)
            assert not response.engine_token  # deprecated: never issued
            self.leases.append(response.lease_id)
        return self

    async def keep_alive(self) -> grpc.aio.StreamStreamCall:
        """Opens a KeepAlive stream and renews every lease once on it."""
        call = self.registrar.KeepAlive(metadata=self.metadata, timeout=STREAM_TIMEOUT_S)
        await call.write(reg_pb.KeepAliveRequest(lease_ids=self.leases))
        response = await read(call)
        assert not response.unknown_lease_ids
        return call

    async def orders(self, tp_rank: int = 0, early: bool = False) -> grpc.aio.UnaryStreamCall:
        """Opens StreamWriteOrders for a rank and waits until the broker confirmed the subscription."""
        request = rv_pb.StreamWriteOrdersRequest(
            engine_id=self.engine_id, incarnation=self.incarnation, tp_rank=tp_rank, early_orders=early
        )
        call = self.broker.StreamWriteOrders(request, metadata=self.metadata, timeout=STREAM_TIMEOUT_S)
        await asyncio.wait_for(call.initial_metadata(), WAIT_S)
        return call

    async def events(self) -> grpc.aio.UnaryStreamCall:
        request = rv_pb.StreamTransferEventsRequest(engine_id=self.engine_id, incarnation=self.incarnation)
        call = self.broker.StreamTransferEvents(request, metadata=self.metadata, timeout=STREAM_TIMEOUT_S)
        await asyncio.wait_for(call.initial_metadata(), WAIT_S)
        return call


@contextlib.asynccontextmanager
async def running_control_plane(
    server_config: ServerConfig,
    *,
    registrar_config: RegistrarConfig | None = None,
    broker_config: BrokerConfig | None = None,
    tracer_provider=None,
):
    async with control_plane.running(
        server_config,
        registrar_config or RegistrarConfig(default_lease_ttl_s=5.0),
        broker_config,
        tokens=None if server_config.mtls else identity_tokens(),
        tracer_provider=tracer_provider,
    ) as plane:
        yield plane
