# SPDX-License-Identifier: Apache-2.0
"""The registrar's directory model: engines, their ranks, snapshots and states, watches and removal listeners.

Every registrar shares it; what differs is the lease authority that changes
it: the local one (RegistrarCore: a TTL heap swept in process) or etcd (a
replica's mirror applies what etcd says). An engine incarnation is READY
while every one of its tp_size * pp_size ranks is registered, PARTIAL while
some are missing, and GONE once its last rank left. Any rank leaving
(deregistration, lease lapse, replacement by a new incarnation) is reported
to the removal listeners, because an engine missing a worker cannot take
part in transfers.

Every change carries a revision (the local authority counts its own; etcd's
mirror uses etcd's), and the directory keeps the last changes so a watch can
resume after a revision instead of starting over from a snapshot.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable

from kvpush.clock import Clock, timestamp, wall_at
from kvpush.errors import NotFound, Reason, ResourceExhausted
from kvpush.registrar.v1 import registrar_service_pb2 as reg_pb
from kvpush.services.common.outbox import Outbox
from kvpush.services.registrar import checks
from kvpush.services.registrar.config import RegistrarConfig
from kvpush.services.registrar.engine_message import engine_message

logger = logging.getLogger(__name__)

# RemovalListener(engine_id, incarnation, reason) learns that ranks of an
# engine incarnation left; it must not raise and must not call back into the
# registrar.
RemovalListener = Callable[[str, str, str], None]

Position = tuple[int, int]  # (pp_rank, tp_rank): the order Engine.ranks lists ranks in


class RemovalReason:
    """Why ranks left; sent as WatchEnginesResponse.reason and to removal listeners."""

    DEREGISTERED = "DEREGISTERED"
    LEASE_EXPIRED = "LEASE_EXPIRED"
    REPLACED = "REPLACED"


class Rank:
    """One registered rank and the lease that holds it (ttl in seconds, expires on the monotonic clock)."""

    __slots__ = ("engine", "position", "lease_id", "registered", "ttl", "expires")

    def __init__(self, engine: EngineRecord, position: Position, lease_id: str, registered: reg_pb.RegisteredRank, ttl: float, expires: float):
        self.engine = engine
        self.position = position
        self.lease_id = lease_id
        self.registered = registered
        self.ttl = ttl
        self.expires = expires


class EngineRecord:
    """One engine incarnation: what its first rank registered, its ranks, state and current snapshot."""

    __slots__ = ("engine_id", "incarnation", "role", "tp_size", "pp_size", "compatibility_hash", "register_wall", "ranks", "state", "snapshot",
                 "first_rank")

    def __init__(self, registered: reg_pb.RegisteredRank, compatibility_hash: str, register_wall: float):
        rank = registered.rank
        self.first_rank = rank  # the engine-wide fields of its Engine message come from it
        self.engine_id = rank.engine_id
        self.incarnation = rank.incarnation
        self.role = rank.role
        self.tp_size = rank.tp_size
        self.pp_size = rank.pp_size
        self.compatibility_hash = compatibility_hash
        self.register_wall = register_wall
        self.ranks: dict[Position, Rank] = {}
        self.state = reg_pb.ENGINE_STATE_PARTIAL
        self.snapshot = reg_pb.Engine()


class EngineWatch:
    """One WatchEngines subscription: the events for one role (0 = every role), oldest first."""

    __slots__ = ("role", "watcher", "counted", "outbox")

    def __init__(self, role: int, watcher: str):
        self.role = role
        self.watcher = watcher
        self.counted = True  # still counted against the watcher's cap
        # A watcher that falls a whole queue behind is closed rather than fed a
        # history with holes; it watches again and gets a fresh snapshot.
        # Unbounded while the snapshot is queued (a snapshot always fits).
        self.outbox: Outbox[reg_pb.WatchEnginesResponse] = Outbox(None)


class Directory:
    """The engines a registrar knows and who watches them. Not thread-safe: call it from one thread (the event loop)."""

    def __init__(self, config: RegistrarConfig, clock: Clock, *, revision: int = 0):
        self._config = config
        self._clock = clock
        self._engines: dict[str, EngineRecord] = {}
        self._leases: dict[str, Rank] = {}
        self._watches: dict[EngineWatch, None] = {}  # an ordered set: events reach watchers in a fixed order
        self._watches_by_watcher: dict[str, int] = {}
        self._removal_listeners: list[RemovalListener] = []
        self.revision = revision  # of the last change applied
        # The last changes, for watches that resume; every change after
        # _history_floor is in it.
        self._history: collections.deque[reg_pb.WatchEnginesResponse] = collections.deque()
        self._history_floor = revision

    # ----- reads -----

    @property
    def engine_count(self) -> int:
        return len(self._engines)

    @property
    def lease_count(self) -> int:
        return len(self._leases)

    @property
    def watch_count(self) -> int:
        return len(self._watches)

    def get_engine(self, engine_id: str) -> reg_pb.Engine | None:
        """The engine's current snapshot, or None. Shared: callers must not mutate it.

        The snapshot object changes whenever the engine's ranks or state do,
        so callers may cache what they derive from it by identity. Its ranks'
        expire_time is as of that change; describe_engine() has current ones.
        """
        record = self._engines.get(engine_id)
        return record.snapshot if record is not None else None

    def describe_engine(self, engine_id: str) -> reg_pb.Engine:
        """A copy of the engine with its ranks' lease expiry times as known now (for GetEngine)."""
        record = self._engines.get(engine_id)
        if record is None:
            raise NotFound(f"engine {engine_id!r} is not registered", reason=Reason.ENGINE_NOT_FOUND, field="engine_id")
        return self._describe(record)

    def list_engines(self, role: int = 0) -> list[reg_pb.Engine]:
        """Copies of the live engines of a role (0 = all), ordered by engine_id."""
        checks.check_role_filter(role)
        return [self._describe(self._engines[eid]) for eid in sorted(self._engines) if not role or self._engines[eid].role == role]

    def lease_engine(self, lease_id: str) -> str | None:
        """The engine a lease belongs to, or None for an unknown lease."""
        rank = self._leases.get(lease_id)
        return rank.engine.engine_id if rank is not None else None

    def engine_ids(self) -> list[str]:
        """Every registered engine's id, in order."""
        return sorted(self._engines)

    def engine(self, engine_id: str) -> EngineRecord | None:
        """The engine's record, for a lease authority's checks (do not change it but through this class)."""
        return self._engines.get(engine_id)

    def rank_of(self, lease_id: str) -> Rank | None:
        """The rank a lease holds, or None."""
        return self._leases.get(lease_id)

    def ranks(self) -> list[Rank]:
        """Every registered rank (a copy of the list)."""
        return list(self._leases.values())

    def add_removal_listener(self, listener: RemovalListener) -> None:
        self._removal_listeners.append(listener)

    # ----- changes (made by the lease authority) -----

    def add_rank(
        self, registered: reg_pb.RegisteredRank, compatibility_hash: str, lease_id: str, ttl: float, expires: float, register_wall: float, revision: int
    ) -> Rank:
        """Adds a rank (replacing one at its position) to its engine incarnation, which must be the one registered if any."""
        rank = registered.rank
        record = self._engines.get(rank.engine_id)
        if record is None:
            record = EngineRecord(registered, compatibility_hash, register_wall)
            self._engines[rank.engine_id] = record
        position = (rank.pp_rank, rank.tp_rank)
        previous = record.ranks.get(position)
        if previous is not None:
            del self._leases[previous.lease_id]
        entry = Rank(record, position, lease_id, registered, ttl, expires)
        record.ranks[position] = entry
        self._leases[lease_id] = entry
        record.state = reg_pb.ENGINE_STATE_READY if len(record.ranks) == record.tp_size * record.pp_size else reg_pb.ENGINE_STATE_PARTIAL
        self._refresh(record)
        self._emit(reg_pb.ENGINE_EVENT_TYPE_UPSERTED, record, "", revision)
        logger.info(
            "registered %s incarnation %s rank (tp %d, pp %d); engine %s",
            rank.engine_id,
            rank.incarnation,
            rank.tp_rank,
            rank.pp_rank,
            reg_pb.EngineState.Name(record.state),
        )
        return entry

    def remove_ranks(self, record: EngineRecord, positions: list[Position], reason: str, revision: int) -> None:
        """Removes ranks of an engine incarnation (the whole engine once none is left) and tells watchers and listeners why."""
        for position in positions:
            rank = record.ranks.pop(position)
            del self._leases[rank.lease_id]
        if record.ranks:
            record.state = reg_pb.ENGINE_STATE_PARTIAL
            self._refresh(record)
            self._emit(reg_pb.ENGINE_EVENT_TYPE_UPSERTED, record, reason, revision)
        else:
            del self._engines[record.engine_id]
            record.state = reg_pb.ENGINE_STATE_GONE
            # The REMOVED event keeps the last ranks so watchers know which
            # NIXL agents to unload.
            removed = reg_pb.Engine()
            removed.CopyFrom(record.snapshot)
            removed.state = reg_pb.ENGINE_STATE_GONE
            record.snapshot = removed
            self._emit(reg_pb.ENGINE_EVENT_TYPE_REMOVED, record, reason, revision)
        logger.info("%s incarnation %s lost %d rank(s): %s", record.engine_id, record.incarnation, len(positions), reason)
        for listener in self._removal_listeners:
            try:
                listener(record.engine_id, record.incarnation, reason)
            except Exception:  # one faulty listener must not stop the registrar or the others
                logger.exception("removal listener failed for %s", record.engine_id)

    def advance(self, revision: int) -> None:
        """Notes that the directory is current as of revision although nothing it holds changed."""
        self.revision = max(self.revision, revision)

    def start_history(self, revision: int) -> None:
        """Makes what the directory holds the state as of revision, with no history before it (a first listing's adds are no changes to resume through)."""
        self.revision = revision
        self._history.clear()
        self._history_floor = revision

    # ----- watches -----

    def watch(self, role: int = 0, watcher: str = "", start_revision: int = 0) -> EngineWatch:
        """Opens a watch: the current engines of role (0 = all) as UPSERTED events, then every change.

        With start_revision, a watch whose changes from that revision on are
        all still held gets only those (no snapshot); otherwise a snapshot
        ended by SNAPSHOT_END. watcher names who watches (the caller's
        identity); each may hold at most max_watches_per_identity watches
        until unwatch().
        """
        checks.check_role_filter(role)
        if start_revision < 0:
            raise checks.out_of_range("start_revision must not be negative", "start_revision")
        held = self._watches_by_watcher.get(watcher, 0)
        if held >= self._config.max_watches_per_identity:
            raise ResourceExhausted(f"{watcher!r} already holds {held} engine watches, the most allowed", reason=Reason.TOO_MANY_WATCHES)
        self._watches_by_watcher[watcher] = held + 1
        subscription = EngineWatch(role, watcher)
        if start_revision and self._history_floor < start_revision <= self.revision + 1:
            for event in self._history:
                if event.revision >= start_revision and (not role or event.engine.role == role):
                    subscription.outbox.put(event)
        else:
            for engine_id in sorted(self._engines):
                record = self._engines[engine_id]
                if not role or record.role == role:
                    subscription.outbox.put(
                        reg_pb.WatchEnginesResponse(type=reg_pb.ENGINE_EVENT_TYPE_UPSERTED, engine=record.snapshot, revision=self.revision)
                    )
            if start_revision:
                subscription.outbox.put(reg_pb.WatchEnginesResponse(type=reg_pb.ENGINE_EVENT_TYPE_SNAPSHOT_END, revision=self.revision))
        subscription.outbox.limit(self._config.watch_queue_capacity)
        self._watches[subscription] = None
        return subscription

    def unwatch(self, subscription: EngineWatch) -> None:
        self._watches.pop(subscription, None)
        subscription.outbox.close()
        # A watch closed for falling behind still counts until its stream ends here.
        if subscription.counted:
            subscription.counted = False
            held = self._watches_by_watcher[subscription.watcher] - 1
            if held:
                self._watches_by_watcher[subscription.watcher] = held
            else:
                del self._watches_by_watcher[subscription.watcher]

    def close(self) -> None:
        """Ends every watch."""
        for subscription in list(self._watches):
            self.unwatch(subscription)

    # ----- internals -----

    def _refresh(self, record: EngineRecord) -> None:
        """Rebuilds the engine's shared snapshot (a new object, so identity caches notice)."""
        for rank in record.ranks.values():
            rank.registered.expire_time.CopyFrom(timestamp(wall_at(self._clock, rank.expires)))
        record.snapshot = engine_message(record.first_rank, record.compatibility_hash, record.register_wall, state=record.state,
                                         ranks=[record.ranks[position].registered for position in sorted(record.ranks)])

    def _describe(self, record: EngineRecord) -> reg_pb.Engine:
        engine = reg_pb.Engine()
        engine.CopyFrom(record.snapshot)
        for registered in engine.ranks:
            rank = record.ranks[(registered.rank.pp_rank, registered.rank.tp_rank)]
            registered.expire_time.CopyFrom(timestamp(wall_at(self._clock, rank.expires)))
        return engine

    def _emit(self, event_type: reg_pb.EngineEventType, record: EngineRecord, reason: str, revision: int) -> None:
        self.revision = max(self.revision, revision)
        event = reg_pb.WatchEnginesResponse(type=event_type, engine=record.snapshot, reason=reason, revision=revision)
        self._history.append(event)
        if len(self._history) > self._config.watch_history:
            self._history_floor = self._history.popleft().revision
        for subscription in list(self._watches):
            if subscription.role and subscription.role != record.role:
                continue
            if not subscription.outbox.put(event):
                logger.warning("closing an engine watch that fell %d events behind", subscription.outbox.capacity)
                self._watches.pop(subscription, None)
