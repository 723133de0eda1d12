# SPDX-License-Identifier: Apache-2.0
"""A broker member's membership kept in etcd: its own key under a lease it renews, every member's key from a watch.

Key `<prefix>brokers/<member_id>` holds a serialized BrokerShard and is
attached to the member's KeptLease, so etcd deletes it when the member dies
or is cut off for a lease ttl. The map is listed, then followed by a watch
from the listed revision (resumed after a broken stream, listed again after
a compaction). The member serves only while it surely holds the lease and
sees its own key; once the lease is lost (or its key deleted) it stops
serving, takes a new lease and writes its key again by itself — as it does
after a restart, the key then moving to the new lease.
"""

from __future__ import annotations

import asyncio
import logging

from kvpush.client.backoff import Backoff
from kvpush.errors import KvpushError, Reason, Unavailable
from kvpush.etcd.client import EtcdClient, Event, WatchBatch
from kvpush.etcd.follow import follow_prefix
from kvpush.etcd.lease import KeptLease
from kvpush.rendezvous.v1 import rendezvous_service_pb2 as rv_pb
from kvpush.services.broker.membership import MapMembership

logger = logging.getLogger(__name__)

BROKERS = "brokers/"


class _Evicted(Exception):
    """This member's own key was deleted while its lease held: it joins again."""


class _SteppedDown(Exception):
    """This member left the map on purpose (no engine reaches it): it joins again after a hold-off."""


def brokers_prefix(prefix: str) -> bytes:
    """Where the members' keys live under a deployment's etcd prefix."""
    return (prefix + BROKERS).encode()


