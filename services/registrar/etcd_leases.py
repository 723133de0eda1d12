# SPDX-License-Identifier: Apache-2.0
"""The etcd lease authority of a registrar replica: registrations, renewals and removals are etcd writes.

Each rank holds its own etcd lease (the registrar's lease_id is its id in
hex), so a rank's key lapses in etcd exactly when its lease does and every
replica's mirror sees it go. A registration commits only if its engine's
keys are still what it checked the rank against (etcd_keys.unchanged_since),
so replicas racing cannot admit conflicting metadata; the loser reads again
and answers as the local registrar would. Writes answer once this replica's
mirror applied them, so a caller reads its own write on the replica it
wrote through. Identity rules are the local registrar's: only a lease's own
engine may renew or end it, and a lease the mirror does not know is no
one's.

A rank's etcd lease is its TTL plus the outage grace: renewing resets it,
so its time to live stays above the grace while the engine renews. A
replica ends a rank whose lease's time to live fell below the grace (the
engine has not renewed for its TTL) itself, with a departure key
LEASE_EXPIRED, the way it ends a deregistered one. The registrars so
decide every expiry, and when every replica is down (none renews, none
expires) a rank lapses in etcd only after its TTL plus the grace: an
outage shorter than the grace, minus the TTL's last renewal interval,
expires nothing. A replica leaves ranks one TTL after it starts to renew
before it judges them.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Iterable

from kvpush.clock import Clock, duration, timestamp
from kvpush.errors import DeadlineExceeded, NotFound, Reason, ResourceExhausted, Unavailable
from kvpush.etcd.client import EtcdClient, compare_lease, compare_version, op_delete, op_put
from kvpush.registrar.v1 import registrar_service_pb2 as reg_pb
from kvpush.services.registrar import checks
from kvpush.services.registrar.config import RegistrarConfig
from kvpush.services.registrar.directory import Rank, RemovalReason
from kvpush.services.registrar.etcd_keys import EtcdKeys, decode_rank, encode_rank, lease_name, lease_number, unchanged_since
from kvpush.services.registrar.etcd_mirror import EtcdMirror

logger = logging.getLogger(__name__)

# A registration that lost this many races in a row gives up (Unavailable: the client retries later).
_ATTEMPTS = 5
# How often a replica looks for ranks whose engines stopped renewing: one etcd TimeToLive per rank each time.
EXPIRY_INTERVAL_S = 0.5


class EtcdLeases:
    """Writes ranks and their leases to etcd; reads what is registered from the replica's mirror."""

    def __init__(self, client: EtcdClient, keys: EtcdKeys, mirror: EtcdMirror, config: RegistrarConfig, clock: Clock, *, timeout_s: float = 5.0):
        self._client = client
        self._keys = keys
        self._mirror = mirror
        self._directory = mirror.directory
        self._config = config
        self._clock = clock
        self._timeout_s = timeout_s  # how long a write waits for the mirror to show it, or to learn of a lease

    async def register(self, request: reg_pb.RegisterEngineRankRequest) -> reg_pb.RegisterEngineRankResponse:
        """Registers one rank; see RegistrarService.RegisterEngineRank."""
        # etcd leases last whole seconds; the rank's outlives its TTL by the outage grace (see expire_silent_ranks).
        ttl_s = max(1, math.ceil(checks.registration_ttl(request, self._config)))
        grace_s = self._config.outage_grace_s
        rank = request.rank
        position = (rank.pp_rank, rank.tp_rank)
        key = self._keys.rank(rank.engine_id, rank.incarnation, position)
        for _ in range(_ATTEMPTS):
            kvs, read_revision = await self._client.get_prefix(self._keys.engine(rank.engine_id))
            mine = [kv for kv in kvs if self._incarnation(kv.key) == rank.incarnation]
            old = [kv for kv in kvs if self._incarnation(kv.key) != rank.incarnation]
            if mine:
                checks.check_same_engine(decode_rank(mine[0].value)[0], request)
            existing = next((kv for kv in mine if kv.key == key), None)
            if existing is not None:
                checks.check_same_rank(decode_rank(existing.value)[0].ranks[0], request)
                granted = await self._client.keep_alive_once(existing.lease)
                if granted > 0:  # a repeat renews the lease it got (whose TTL etcd keeps)
                    await self._mirror.caught_up(existing.mod_revision, self._timeout_s)
                    return self._grant(existing.lease, max(1, granted - grace_s))
                continue  # the lease just lapsed: its key is going too
            if not kvs and self._directory.engine(rank.engine_id) is None and self._directory.engine_count >= self._config.max_engines:
                raise ResourceExhausted(
                    f"{self._directory.engine_count} engines are registered, the most allowed (--max-engines)",
                    reason=Reason.TOO_MANY_ENGINES,
                    field="rank.engine_id",
                )
            lease, granted = await self._client.grant(ttl_s + grace_s)
            granted -= grace_s
            # A new incarnation: the old one's ranks go in the same Txn, with
            # a departure key (on the new lease) saying they were replaced.
            # (A key under the engine's prefix that is no rank key names no incarnation to depart.)
            replaced = {inc for kv in old if (inc := self._incarnation(kv.key)) is not None}
            success = [op_put(self._keys.departure(rank.engine_id, inc), RemovalReason.REPLACED.encode(), lease) for inc in replaced]
            success += [op_delete(kv.key) for kv in old]
            success.append(op_put(key, encode_rank(request, granted, self._clock.wall()), lease))
            compares = [compare_version(key, "=", 0), unchanged_since(self._keys.engine(rank.engine_id), read_revision)]
            try:
                committed, revision = await self._client.txn(compares, success)
            except (Unavailable, DeadlineExceeded) as exc:
                # It may have committed; the next round reads whether it did
                # (then it answers as a repeat, with this lease).
                logger.warning("registering %s: etcd transaction failed (%s); reading again", key.decode(), exc)
                continue
            if not committed:
                await self._client.revoke(lease)
                continue
            for kv in old:  # their keys are gone; free the leases
                await self._client.revoke(kv.lease)
            await self._mirror.caught_up(revision, self._timeout_s)
            return self._grant(lease, granted)
        raise Unavailable(f"registering {key.decode()} kept racing other changes to {rank.engine_id}; try again", reason=Reason.UNAVAILABLE)

    async def keep_alive(self, lease_ids: Iterable[str], caller_engine_id: str) -> reg_pb.KeepAliveResponse:
        """Renews leases of the caller's engine; unknown ones come back in unknown_lease_ids (see RegistrarCore.keep_alive)."""
        ids = list(lease_ids)
        if not ids:
            raise checks.required("lease_ids needs at least one lease", "lease_ids")
        ranks = [await self._known_rank(lease_id) for lease_id in ids]
        for rank in ranks:  # every lease is checked before any is renewed
            checks.check_lease_holder(rank.engine.engine_id if rank is not None else None, caller_engine_id, "lease_ids")
        response = reg_pb.KeepAliveResponse()
        earliest = None
        for lease_id, rank in zip(ids, ranks, strict=True):
            remaining = await self._client.keep_alive_once(_held_lease(lease_id)) if rank is not None else 0
            if rank is None or remaining <= 0:
                response.unknown_lease_ids.append(lease_id)
                continue
            rank.expires = self._clock.now() + rank.ttl
            earliest = rank.ttl if earliest is None else min(earliest, rank.ttl)
        if earliest is not None:
            response.expire_time.CopyFrom(timestamp(self._clock.wall() + earliest))
        return response

    async def deregister(self, lease_id: str, caller_engine_id: str) -> reg_pb.DeregisterEngineRankResponse:
        """Removes the rank holding lease_id, which must be the caller's engine's; returns the engine after the removal."""
        if not lease_id:
            raise checks.required("lease_id is required", "lease_id")
        rank = await self._known_rank(lease_id)
        if rank is None:
            raise NotFound(f"lease {lease_id!r} does not exist", reason=Reason.LEASE_NOT_FOUND, field="lease_id")
        record = rank.engine
        checks.check_lease_holder(record.engine_id, caller_engine_id, "lease_id")
        key = self._keys.rank(record.engine_id, record.incarnation, rank.position)
        lease = _held_lease(lease_id)
        # The departure key rides on the rank's own lease: revoking it next
        # deletes the key once watchers saw it.
        departure = op_put(self._keys.departure(record.engine_id, record.incarnation), RemovalReason.DEREGISTERED.encode(), lease)
        committed, revision = await self._client.txn([compare_lease(key, "=", lease)], [departure, op_delete(key)])
        if not committed:
            raise NotFound(f"lease {lease_id!r} does not exist", reason=Reason.LEASE_NOT_FOUND, field="lease_id")
        await self._client.revoke(lease)
        if not await self._mirror.caught_up(revision, self._timeout_s):
            logger.warning("deregistered %s, but this replica's mirror has not shown it yet", key.decode())
        return reg_pb.DeregisterEngineRankResponse(engine=record.snapshot)

    async def expire_silent_ranks(self, interval_s: float = EXPIRY_INTERVAL_S) -> None:
        """Ends, every interval_s, the ranks whose engines stopped renewing for their TTL (runs until cancelled)."""
        started = self._clock.now()
        while True:
            await asyncio.sleep(interval_s)
            for rank in self._directory.ranks():
                if self._clock.now() < started + rank.ttl:
                    continue  # after an outage, engines get one TTL to renew through this replica before they are judged
                try:
                    await self._expire_if_silent(rank)
                except (Unavailable, DeadlineExceeded) as exc:
                    logger.warning("checking lease %s: etcd did not answer (%s); checking again next round", rank.lease_id, exc)
                    break

    async def _expire_if_silent(self, rank: Rank) -> None:
        lease = _held_lease(rank.lease_id)
        left = await self._client.time_to_live(lease)
        if left <= 0 or left >= self._config.outage_grace_s:
            return  # gone already (the mirror hears of it), or renewed within its TTL
        record = rank.engine
        key = self._keys.rank(record.engine_id, record.incarnation, rank.position)
        departure = op_put(self._keys.departure(record.engine_id, record.incarnation), RemovalReason.LEASE_EXPIRED.encode(), lease)
        committed, _ = await self._client.txn([compare_lease(key, "=", lease)], [departure, op_delete(key)])
        if committed:
            logger.info("rank %s: its engine renewed nothing for %g s; ended", key.decode(), rank.ttl)
            await self._client.revoke(lease)

    async def _known_rank(self, lease_id: str) -> Rank | None:
        """The rank holding lease_id; a live lease the mirror does not know yet (a registration through another replica) is waited for."""
        rank = self._directory.rank_of(lease_id)
        if rank is not None:
            return rank
        lease = lease_number(lease_id)
        if lease is None or await self._client.time_to_live(lease) <= 0:
            return None
        return await self._mirror.rank_of(lease_id, self._timeout_s)

    def _incarnation(self, key: bytes) -> str | None:
        parsed = self._keys.parse_rank(key)
        return parsed[1] if parsed is not None else None

    def _grant(self, lease: int, ttl_s: int) -> reg_pb.RegisterEngineRankResponse:
        return reg_pb.RegisterEngineRankResponse(
            lease_id=lease_name(lease), lease_ttl=duration(ttl_s), expire_time=timestamp(self._clock.wall() + ttl_s)
        )


def _held_lease(lease_id: str) -> int:
    """The etcd lease of a rank the directory holds: the mirror names each by its lease (lease_name), so it always parses."""
    lease = lease_number(lease_id)
    if lease is None:
        raise ValueError(f"lease_id {lease_id!r} names no etcd lease")
    return lease
