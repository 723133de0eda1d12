# SPDX-License-Identifier: Apache-2.0
"""A sharded broker in the simulation: etcd and its leases, and broker members that own transfers while they hold theirs.

As services/broker/etcd_membership.py does, each member writes its key
under an etcd lease it renews every ttl/6 (kvpush/etcd/lease.py) and
serves only while the lease surely holds: until ttl after the last renewal
that succeeded was *sent*, by its own clock. etcd deletes the key once no
renewal arrived for a ttl; the others see the map change through their
watch and take the member's transfers (rendezvous hashing, kvpush.shards),
each member's BrokerCore fencing them as the real one does (Ownership: a
member that gains a transfer vouches for nothing about it for a grace).

A member may be paused (it wakes believing what it believed), cut from etcd
(its map goes stale and its lease lapses while engines still reach it), cut
from the engines (etcd keeps its lease: its transfers stay its own), give
its lease up, or be killed; it joins again with a new lease.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvpush.dev.sim.world import Process, Stream
from kvpush.errors import KvpushError
from kvpush.etcd.lease import RENEWALS_PER_TTL
from kvpush.services.broker.core import BrokerCore
from kvpush.services.broker.membership import SHARD_MAP_HEARTBEAT_S, MapMembership, shard_map

if TYPE_CHECKING:
    from kvpush.dev.sim.control_plane import Rpc
    from kvpush.dev.sim.shard_maps import Shards
    from kvpush.dev.sim.simulation import Simulation

BROKER_METHODS = frozenset(("RegisterDestination", "ReportPrefillDone", "ReportWriteResult", "CancelTransfer"))


class Etcd:
    """The coordination store: member keys under leases, and a watch of them for every member (never down itself)."""

    def __init__(self, sim: Simulation, shards: Shards):
        self.sim = sim
        self.shards = shards
        self.proc = Process(sim.world, "etcd", 0.0)
        self.keys: dict[str, int] = {}  # member -> the lease its key is under
        self.expiry: dict[int, float] = {}  # lease -> true time it lapses
        self.revision = 1
        self._lease_seq = 0

    def members(self) -> dict[str, str]:
        return {member: member for member in sorted(self.keys)}

    def join(self, member: str, ttl: float) -> tuple[int, dict[str, str], int]:
        """Grants a lease and puts the member's key under it: (lease, the map after the put, its revision)."""
        self._lease_seq += 1
        lease = self._lease_seq
        self._renew(lease, ttl)
        old = self.keys.get(member)
        self.keys[member] = lease
        if old is not None:
            self.expiry.pop(old, None)
        self._changed()
        return lease, self.members(), self.revision

    def keep_alive(self, lease: int, ttl: float) -> float:
        """The lease's ttl once renewed, 0 when it is gone."""
        if lease not in self.expiry:
            return 0.0
        self._renew(lease, ttl)
        return ttl

    def revoke(self, lease: int) -> None:
        if self.expiry.pop(lease, None) is not None:
            self._drop(lease)

    def _renew(self, lease: int, ttl: float) -> None:
        until = self.sim.world.time + ttl  # the leader starts a renewal's ttl when it receives it
        self.expiry[lease] = until
        self.sim.world.at(until, self._lapse, lease, until)

    def _lapse(self, lease: int, until: float) -> None:
        if self.expiry.get(lease) == until:
            del self.expiry[lease]
            self._drop(lease)

    def _drop(self, lease: int) -> None:
        for member in [m for m, held in self.keys.items() if held == lease]:
            del self.keys[member]
        self._changed()

    def _changed(self) -> None:
        self.revision += 1
        members, revision = self.members(), self.revision
        for member in self.shards.members:
            member.watched(members, revision)


