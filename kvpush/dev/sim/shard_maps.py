# SPDX-License-Identifier: Apache-2.0
"""The shard map as the simulated clients see it, and the sharded schedule's members and faults.

Each client (the router, each engine) follows one member's WatchShards
stream, as kvpush.client.shard_map.ShardMap does: it keeps the newest map
(an older revision from a member that lags behind etcd is ignored), and
follows the next member when the stream breaks, is refused, or stays silent
for SILENT_HEARTBEATS of the member's heartbeat intervals (a hung or cut-off
member keeps its stream open and says nothing). A client's map may
therefore lag etcd, or lag another client's: that is what this models.

An engine keeps its order or event streams open to every member of its map
(connector/control.py, follow_members) and drops a member's once the map
loses it; a decode engine then fails the requests registered with that
member and holds their blocks (DecodeWaits.member_left).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvpush import shards
from kvpush.client.shard_map import SILENT_HEARTBEATS
from kvpush.dev.sim.shards import BrokerMember, Etcd
from kvpush.dev.sim.world import Process

if TYPE_CHECKING:
    from kvpush.dev.sim.control_plane import Rpc
    from kvpush.dev.sim.simulation import Simulation

# cb(added, removed) with member names, after the map changed.
Listener = Callable[[set[str], set[str]], None]


class Shards:
    """A sharded broker's members and etcd, and the faults drawn for them (from a generator of their own)."""

    def __init__(self, sim: Simulation, count: int, rng: random.Random):
        self.sim = sim
        self.rng = rng
        self.members: list[BrokerMember] = []
        self.etcd = Etcd(sim, self)
        self.members = [BrokerMember(sim, i, self) for i in range(count)]
        for member in self.members:
            member.join_now()
        self.first_revision = self.etcd.revision

    def engine_removed(self, engine_id: str, incarnation: str, reason: str) -> None:
        """The registrar dropped ranks of an engine: each member hears of it through its watch."""
        for member in self.members:
            member.directory.removed(engine_id, incarnation, reason)

    def member(self, name: str) -> BrokerMember | None:
        return next((m for m in self.members if m.name == name), None)

    @property
    def names(self) -> list[str]:
        return [m.name for m in self.members]

    def schedule_faults(self, horizon: float) -> dict[str, int]:
        """Pauses past the lease, cuts from etcd or from the engines, lease give-ups and kills, each of a member."""
        rng, world = self.rng, self.sim.world

        def some(n: int, p: float) -> int:
            return rng.randint(1, n) if rng.random() < p else 0

        counts = {"member_pauses": some(2, 0.4), "etcd_cuts": some(2, 0.4), "engine_cuts": some(2, 0.3), "leaves": some(2, 0.3),
                  "member_kills": some(1, 0.2)}
        for name, n in counts.items():
            for _ in range(n):
                world.at(rng.uniform(0.2, horizon + 1.0), self._fault, name, rng.choice(self.members), rng.uniform(0.3, 3.0))
        return counts

    def _fault(self, name: str, member: BrokerMember, seconds: float) -> None:
        if name == "member_pauses":
            member.proc.paused_until = max(member.proc.paused_until, self.sim.world.time + seconds)
        elif name == "etcd_cuts":
            member.cut_from_etcd(seconds)
        elif name == "engine_cuts":
            member.cut_from_engines(seconds)
        elif name == "leaves":
            member.give_up(seconds / 2)
        elif member.proc.alive:
            member.kill(seconds / 2)

    def doubt_leases(self, seconds: float) -> None:
        """etcd elects a leader: no member can be sure of its lease meanwhile."""
        for member in self.members:
            if member.proc.alive:
                member.doubt_lease(seconds)

    @property
    def unsettled_attempts(self) -> int:
        return sum(m.core.unsettled_attempts for m in self.members if m.proc.alive)


