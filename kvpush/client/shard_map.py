# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""The broker's shard map as a client sees it: WatchShards followed on the seed target, and which member owns a transfer.

Until a map arrives, and for as long as the broker is unsharded, the map
is the seed target alone under the member id UNSHARDED (""): every
transfer is owned by the seed, so a call goes straight to it with no
extra round trip. A sharded broker's map (revision > 0) replaces it, and
a caller that still had the seed's view is redirected by the member it
reached (NOT_SHARD_OWNER, see ShardedBrokerClient).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable

from opentelemetry import trace

from kvpush import errors, shards
from kvpush.client.backoff import Backoff
from kvpush.client.broker import BrokerClient
from kvpush.client.config import ClientConfig
from kvpush.rendezvous.v1 import rendezvous_service_pb2 as pb

logger = logging.getLogger(__name__)

# The member id of an unsharded broker's one shard, and of the seed target before a map arrived.
UNSHARDED = ""

# How many of a member's heartbeat intervals of silence mean it is hung or cut off (its map is followed elsewhere then).
SILENT_HEARTBEATS = 4
# How long a new WatchShards stream may wait for its first map before any member named its heartbeat interval: a member
# sends its map at once, so one that does not is hung (a stream opened on a hung member would wait until it wakes).
FIRST_MAP_S = 5.0

# cb(added, removed): member_id -> address. A member whose address changed is in both.
Listener = Callable[[dict[str, str], dict[str, str]], None]


