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
from kvpush.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound, Reason, ResourceExhausted
from kvpush.registrar.v1 import registrar_service_pb2 as reg_pb
from kvpush.services.common import validation
from kvpush.services.common.clock import Clock, timestamp, wall_at
from kvpush.services.common.outbox import Outbox
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


_ROLES = frozenset(engine_pb2.EngineRole.values()) - {0}
_DTYPES = frozenset(engine_pb2.KvDtype.values()) - {0}
_MEMORY_KINDS = frozenset(engine_pb2.MemoryKind.values()) - {0}
_PLANES = frozenset(engine_pb2.KvPlane.values()) - {0}
_GROUP_KINDS = frozenset(engine_pb2.KvCacheGroupKind.values()) - {0}


def _out_of_range(message: str, field: str) -> InvalidArgument:
    return InvalidArgument(message, reason=Reason.FIELD_OUT_OF_RANGE, field=field)


def _required(message: str, field: str) -> InvalidArgument:
    return InvalidArgument(message, reason=Reason.FIELD_REQUIRED, field=field)


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
        if role and role not in _ROLES:
            raise InvalidArgument(f"role has unknown value {role}", reason=Reason.FIELD_INVALID, field="role")
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
        ttl = self._validate_registration(request)
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
            self._check_same_engine(record, request)
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

    def keep_alive(self, lease_ids: Iterable[str]) -> reg_pb.KeepAliveResponse:
        """Renews leases; unknown ones come back in unknown_lease_ids."""
        ids = list(lease_ids)
        if not ids:
            raise _required("lease_ids needs at least one lease", "lease_ids")
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

    def deregister(self, lease_id: str) -> reg_pb.DeregisterEngineRankResponse:
        """Removes the rank holding lease_id; returns the engine after the removal."""
        if not lease_id:
            raise _required("lease_id is required", "lease_id")
        rank = self._leases.get(lease_id)
        if rank is None:
            raise NotFound(f"lease {lease_id!r} does not exist", reason=Reason.LEASE_NOT_FOUND, field="lease_id")
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
        if role and role not in _ROLES:
            raise InvalidArgument(f"role has unknown value {role}", reason=Reason.FIELD_INVALID, field="role")
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

    def _validate_registration(self, request: reg_pb.RegisterEngineRankRequest) -> float:
        """Checks every field; returns the granted lease TTL in seconds."""
        cfg = self._config
        if not request.HasField("rank"):
            raise _required("rank is required", "rank")
        rank = request.rank
        validation.check_id(rank.engine_id, "rank.engine_id")
        validation.check_text(rank.incarnation, "rank.incarnation", cfg.max_text_length)
        validation.check_enum(rank.role, _ROLES, "rank.role")
        if rank.tp_size == 0:
            raise _required("rank.tp_size must be at least 1", "rank.tp_size")
        if rank.pp_size == 0:
            raise _required("rank.pp_size must be at least 1", "rank.pp_size")
        if rank.tp_size * rank.pp_size > cfg.max_ranks_per_engine:
            raise _out_of_range(f"an engine may have at most {cfg.max_ranks_per_engine} ranks", "rank.tp_size")
        if rank.tp_rank >= rank.tp_size:
            raise _out_of_range(f"rank.tp_rank {rank.tp_rank} is not below tp_size {rank.tp_size}", "rank.tp_rank")
        if rank.pp_rank >= rank.pp_size:
            raise _out_of_range(f"rank.pp_rank {rank.pp_rank} is not below pp_size {rank.pp_size}", "rank.pp_rank")

        if not request.HasField("nixl"):
            raise _required("nixl is required", "nixl")
        nixl = request.nixl
        validation.check_text(nixl.agent_name, "nixl.agent_name", cfg.max_text_length)
        if not nixl.agent_metadata:
            raise _required("nixl.agent_metadata is required", "nixl.agent_metadata")
        if len(nixl.agent_metadata) > cfg.max_agent_metadata_bytes:
            raise _out_of_range(f"nixl.agent_metadata exceeds {cfg.max_agent_metadata_bytes} bytes", "nixl.agent_metadata")
        if len(nixl.backends) > cfg.max_backends:
            raise _out_of_range(f"nixl.backends lists more than {cfg.max_backends} backends", "nixl.backends")
        for i, backend in enumerate(nixl.backends):
            validation.check_text(backend, f"nixl.backends[{i}]", cfg.max_text_length)

        if not request.HasField("layout"):
            raise _required("layout is required", "layout")
        self._validate_layout(request.layout)
        validation.check_text(request.compatibility_hash, "compatibility_hash", cfg.max_text_length)

        if not request.HasField("lease_ttl"):
            return cfg.default_lease_ttl_s
        requested = request.lease_ttl.seconds + request.lease_ttl.nanos * 1e-9
        if requested < 0:
            raise _out_of_range("lease_ttl must not be negative", "lease_ttl")
        if requested == 0:
            return cfg.default_lease_ttl_s
        return min(max(requested, cfg.min_lease_ttl_s), cfg.max_lease_ttl_s)

    def _validate_layout(self, layout: engine_pb2.KvLayout) -> None:
        cfg = self._config
        validation.check_enum(layout.dtype, _DTYPES, "layout.dtype")
        if layout.head_size == 0:
            raise _required("layout.head_size must be positive", "layout.head_size")
        if layout.total_kv_heads == 0:
            raise _required("layout.total_kv_heads must be positive", "layout.total_kv_heads")
        if layout.num_local_heads == 0:
            raise _required("layout.num_local_heads must be positive", "layout.num_local_heads")
        if layout.first_head + layout.num_local_heads > layout.total_kv_heads:
            raise _out_of_range(
                f"heads [{layout.first_head}, {layout.first_head + layout.num_local_heads}) exceed total_kv_heads {layout.total_kv_heads}",
                "layout.first_head",
            )
        if layout.num_layers == 0:
            raise _required("layout.num_layers must be positive", "layout.num_layers")
        validation.check_enum(layout.memory_kind, _MEMORY_KINDS, "layout.memory_kind")

        if not layout.groups:
            raise _required("layout.groups needs at least one group", "layout.groups")
        if len(layout.groups) > cfg.max_groups:
            raise _out_of_range(f"layout.groups lists more than {cfg.max_groups} groups", "layout.groups")
        group_indexes: set[int] = set()
        for i, group in enumerate(layout.groups):
            where = f"layout.groups[{i}]"
            if group.group_index in group_indexes:
                raise InvalidArgument(f"group_index {group.group_index} is listed twice", reason=Reason.FIELD_INVALID, field=f"{where}.group_index")
            group_indexes.add(group.group_index)
            validation.check_enum(group.kind, _GROUP_KINDS, f"{where}.kind")
            if group.block_size == 0:
                raise _required(f"{where}.block_size must be positive", f"{where}.block_size")
            if group.num_blocks == 0:
                raise _required(f"{where}.num_blocks must be positive", f"{where}.num_blocks")

        if not layout.regions:
            raise _required("layout.regions needs at least one region", "layout.regions")
        if len(layout.regions) > cfg.max_regions:
            raise _out_of_range(f"layout.regions lists more than {cfg.max_regions} regions", "layout.regions")
        seen: set[tuple[int, int]] = set()
        for i, region in enumerate(layout.regions):
            where = f"layout.regions[{i}]"
            validation.check_text(region.layer_name, f"{where}.layer_name", cfg.max_text_length)
            if region.layer_index >= layout.num_layers:
                raise _out_of_range(f"layer_index {region.layer_index} is not below num_layers {layout.num_layers}", f"{where}.layer_index")
            if region.group_index not in group_indexes:
                raise InvalidArgument(f"group_index {region.group_index} names no group", reason=Reason.FIELD_INVALID, field=f"{where}.group_index")
            validation.check_enum(region.plane, _PLANES, f"{where}.plane")
            if (region.layer_index, region.plane) in seen:
                raise InvalidArgument("this (layer_index, plane) is described twice", reason=Reason.FIELD_INVALID, field=f"{where}.plane")
            seen.add((region.layer_index, region.plane))
            if region.base_address == 0:
                raise _required(f"{where}.base_address is required", f"{where}.base_address")
            if region.block_stride_bytes == 0:
                raise _required(f"{where}.block_stride_bytes must be positive", f"{where}.block_stride_bytes")
            if region.token_stride_bytes == 0:
                raise _required(f"{where}.token_stride_bytes must be positive", f"{where}.token_stride_bytes")
            if region.head_stride_bytes == 0 and layout.num_local_heads > 1:
                raise _required(f"{where}.head_stride_bytes must be positive with several local heads", f"{where}.head_stride_bytes")

    @staticmethod
    def _check_same_engine(record: _Engine, request: reg_pb.RegisterEngineRankRequest) -> None:
        rank = request.rank
        if rank.role != record.role:
            raise FailedPrecondition(
                f"{record.engine_id} incarnation {record.incarnation} registered as {engine_pb2.EngineRole.Name(record.role)}",
                reason=Reason.ENGINE_ROLE_MISMATCH,
                field="rank.role",
            )
        for name, value, expected in (("tp_size", rank.tp_size, record.tp_size), ("pp_size", rank.pp_size, record.pp_size)):
            if value != expected:
                raise FailedPrecondition(
                    f"other ranks of {record.engine_id} registered {name} {expected}, not {value}",
                    reason=Reason.INCOMPATIBLE_LAYOUT,
                    field=f"rank.{name}",
                )
        if request.compatibility_hash != record.compatibility_hash:
            raise FailedPrecondition(
                f"other ranks of {record.engine_id} registered compatibility_hash {record.compatibility_hash!r}",
                reason=Reason.INCOMPATIBLE_LAYOUT,
                field="compatibility_hash",
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
