# SPDX-License-Identifier: Apache-2.0
"""The registrar's grpc-free core: engine ranks, their leases and watches.

An engine incarnation is READY while every one of its tp_size * pp_size
ranks is registered and leased, PARTIAL while some are missing, and GONE
once its last rank left. Any rank leaving (deregistration, lease lapse,
replacement by a new incarnation) is reported to the removal listeners,
because an engine missing a worker cannot take part in transfers. A lease
lapses only by time, like an etcd lease: a KeepAlive stream that ends does
not end it, so a rank that reconnects keeps renewing the same lease.
"""

from __future__ import annotations

import heapq
import logging
import uuid
from collections.abc import Callable, Iterable

from kvpush.engine.v1 import engine_pb2
from kvpush.errors import AlreadyExists, NotFound, PermissionDenied, Reason, ResourceExhausted
from kvpush.registrar.v1 import registrar_service_pb2 as reg_pb
from kvpush.services.common import validation
from kvpush.services.common.clock import Clock, timestamp, wall_at
from kvpush.services.common.outbox import Outbox
from kvpush.services.registrar import checks
from kvpush.services.registrar.config import RegistrarConfig

logger = logging.getLogger(__name__)

# RemovalListener(engine_id, incarnation, reason) learns that ranks of an
# engine incarnation left; it must not raise and must not call back into the
# registrar.
RemovalListener = Callable[[str, str, str], None]


class RemovalReason:
    """Why ranks left; sent as WatchEnginesResponse.reason and to removal listeners."""

    DEREGISTERED = "DEREGISTERED"
    LEASE_EXPIRED = "LEASE_EXPIRED"
    REPLACED = "REPLACED"


class _Rank:
    __slots__ = ("engine", "position", "lease_id", "registered", "ttl", "expires")

    def __init__(self, engine: _Engine, position: tuple[int, int], lease_id: str, registered: reg_pb.RegisteredRank, ttl: float, expires: float):
        self.engine = engine
        self.position = position  # (pp_rank, tp_rank): the order Engine.ranks lists ranks in
        self.lease_id = lease_id
        self.registered = registered
        self.ttl = ttl
        self.expires = expires


class _Engine:
    __slots__ = ("engine_id", "incarnation", "role", "tp_size", "pp_size", "compatibility_hash", "register_wall", "ranks", "state", "snapshot")

    def __init__(self, rank: engine_pb2.EngineRank, compatibility_hash: str, register_wall: float):
        self.engine_id = rank.engine_id
        self.incarnation = rank.incarnation
        self.role = rank.role
        self.tp_size = rank.tp_size
        self.pp_size = rank.pp_size
        self.compatibility_hash = compatibility_hash
        self.register_wall = register_wall
        self.ranks: dict[tuple[int, int], _Rank] = {}
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