class EtcdMembership(MapMembership):
    """This member's place in the etcd shard map; run() keeps it until cancelled, close() leaves the map."""

    def __init__(self, client: EtcdClient, *, member_id: str, prefix: str, lease_ttl_s: int, max_backoff_s: float = 2.0):
        self._lease: KeptLease | None = None
        super().__init__(member_id, self._held)
        self._client = client
        # Where others reach this member: set before run() (a port chosen at bind time is known only then).
        self.address = ""
        self._prefix = brokers_prefix(prefix)
        self._key = self._prefix + member_id.encode()
        self._lease_ttl_s = lease_ttl_s
        self._max_backoff_s = max_backoff_s
        self._closed = False
        self._put_revision = 0  # of its key's latest put: deletions before it were of a key it held before
        # Whether engines reach this member (written into its key) and each other member's own word on it.
        self._engines_attached = False
        self._attached: dict[str, bool] = {}
        self._attached_changed = asyncio.Event()
        self._step_down = asyncio.Event()
        self._hold_off_s = 0.0
        self._step_down_why = ""

    def _held(self) -> bool:
        return self._lease is not None and self._lease.held()

    async def run(self) -> None:
        """Joins, follows the map, and joins again whenever the lease is lost; until cancelled."""
        backoff = Backoff(0.1, self._max_backoff_s)
        while not self._closed:
            try:
                await self._hold_membership(backoff)
            except (KvpushError, _Evicted) as exc:
                if self._closed:
                    return
                logger.warning("broker member %s is out of the shard map (%s); joining again in %.1fs", self.member_id, exc, backoff.delay_s)
            except _SteppedDown as exc:
                logger.warning("broker member %s stepped out of the shard map: %s; joining again in %.1fs", self.member_id, exc, self._hold_off_s)
                await self._drop_lease()
                await asyncio.sleep(self._hold_off_s)
                self._step_down.clear()
                continue
            finally:
                await self._drop_lease()
            await backoff.sleep()

    def set_engines_attached(self, attached: bool) -> None:
        """Records whether engines reach this member; its key says so from the next write on."""
        if attached != self._engines_attached:
            self._engines_attached = attached
            self._attached_changed.set()

    def peers_attached(self) -> bool:
        """Whether another member in the map says engines reach it."""
        return any(flag for member, flag in self._attached.items() if member != self.member_id and member in self.members())

    def step_down(self, hold_off_s: float, why: str) -> None:
        """Leaves the map at once (revoking the lease) and joins again after hold_off_s."""
        self._hold_off_s = hold_off_s
        self._step_down_why = why
        self._step_down.set()

    async def close(self) -> None:
        """Leaves the map for good, at once (revoking the lease deletes the key) rather than when the lease would lapse."""
        self._closed = True
        await self._drop_lease()

    async def _hold_membership(self, backoff: Backoff) -> None:
        lease = self._lease = await KeptLease(self._client, self._lease_ttl_s).start()
        members, revision = await self._read()
        self._attached_changed.clear()
        await self._put_own_key(lease)
        # Serving as soon as others can see the key, not one read later: the map read just
        # before the put, plus this member; the watch from that read on brings whatever
        # changed since, this put included.
        members[self.member_id] = self.address
        self.update(members, revision)
        backoff.reset()
        follow = asyncio.create_task(
            follow_prefix(self._client, self._prefix, relist=self._list, apply=self._apply_batch, backoff=backoff, revision=revision),
            name=f"shard-map-{self.member_id}",
        )
        lost = asyncio.create_task(lease.lost.wait(), name=f"shard-lease-{self.member_id}")
        writes = asyncio.create_task(self._write_attached(lease), name=f"shard-key-{self.member_id}")
        step_down = asyncio.create_task(self._step_down.wait(), name=f"shard-step-down-{self.member_id}")
        tasks = (follow, lost, writes, step_down)
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            if follow.done():
                follow.result()  # raises why it stopped
            if writes.done():
                writes.result()
            if step_down.done():
                raise _SteppedDown(self._step_down_why)
            raise Unavailable("its membership lease was lost", reason=Reason.BROKER_SHARD_LOST)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _put_own_key(self, lease: KeptLease) -> None:
        shard = rv_pb.BrokerShard(member_id=self.member_id, address=self.address, engines_attached=self._engines_attached)
        self._put_revision = await self._client.put(self._key, shard.SerializeToString(), lease=lease.id)

    async def _write_attached(self, lease: KeptLease) -> None:
        """Writes the key again whenever whether engines reach this member changes (rarely: on a partition or a fleet restart)."""
        while True:
            await self._attached_changed.wait()
            self._attached_changed.clear()
            await self._put_own_key(lease)

    def _apply_batch(self, batch: WatchBatch) -> None:
        members = dict(self.members())
        for event in batch.events:
            self._apply(members, event)
        self.update(members, batch.revision)

    async def _read(self) -> tuple[dict[str, str], int]:
        """The map in etcd now (member -> address) and the revision it was read at."""
        kvs, revision = await self._client.get_prefix(self._prefix)
        shards = {self._member_of(kv.key): rv_pb.BrokerShard.FromString(kv.value) for kv in kvs}
        self._attached = {member: shard.engines_attached for member, shard in shards.items()}
        return {member: shard.address for member, shard in shards.items()}, revision

    async def _list(self) -> int:
        members, revision = await self._read()
        if self.member_id not in members:
            raise _Evicted(f"its key {self._key.decode()} is missing")
        self.update(members, revision)
        return revision

    def _member_of(self, key: bytes) -> str:
        """The member a key belongs to: the key names it (the value only says where it is reached)."""
        return key[len(self._prefix):].decode()

    def _apply(self, members: dict[str, str], event: Event) -> None:
        member_id = self._member_of(event.kv.key)
        if event.type == "DELETE":
            members.pop(member_id, None)
            self._attached.pop(member_id, None)
            if member_id == self.member_id:
                if event.kv.mod_revision < self._put_revision:
                    members[member_id] = self.address  # its previous key lapsing before this put: not this one
                    return
                raise _Evicted(f"its key {self._key.decode()} was deleted")
        else:
            shard = rv_pb.BrokerShard.FromString(event.kv.value)
            members[member_id] = shard.address
            self._attached[member_id] = shard.engines_attached

    async def _drop_lease(self) -> None:
        lease, self._lease = self._lease, None
        # Out of the map until its key is written again: with a new lease it must not serve on the old map meanwhile.
        self._members = {member: address for member, address in self._members.items() if member != self.member_id}
        if lease is not None:
            self.notify()  # serving() turned false: the core ends what it served
            await lease.close()
