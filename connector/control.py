# SPDX-License-Identifier: Apache-2.0
"""The connector's link to the control plane.

All gRPC runs on one asyncio loop in a background thread (LoopThread); the
engine thread only hands work over and never waits on the network, except
once at startup to register its rank.

The broker may be sharded: its members split the transfers among them, and
the session follows their shard map (kvpush.client.ShardMap). Each user of
the broker's engine streams (reports, write orders, transfer events) gets
one stream per member, opened when the member joins and closed when it
leaves, so a rank holds O(members) streams. An unsharded broker is one
member, the control plane's address: the streams open at once, on the same
channel as without sharding, and stay its only ones (the map's watch ends
once the broker said it is unsharded).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from kvpush import errors
from kvpush.client import BrokerClient, ClientConfig, LoopThread, RegistrarClient
from kvpush.client.backoff import Backoff
from kvpush.client.shard_map import UNSHARDED, ShardMap
from kvpush.connector.config import ConnectorConfig
from kvpush.connector.report_routing import ReportRouter, stop_tasks
from kvpush.registrar.v1 import registrar_service_pb2 as reg_pb

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class MemberFollower:
    """A server stream kept open to every broker member (see ControlSession.follow_members)."""

    name: str
    open_stream: Callable[[BrokerClient], Any]
    on_open: Callable[[str], Callable[[Any], None]]
    on_lost: Callable[[str], None] | None


class ControlSession:
    """One loop thread with a registrar and a broker client, plus long-lived streams."""

    def __init__(self, config: ConnectorConfig, name: str):
        self.config = config
        client_config = ClientConfig(
            target=config.control_plane,
            broker_target=config.broker,
            token=config.token,
            ca_cert_path=config.tls_ca,
            client_cert_path=config.tls_cert,
            client_key_path=config.tls_key,
            default_timeout_s=config.rpc_timeout_s,
        )
        self.loop = LoopThread(name)
        self.registrar = RegistrarClient(client_config)
        self.broker = BrokerClient(client_config)  # the seed: the whole broker when unsharded
        self._client_config = client_config
        self._tasks: list[Any] = []
        self._closed = False
        # Broker members and their engine streams, from the first use of them on (control loop only).
        self._shards: ShardMap | None = None
        self._clients: dict[str, BrokerClient] = {}  # member -> client; the seed's is self.broker
        self._redirected: dict[str, BrokerClient] = {}  # members a NOT_SHARD_OWNER answer named before the map listed them
        self._member_tasks: dict[str, list[asyncio.Task]] = {}  # member -> its followers' tasks
        self._routers: list[ReportRouter] = []
        self._followers: list[MemberFollower] = []
        self._member_left: list[Callable[[str, frozenset[str]], None]] = []
        self._sync: asyncio.Task | None = None
        self._unfollow: asyncio.Task | None = None

    def report_stream(self, engine_id: str) -> ReportRouter:
        """Opens engine_id's EngineReports stream to every broker member; each item goes to its transfer's owner, until close()."""
        router = ReportRouter(engine_id, self.loop.loop, self.config.rpc_timeout_s, lambda: self._closed, self._client_for)
        self.loop.loop.call_soon_threadsafe(self._attach, router, None)
        return router

    def follow_members(self, name: str, open_stream: Callable[[BrokerClient], Any], on_open: Callable[[str], Callable[[Any], None]],
                       on_lost: Callable[[str], None] | None = None) -> None:
        """Keeps a server stream open to every broker member (as follow() does to one), from now until the member leaves.

        open_stream(client) opens it on a member's client; on_open(member) is
        called for every new stream and returns its message handler;
        on_lost(member) whenever one ends, the member's leaving included.
        """
        self.loop.loop.call_soon_threadsafe(self._attach, None, MemberFollower(name, open_stream, on_open, on_lost))

    def on_member_left(self, callback: Callable[[str, frozenset[str]], None]) -> None:
        """callback(member, members) on the control loop once a member left the shard map and its streams are closed.

        members: those of the map it left. Call before the first stream user
        (report_stream / follow_members). The seed giving way to a sharded
        map is not a member leaving.
        """
        self._member_left.append(callback)

    def members(self) -> set[str]:
        """The broker members this session keeps engine streams to now (any thread; for status and tests)."""
        return set(self._clients.copy())

    # ---- broker members (control loop) ---------------------------------------------------

    def _attach(self, router: ReportRouter | None, follower: MemberFollower | None) -> None:
        if self._closed:
            return
        if self._shards is None:
            # Until the broker says otherwise it is unsharded: the seed alone, reached at once.
            self._shards = ShardMap(self._client_config)
            self._clients[UNSHARDED] = self.broker
            self._shards.add_listener(lambda added, removed: self._resync())
            self._shards.start()
            self._unfollow = asyncio.ensure_future(self._unfollow_if_unsharded(self._shards))
        if router is not None:
            self._routers.append(router)
            for member, client in self._clients.items():
                router.add_member(member, client)
        if follower is not None:
            self._followers.append(follower)
            for member, client in self._clients.items():
                self._start(follower, member, client)

    async def _unfollow_if_unsharded(self, shard_map: ShardMap) -> None:
        """An unsharded broker's map never changes: once it said so, its watch stream goes, leaving today's streams alone."""
        await shard_map.ready.wait()
        if not shard_map.sharded:
            await shard_map.close()

    def _start(self, follower: MemberFollower, member: str, client: BrokerClient) -> None:
        name = follower.name if member == UNSHARDED else f"{follower.name} ({member})"
        on_lost = follower.on_lost
        task = asyncio.ensure_future(self._follow(name, lambda: follower.open_stream(client), None, lambda: follower.on_open(member),
                                                  (lambda: on_lost(member)) if on_lost is not None else None))
        self._member_tasks.setdefault(member, []).append(task)

    def _client_for(self, member: str, address: str) -> BrokerClient:
        """The client of a member a NOT_SHARD_OWNER answer named (the map does not list it yet)."""
        client = self._redirected.get(member)
        if client is None or client.target != address:
            client = self._redirected[member] = self._member_client(address)
        return client

    def _member_client(self, address: str) -> BrokerClient:
        """A client of one member's address, on connections of its own (ClientConfig.own_connections says why)."""
        return BrokerClient(dataclasses.replace(self._client_config, broker_target=address, own_connections=True))

    def _resync(self) -> None:
        """The shard map changed: one pass at a time brings the members' streams to the newest map."""
        if self._sync is None or self._sync.done():
            self._sync = asyncio.ensure_future(self._apply_map())
            self._sync.add_done_callback(_log_failure)

    async def _apply_map(self) -> None:
        assert self._shards is not None, "only the shard map's listener starts a resync"
        while not self._closed:
            members = self._shards.members()
            gone = [m for m, c in self._clients.items() if members.get(m) != c.target]  # left, or moved to another address
            gone += [m for m in self._redirected if m not in members]
            if not gone and all(m in self._clients for m in members):
                return
            # Members join first, so that the items of those leaving go straight to their new owners.
            for member, address in members.items():
                if member not in self._clients and member not in gone:
                    self._add(member, address)
            for member in gone:
                await self._remove(member, frozenset(members))
            for member, address in members.items():
                if member not in self._clients:
                    self._add(member, address)  # moved to another address

    def _add(self, member: str, address: str) -> None:
        client = self._redirected.pop(member, None)
        if client is None or client.target != address:
            client = self.broker if address == self.broker.target else self._member_client(address)
        self._clients[member] = client
        logger.info("kvpush: broker member %r at %s joined", member, address)
        for router in self._routers:
            router.add_member(member, client)
        for follower in self._followers:
            self._start(follower, member, client)

    async def _remove(self, member: str, members: frozenset[str]) -> None:
        lost = member != UNSHARDED  # the seed gives way to a sharded map: its items go again to their owners
        await stop_tasks(self._member_tasks.pop(member, []), f"a stream of broker member {member!r}")
        client = self._clients.pop(member, None) or self._redirected.pop(member, None)
        for router in self._routers:
            await router.remove_member(member, lost=lost)
        if client is not None and client is not self.broker:
            await client.close(0)
        logger.info("kvpush: broker member %r left", member)
        if lost:
            for callback in self._member_left:
                try:
                    callback(member, members)
                except Exception:
                    logger.exception("kvpush: member-left handler failed")

    def register_rank(self, request: reg_pb.RegisterEngineRankRequest) -> reg_pb.RegisterEngineRankResponse:
        """Registers this worker's rank, retrying until startup_timeout_s; blocks (engine start only)."""

        async def attempt() -> reg_pb.RegisterEngineRankResponse:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + self.config.startup_timeout_s
            backoff = Backoff()
            while True:
                try:
                    return await self.registrar.register_engine_rank(request)
                except (errors.Unavailable, errors.DeadlineExceeded) as exc:
                    if loop.time() + backoff.delay_s > deadline:
                        raise errors.Unavailable(
                            f"kvpush: control plane {self.config.control_plane} unreachable for "
                            f"{self.config.startup_timeout_s:g}s: {exc.message}",
                            reason=errors.Reason.UNAVAILABLE,
                        ) from exc
                    await backoff.sleep()

        return self.loop.call(attempt(), timeout_s=self.config.startup_timeout_s + self.config.rpc_timeout_s)

    def keep_alive(self, request: reg_pb.RegisterEngineRankRequest, lease: reg_pb.RegisterEngineRankResponse) -> None:
        """Renews the lease every ttl/3 on a KeepAlive stream, reopening the stream after any failure.

        A lease lapses only by time at the registrar, so a new stream keeps
        renewing the same lease; only when the registrar no longer knows it
        (it lapsed, or the control plane restarted) does the rank register
        again, with backoff, until it succeeds.
        """
        ttl_s = lease.lease_ttl.ToTimedelta().total_seconds()

        async def register_again() -> str:
            backoff = Backoff()
            while True:
                try:
                    response = await self.registrar.register_engine_rank(request)
                    logger.info("kvpush: rank re-registered with the control plane")
                    return response.lease_id
                except errors.KvpushError as exc:
                    logger.warning("kvpush: re-registration failed (%s); retrying", exc)
                await backoff.sleep()

        async def run() -> None:
            lease_id = lease.lease_id
            backoff = Backoff()
            while not self._closed:
                stream = self.registrar.keep_alive()
                unknown = False
                try:
                    await stream.write(reg_pb.KeepAliveRequest(lease_ids=[lease_id]))
                    async for response in stream:
                        backoff.reset()
                        if lease_id in response.unknown_lease_ids:
                            unknown = True
                            break
                        await asyncio.sleep(ttl_s / 3)
                        await stream.write(reg_pb.KeepAliveRequest(lease_ids=[lease_id]))
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # any stream failure: open another one
                    logger.warning("kvpush: lease keep-alive stream failed (%s)", exc)
                finally:
                    stream.cancel()
                if unknown:
                    lease_id = await register_again()
                    continue
                await backoff.sleep()

        self._tasks.append(self.loop.submit(run()))

    def follow(
        self,
        name: str,
        open_stream: Callable[[], Any],
        on_message: Callable[[Any], None] | None,
        *,
        on_open: Callable[[], Callable[[Any], None]] | None = None,
        on_lost: Callable[[], None] | None = None,
    ) -> None:
        """Keeps a server stream open, reconnecting with backoff, and hands each message over.

        on_open, if given, is called for every new stream and returns that
        stream's message handler (instead of on_message); on_lost is called
        whenever a stream ends. Any failure, including one of a handler,
        ends the stream and opens a new one: nothing kills the follower.
        """

        self._tasks.append(self.loop.submit(self._follow(name, open_stream, on_message, on_open, on_lost)))

    async def _follow(self, name: str, open_stream: Callable[[], Any], on_message: Callable[[Any], None] | None,
                      on_open: Callable[[], Callable[[Any], None]] | None, on_lost: Callable[[], None] | None) -> None:
        backoff = Backoff()
        while not self._closed:
            stream = open_stream()
            handle = on_open() if on_open is not None else on_message
            assert handle is not None, "follow() passes on_message, follow_members() on_open"
            try:
                async for message in stream:
                    backoff.reset()
                    handle(message)
                if self._closed:
                    return
                logger.warning("kvpush: %s stream ended; reopening", name)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                logger.warning("kvpush: %s stream failed (%s); reopening in %.2fs", name, exc, backoff.delay_s)
            finally:
                stream.cancel()
                if on_lost is not None:
                    on_lost()
            await backoff.sleep()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for task in self._tasks:
            task.cancel()

        async def shutdown() -> None:
            if self._shards is not None:
                await self._shards.close()
            await self.registrar.close(0.5)
            for client in {*self._clients.values(), *self._redirected.values(), self.broker}:
                await client.close(0.5)

        try:
            self.loop.call(shutdown(), timeout_s=2.0)
        except Exception:  # the process is going away; never hang shutdown on the network
            logger.debug("kvpush: control session close", exc_info=True)
        self.loop.stop()


def _log_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.error("kvpush: applying the broker's shard map failed", exc_info=task.exception())
