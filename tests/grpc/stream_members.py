# SPDX-License-Identifier: Apache-2.0
"""Real grpc.aio servers acting as the members of a sharded broker, for the connector's engine streams.

Each member serves WatchShards (the map the test publishes), EngineReports
(it answers items of transfers it owns, by kvpush.shards over its view of
the membership, and refuses the others with NOT_SHARD_OWNER naming the
owner, as a sharded broker does; write results it takes from anyone, as
the member that sent an order does), and StreamWriteOrders /
StreamTransferEvents carrying what the test pushes to that member. What
WatchShards publishes is set apart from the membership, so a test can make
an engine's map lag behind the members' own.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc

from kvpush import errors, shards, status
from kvpush.rendezvous.v1 import rendezvous_service_pb2 as rv_pb
from kvpush.rendezvous.v1 import rendezvous_service_pb2_grpc as rv_grpc
from kvpush.rendezvous.v1 import transfer_pb2
from tests.client import shard_members

KINDS = ("registrations", "prefill_done", "write_results", "cancels")


class Cluster(shard_members.Cluster):
    """tests/client/shard_members' Cluster, but unsharded is one shard with no address ("the address you called")."""

    def __init__(self) -> None:
        super().__init__()
        self.published = rv_pb.WatchShardsResponse(shards=[rv_pb.BrokerShard()])


class StreamMember(rv_grpc.RendezvousServiceServicer):
    """One member: records what reached it, serves the transfers it owns, streams what the test pushes."""

    def __init__(self, cluster: Cluster, member_id: str):
        self.cluster = cluster
        self.member_id = member_id
        self.address = ""
        self.server: grpc.aio.Server | None = None
        self.accepted: list[tuple[str, str]] = []  # (kind, transfer_id) it answered
        self.refused: list[tuple[str, str]] = []  # (kind, transfer_id) it sent elsewhere
        self.hold_answers = False  # swallow report batches (no answer: the engine cannot know what was applied)
        self.held: list[rv_pb.EngineReportsRequest] = []
        self.watches_open = 0
        self.streams_opened: dict[str, int] = {"StreamWriteOrders": 0, "StreamTransferEvents": 0}
        self._outboxes: dict[str, list[asyncio.Queue]] = {"StreamWriteOrders": [], "StreamTransferEvents": []}

    def _owner(self, transfer_id: str) -> str:
        return shards.owner(transfer_id, self.cluster.membership) or ""

    async def EngineReports(self, request_iterator, context):
        async for request in request_iterator:
            if self.hold_answers:
                self.held.append(request)
                continue
            response = rv_pb.EngineReportsResponse()
            for kind in KINDS:
                for item in getattr(request, kind):
                    answer = getattr(response, kind).add(key=item.key)
                    owner = self._owner(item.key.transfer_id)
                    # A write result answers an order: the member that sent it takes it, owner or not (it holds the attempt).
                    if owner != self.member_id and kind != "write_results":
                        self.refused.append((kind, item.key.transfer_id))
                        refusal = errors.FailedPrecondition(
                            f"transfer {item.key.transfer_id} is owned by {owner}", reason=errors.Reason.NOT_SHARD_OWNER,
                            metadata={"owner_member_id": owner, "owner_address": self.cluster.membership.get(owner, "")})
                        status.to_item_error(refusal, answer.error)
                        continue
                    self.accepted.append((kind, item.key.transfer_id))
                    if kind == "registrations":
                        answer.response.state = transfer_pb2.TRANSFER_STATE_WAITING_FOR_PREFILL
                    elif kind == "cancels":
                        answer.response.state = transfer_pb2.TRANSFER_STATE_CANCELLED
                    else:
                        answer.state = transfer_pb2.TRANSFER_STATE_MATCHED
            yield response

    async def StreamWriteOrders(self, request, context):
        async for message in self._stream("StreamWriteOrders"):
            yield message

    async def StreamTransferEvents(self, request, context):
        async for message in self._stream("StreamTransferEvents"):
            yield message

    async def _stream(self, method: str) -> AsyncIterator:
        outbox: asyncio.Queue = asyncio.Queue()
        self.streams_opened[method] += 1
        self._outboxes[method].append(outbox)
        try:
            while True:
                yield await outbox.get()
        finally:
            self._outboxes[method].remove(outbox)

    def push(self, method: str, message) -> int:
        """Sends message on every open stream of method; how many there were."""
        for outbox in self._outboxes[method]:
            outbox.put_nowait(message)
        return len(self._outboxes[method])

    def open_streams(self, method: str) -> int:
        return len(self._outboxes[method])

    async def WatchShards(self, request, context):
        self.watches_open += 1
        try:
            async for response in self.cluster.maps(context):
                yield response
        finally:
            self.watches_open -= 1


@contextlib.asynccontextmanager
async def stream_members(cluster: Cluster, member_ids: list[str]) -> AsyncIterator[dict[str, StreamMember]]:
    """Serves one StreamMember per id on its own 127.0.0.1 port; the cluster's membership lists them all."""
    async with shard_members.members(cluster, member_ids, StreamMember) as served:
        yield served
