# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""Which push attempts lost their broker shard: the member that held the attempt left the shard map, or no longer owns its transfer.

The router records each attempt's owner (member and address) when its legs
go out. An unsharded broker (and a sharded one before its map arrived) is
the UNSHARDED owner, which is never lost: the attempt then fails only as
it did before sharding.
"""

from __future__ import annotations

import asyncio
import dataclasses

from kvpush.client import UNSHARDED, ShardMap

BROKER_SHARD_LOST = "BROKER_SHARD_LOST"  # the owner left the map (died, lost its lease) or came back at another address
BROKER_SHARD_MOVED = "BROKER_SHARD_MOVED"  # the owner is still a member but another member owns the transfer now


@dataclasses.dataclass(frozen=True)
class Owner:
    """The broker member that held an attempt when its legs went out."""

    member_id: str = UNSHARDED
    address: str = ""


class ShardWatch:
    """Resolves a future per watched attempt once its owner stops serving it (one shard map listener for the router)."""

    def __init__(self, shard_map: ShardMap):
        self.shard_map = shard_map
        self._watched: dict[asyncio.Future, tuple[str, Owner]] = {}
        shard_map.add_listener(self._on_change)

    def owner(self, transfer_id: str) -> Owner:
        """The member that owns transfer_id now."""
        return Owner(*self.shard_map.owner(transfer_id))

    def lost(self, transfer_id: str, owner: Owner) -> str:
        """Why owner no longer serves transfer_id (BROKER_SHARD_LOST or BROKER_SHARD_MOVED), or "" while it does."""
        if owner.member_id == UNSHARDED:
            return ""
        if self.shard_map.members().get(owner.member_id) != owner.address:
            return BROKER_SHARD_LOST
        if self.shard_map.owner(transfer_id)[0] != owner.member_id:
            return BROKER_SHARD_MOVED
        return ""

    def watch(self, transfer_id: str, owner: Owner) -> asyncio.Future[str]:
        """A future resolved with lost()'s reason once it has one (at once if it has one now); unwatch() it when done."""
        future: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        reason = self.lost(transfer_id, owner)
        if reason:
            future.set_result(reason)
        elif owner.member_id != UNSHARDED:
            self._watched[future] = (transfer_id, owner)
        return future

    def unwatch(self, future: asyncio.Future[str]) -> None:
        self._watched.pop(future, None)
        future.cancel()

    def close(self) -> None:
        self.shard_map.remove_listener(self._on_change)
        for future in list(self._watched):
            self.unwatch(future)

    def _on_change(self, _added: dict[str, str], _removed: dict[str, str]) -> None:
        for future, (transfer_id, owner) in list(self._watched.items()):
            reason = self.lost(transfer_id, owner)
            if reason:
                del self._watched[future]
                future.set_result(reason)