class RegistrarCore:
    """The directory of engine ranks. Not thread-safe: call it from one thread (the event loop)."""

    def __init__(self, config: RegistrarConfig, clock: Clock, *, new_lease_id: Callable[[], str] = lambda: uuid.uuid4().hex):
        self._config = config
        self._clock = clock
        self._new_lease_id = new_lease_id  # injectable so a simulation replays exactly
        self._engines: dict[str, _Engine] = {}
        self._leases: dict[str, _Rank] = {}
        self._expiries: list[tuple[float, str]] = []  # heap; stale entries are skipped when popped
        self._watches: dict[EngineWatch, None] = {}  # an ordered set: events reach watchers in a fixed order
        self._watches_by_watcher: dict[str, int] = {}
        self._removal_listeners: list[RemovalListener] = []
        self._wakeup: Callable[[float], None] | None = None

    # ----- directory reads -----

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
        """A copy of the engine with current lease expiry times (for GetEngine)."""
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

    def add_removal_listener(self, listener: RemovalListener) -> None:
        self._removal_listeners.append(listener)

    def set_wakeup(self, wakeup: Callable[[float], None]) -> None:
        """wakeup(t) is called when a lease may now expire at t, earlier than sweep() last said."""
        self._wakeup = wakeup

    # ----- registration and leases -----

    def register(self, request: reg_pb.RegisterEngineRankRequest) -> reg_pb.RegisterEngineRankResponse:
        """Registers one rank; see RegistrarService.RegisterEngineRank."""
        ttl = checks.registration_ttl(request, self._config)
        rank = request.rank
        now = self._clock.now()
        record = self._engines.get(rank.engine_id)
        if record is None and len(self._engines) >= self._config.max_engines:
            raise ResourceExhausted(
                f"{len(self._engines)} engines are registered, the most allowed (--max-engines)", reason=Reason.TOO_MANY_ENGINES, field="rank.engine_id"
            )
        if record is not None and record.incarnation != rank.incarnation:
            self._remove_ranks(record, list(record.ranks), RemovalReason.REPLACED)
            record = None
        position = (rank.pp_rank, rank.tp_rank)
        if record is None:
            record = _Engine(rank, request.compatibility_hash, self._clock.wall())
            self._engines[rank.engine_id] = record
        else:
            checks.check_same_engine(record, request)
            existing = record.ranks.get(position)
            if existing is not None:
                registered = existing.registered
                if registered.rank != rank or registered.nixl != request.nixl or registered.layout != request.layout:
                    raise AlreadyExists(
                        f"rank (tp {rank.tp_rank}, pp {rank.pp_rank}) of {rank.engine_id} incarnation {rank.incarnation} "
                        "is already registered with different metadata",
                        reason=Reason.CONFLICTING_DUPLICATE,
                        field="rank",
                    )
                existing.ttl = ttl
                existing.expires = now + ttl
                self._note_expiry(existing)
                return self._grant(existing)
        registered = reg_pb.RegisteredRank(rank=rank, nixl=request.nixl, layout=request.layout)
        entry = _Rank(record, position, self._new_lease_id(), registered, ttl, now + ttl)
        record.ranks[position] = entry
        self._leases[entry.lease_id] = entry
        self._note_expiry(entry)
        record.state = reg_pb.ENGINE_STATE_READY if len(record.ranks) == record.tp_size * record.pp_size else reg_pb.ENGINE_STATE_PARTIAL
        self._refresh(record)
        self._emit(reg_pb.ENGINE_EVENT_TYPE_UPSERTED, record, "")
        logger.info(
            "registered %s incarnation %s rank (tp %d, pp %d); engine %s",
            rank.engine_id,
            rank.incarnation,
            rank.tp_rank,
            rank.pp_rank,
            reg_pb.EngineState.Name(record.state),
        )
        return self._grant(entry)

    def keep_alive(self, lease_ids: Iterable[str], caller_engine_id: str) -> reg_pb.KeepAliveResponse:
        """Renews leases of the caller's engine; unknown ones come back in unknown_lease_ids.

        A request naming another engine's lease renews nothing. A KeepAlive
        stream is bound to no lease: its end ends none, so a rank that
        reconnects renews the same leases on a new stream.
        """
        ids = list(lease_ids)
        if not ids:
            raise checks.required("lease_ids needs at least one lease", "lease_ids")
        for lease_id in ids:
            self._check_lease_holder(self._leases.get(lease_id), caller_engine_id, "lease_ids")
        now = self._clock.now()
        response = reg_pb.KeepAliveResponse()
        earliest = None
        for lease_id in ids:
            rank = self._leases.get(lease_id)
            if rank is None:
                response.unknown_lease_ids.append(lease_id)
                continue
            rank.expires = now + rank.ttl
            earliest = rank.expires if earliest is None else min(earliest, rank.expires)
        if earliest is not None:
            response.expire_time.CopyFrom(timestamp(wall_at(self._clock, earliest)))
        return response

    def deregister(self, lease_id: str, caller_engine_id: str) -> reg_pb.DeregisterEngineRankResponse:
        """Removes the rank holding lease_id, which must be the caller's engine's; returns the engine after the removal."""
        if not lease_id:
            raise checks.required("lease_id is required", "lease_id")
        rank = self._leases.get(lease_id)
        if rank is None:
            raise NotFound(f"lease {lease_id!r} does not exist", reason=Reason.LEASE_NOT_FOUND, field="lease_id")
        self._check_lease_holder(rank, caller_engine_id, "lease_id")
        record = rank.engine
        self._remove_ranks(record, [rank.position], RemovalReason.DEREGISTERED)
        return reg_pb.DeregisterEngineRankResponse(engine=record.snapshot)

    def sweep(self) -> float | None:
        """Ends every lapsed lease; returns when the next lease may lapse (monotonic), or None."""
        now = self._clock.now()
        lapsed: dict[int, tuple[_Engine, list[tuple[int, int]]]] = {}
        expiries = self._expiries
        while expiries and expiries[0][0] <= now:
            _, lease_id = heapq.heappop(expiries)
            rank = self._leases.get(lease_id)
            if rank is None:
                continue
            if rank.expires > now:  # renewed since this entry was pushed
                heapq.heappush(expiries, (rank.expires, lease_id))
                continue
            positions = lapsed.setdefault(id(rank.engine), (rank.engine, []))[1]
            if rank.position not in positions:  # a lease can sit in the heap twice (re-registered identically)
                positions.append(rank.position)
        for record, positions in lapsed.values():
            self._remove_ranks(record, positions, RemovalReason.LEASE_EXPIRED)
        return expiries[0][0] if expiries else None

    # ----- watches -----

    def watch(self, role: int = 0, watcher: str = "") -> EngineWatch:
        """Opens a watch: the current engines of role (0 = all) as UPSERTED events, then every change.

        watcher names who watches (the caller's identity); each may hold at
        most max_watches_per_identity watches until unwatch().
        """
        checks.check_role_filter(role)
        held = self._watches_by_watcher.get(watcher, 0)
        if held >= self._config.max_watches_per_identity:
            raise ResourceExhausted(f"{watcher!r} already holds {held} engine watches, the most allowed", reason=Reason.TOO_MANY_WATCHES)
        self._watches_by_watcher[watcher] = held + 1
        subscription = EngineWatch(role, watcher)
        for engine_id in sorted(self._engines):
            record = self._engines[engine_id]
            if not role or record.role == role:
                subscription.outbox.put(reg_pb.WatchEnginesResponse(type=reg_pb.ENGINE_EVENT_TYPE_UPSERTED, engine=record.snapshot))
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

    @staticmethod
    def _check_lease_holder(rank: _Rank | None, caller_engine_id: str, field: str) -> None:
        """A known lease may be used only by the engine that holds it (an unknown one is no one's)."""
        if rank is not None and rank.engine.engine_id != caller_engine_id:
            raise PermissionDenied(
                f"{caller_engine_id!r} may not act for engine {rank.engine.engine_id!r}", reason=Reason.ENGINE_IDENTITY_MISMATCH, field=field
            )

    def _grant(self, rank: _Rank) -> reg_pb.RegisterEngineRankResponse:
        return reg_pb.RegisterEngineRankResponse(
            lease_id=rank.lease_id,
            lease_ttl=validation.duration(rank.ttl),
            expire_time=timestamp(wall_at(self._clock, rank.expires)),
        )

    def _note_expiry(self, rank: _Rank) -> None:
        heapq.heappush(self._expiries, (rank.expires, rank.lease_id))
        if self._expiries[0][1] == rank.lease_id and self._wakeup is not None:
            self._wakeup(rank.expires)

    def _refresh(self, record: _Engine) -> None:
        """Rebuilds the engine's shared snapshot (a new object, so identity caches notice)."""
        engine = reg_pb.Engine(
            engine_id=record.engine_id,
            incarnation=record.incarnation,
            role=record.role,
            tp_size=record.tp_size,
            pp_size=record.pp_size,
            compatibility_hash=record.compatibility_hash,
            state=record.state,
            register_time=timestamp(record.register_wall),
        )
        for position in sorted(record.ranks):
            rank = record.ranks[position]
            rank.registered.expire_time.CopyFrom(timestamp(wall_at(self._clock, rank.expires)))
            engine.ranks.append(rank.registered)
        record.snapshot = engine

    def _describe(self, record: _Engine) -> reg_pb.Engine:
        engine = reg_pb.Engine()
        engine.CopyFrom(record.snapshot)
        for registered in engine.ranks:
            rank = record.ranks[(registered.rank.pp_rank, registered.rank.tp_rank)]
            registered.expire_time.CopyFrom(timestamp(wall_at(self._clock, rank.expires)))
        return engine

    def _remove_ranks(self, record: _Engine, positions: list[tuple[int, int]], reason: str) -> None:
        for position in positions:
            rank = record.ranks.pop(position)
            del self._leases[rank.lease_id]
        if record.ranks:
            record.state = reg_pb.ENGINE_STATE_PARTIAL
            self._refresh(record)
            self._emit(reg_pb.ENGINE_EVENT_TYPE_UPSERTED, record, reason)
        else:
            del self._engines[record.engine_id]
            record.state = reg_pb.ENGINE_STATE_GONE
            # The REMOVED event keeps the last ranks so watchers know which
            # NIXL agents to unload.
            removed = reg_pb.Engine()
            removed.CopyFrom(record.snapshot)
            removed.state = reg_pb.ENGINE_STATE_GONE
            record.snapshot = removed
            self._emit(reg_pb.ENGINE_EVENT_TYPE_REMOVED, record, reason)
        logger.info("%s incarnation %s lost %d rank(s): %s", record.engine_id, record.incarnation, len(positions), reason)
        for listener in self._removal_listeners:
            try:
                listener(record.engine_id, record.incarnation, reason)
            except Exception:  # one faulty listener must not stop the registrar or the others
                logger.exception("removal listener failed for %s", record.engine_id)

    def _emit(self, event_type: int, record: _Engine, reason: str) -> None:
        if not self._watches:
            return
        event = reg_pb.WatchEnginesResponse(type=event_type, engine=record.snapshot, reason=reason)
        for subscription in list(self._watches):
            if subscription.role and subscription.role != record.role:
                continue
            if not subscription.outbox.put(event):
                logger.warning("closing an engine watch that fell %d events behind", subscription.outbox.capacity)
                self._watches.pop(subscription, None)
