# SPDX-License-Identifier: Apache-2.0
"""Every attempt the broker remembers: by key and by engine, counted by state, with its timers and retention.

An attempt is remembered from its first arrival until it is settled (ended
and fenced), then kept retention_s longer (and never before its keep_until)
so late messages about it get a precise answer; at most
max_retained_attempts settled ones are kept past their keep_until. Deadlines
and fencing bounds share one timer heap whose entries only say "look at
this attempt then", so a stale entry costs a look, never a wrong answer.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Iterator

from kvpush.errors import Aborted, FailedPrecondition, Reason, ResourceExhausted
from kvpush.rendezvous.v1 import transfer_pb2 as tr_pb
from kvpush.services.broker import attempts as a
from kvpush.services.broker.attempts import Attempt, RankKey, TransferRecord
from kvpush.services.broker.config import BrokerConfig


class AttemptStore:
    """The broker's attempt tables. Not thread-safe, like the core that owns it."""

    def __init__(self, config: BrokerConfig):
        self._config = config
        self._transfers: dict[str, TransferRecord] = {}
        self._timers: list[tuple[float, int, Attempt]] = []
        self._timer_seq = 0
        self._settled: deque[tuple[float, Attempt]] = deque()  # in settle order, so in time order
        self.state_counts = [0] * (max(tr_pb.TransferState.values()) + 1)
        self.unsettled = 0
        # Attempts not yet settled, by the engines they involve (engine loss, resyncs); dicts as
        # ordered sets, so every walk over them is in arrival order (a simulation replays exactly).
        self._by_engine: dict[str, dict[Attempt, None]] = {}
        self.wakeup: Callable[[float], None] | None = None

    @property
    def live(self) -> int:
        return sum(self.state_counts[s] for s in a.LIVE)

    @property
    def remembered(self) -> int:
        return self.unsettled + len(self._settled)

    @property
    def memory_sizes(self) -> dict[str, int]:
        return {
            "transfers": len(self._transfers),
            "remembered_attempts": self.remembered,
            "timers": len(self._timers),
            "engines_indexed": len(self._by_engine),
        }

    # ----- lookups -----

    def record(self, transfer_id: str) -> TransferRecord | None:
        return self._transfers.get(transfer_id)

    def find(self, transfer_id: str, number: int) -> Attempt | None:
        record = self._transfers.get(transfer_id)
        return record.attempts.get(number) if record is not None else None

    def live_attempts(self) -> list[Attempt]:
        """Every attempt not yet ended, in arrival order of their transfers (a copy: callers may end them)."""
        return [att for record in self._transfers.values() for att in record.attempts.values() if not att.ended]

    def of_engine(self, engine_id: str) -> list[Attempt]:
        """The engine's unsettled attempts, in arrival order (a copy: callers may settle them)."""
        return list(self._by_engine.get(engine_id, ()))

    # ----- changes -----

    def create(self, transfer_id: str, number: int, now: float, *, tombstone: bool = False) -> Attempt:
        """A new attempt; it must be the newest yet unless it is a tombstone (a refusal remembered), which never becomes the newest."""
        record = self._transfers.get(transfer_id)
        if record is not None and not tombstone:
            if number < record.newest:
                raise Aborted(f"attempt {record.newest} superseded attempt {number}", reason=Reason.TRANSFER_SUPERSEDED, field="key.attempt")
            if number == record.newest:
                raise FailedPrecondition(f"transfer {transfer_id} attempt {number} ended and was forgotten", reason=Reason.TRANSFER_ENDED, field="key")
        cfg = self._config
        if self.unsettled >= cfg.max_unsettled_attempts or len(self._settled) >= cfg.max_retained_attempts + cfg.max_unsettled_attempts:
            raise ResourceExhausted(f"the broker holds {self.remembered} attempts, its limit", reason=Reason.TOO_MANY_TRANSFERS, field="key")
        if record is None:
            record = self._transfers[transfer_id] = TransferRecord(transfer_id)
        att = Attempt(transfer_id, number, now)
        record.attempts[number] = att
        if not tombstone:
            record.newest = max(record.newest, number)
        self.unsettled += 1
        self.state_counts[a.NEW] += 1
        return att

    def set_state(self, att: Attempt, state: tr_pb.TransferState) -> None:
        counts = self.state_counts
        counts[att.state] -= 1
        counts[state] += 1
        att.state = state

    def _index(self, att: Attempt, engine_id: str) -> None:
        attempts = self._by_engine.get(engine_id)
        if attempts is None:
            attempts = self._by_engine[engine_id] = {}
        attempts[att] = None

    def bind_decode(self, att: Attempt, engine_id: str, incarnation: str) -> None:
        """Names the attempt's decode engine (its first naming indexes it)."""
        if not att.d_engine_id:
            att.d_engine_id = engine_id
            self._index(att, engine_id)
        att.d_incarnation = incarnation

    def bind_prefill(self, att: Attempt, engine_id: str, incarnation: str, rank_keys: tuple[RankKey, ...]) -> None:
        """Names the attempt's prefill engine and ranks, once."""
        if not att.p_engine_id:
            att.p_engine_id, att.p_incarnation, att.p_ranks = engine_id, incarnation, rank_keys
            self._index(att, engine_id)

    def schedule(self, att: Attempt, when: float) -> None:
        """tick() looks at att again at when."""
        self._timer_seq += 1
        heap = self._timers
        heapq.heappush(heap, (when, self._timer_seq, att))
        if heap[0][2] is att and self.wakeup is not None:
            self.wakeup(when)

    def set_deadline(self, att: Attempt, deadline: float) -> None:
        if deadline != att.deadline:
            att.deadline = deadline
            self.schedule(att, deadline)

    def settle(self, att: Attempt, now: float) -> None:
        """att is ended and fenced: it leaves the engine index and starts its retention."""
        self.unsettled -= 1
        for engine_id in (att.p_engine_id, att.d_engine_id):
            attempts = self._by_engine.get(engine_id)
            if attempts is not None:
                attempts.pop(att, None)
                if not attempts:
                    del self._by_engine[engine_id]
        if not self._settled and self.wakeup is not None:
            self.wakeup(max(now + self._config.retention_s, att.keep_until))
        self._settled.append((now, att))

    # ----- time -----

    def due(self, now: float) -> Iterator[Attempt]:
        """Pops every timer whose time came (including ones scheduled while the caller handles these)."""
        timers = self._timers
        while timers and timers[0][0] <= now:
            yield heapq.heappop(timers)[2]

    def forget_retained(self, now: float) -> None:
        """Forgets settled attempts past their retention (or beyond the cap) and their keep_until."""
        settled, cfg = self._settled, self._config
        while settled:
            settled_at, att = settled[0]
            old = settled_at <= now - cfg.retention_s or len(settled) > cfg.max_retained_attempts
            if not old or att.keep_until > now:
                break
            settled.popleft()
            self._forget(att)

    def next_time(self) -> float | None:
        """When the next timer falls due or the oldest settled attempt may be forgotten (None: never)."""
        next_time = self._timers[0][0] if self._timers else None
        if self._settled:
            settled_at, att = self._settled[0]
            forget_at = max(settled_at + self._config.retention_s, att.keep_until)
            next_time = forget_at if next_time is None else min(next_time, forget_at)
        return next_time

    def _forget(self, att: Attempt) -> None:
        record = self._transfers.get(att.transfer_id)
        if record is not None and record.attempts.get(att.number) is att:
            del record.attempts[att.number]
            if not record.attempts:
                del self._transfers[att.transfer_id]
        # A stale timer entry may still point here until its time comes.
        att.dest = att.src = None
        att.timeline = []
