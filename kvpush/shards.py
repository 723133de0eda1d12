# SPDX-License-Identifier: Apache-2.0
"""Which broker shard owns a transfer: rendezvous (highest random weight) hashing of transfer_id over the live members.

Every party (broker members, engines, routers) computes the owner from the
same member list, so they agree without asking anyone. When a member leaves,
only the transfers it owned move (each to the member with its next highest
weight); when one joins, only the transfers that now hash highest to it move.
The weight is a keyed BLAKE2b of the transfer id, stable across processes,
machines and languages.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable


def weight(member_id: str, transfer_id: str) -> int:
    """The member's weight for the transfer: 64 bits of BLAKE2b(transfer_id) keyed by member_id."""
    digest = hashlib.blake2b(transfer_id.encode(), digest_size=8, key=member_id.encode()[:64])
    return int.from_bytes(digest.digest(), "big")


def owner(transfer_id: str, member_ids: Iterable[str]) -> str | None:
    """The member that owns transfer_id (ties broken by the larger member_id), or None with no members."""
    best: tuple[int, str] | None = None
    for member_id in member_ids:
        candidate = (weight(member_id, transfer_id), member_id)
        if best is None or candidate > best:
            best = candidate
    return best[1] if best is not None else None
