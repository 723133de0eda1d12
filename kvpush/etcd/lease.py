# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""KeptLease: an etcd lease renewed in the background, with a conservative answer to "do I still hold it?"."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from kvpush import errors
from kvpush.etcd.client import EtcdClient

logger = logging.getLogger(__name__)

# Renewals per ttl. held() lasts ttl after the last renewal sent, so an etcd
# that cannot renew (a leader killed: an election, on a loaded host a split
# vote too, measured at 1.1 s with 500 ms election timeouts) costs the lease
# only if it lasts longer than ttl - ttl/RENEWALS_PER_TTL: 1.67 s of a 2 s
# lease, where ttl/3 left 1.33 s and lost two broker members' leases in CI.
RENEWALS_PER_TTL = 6
# A failed renewal is tried again after this share of the ttl, so several
# tries fit before the lease could lapse.
RETRY_SHARE = 0.1
MIN_RETRY_S = 0.05


class KeptLease:
    """Grants an etcd lease of ttl_s seconds and renews it every ttl/RENEWALS_PER_TTL (ttl/6) until close().

    held() is True only while the lease surely exists: etcd's leader starts
    a renewal's ttl when it receives it, after we sent it, so "the last
    renewal that succeeded was sent less than ttl ago" is a lower bound on
    the lease's life whatever the network delayed. Once that bound passes,
    or etcd says the lease is gone, `lost` is set and stays set: the lease is
    never trusted again (a holder that fences itself takes a new one).

        async with KeptLease(client, 2) as lease:
            await client.put(key, value, lease=lease.id)
    """

    def __init__(self, client: EtcdClient, ttl_s: int):
        if ttl_s < 1:
            raise ValueError("ttl_s must be at least 1")
        self.client = client
        self.requested_ttl_s = ttl_s
        self.id = 0
        self.ttl_s = 0
        self.lost = asyncio.Event()
        self._valid_until = 0.0
        self._closed = False
        self._task: asyncio.Task | None = None

    async def start(self) -> KeptLease:
        """Grants the lease and starts renewing it; raises kvpush.errors exceptions if etcd does not grant it."""
        sent = time.monotonic()
        self.id, self.ttl_s = await self.client.grant(self.requested_ttl_s)
        self._valid_until = sent + self.ttl_s
        self._task = asyncio.create_task(self._renew(), name=f"etcd-lease-{self.id:x}")
        return self

    def held(self) -> bool:
        """Whether the lease surely has not lapsed (False before start(), after close() and once lost)."""
        return not self._closed and not self.lost.is_set() and time.monotonic() < self._valid_until

    async def close(self) -> None:
        """Stops renewing and revokes the lease, deleting its keys; a revoke etcd does not take is left to expiry."""
        if self._closed:
            return
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self.id and not self.lost.is_set():
            try:
                await self.client.revoke(self.id)
            except errors.KvpushError as exc:
                logger.warning("etcd lease %x not revoked (it expires in %d s): %s", self.id, self.ttl_s, exc)

    async def __aenter__(self) -> KeptLease:
        return await self.start()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def _renew(self) -> None:
        next_renewal = self._valid_until - self.ttl_s * (1 - 1 / RENEWALS_PER_TTL)
        while True:
            await asyncio.sleep(max(0.0, next_renewal - time.monotonic()))
            sent = time.monotonic()
            if sent >= self._valid_until:
                return self._lose("no renewal succeeded within its ttl")
            try:
                # A renewal still unanswered when the lease may have lapsed
                # cannot help any more.
                async with asyncio.timeout(self._valid_until - sent):
                    ttl = await self.client.keep_alive_once(self.id)
            except TimeoutError:
                return self._lose("no renewal succeeded within its ttl")
            except errors.KvpushError as exc:
                logger.info("renewing etcd lease %x failed, retrying: %s", self.id, exc)
                next_renewal = time.monotonic() + max(MIN_RETRY_S, self.ttl_s * RETRY_SHARE)
                continue
            if ttl <= 0:
                return self._lose("etcd says it is gone")
            self._valid_until = sent + ttl
            next_renewal = sent + ttl / RENEWALS_PER_TTL

    def _lose(self, why: str) -> None:
        logger.warning("etcd lease %x lost: %s", self.id, why)
        self.lost.set()
