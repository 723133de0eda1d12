# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""Real grpc.aio servers that act as broker shard members for client tests: WatchShards and ownership refusals.

Each member owns the transfers kvpush.shards.owner gives it over its
view of the membership (the cluster's, unless a test gives it one of its
own) and refuses the others with NOT_SHARD_OWNER naming the owner, as a
sharded broker does. What WatchShards publishes is set apart from the
membership, so a test can make clients' maps lag behind it.
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


class Cluster:
    """What the members share: the membership (member_id -> address) and the map WatchShards publishes."""

    def __init__(self) -> None:
        self.membership: dict[str, str] = {}
        self.published = rv_pb.WatchShardsResponse()  # revision 0: unsharded
        self.changed = asyncio.Condition()
        self.generation = 0  # break_streams() bumps it: streams of an older one fail
        self.answer_watches = asyncio.Event()
        self.answer_watches.set()
        self.watch_unimplemented = False  # WatchShards answers UNIMPLEMENTED (what another server on a member's address would)

    async def publish(self, members: dict[str, str], revision: int) -> None:
        """Publishes a map to every WatchShards stream (open and future)."""
        response = rv_pb.WatchShardsResponse(revision=revision)
        for member_id in sorted(members):
            response.shards.add(member_id=member_id, address=members[member_id])
        async with self.changed:
            self.published = response
            self.changed.notify_all()

    async def break_streams(self) -> None:
        """Fails every open WatchShards stream with UNAVAILABLE (a member going away under it)."""
        async with self.changed:
            self.generation += 1
            self.changed.notify_all()

    async def maps(self, context: grpc.aio.ServicerContext) -> AsyncIterator[rv_pb.WatchShardsResponse]:
        """What a member's WatchShards sends: once answer_watches is set, the published map and every later one."""
        await self.answer_watches.wait()
        if self.watch_unimplemented:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
        generation = self.generation
        sent = None
        while True:
            async with self.changed:
                while self.published is sent and self.generation == generation:
                    await self.changed.wait()
                if self.generation != generation:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "member going away")
                sent = self.published
            yield sent


class Member(rv_grpc.RendezvousServiceServicer):
    """One broker member: records the transfer ids of its unary calls, serves those it owns."""

    def __init__(self, cluster: Cluster, member_id: str):
        self.cluster = cluster
        self.member_id = member_id
        self.view: dict[str, str] | None = None  # its own membership view; None: the cluster's
        self.calls: list[tuple[str, str]] = []  # (method, transfer_id), served or refused
        self.transfer_state = transfer_pb2.TRANSFER_STATE_UNSPECIFIED  # what GetTransfer says of every attempt
        self.address = ""
        self.server: grpc.aio.Server | None = None

    async def _check_owner(self, method: str, transfer_id: str, context: grpc.aio.ServicerContext) -> None:
        self.calls.append((method, transfer_id))
        if self.cluster.published.revision == 0:
            return  # unsharded: owns everything
        view = self.cluster.membership if self.view is None else self.view
        owner = shards.owner(transfer_id, view)
        if owner != self.member_id:
            refusal = errors.FailedPrecondition(
                f"transfer {transfer_id} is owned by {owner}",
                reason=errors.Reason.NOT_SHARD_OWNER,
                metadata={"owner_member_id": owner or "", "owner_address": view.get(owner or "", "")},
            )
            await context.abort_with_status(status.to_status(refusal))

    async def RegisterDestination(self, request, context):
        await self._check_owner("RegisterDestination", request.key.transfer_id, context)
        return rv_pb.RegisterDestinationResponse(state=transfer_pb2.TRANSFER_STATE_WAITING_FOR_PREFILL)

    async def ReportPrefillDone(self, request, context):
        await self._check_owner("ReportPrefillDone", request.key.transfer_id, context)
        return rv_pb.ReportPrefillDoneResponse(state=transfer_pb2.TRANSFER_STATE_MATCHED)

    async def ReportWriteResult(self, request, context):
        await self._check_owner("ReportWriteResult", request.key.transfer_id, context)
        return rv_pb.ReportWriteResultResponse()

    async def CancelTransfer(self, request, context):
        await self._check_owner("CancelTransfer", request.key.transfer_id, context)
        return rv_pb.CancelTransferResponse()

    async def GetTransfer(self, request, context):
        await self._check_owner("GetTransfer", request.transfer_id, context)
        if request.HasField("wait") and self.transfer_state == transfer_pb2.TRANSFER_STATE_UNSPECIFIED:
            await asyncio.sleep(request.wait.ToTimedelta().total_seconds())  # a long poll of an attempt that never ends
        key = transfer_pb2.TransferKey(transfer_id=request.transfer_id, attempt=request.attempt)
        transfer = transfer_pb2.Transfer(key=key, state=self.transfer_state, detail=self.member_id)
        return rv_pb.GetTransferResponse(transfer=transfer)

    async def WatchShards(self, request, context):
        async for response in self.cluster.maps(context):
            yield response


@contextlib.asynccontextmanager
async def members(cluster: Cluster, member_ids: list[str], member_class: type = Member) -> AsyncIterator[dict]:
    """Serves one member_class(cluster, member_id) per id on its own 127.0.0.1 port (its address and server set); the cluster's membership lists them all."""
    served = {}
    try:
        for member_id in member_ids:
            server = grpc.aio.server()
            member = member_class(cluster, member_id)
            rv_grpc.add_RendezvousServiceServicer_to_server(member, server)
            member.address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
            member.server = server
            await server.start()
            served[member_id] = member
            cluster.membership[member_id] = member.address
        yield served
    finally:
        for member in served.values():
            await member.server.stop(grace=None)