class ShardMap:
    """Follows WatchShards on the seed broker target (config.broker_target or config.target), then on members, and keeps the newest map.

    The seed may be a multi-address gRPC target (`ipv4:127.0.0.1:1,127.0.0.1:2`).
    A sharded member repeats its map every heartbeat interval it names; a
    stream that ends, fails, or stays silent for SILENT_HEARTBEATS of them
    (a hung member, or one cut off from this client, keeps its connection
    open and says nothing) is followed again on the next member of the map
    (the seed when none), at once after a silence, after a backoff
    otherwise. A map with a revision lower than the one held (a member that
    lags behind the coordination store) is ignored. `ready` is set once the
    broker said what its map is (an unsharded broker, or one from before
    WatchShards, counts as the seed alone).

    Use it from one event loop: start() there; listeners run on it.
    """

    def __init__(self, config: ClientConfig, *, tracer_provider: trace.TracerProvider | None = None, backoff: Backoff | None = None):
        self.seed_target = config.broker_target or config.target
        self._config = config
        self._tracer_provider = tracer_provider
        self._seed = BrokerClient(config, tracer_provider=tracer_provider)
        self._followed = self.seed_target  # the address whose WatchShards stream the map follows
        self._member_client: BrokerClient | None = None  # the followed member's, when it is not the seed
        self._backoff = backoff or Backoff()
        self._members: dict[str, str] = {UNSHARDED: self.seed_target}
        self.revision = 0  # of the map held; 0: unsharded (or none arrived yet)
        self.ready = asyncio.Event()
        self._listeners: list[Listener] = []
        self._task: asyncio.Task | None = None
        self._first_map_s = FIRST_MAP_S  # SILENT_HEARTBEATS intervals once a member named its interval

    @property
    def followed(self) -> str:
        """The address whose WatchShards stream the map follows now."""
        return self._followed

    @property
    def sharded(self) -> bool:
        return self.revision > 0

    def members(self) -> dict[str, str]:
        """member_id -> address of the live members (a copy); {UNSHARDED: seed target} when unsharded."""
        return dict(self._members)

    def owner(self, transfer_id: str) -> tuple[str, str]:
        """(member_id, address) of the member that owns transfer_id; (UNSHARDED, seed target) when no member is known."""
        member_id = shards.owner(transfer_id, self._members)
        if member_id is None:
            # No live member at all: the seed is the only one that can say so (BROKER_SHARD_LOST, or UNAVAILABLE).
            return UNSHARDED, self.seed_target
        return member_id, self._members[member_id]

    def add_listener(self, listener: Listener) -> None:
        """Calls listener(added, removed) on every change of the members after this.

        A sharded broker's first map is a change too: its members are
        added and UNSHARDED (the seed) is removed. An unsharded broker's
        map changes nothing, so its listeners are never called.
        """
        self._listeners.append(listener)

    def remove_listener(self, listener: Listener) -> None:
        if listener in self._listeners:
            self._listeners.remove(listener)

    def start(self) -> None:
        """Starts following the map on the running loop (once; later calls do nothing)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._follow(), name="kvpush-shard-map")

    async def wait_ready(self, timeout_s: float) -> bool:
        """Starts following if needed and waits at most timeout_s for the first map; whether it came."""
        self.start()
        try:
            async with asyncio.timeout(timeout_s):
                await self.ready.wait()
        except TimeoutError:
            return False
        return True

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        await self._set_followed(self.seed_target)
        await self._seed.close()

    async def _follow(self) -> None:
        while True:
            address = self._followed
            silence_s: float | None = self._first_map_s  # until this member says how often it repeats its map
            try:
                async with self._client().watch_shards() as stream:
                    responses = aiter(stream)
                    while True:
                        try:
                            async with asyncio.timeout(silence_s):
                                response = await anext(responses)
                        except StopAsyncIteration:
                            break
                        self._backoff.reset()
                        self._apply(response)
                        interval = response.heartbeat_interval.ToNanoseconds() / 1e9 if response.revision else 0.0
                        silence_s = SILENT_HEARTBEATS * interval if interval else None
                        if silence_s is not None:
                            self._first_map_s = silence_s
                if not self.sharded:
                    return  # an unsharded broker said its map once: it never changes
                logger.warning("shard map stream on %s ended; following another member", address)
            except TimeoutError:
                # A hung or cut-off member keeps its connection open and says nothing: another member serves the same map
                # (and drops this one once etcd does), so follow that one at once.
                logger.warning("shard map stream on %s silent for %.2f s; following another member", address, silence_s)
                await self._set_followed(self._next_address(address))
                continue
            except errors.KvpushError as exc:
                if exc.code == "UNIMPLEMENTED" and not self.sharded:
                    # A broker from before WatchShards is unsharded. Once a sharded map came, the
                    # address answering now is no member (a port reused): keep following.
                    self.ready.set()
                    return
                logger.warning("shard map stream on %s failed (%s); following another member", address, exc)
            except Exception:
                # Whatever broke this stream, a map nobody follows would route to a dead member for ever.
                logger.exception("shard map stream on %s broke; following another member", address)
            await self._set_followed(self._next_address(address))
            await self._backoff.sleep()

    def _next_address(self, leaving: str) -> str:
        """The address to follow after `leaving`: the next member's in the map (in address order), the seed when none."""
        if not self.sharded:
            return self.seed_target
        others = sorted(set(self._members.values()) | {self.seed_target})
        others = [address for address in others if address != leaving] or [self.seed_target]
        return next((address for address in others if address > leaving), others[0])

    def _client(self) -> BrokerClient:
        if self._followed == self.seed_target:
            return self._seed
        if self._member_client is None:
            self._member_client = BrokerClient(dataclasses.replace(self._config, broker_target=self._followed),
                                               tracer_provider=self._tracer_provider)
        return self._member_client

    async def _set_followed(self, address: str) -> None:
        if address != self._followed and self._member_client is not None:
            client, self._member_client = self._member_client, None
            await client.close()
        self._followed = address

    def _apply(self, response: pb.WatchShardsResponse) -> None:
        if self.ready.is_set() and response.revision <= self.revision:
            return  # not newer than the map held: the member answering lags behind
        if response.revision == 0:
            members = {UNSHARDED: self.seed_target}
        else:
            # An empty address means the address we called: the seed.
            members = {shard.member_id: shard.address or self.seed_target for shard in response.shards}
        old, self._members, self.revision = self._members, members, response.revision
        self.ready.set()
        added = {member: address for member, address in members.items() if old.get(member) != address}
        removed = {member: address for member, address in old.items() if members.get(member) != address}
        if not (added or removed):
            return
        logger.info("shard map revision %d: added %s, removed %s", response.revision, sorted(added), sorted(removed))
        for listener in list(self._listeners):
            try:
                listener(added, removed)
            except Exception:
                logger.exception("shard map listener %r failed", listener)
