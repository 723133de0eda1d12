# SPDX-License-Identifier: Apache-2.0
"""A registrar replica's mirror of `<prefix>engines/`: a Directory kept equal to etcd by a listing, then a watch.

The watch covers the whole prefix so a departure key and the rank deletes
of its transaction arrive in one batch: a rank deleted in the revision of
a departure key of its incarnation left for that key's reason, any other
deleted rank because its lease expired. Deletes of one engine incarnation
in a row for one reason make one change, as in the local registrar. A
broken watch resumes from the last revision applied + 1; a start revision
etcd compacted away is answered by listing again and applying the
difference (ranks gone meanwhile count as expired: their departure keys are
no longer to be seen).
"""

from __future__ import annotations

import asyncio
import logging
import time

from google.protobuf.message import DecodeError

from kvpush.client.backoff import Backoff
from kvpush.clock import Clock
from kvpush.etcd.client import EtcdClient, KeyValue, WatchBatch
from kvpush.etcd.follow import follow_prefix
from kvpush.services.registrar.directory import Directory, EngineRecord, Position, Rank, RemovalReason
from kvpush.services.registrar.etcd_keys import EtcdKeys, decode_rank, lease_name

logger = logging.getLogger(__name__)


class EtcdMirror:
    """Follows etcd into a Directory until cancelled; `synced` is set once the first listing applied."""

    def __init__(self, client: EtcdClient, keys: EtcdKeys, directory: Directory, clock: Clock, *, max_backoff_s: float = 2.0):
        self.directory = directory
        self.synced = asyncio.Event()
        self._client = client
        self._keys = keys
        self._clock = clock
        self._max_backoff_s = max_backoff_s
        self._progress = asyncio.Event()  # set (and replaced) whenever the directory moved on

    async def run(self) -> None:
        await follow_prefix(self._client, self._keys.root, relist=self._relist, apply=self._apply, backoff=Backoff(0.05, self._max_backoff_s))

    async def caught_up(self, revision: int, timeout_s: float) -> bool:
        """Waits (at most timeout_s) until the directory applied revision; False if it did not."""
        deadline = time.monotonic() + timeout_s
        while self.directory.revision < revision:
            if not await self._next_progress(deadline):
                return False
        return True

    async def rank_of(self, lease_id: str, timeout_s: float) -> Rank | None:
        """The rank holding lease_id, waiting (at most timeout_s) for the mirror to learn of it."""
        deadline = time.monotonic() + timeout_s
        while (rank := self.directory.rank_of(lease_id)) is None:
            if not await self._next_progress(deadline):
                return None
        return rank

    async def _next_progress(self, deadline: float) -> bool:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        try:
            async with asyncio.timeout(remaining):
                await self._progress.wait()
        except TimeoutError:
            return False
        return True

    def _moved_on(self) -> None:
        self._progress.set()
        self._progress = asyncio.Event()

    # ----- listing -----

    async def _relist(self) -> int:
        kvs, revision = await self._client.get_prefix(self._keys.engines)
        listed: dict[str, dict[Position, KeyValue]] = {}
        incarnations: dict[str, str] = {}
        for kv in kvs:
            parsed = self._keys.parse_rank(kv.key)
            if parsed is None:
                continue
            engine_id, incarnation, position = parsed
            if incarnations.setdefault(engine_id, incarnation) != incarnation:
                logger.warning("etcd holds two incarnations of %s; keeping %s", engine_id, incarnations[engine_id])
                continue
            listed.setdefault(engine_id, {})[position] = kv
        directory = self.directory
        for engine_id in directory.engine_ids():
            record = directory.engine(engine_id)
            assert record is not None, "engine_ids() is a copy, and removing one engine's ranks removes no other engine"
            if engine_id not in listed:
                directory.remove_ranks(record, list(record.ranks), RemovalReason.LEASE_EXPIRED, revision)
            elif incarnations[engine_id] != record.incarnation:
                directory.remove_ranks(record, list(record.ranks), RemovalReason.REPLACED, revision)
        for engine_id, ranks in listed.items():
            record = directory.engine(engine_id)
            if record is not None:
                gone = [p for p, rank in record.ranks.items() if p not in ranks or rank.lease_id != lease_name(ranks[p].lease)]
                if gone:
                    directory.remove_ranks(record, gone, RemovalReason.LEASE_EXPIRED, revision)
            for position in sorted(ranks):
                record = directory.engine(engine_id)
                if record is None or position not in record.ranks:
                    self._put(ranks[position], revision)
        if self.synced.is_set():
            directory.advance(revision)
        else:
            directory.start_history(revision)
        self.synced.set()
        self._moved_on()
        logger.info("mirrored %d engines from etcd at revision %d", directory.engine_count, revision)
        return revision

    # ----- changes -----

    def _apply(self, batch: WatchBatch) -> None:
        departures: dict[tuple[str, str, int], str] = {}
        for event in batch.events:
            if event.type == "PUT" and (departed := self._keys.parse_departure(event.kv.key)) is not None:
                departures[(*departed, event.kv.mod_revision)] = event.kv.value.decode()
        pending: tuple[EngineRecord, list[Position], str, int] | None = None
        for event in batch.events:
            parsed = self._keys.parse_rank(event.kv.key)
            if parsed is None:
                continue
            engine_id, incarnation, position = parsed
            revision = event.kv.mod_revision
            if event.type == "PUT":
                self._flush(pending)
                pending = None
                self._put(event.kv, revision)
                continue
            record = self.directory.engine(engine_id)
            if record is None or record.incarnation != incarnation or position not in record.ranks:
                continue  # never mirrored (or already gone with an earlier change)
            reason = departures.get((engine_id, incarnation, revision), RemovalReason.LEASE_EXPIRED)
            if pending is not None and pending[0] is record and pending[2] == reason:
                pending = (record, [*pending[1], position], reason, revision)
            else:
                self._flush(pending)
                pending = (record, [position], reason, revision)
        self._flush(pending)
        self.directory.advance(batch.revision)
        self._moved_on()

    def _flush(self, pending: tuple[EngineRecord, list[Position], str, int] | None) -> None:
        if pending is not None:
            self.directory.remove_ranks(*pending)

    def _put(self, kv: KeyValue, revision: int) -> None:
        try:
            stored, ttl_s, register_wall = decode_rank(kv.value)
        except (DecodeError, IndexError):  # not written by a registrar: one bad key must not stop the mirror
            logger.warning("skipping %s: its value is no registered rank", kv.key.decode(errors="replace"))
            return
        record = self.directory.engine(stored.engine_id)
        if record is not None and record.incarnation != stored.incarnation:
            # A registration deletes the old incarnation in its own transaction,
            # so this is reached only by a listing that missed the deletes.
            self.directory.remove_ranks(record, list(record.ranks), RemovalReason.REPLACED, revision)
        self.directory.add_rank(
            stored.ranks[0], stored.compatibility_hash, lease_name(kv.lease), ttl_s, self._clock.now() + ttl_s, register_wall, revision
        )
