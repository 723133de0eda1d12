# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""A small asyncio client for etcd's v3 gRPC API (KV, Watch, Lease, Maintenance.Status).

It speaks etcd's own method paths with kvpush.etcd.v1's wire-compatible
messages, one grpc.aio channel per endpoint. Calls go to the current
endpoint; a failed call moves the client on to the next one. Calls whose
repetition cannot change the outcome (reads, put, lease calls) are retried
on another endpoint within their deadline; txn and delete are sent once and
their failure is the caller's to judge. Failures are kvpush.errors
exceptions.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import grpc
from google.protobuf.message import Message

from kvpush import errors, status
from kvpush.etcd.v1 import etcd_pb2 as pb

T = TypeVar("T", bound=Message)

_RANGE = "/etcdserverpb.KV/Range"
_PUT = "/etcdserverpb.KV/Put"
_DELETE_RANGE = "/etcdserverpb.KV/DeleteRange"
_TXN = "/etcdserverpb.KV/Txn"
_COMPACT = "/etcdserverpb.KV/Compact"
_WATCH = "/etcdserverpb.Watch/Watch"
_LEASE_GRANT = "/etcdserverpb.Lease/LeaseGrant"
_LEASE_REVOKE = "/etcdserverpb.Lease/LeaseRevoke"
_LEASE_KEEP_ALIVE = "/etcdserverpb.Lease/LeaseKeepAlive"
_LEASE_TIME_TO_LIVE = "/etcdserverpb.Lease/LeaseTimeToLive"
# Public: EtcdCluster asks members for their status without an event loop.
STATUS_METHOD = "/etcdserverpb.Maintenance/Status"

# etcd ends a watch stream whose member loses its leader when the stream
# carries this metadata (clientv3's WithRequireLeader), instead of leaving it
# silent while the rest of the cluster moves on.
_REQUIRE_LEADER = (("hasleader", "true"),)
# etcd refuses keepalive pings more frequent than every 5 s
# (--grpc-keepalive-min-time); these find a member that stopped answering
# under an open watch.
_CHANNEL_OPTIONS = [
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 0),
]
# Between rounds over every endpoint (e.g. while the cluster elects a leader).
_RETRY_BACKOFF_S = (0.05, 0.1, 0.2, 0.4)
_UNHEALTHY = (grpc.ChannelConnectivity.TRANSIENT_FAILURE, grpc.ChannelConnectivity.SHUTDOWN)
_RETRIED_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)

_COMPARE_RESULTS = {"=": 0, ">": 1, "<": 2, "!=": 3}
_TARGET_VERSION, _TARGET_VALUE, _TARGET_LEASE = 0, 3, 4
_EVENT_TYPES = {0: "PUT", 1: "DELETE"}


@dataclass(frozen=True)
class KeyValue:
    """A stored key as etcd reports it."""

    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int


@dataclass(frozen=True)
class Event:
    """One change seen by a watch: type is "PUT" or "DELETE"."""

    type: str
    kv: KeyValue
    prev_kv: KeyValue | None


@dataclass(frozen=True)
class WatchBatch:
    """Events of one watch response; every event up to `revision` has been delivered.

    revision is the last event's mod_revision, not the response header's:
    a watch catching up on a long history gets the header's (current)
    revision with only the first part of the backlog, so only the events
    themselves say how far it got.
    """

    events: list[Event]
    revision: int


@dataclass(frozen=True)
class MemberStatus:
    """One member's own view (Maintenance.Status): leader is 0 while it knows none."""

    member_id: int
    leader: int
    version: str
    errors: list[str]


class Compacted(Exception):
    """A watch's start revision was compacted away: relist, then watch from the listing's revision + 1."""

    def __init__(self, compact_revision: int):
        super().__init__(f"etcd compacted the history before revision {compact_revision}")
        self.compact_revision = compact_revision


def prefix_end(prefix: bytes) -> bytes:
    """The range_end that makes [prefix, range_end) every key starting with prefix."""
    stripped = prefix.rstrip(b"\xff")
    if not stripped:
        return b"\0"  # every key from prefix on
    return stripped[:-1] + bytes([stripped[-1] + 1])


