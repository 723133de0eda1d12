# SPDX-License-Identifier: Apache-2.0
"""The in-process registrar: the shared Directory with a local lease authority (a TTL heap, swept on time).

A lease lapses only by time, like an etcd lease: a KeepAlive stream that
ends does not end it, so a rank that reconnects keeps renewing the same
lease. Its revisions start at the wall clock in microseconds, so a watcher
resuming with a revision from an earlier run of this registrar gets a fresh
snapshot rather than a resume into another history.
"""

from __future__ import annotations

import heapq
import uuid
from collections.abc import Callable, Iterable

from kvpush.clock import Clock, duration, timestamp, wall_at
from kvpush.errors import NotFound, Reason, ResourceExhausted
from kvpush.registrar.v1 import registrar_service_pb2 as reg_pb
from kvpush.services.registrar import checks
from kvpush.services.registrar.config import RegistrarConfig
from kvpush.services.registrar.directory import Directory, EngineRecord, Position, Rank, RemovalReason


class RegistrarCore(Directory):
    """The directory of engine ranks, leased in process. Not thread-safe: call it from one thread (the event loop)."""

    def __init__(self, config: RegistrarConfig, clock: Clock, *, new_lease_id: Callable[[], str] = lambda: uuid.uuid4().hex):
        super().__init__(config, clock, revision=int(clock.wall() * 1e6))
        self._new_lease_id = new_lease_id  # injectable so a simulation replays exactly
        self._expiries: list[tuple[float, str]] = []  # heap; stale entries are skipped when popped
        self._wakeup: Callable[[float], None] | None = None

    def set_wakeup(self, wakeup: Callable[[float], None]) -> None:
        """wakeup(t) is called when a lease may now expire at t, earlier than sweep() last said."""
        self._wakeup = wakeup

    # ----- registration and leases -----

    def register(self, request: reg_pb.RegisterEngineRankRequest) -> reg_pb.RegisterEngineRankResponse:
        """Registers one rank; see RegistrarService.RegisterEngineRank."""
        ttl = checks.registration_ttl(request, self._config)
        rank = request.rank
        now = self._clock.now()
        record = self.engine(rank.engine_id)
        if record is None and self.engine_count >= self._config.max_engines:
            raise ResourceExhausted(
                f"{self.engine_count} engines are registered, the most allowed (--max-engines)", reason=Reason.TOO_MANY_ENGINES, field="rank.engine_id"
            )
        if record is not None and record.incarnation != rank.incarnation:
            self.remove_ranks(record, list(record.ranks), RemovalReason.REPLACED, self.revision + 1)
            record = None
        if record is not None:
            checks.check_same_engine(record, request)
            existing = record.ranks.get((rank.pp_rank, rank.tp_rank))
            if existing is not None:
                checks.check_same_rank(existing.registered, request)
                existing.ttl = ttl
                existing.expires = now + ttl
                self._note_expiry(existing)
                return self._grant(existing)
        registered = reg_pb.RegisteredRank(rank=rank, nixl=request.nixl, layout=request.layout)
        entry = self.add_rank(registered, request.compatibility_hash, self._new_lease_id(), ttl, now + ttl, self._clock.wall(), self.revision + 1)
        self._note_expiry(entry)
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
            checks.check_lease_holder(self.lease_engine(lease_id), caller_engine_id, "lease_ids")
        now = self._clock.now()
        response = reg_pb.KeepAliveResponse()
        earliest = None
        for lease_id in ids:
            rank = self.rank_of(lease_id)
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
        rank = self.rank_of(lease_id)
        if rank is None:
            raise NotFound(f"lease {lease_id!r} does not exist", reason=Reason.LEASE_NOT_FOUND, field="lease_id")
        checks.check_lease_holder(rank.engine.engine_id, caller_engine_id, "lease_id")
        record = rank.engine
        self.remove_ranks(record, [rank.position], RemovalReason.DEREGISTERED, self.revision + 1)
        return reg_pb.DeregisterEngineRankResponse(engine=record.snapshot)

    def sweep(self) -> float | None:
        """Ends every lapsed lease; returns when the next lease may lapse (monotonic), or None."""
        now = self._clock.now()
        lapsed: dict[int, tuple[EngineRecord, list[Position]]] = {}
        expiries = self._expiries
        while expiries and expiries[0][0] <= now:
            _, lease_id = heapq.heappop(expiries)
            rank = self.rank_of(lease_id)
            if rank is None:
                continue
            if rank.expires > now:  # renewed since this entry was pushed
                heapq.heappush(expiries, (rank.expires, lease_id))
                continue
            positions = lapsed.setdefault(id(rank.engine), (rank.engine, []))[1]
            if rank.position not in positions:  # a lease can sit in the heap twice (re-registered identically)
                positions.append(rank.position)
        for record, positions in lapsed.values():
            self.remove_ranks(record, positions, RemovalReason.LEASE_EXPIRED, self.revision + 1)
        return expiries[0][0] if expiries else None

    # ----- internals -----

    def _grant(self, rank: Rank) -> reg_pb.RegisterEngineRankResponse:
        return reg_pb.RegisterEngineRankResponse(
            lease_id=rank.lease_id,
            lease_ttl=duration(rank.ttl),
            expire_time=timestamp(wall_at(self._clock, rank.expires)),
        )

    def _note_expiry(self, rank: Rank) -> None:
        heapq.heappush(self._expiries, (rank.expires, rank.lease_id))
        if self._expiries[0][1] == rank.lease_id and self._wakeup is not None:
            self._wakeup(rank.expires)


class LocalLeases:
    """A RegistrarCore as the servicer's lease authority: the core answers every write at once."""

    def __init__(self, core: RegistrarCore):
        self._core = core

    async def register(self, request: reg_pb.RegisterEngineRankRequest) -> reg_pb.RegisterEngineRankResponse:
        return self._core.register(request)

    async def keep_alive(self, lease_ids: Iterable[str], caller_engine_id: str) -> reg_pb.KeepAliveResponse:
        return self._core.keep_alive(lease_ids, caller_engine_id)

    async def deregister(self, lease_id: str, caller_engine_id: str) -> reg_pb.DeregisterEngineRankResponse:
        return self._core.deregister(lease_id, caller_engine_id)