class Directory:
    """A member's mirror of the registrar's engines (RemoteEngineDirectory), read from the registrar itself; removals arrive by its watch."""

    def __init__(self, sim: Simulation, member: BrokerMember):
        self.sim, self.member = sim, member
        self.listeners: list = []

    def get_engine(self, engine_id: str):
        return self.sim.cp.registrar.get_engine(engine_id)

    def add_removal_listener(self, listener) -> None:
        self.listeners.append(listener)

    def removed(self, engine_id: str, incarnation: str, reason: str) -> None:
        self.sim.network.deliver(self.member.proc, self._apply, list(self.listeners), engine_id, incarnation, reason, lossy=False)

    def _apply(self, listeners: list, engine_id: str, incarnation: str, reason: str) -> None:
        for listener in listeners:
            if listener in self.listeners:
                listener(engine_id, incarnation, reason)
        self.member.tick()


class BrokerMember:
    """One broker member: its process, BrokerCore, lease and streams to the engines."""

    def __init__(self, sim: Simulation, index: int, shards: Shards):
        self.sim = sim
        self.shards = shards
        self.name = f"broker-{index}"
        self.proc = Process(sim.world, self.name, shards.rng.uniform(-1, 1) * sim.faults.skew_s)
        self.directory = Directory(sim, self)
        self.cut_etcd_until = 0.0  # cut from etcd (the engines still reach it)
        self.cut_engines_until = 0.0  # cut from the engines and the router (etcd still reaches it)
        self.lease_sure = True  # etcd is not electing a leader
        self._watch_arrival = 0.0
        self.start()

    def start(self) -> None:
        self.lease = 0
        self.valid_until = float("-inf")  # by this member's monotonic clock
        self.put_revision = 0
        self.membership = MapMembership(self.name, self.held)
        self.directory.listeners = []  # the new core listens; the dead one's state is gone
        self.core = BrokerCore(self.directory, self.sim.timing.broker, self.proc, membership=self.membership)
        self.streams: list[tuple[Stream, Any, str]] = []
        self._opening: set[Stream] = set()  # streams whose subscription has not reached the core yet
        self._next_tick = float("inf")

    # ---- the lease (what KeptLease and EtcdMembership do) ----

    def held(self) -> bool:
        """Whether the lease surely holds: ttl after the last renewal that succeeded was sent, by this member's clock."""
        return bool(self.lease) and self.lease_sure and self.proc.now() < self.valid_until

    def join_now(self) -> None:
        """Joins at the schedule's start, before any request (the deployment came up earlier)."""
        lease, members, revision = self.shards.etcd.join(self.name, self.sim.timing.shard_lease_s)
        self._joined(self.proc.now(), lease, members, revision)

    def join(self) -> None:
        if not self.proc.alive or self.lease:
            return
        if self.sim.world.time < self.cut_etcd_until:
            self.proc.later(self.shards.rng.uniform(0.1, 0.5), self.join)
            return
        sent = self.proc.now()
        self._to_etcd(lambda: self._reply_etcd(self._joined, sent, *self.shards.etcd.join(self.name, self.sim.timing.shard_lease_s)))
        self.proc.later(self.sim.timing.shard_lease_s, self.join)  # its answer may be lost to a cut: join again then

    def _joined(self, sent: float, lease: int, members: dict[str, str], revision: int) -> None:
        if self.lease:
            return
        self.lease, self.valid_until, self.put_revision = lease, sent + self.sim.timing.shard_lease_s, revision
        self.membership.update(members, revision)
        self._renew_later()
        self.tick()

    def _renew_later(self) -> None:
        # The next renewal, or the moment the lease may lapse if none succeeds before (KeptLease's renewal timeout).
        delay = min(self.sim.timing.shard_lease_s / RENEWALS_PER_TTL, max(0.0, self.valid_until - self.proc.now()))
        self.proc.later(delay, self._renew, self.lease)

    def _renew(self, lease: int) -> None:
        if lease != self.lease:
            return
        sent = self.proc.now()
        if sent >= self.valid_until:
            self.lose("no renewal succeeded within its ttl")
            return
        ttl = self.sim.timing.shard_lease_s
        self._to_etcd(lambda: self._reply_etcd(self._renewed, lease, sent, self.shards.etcd.keep_alive(lease, ttl)))
        self._renew_later()

    def _renewed(self, lease: int, sent: float, ttl: float) -> None:
        if lease != self.lease:
            return
        if ttl <= 0:
            self.lose("etcd says it is gone")
        elif self.lease_sure:  # a renewal made while etcd elects a leader does not count
            self.valid_until = max(self.valid_until, sent + ttl)

    def lose(self, why: str) -> None:
        """Out of the map until it joins again with a new lease: it must not serve on the old map meanwhile."""
        if not self.lease:
            return
        self.lease = 0
        members = {m: a for m, a in self.membership.members().items() if m != self.name}
        self.membership.update(members, self.membership.revision)
        self.tick()
        self.proc.later(self.shards.rng.uniform(0.1, 0.5), self.join)

    def give_up(self, rejoin_after: float) -> None:
        """Leaves the map at once (revoking the lease deletes its key), and joins again later."""
        if not self.proc.alive or not self.lease or self.sim.world.time < self.cut_etcd_until:
            return
        lease = self.lease
        self._to_etcd(lambda: self.shards.etcd.revoke(lease))
        self.lease = 0
        self.membership.update({m: a for m, a in self.membership.members().items() if m != self.name}, self.membership.revision)
        self.tick()
        self.proc.later(rejoin_after, self.join)

    def watched(self, members: dict[str, str], revision: int) -> None:
        """etcd's watch brings a change (in order; lost while cut from etcd, which relists when the cut heals)."""
        if self.sim.world.time < self.cut_etcd_until:
            return
        arrival = max(self._watch_arrival, self.sim.world.time + self.sim.network.delay())
        self._watch_arrival = arrival
        self.proc.later(arrival - self.sim.world.time, self._apply_map, members, revision)

    def _apply_map(self, members: dict[str, str], revision: int) -> None:
        if self.lease and self.name not in members and revision > self.put_revision:
            self.lose("its key was deleted")
            return
        if not self.lease:
            members = {m: a for m, a in members.items() if m != self.name}
        self.membership.update(members, revision)
        self.tick()

    def _to_etcd(self, call) -> None:
        """A unary call to etcd: lost while cut from it."""
        if self.sim.world.time < self.cut_etcd_until:
            return
        self.sim.network.deliver(self.shards.etcd.proc, call, lossy=False)

    def _reply_etcd(self, fn, *args) -> None:
        if self.sim.world.time < self.cut_etcd_until:
            return
        self.sim.network.deliver(self.proc, lambda: None if self.sim.world.time < self.cut_etcd_until else fn(*args), lossy=False)

    # ---- faults ----

    def cut_from_etcd(self, seconds: float) -> None:
        self.cut_etcd_until = self.sim.world.time + seconds
        self.sim.world.at(self.cut_etcd_until + 1e-6, self._relist)

    def _relist(self) -> None:
        if self.sim.world.time >= self.cut_etcd_until:
            etcd = self.shards.etcd
            self.watched(etcd.members(), etcd.revision)

    def cut_from_engines(self, seconds: float) -> None:
        self.cut_engines_until = self.sim.world.time + seconds
        self.break_streams(None, self.shards.rng.uniform(0.0, seconds))

    def kill(self, downtime: float) -> None:
        self.proc.kill()
        for stream in [s for s, _, _ in self.streams] + list(self._opening):
            stream.break_(self.sim.network.delay())  # its connections reset: the clients hear of it
        self.streams = []
        self.sim.world.at(self.sim.world.time + downtime, self._restart)

    def _restart(self) -> None:
        self.proc.revive()
        self.start()
        self.join()

    def doubt_lease(self, seconds: float) -> None:
        generation = self.proc.generation
        self.lease_sure = False
        self.membership.notify()
        self.tick()
        self.sim.world.at(self.sim.world.time + seconds, self._sure_again, generation)

    def _sure_again(self, generation: int) -> None:
        if self.proc.alive and self.proc.generation == generation:
            self.lease_sure = True
            self.membership.notify()
            self.tick()

    # ---- requests and streams (what the servicer does) ----

    def reachable(self) -> bool:
        return self.sim.world.time >= self.cut_engines_until

    def receive(self, rpc: Rpc, method: str, request, finish) -> None:
        if self.reachable():
            self.sim.network.deliver(self.proc, self._handle, rpc, method, request, finish)

    def _handle(self, rpc: Rpc, method: str, request, finish) -> None:
        if not self.reachable():
            return
        try:
            response, error = self._dispatch(method, request, rpc.caller), None
        except KvpushError as exc:
            response, error = None, exc
        if self.reachable():
            rpc.reply(finish, response, error)
        self.tick()

    def _dispatch(self, method: str, request, caller: str):
        core = self.core
        if method == "RegisterDestination":
            return core.register_destination(request, caller)
        if method == "ReportPrefillDone":
            return core.report_prefill_done(request, caller)
        if method == "ReportWriteResult":
            return core.report_write_result(request, caller)
        if method == "CancelTransfer":
            return core.cancel(request.key, None if caller == "router" else caller, request.detail)
        raise ValueError(method)

    def open_stream(self, kind: str, request, client: Process, caller: str, on_message, on_broken, on_refused) -> Stream:
        stream = Stream(self.sim.network, client, on_message, on_broken)

        def subscribe() -> None:
            self._opening.discard(stream)
            if not self.reachable():
                return stream.break_(self.sim.network.delay())
            subscription: Any  # a Subscription, or the shard watch's Outbox
            try:
                if kind == "orders":
                    subscription = self.core.subscribe_producer(request, caller)
                elif kind == "events":
                    subscription = self.core.subscribe_decode(request, caller)
                else:
                    subscription = self.core.watch_shards()
            except KvpushError as exc:
                self.sim.network.deliver(client, on_refused, exc, lossy=False)
                return
            self.streams.append((stream, subscription, kind))
            if kind == "orders":
                self.proc.later(self.core.heartbeat_interval_s, self._heartbeat, stream, subscription)
            elif kind == "shards":
                self.proc.later(SHARD_MAP_HEARTBEAT_S, self._map_heartbeat, stream, subscription)
            self.tick()

        if self.reachable() and self.proc.alive:
            self._opening.add(stream)
            self.sim.network.deliver(self.proc, subscribe, lossy=False)
        else:  # refused, or no answer within the connection timeout
            stream.break_(self.sim.timing.reconnect_s)
        return stream

    def _heartbeat(self, stream: Stream, subscription) -> None:
        if stream.broken or not subscription.active:
            return
        if not len(subscription.outbox):
            stream.send(self.core.heartbeat())
        self.proc.later(self.core.heartbeat_interval_s, self._heartbeat, stream, subscription)

    def _map_heartbeat(self, stream: Stream, outbox) -> None:
        """A member repeats its map while it holds still: a client that hears nothing knows the member is hung."""
        if stream.broken or outbox.closed:
            return
        if not len(outbox):
            stream.send(shard_map(self.membership))
        self.proc.later(SHARD_MAP_HEARTBEAT_S, self._map_heartbeat, stream, outbox)

    def _pump(self) -> None:
        kept = []
        for stream, subscription, kind in self.streams:
            outbox = subscription if kind == "shards" else subscription.outbox
            for item in outbox.drain():
                stream.send(item)
            active = not outbox.closed if kind == "shards" else subscription.active
            if stream.broken or not active:
                if kind == "shards":
                    self.core.unwatch_shards(subscription)
                else:
                    self.core.unsubscribe(subscription)
                stream.break_(self.sim.network.delay())
            else:
                kept.append((stream, subscription, kind))
        self.streams = kept

    def break_streams(self, client: Process | None, notice_after: float) -> None:
        for stream, _, _ in list(self.streams):
            if client is None or stream.client is client:
                stream.break_(notice_after)
        self._pump()

    def tick(self, scheduled: float | None = None) -> None:
        """Runs the core's timers and writes out what it queued (what its DeadlineRunner and servicer do)."""
        if not self.proc.alive:
            return
        if scheduled is not None:
            if scheduled != self._next_tick:
                return
            self._next_tick = float("inf")
        self.core.on_membership_change()
        due = self.core.tick()
        self._pump()
        if due is not None and due < self._next_tick:
            self._next_tick = due
            self.proc.later(max(0.0, due - self.proc.now()) + 1e-6, self.tick, due)
