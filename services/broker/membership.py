# SPDX-License-Identifier: Apache-2.0
"""Which broker members are live, and which of them owns a transfer: the shard map a broker member serves by.

A sharded broker's members each own the transfers whose transfer_id hashes
to them (kvpush.shards, highest random weight over the live members). A
Membership says who the members are (with the address each serves at), at
which coordination-store revision that map was read, whether this member
may serve now, and tells its listeners when any of that changed. An
unsharded broker is a StaticMembership: one member, always serving, owning
everything, never changing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Protocol

from kvpush import shards
from kvpush.rendezvous.v1 import rendezvous_service_pb2 as rv_pb
from kvpush.services.common.outbox import Outbox

logger = logging.getLogger(__name__)

# How many maps may wait for one WatchShards stream; past it the stream ends and its caller watches again.
WATCH_CAPACITY = 64
# How often a sharded member sends its map again while it does not change, so that a caller notices a hung or cut-off
# member it follows (kvpush.client.shard_map: after SILENT_HEARTBEATS of silence) well inside a member's shortest etcd
# lease (1 s): four small messages a second per watching client.
SHARD_MAP_HEARTBEAT_S = 0.25


class Membership(Protocol):
    """The broker's view of its shard map (read from the event loop's thread only)."""

    @property
    def member_id(self) -> str:
        """This member's id ("" for an unsharded broker)."""

    @property
    def revision(self) -> int:
        """The coordination store's revision the map was read at (only grows; 0 unsharded)."""

    def members(self) -> Mapping[str, str]:
        """Every live member's id and advertised address."""

    def owner(self, transfer_id: str) -> str | None:
        """The member that owns transfer_id under members() (None: no member)."""

    def serving(self) -> bool:
        """Whether this member may serve transfers now: false while it cannot be sure it is still a member."""

    def add_listener(self, listener: Callable[[], None]) -> None:
        """listener() is called after members(), revision or serving() changed."""


class StaticMembership:
    """An unsharded broker: one member with an empty id and address (the address the caller reached), always serving."""

    member_id = ""
    revision = 0

    def members(self) -> Mapping[str, str]:
        return {"": ""}

    def owner(self, transfer_id: str) -> str:
        return ""

    def serving(self) -> bool:
        return True

    def add_listener(self, listener: Callable[[], None]) -> None:
        """Nothing to hear: the map never changes."""


class MapMembership:
    """A shard map fed from elsewhere by update(); serving while held() and this member is in the map.

    EtcdMembership feeds it from an etcd watch; unit tests feed it by hand.
    """

    def __init__(self, member_id: str, held: Callable[[], bool]):
        if not member_id:
            raise ValueError("a sharded broker member needs a member id")
        self._member_id = member_id
        self._held = held
        self._members: dict[str, str] = {}
        self._revision = 0
        self._listeners: list[Callable[[], None]] = []

    @property
    def member_id(self) -> str:
        return self._member_id

    @property
    def revision(self) -> int:
        return self._revision

    def members(self) -> Mapping[str, str]:
        return self._members

    def owner(self, transfer_id: str) -> str | None:
        return shards.owner(transfer_id, self._members)

    def serving(self) -> bool:
        # Until its own key shows in the map, other parties do not route to it yet; serving
        # before that would let it take transfers another member still owns in their view.
        return self._member_id in self._members and self._held()

    def add_listener(self, listener: Callable[[], None]) -> None:
        self._listeners.append(listener)

    def update(self, members: Mapping[str, str], revision: int) -> None:
        """Replaces the map with the one read at revision (an older revision than the current is ignored)."""
        if revision < self._revision:
            return
        self._members = dict(sorted(members.items()))
        self._revision = revision
        self.notify()

    def notify(self) -> None:
        """Tells every listener that the map or serving() changed."""
        for listener in self._listeners:
            try:
                listener()
            except Exception:  # one faulty listener must not stop the map or the others
                logger.exception("shard map listener failed")


def shard_map(membership: Membership) -> rv_pb.WatchShardsResponse:
    """The WatchShards answer for the membership's current map (shards ordered by member_id)."""
    response = rv_pb.WatchShardsResponse(
        shards=[rv_pb.BrokerShard(member_id=m, address=a) for m, a in sorted(membership.members().items())],
        revision=membership.revision,
    )
    if membership.revision:
        response.heartbeat_interval.FromNanoseconds(int(SHARD_MAP_HEARTBEAT_S * 1e9))
    return response


class ShardWatches:
    """The open WatchShards streams' outboxes: each gets the whole map at once and again after every change."""

    def __init__(self) -> None:
        self._outboxes: set[Outbox] = set()

    def __len__(self) -> int:
        return len(self._outboxes)

    def open(self, membership: Membership) -> Outbox:
        outbox: Outbox = Outbox(WATCH_CAPACITY)
        outbox.put(shard_map(membership))
        self._outboxes.add(outbox)
        return outbox

    def release(self, outbox: Outbox) -> None:
        self._outboxes.discard(outbox)

    def changed(self, membership: Membership) -> None:
        """Sends the new map to every stream."""
        response = shard_map(membership)
        for outbox in self._outboxes:
            outbox.put(response)

    def close(self) -> None:
        """Ends every stream (the member stopped serving, or the broker stops)."""
        for outbox in self._outboxes:
            outbox.close()
        self._outboxes.clear()
