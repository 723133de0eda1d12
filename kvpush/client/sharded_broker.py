# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""BrokerClient's unary calls routed to the broker member that owns each transfer."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from opentelemetry import trace

from kvpush import errors
from kvpush.client.broker import BrokerClient
from kvpush.client.config import ClientConfig
from kvpush.client.shard_map import ShardMap
from kvpush.rendezvous.v1 import rendezvous_service_pb2 as pb

logger = logging.getLogger(__name__)

T = TypeVar("T")

# How long calls still open on a member that left the map get before its channel cancels them.
CLOSE_GRACE_S = 1.0


class ShardedBrokerClient:
    """The unary RendezvousService calls of BrokerClient, each sent to its transfer's owner in the shard map.

    One BrokerClient per member address (client_for), closed when the
    member leaves the map. A member that no longer owns the transfer (the
    map here is behind, or ahead, of the member's) answers NOT_SHARD_OWNER
    naming the owner; the call is sent once more, there, with a deadline
    of its own. Unsharded, every call goes to the seed target as
    BrokerClient would send it.

    shard_map: a map shared with other users (not closed here); by default
    the client follows one of its own. Use from one event loop.
    """

    def __init__(self, config: ClientConfig, *, shard_map: ShardMap | None = None, tracer_provider: trace.TracerProvider | None = None):
        self.config = config
        self._tracer_provider = tracer_provider
        self._owns_map = shard_map is None
        self.shard_map = shard_map if shard_map is not None else ShardMap(config, tracer_provider=tracer_provider)
        self._clients: dict[str, BrokerClient] = {}
        self._closing: set[asyncio.Task] = set()
        self.shard_map.add_listener(self._on_change)

    def client_for(self, address: str) -> BrokerClient:
        """The BrokerClient of one member address (for its streams); kept while the address is in the map."""
        client = self._clients.get(address)
        if client is None:
            config = dataclasses.replace(self.config, broker_target=address)
            client = self._clients[address] = BrokerClient(config, tracer_provider=self._tracer_provider)
        return client

    def _on_change(self, _added: dict[str, str], _removed: dict[str, str]) -> None:
        # Every address the map no longer lists goes, including one a redirect named before the map did.
        keep = set(self.shard_map.members().values()) | {self.shard_map.seed_target}
        for address in [address for address in self._clients if address not in keep]:
            task = asyncio.get_running_loop().create_task(self._clients.pop(address).close(CLOSE_GRACE_S))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    async def _routed(self, transfer_id: str, call: Callable[[BrokerClient], Awaitable[T]]) -> T:
        self.shard_map.start()
        _, address = self.shard_map.owner(transfer_id)
        try:
            return await call(self.client_for(address))
        except errors.FailedPrecondition as exc:
            if exc.reason != errors.Reason.NOT_SHARD_OWNER:
                raise
            owner_address = exc.metadata.get("owner_address") or self.shard_map.members().get(exc.metadata.get("owner_member_id", ""), "")
            if not owner_address or owner_address == address:
                raise
            logger.debug("transfer %s: %s is not its owner; resending to %s", transfer_id, address, owner_address)
            return await call(self.client_for(owner_address))

    async def register_destination(self, request: pb.RegisterDestinationRequest, *, timeout_s: float | None = None) -> pb.RegisterDestinationResponse:
        return await self._routed(request.key.transfer_id, lambda client: client.register_destination(request, timeout_s=timeout_s))

    async def report_prefill_done(self, request: pb.ReportPrefillDoneRequest, *, timeout_s: float | None = None) -> pb.ReportPrefillDoneResponse:
        return await self._routed(request.key.transfer_id, lambda client: client.report_prefill_done(request, timeout_s=timeout_s))

    async def report_write_result(self, request: pb.ReportWriteResultRequest, *, timeout_s: float | None = None) -> pb.ReportWriteResultResponse:
        return await self._routed(request.key.transfer_id, lambda client: client.report_write_result(request, timeout_s=timeout_s))

    async def cancel_transfer(self, request: pb.CancelTransferRequest, *, timeout_s: float | None = None) -> pb.CancelTransferResponse:
        return await self._routed(request.key.transfer_id, lambda client: client.cancel_transfer(request, timeout_s=timeout_s))

    async def get_transfer(self, request: pb.GetTransferRequest, *, timeout_s: float | None = None, wait_s: float | None = None) -> pb.GetTransferResponse:
        return await self._routed(request.transfer_id, lambda client: client.get_transfer(request, timeout_s=timeout_s, wait_s=wait_s))

    async def close(self) -> None:
        self.shard_map.remove_listener(self._on_change)
        clients, self._clients = list(self._clients.values()), {}
        await asyncio.gather(*(client.close() for client in clients), *self._closing, return_exceptions=True)
        if self._owns_map:
            await self.shard_map.close()

    async def __aenter__(self) -> ShardedBrokerClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

