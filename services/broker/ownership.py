# SPDX-License-Identifier: Apache-2.0
"""Which transfers this broker member serves, and until when it vouches for none it just gained.

The core acts on a membership change (refresh) before it answers any
request, so an answer never rests on a map older than the one its attempts
were ended by. A member refuses a transfer it does not own
(FAILED_PRECONDITION NOT_SHARD_OWNER, naming the owner) and every transfer
while it is not serving (UNAVAILABLE BROKER_SHARD_LOST).

A member that gains transfers — it started or rejoined, or another member
left — is for them what a new broker is for everything (docs/design.md,
"Fencing"): their previous owner's orders may still be acted on for
startup_grace_s, so until then it vouches for no refusal and fences
nothing with orders or a destination among them.
"""

from __future__ import annotations

from collections import deque

from kvpush import shards
from kvpush.clock import Clock
from kvpush.errors import FailedPrecondition, Reason, Unavailable
from kvpush.services.broker.membership import Membership

SHARD_REASONS = frozenset((Reason.NOT_SHARD_OWNER, Reason.BROKER_SHARD_LOST))


# Owners remembered at most (cleared whole when full: a lookup costs ~1.3 µs per member).
OWNER_CACHE_SIZE = 65_536


class Ownership:
    """This member's serving state and recent hand-overs, as of the last membership change the core acted on."""

    def __init__(self, membership: Membership, clock: Clock, grace_s: float):
        self.membership = membership
        self._clock = clock
        self._grace_s = grace_s
        self._startup_end = clock.now() + grace_s
        self._seen: tuple[bool, int] | None = None  # (serving, revision) last acted on
        self._serving = False
        self._members: frozenset[str] = frozenset()
        # (until, members before the change): a transfer that another member (or none) owned before may hold its orders until then.
        self._handovers: deque[tuple[float, frozenset[str]]] = deque()
        # Owners worked out under the map of _owners_revision: a lookup hashes every member, and
        # a transfer's messages (registration, prefill-done, each rank's write result) ask again.
        self._owners: dict[str, str | None] = {}
        self._owners_revision: int | None = None

    @property
    def serving(self) -> bool:
        """Whether this member served at the last change acted on."""
        return self._serving

    def refresh(self) -> bool:
        """Takes in a membership change not acted on yet; True when there was one (the core then ends what it no longer owns)."""
        membership = self.membership
        serving = membership.serving()
        seen = (serving, membership.revision)
        if seen == self._seen:
            return False
        first = self._seen is None
        self._seen = seen
        members = frozenset(membership.members()) if serving else frozenset()
        if serving and not first:
            # After a time not serving, every transfer it owns now may have had another owner meanwhile.
            before = self._members if self._serving else frozenset()
            now = self._clock.now()
            if before != members:
                self._handovers.append((now + self._grace_s, before))
        self._serving, self._members = serving, members
        return not first

    def owner(self, transfer_id: str) -> str | None:
        """The member that owns transfer_id under the current map (remembered until the map changes)."""
        revision = self.membership.revision
        owners = self._owners
        if revision != self._owners_revision or len(owners) >= OWNER_CACHE_SIZE:
            owners.clear()
            self._owners_revision = revision
        if transfer_id in owners:
            return owners[transfer_id]
        owner = owners[transfer_id] = self.membership.owner(transfer_id)
        return owner

    def owns(self, transfer_id: str) -> bool:
        """Whether this member serves transfer_id now."""
        return self._serving and self.owner(transfer_id) == self.membership.member_id

    def check_serving(self) -> None:
        """Refuses everything while this member is not serving (call refresh() first)."""
        if not self._serving:
            raise Unavailable(
                f"broker member {self.membership.member_id!r} is not serving: it cannot be sure it still holds its membership",
                reason=Reason.BROKER_SHARD_LOST,
            )

    def check(self, transfer_id: str, field: str) -> None:
        """Refuses a transfer this member may not serve now (call refresh() first)."""
        self.check_serving()
        membership = self.membership
        owner = self.owner(transfer_id)
        if owner == membership.member_id:
            return
        address = membership.members().get(owner, "") if owner is not None else ""
        raise FailedPrecondition(
            f"transfer {transfer_id} belongs to broker member {owner!r} at {address!r}, not {membership.member_id!r}",
            reason=Reason.NOT_SHARD_OWNER,
            field=field,
            metadata={"owner_member_id": owner or "", "owner_address": address},
        )

    def grace_end(self, transfer_id: str) -> float:
        """Until when this member vouches for nothing about transfer_id (its start, or its latest gain of it)."""
        end = self._startup_end
        handovers = self._handovers
        if not handovers:
            return end
        now, me = self._clock.now(), self.membership.member_id
        while handovers and handovers[0][0] <= now:
            handovers.popleft()
        for until, before in handovers:
            if until > end and shards.owner(transfer_id, before) != me:
                end = until
        return end