class ClientMap:
    """One client's shard map, followed on one member's WatchShards stream at a time."""

    def __init__(self, sim: Simulation, proc: Process, rpc: Rpc):
        self.sim, self.proc, self.rpc = sim, proc, rpc
        shards_ = sim.shards
        assert shards_ is not None, "a client map needs a sharded broker"
        self._shards: Shards = shards_
        self.members: set[str] = set(shards_.etcd.members())  # as of the deployment's start
        self.revision = shards_.etcd.revision
        self.listeners: list[Listener] = []
        self._generation = 0
        self._heard = 0.0
        self._silence_s = float("inf")
        self.changes = 0
        self._follow(shards_.rng.choice(shards_.names))

    def owner(self, transfer_id: str) -> str | None:
        return shards.owner(transfer_id, self.members)

    def _follow(self, name: str) -> None:
        self._generation += 1
        generation = self._generation
        self.followed = name
        self._silence_s = float("inf")  # until the member says how often it repeats its map
        if self.sim.world.time < self.rpc.cut_until:
            self.proc.later(self.sim.timing.reconnect_s, self._move_on, generation, False)
            return
        member = self._shards.member(name)
        assert member is not None, f"{name} is no member"
        member.open_stream("shards", None, self.proc, self.rpc.caller, lambda m: self._message(generation, m),
                           lambda: self._move_on(generation, False), lambda _exc: self._move_on(generation, False))

    def _message(self, generation: int, response) -> None:
        if generation != self._generation:
            return
        self._heard = self.sim.world.time
        interval = response.heartbeat_interval.ToNanoseconds() / 1e9
        if interval and self._silence_s == float("inf"):
            self._silence_s = SILENT_HEARTBEATS * interval
            self.proc.later(self._silence_s, self._check_silence, generation)
        if response.revision <= self.revision:
            return  # not newer than the map held: the member answering lags behind etcd
        members = {shard.member_id for shard in response.shards}
        old, self.members, self.revision = self.members, members, response.revision
        added, removed = members - old, old - members
        if added or removed:
            self.changes += 1
            for listener in list(self.listeners):
                listener(added, removed)

    def _check_silence(self, generation: int) -> None:
        if generation != self._generation:
            return
        quiet = self.sim.world.time - self._heard
        if quiet >= self._silence_s - 1e-9:
            self._move_on(generation, True)
        else:
            self.proc.later(self._silence_s - quiet, self._check_silence, generation)

    def _move_on(self, generation: int, at_once: bool) -> None:
        """Follows the next member of the map (any member when it lists none): at once after a silence, after a pause otherwise."""
        if generation != self._generation:
            return
        self._generation += 1  # what the old stream still brings is ignored
        leaving = self.followed
        others = sorted((self.members | {self._shards.names[0]}) - {leaving}) or [leaving]
        name = next((m for m in others if m > leaving), others[0])
        if at_once:
            self._follow(name)
        else:
            self.proc.later(self.sim.timing.reconnect_s, self._follow, name)


class MemberStreams:
    """A server stream kept open to every member of a client's map, each reopened after it breaks until the member leaves the map."""

    def __init__(self, sim: Simulation, client_map: ClientMap, kind: str, request, on_open: Callable[[str], object],
                 on_message: Callable[[Any, Any], None], on_lost: Callable[[Any], None]):
        self.sim, self.map, self.kind, self.request = sim, client_map, kind, request
        self.on_open, self.on_message, self.on_lost = on_open, on_message, on_lost
        self._open: dict[str, list] = {}  # member -> [its follower's generation, its stream or None]
        client_map.listeners.append(self._changed)
        for name in sorted(client_map.members):
            self._start(name)

    def _changed(self, added: set[str], removed: set[str]) -> None:
        for name in sorted(removed):
            self._stop(name)
        for name in sorted(added):
            self._start(name)

    def _start(self, name: str) -> None:
        if name not in self._open:
            self._open[name] = [0, None]
            self._open_stream(name, 0)

    def _stop(self, name: str) -> None:
        entry = self._open.pop(name, None)
        if entry is not None and entry[1] is not None:
            stream, token = entry[1]
            stream.break_(float("inf"))  # the client closed it: the member notices, the client hears nothing more
            self.on_lost(token)

    def _open_stream(self, name: str, generation: int) -> None:
        entry = self._open.get(name)
        if entry is None or entry[0] != generation:
            return
        rpc = self.map.rpc
        if self.sim.world.time < rpc.cut_until:
            self.map.proc.later(self.sim.timing.reconnect_s, self._open_stream, name, generation)
            return
        token = self.on_open(name)

        def message(msg) -> None:
            if self._open.get(name) is entry and entry[0] == generation:
                self.on_message(token, msg)

        def lost(*_args) -> None:
            if self._open.get(name) is entry and entry[0] == generation:
                entry[0] += 1
                entry[1] = None
                self.on_lost(token)
                self.map.proc.later(self.sim.timing.reconnect_s, self._open_stream, name, entry[0])

        member = self.map._shards.member(name)
        assert member is not None, f"{name} is no member"
        stream = member.open_stream(self.kind, self.request, self.map.proc, rpc.caller, message, lost, lost)
        entry[1] = (stream, token)