def compare_version(key: bytes, op: str, version: int) -> pb.Compare:
    """Txn guard on a key's version (0 = the key does not exist)."""
    return pb.Compare(result=_COMPARE_RESULTS[op], target=_TARGET_VERSION, key=key, version=version)


def compare_value(key: bytes, op: str, value: bytes) -> pb.Compare:
    """Txn guard on a key's value."""
    return pb.Compare(result=_COMPARE_RESULTS[op], target=_TARGET_VALUE, key=key, value=value)


def compare_lease(key: bytes, op: str, lease: int) -> pb.Compare:
    """Txn guard on the lease a key is attached to (0 = none, or no key)."""
    return pb.Compare(result=_COMPARE_RESULTS[op], target=_TARGET_LEASE, key=key, lease=lease)


def op_put(key: bytes, value: bytes, lease: int = 0) -> pb.RequestOp:
    """Txn operation: put key."""
    return pb.RequestOp(request_put=pb.PutRequest(key=key, value=value, lease=lease))


def op_delete(key: bytes, prefix: bool = False) -> pb.RequestOp:
    """Txn operation: delete key, or every key with that prefix."""
    return pb.RequestOp(request_delete_range=pb.DeleteRangeRequest(key=key, range_end=prefix_end(key) if prefix else b""))


def _key_value(kv: pb.KeyValue) -> KeyValue:
    return KeyValue(kv.key, kv.value, kv.create_revision, kv.mod_revision, kv.version, kv.lease)


def _event(event: pb.Event) -> Event:
    prev = _key_value(event.prev_kv) if event.HasField("prev_kv") else None
    return Event(_EVENT_TYPES.get(event.type, str(event.type)), _key_value(event.kv), prev)


class EtcdClient:
    """An etcd v3 client over endpoints "127.0.0.1:2379", ...; every call ends within timeout_s.

    Channels open on first use, bound to that event loop: use a client from
    one loop only.
    """

    def __init__(self, endpoints: Sequence[str], *, timeout_s: float = 5.0):
        if not endpoints:
            raise ValueError("at least one etcd endpoint is required")
        if timeout_s <= 0:
            raise ValueError("timeout_s must be positive")
        self.endpoints = list(endpoints)
        self.timeout_s = timeout_s
        self._channels: list[grpc.aio.Channel | None] = [None] * len(self.endpoints)
        self._current = 0

    async def close(self) -> None:
        """Closes every channel; open watches end with Unavailable."""
        channels, self._channels = self._channels, [None] * len(self.endpoints)
        for channel in channels:
            if channel is not None:
                await channel.close()

    # Endpoint choice.

    def _channel(self, index: int) -> grpc.aio.Channel:
        channel = self._channels[index]
        if channel is None:
            channel = self._channels[index] = grpc.aio.insecure_channel(self.endpoints[index], options=_CHANNEL_OPTIONS)
        return channel

    def _pick(self) -> int:
        """The current endpoint, or the next one whose channel is not known to be failing."""
        count = len(self.endpoints)
        for step in range(count):
            index = (self._current + step) % count
            if self._channel(index).get_state(try_to_connect=True) not in _UNHEALTHY:
                self._current = index
                return index
        return self._current

    def _failed(self, index: int) -> None:
        """A call through endpoint index failed: the next call starts at the next endpoint."""
        if self._current == index:
            self._current = (index + 1) % len(self.endpoints)

    async def _call(self, attempt: Callable[[grpc.aio.Channel, float], Awaitable[T]], *, retry: bool) -> T:
        """Runs attempt(channel, timeout_s) on the current endpoint, and with retry on the others until the deadline."""
        deadline = time.monotonic() + self.timeout_s
        # With retry, one endpoint that stopped answering may take only its
        # share of the deadline, so the others still get their turn.
        share = self.timeout_s / len(self.endpoints) if retry else self.timeout_s
        tries = 0
        while True:
            index = self._pick()
            remaining = deadline - time.monotonic()
            try:
                return await attempt(self._channel(index), max(0.001, min(share, remaining)))
            except grpc.aio.AioRpcError as exc:
                if exc.code() in _RETRIED_CODES:
                    self._failed(index)
                remaining = deadline - time.monotonic()
                if not retry or exc.code() not in _RETRIED_CODES or remaining <= 0:
                    raise status.from_rpc_error(exc) from exc
            tries += 1
            if tries % len(self.endpoints) == 0:
                rounds = tries // len(self.endpoints)
                await asyncio.sleep(min(_RETRY_BACKOFF_S[min(rounds, len(_RETRY_BACKOFF_S)) - 1], max(0.0, remaining)))

    async def _unary(self, method: str, request: Message, response_type: type[T], *, retry: bool) -> T:
        async def attempt(channel: grpc.aio.Channel, timeout_s: float) -> T:
            call = channel.unary_unary(method, request_serializer=type(request).SerializeToString,
                                       response_deserializer=response_type.FromString)
            return await call(request, timeout=timeout_s)

        return await self._call(attempt, retry=retry)

    # KV.

    async def get(self, key: bytes) -> KeyValue | None:
        """The key, or None when it does not exist (a linearizable read)."""
        response = await self._unary(_RANGE, pb.RangeRequest(key=key), pb.RangeResponse, retry=True)
        return _key_value(response.kvs[0]) if response.kvs else None

    async def get_prefix(self, prefix: bytes) -> tuple[list[KeyValue], int]:
        """Every key under prefix, by key, and the revision they were read at."""
        request = pb.RangeRequest(key=prefix, range_end=prefix_end(prefix))
        response = await self._unary(_RANGE, request, pb.RangeResponse, retry=True)
        return [_key_value(kv) for kv in response.kvs], response.header.revision

    async def put(self, key: bytes, value: bytes, *, lease: int = 0) -> int:
        """Writes key and returns the revision; retried, since writing the same value again leaves the same state."""
        response = await self._unary(_PUT, pb.PutRequest(key=key, value=value, lease=lease), pb.PutResponse, retry=True)
        return response.header.revision

    async def delete(self, key: bytes, *, prefix: bool = False) -> int:
        """Deletes key (or every key under it) and returns how many were deleted; sent once, as a repeat would count 0."""
        request = pb.DeleteRangeRequest(key=key, range_end=prefix_end(key) if prefix else b"")
        response = await self._unary(_DELETE_RANGE, request, pb.DeleteRangeResponse, retry=False)
        return response.deleted

    async def txn(self, compares: Sequence[pb.Compare], success: Sequence[pb.RequestOp],
                  failure: Sequence[pb.RequestOp] = ()) -> tuple[bool, int]:
        """Applies success if every compare holds, else failure; returns (succeeded, revision). Sent once."""
        request = pb.TxnRequest(compare=compares, success=success, failure=failure)
        response = await self._unary(_TXN, request, pb.TxnResponse, retry=False)
        return response.succeeded, response.header.revision

    async def compact(self, revision: int) -> None:
        """Drops the history before revision (watches from older revisions then raise Compacted)."""
        await self._unary(_COMPACT, pb.CompactionRequest(revision=revision, physical=True), pb.CompactionResponse, retry=True)

    # Leases.

    async def grant(self, ttl_s: int) -> tuple[int, int]:
        """A new lease: (id, granted ttl in seconds). Retried: a lease granted by a lost try expires unused."""
        response = await self._unary(_LEASE_GRANT, pb.LeaseGrantRequest(ttl=ttl_s), pb.LeaseGrantResponse, retry=True)
        if response.error:
            raise errors.Internal(f"etcd refused a lease of {ttl_s} s: {response.error}")
        return response.id, response.ttl

    async def keep_alive_once(self, lease_id: int) -> int:
        """Renews the lease; returns its new ttl in seconds, <= 0 when the lease is gone."""

        async def attempt(channel: grpc.aio.Channel, timeout_s: float) -> int:
            call = channel.stream_stream(_LEASE_KEEP_ALIVE, request_serializer=pb.LeaseKeepAliveRequest.SerializeToString,
                                         response_deserializer=pb.LeaseKeepAliveResponse.FromString)(timeout=timeout_s)
            try:
                await call.write(pb.LeaseKeepAliveRequest(id=lease_id))
                response = await call.read()
            finally:
                call.cancel()
            if response is grpc.aio.EOF:
                raise errors.Unavailable("etcd ended the keep-alive stream without an answer", reason=errors.Reason.UNAVAILABLE)
            return response.ttl

        return await self._call(attempt, retry=True)

    async def revoke(self, lease_id: int) -> None:
        """Ends the lease and deletes its keys; a lease that is already gone is not an error."""
        try:
            await self._unary(_LEASE_REVOKE, pb.LeaseRevokeRequest(id=lease_id), pb.LeaseRevokeResponse, retry=True)
        except errors.NotFound:
            pass

    async def time_to_live(self, lease_id: int) -> int:
        """The lease's remaining seconds; -1 when it is gone."""
        response = await self._unary(_LEASE_TIME_TO_LIVE, pb.LeaseTimeToLiveRequest(id=lease_id),
                                     pb.LeaseTimeToLiveResponse, retry=True)
        return response.ttl

    # Maintenance.

    async def status(self, endpoint: str) -> MemberStatus:
        """What the member at endpoint (one of endpoints) says of itself; asks that member only."""
        index = self.endpoints.index(endpoint)
        call = self._channel(index).unary_unary(STATUS_METHOD, request_serializer=pb.StatusRequest.SerializeToString,
                                                response_deserializer=pb.StatusResponse.FromString)
        try:
            response = await call(pb.StatusRequest(), timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise status.from_rpc_error(exc) from exc
        return MemberStatus(response.header.member_id, response.leader, response.version, list(response.errors))

    # Watch.

    async def watch_prefix(self, prefix: bytes, *, start_revision: int = 0, prev_kv: bool = False) -> AsyncGenerator[WatchBatch, None]:
        """Yields every change under prefix from start_revision (0: from now on) in batches.

        Raises Compacted when start_revision is no longer in etcd's history;
        any other end of the stream raises kvpush.errors.Unavailable, after
        which the caller watches again from the last batch's revision + 1.
        The create is confirmed within timeout_s; after that the stream has
        no deadline (gRPC keepalive and the require-leader metadata end a
        stream whose member stopped serving). Close the iterator when done
        (`async with contextlib.aclosing(...)`, or aclose()): that ends the
        stream.
        """
        index = self._pick()
        call = self._channel(index).stream_stream(_WATCH, request_serializer=pb.WatchRequest.SerializeToString,
                                                  response_deserializer=pb.WatchResponse.FromString)(metadata=_REQUIRE_LEADER)
        create = pb.WatchCreateRequest(key=prefix, range_end=prefix_end(prefix), start_revision=start_revision, prev_kv=prev_kv)
        try:
            async with asyncio.timeout(self.timeout_s):
                await call.write(pb.WatchRequest(create_request=create))
            created = False
            while True:
                if created:
                    response = await call.read()
                else:
                    async with asyncio.timeout(self.timeout_s):
                        response = await call.read()
                if response is grpc.aio.EOF:
                    raise errors.Unavailable(f"etcd {self.endpoints[index]} ended the watch stream", reason=errors.Reason.UNAVAILABLE)
                created = created or response.created
                if response.canceled:
                    if response.compact_revision:
                        raise Compacted(response.compact_revision)
                    raise errors.Unavailable(f"etcd cancelled the watch: {response.cancel_reason}", reason=errors.Reason.UNAVAILABLE)
                if response.events:
                    yield WatchBatch([_event(event) for event in response.events], response.events[-1].kv.mod_revision)
        except grpc.aio.AioRpcError as exc:
            self._failed(index)
            raise errors.Unavailable(f"etcd watch on {self.endpoints[index]} failed: {exc.code().name} {exc.details()}",
                                     reason=errors.Reason.UNAVAILABLE) from exc
        except TimeoutError as exc:
            self._failed(index)
            raise errors.Unavailable(f"etcd {self.endpoints[index]} did not confirm the watch within {self.timeout_s:g} s",
                                     reason=errors.Reason.UNAVAILABLE) from exc
        finally:
            call.cancel()
