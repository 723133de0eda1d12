# SPDX-License-Identifier: Apache-2.0
"""The decode scheduler's record of requests waiting for pushed KV, and when their blocks may be reused.

A request's blocks are reused (its receive reported failed, so vLLM frees
them) only once no WRITE can land in them any more:

* the broker says so: TransferEvent ENDED, a registration answer with
  `fenced`, or a refusal whose ErrorInfo says "fenced": "true";
* nothing naming the blocks ever left this engine (bad parameters, a
  transfer key another waiting request already uses, no control session);
* or the request's own deadline plus hold_margin has passed: every order
  for it lets a WRITE be posted only before that deadline, and the broker
  gives those orders a write timeout that fits in hold_margin.

With a sharded broker each request's transfer has an owner member (the one
its registration went to). When that member leaves the shard map, its
waiting requests fail (END_REASON_BROKER_SHARD_LOST) but keep their blocks
until their deadline plus hold_margin: the lost member's orders may still
be acted on, and no other member can vouch for them.

Failing a request (the client's answer) and reusing its blocks are the same
step for vLLM, so a request that has failed but whose blocks are not safe
yet keeps waiting; a router answers its client from the broker meanwhile.
Pure logic over a Clock: the connector and the protocol simulation share it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from kvpush import shards
from kvpush.clock import Clock
from kvpush.connector.handoff import Key
from kvpush.connector.params import TransferParams
from kvpush.rendezvous.v1 import transfer_pb2

logger = logging.getLogger(__name__)

# The broker's events a decode engine acts on: those that end a transfer without its KV. Completion is the workers' to
# see (they count every WRITE's notification), so a decode engine's event stream asks for these alone, which spares it
# and the broker a message per transfer.
EVENT_TYPES = (transfer_pb2.TRANSFER_EVENT_TYPE_FAILED, transfer_pb2.TRANSFER_EVENT_TYPE_ENDED)


@dataclass
class DecodeWait:
    """A decode request waiting for its KV."""

    req_id: str
    key: Key | None  # None when its parameters could not be read
    params: TransferParams | None
    alloc_ns: int
    deadline: float  # monotonic: give up waiting for the KV
    hold_until: float  # monotonic: reuse the blocks even without the broker's word
    registered: bool = False  # a registration left this engine (the broker may hold it)
    failure: str = ""  # why it will not receive its KV, once known
    safe: bool = False  # no WRITE can land in its blocks any more
    cancel_sent: bool = False
    member: str | None = None  # the broker member its registration went to (sharded brokers only)
    member_lost: bool = False  # that member left: only the hold rule frees its blocks now


class DecodeWaits:
    """Waiting decode requests of one engine (single-threaded: the engine thread)."""

    def __init__(self, clock: Clock, hold_margin_s: float):
        self.clock = clock
        self.hold_margin_s = hold_margin_s
        self._waits: dict[str, DecodeWait] = {}
        self._by_key: dict[Key, str] = {}

    def __len__(self) -> int:
        return len(self._waits)

    def get(self, req_id: str) -> DecodeWait | None:
        return self._waits.get(req_id)

    def admit(self, req_id: str, params: TransferParams | None, refusal: str, timeout_s: float, alloc_ns: int) -> DecodeWait:
        """A request whose blocks were just allocated. The caller registers it when the returned wait has no failure."""
        now = self.clock.now()
        key = params.key if params is not None else None
        wait = DecodeWait(req_id, key, params, alloc_ns, now + timeout_s, now + timeout_s + self.hold_margin_s, failure=refusal)
        if not refusal and key in self._by_key:
            wait.failure = f"transfer key {key[0]} attempt {key[1]} is already used by waiting request {self._by_key[key]}"
        if wait.failure:
            wait.safe = True  # nothing naming these blocks left this engine
        else:
            assert key is not None, "a request whose parameters could not be read is admitted only with its refusal"
            self._by_key[key] = req_id
        self._waits[req_id] = wait
        return wait

    def registered(self, req_id: str) -> None:
        wait = self._waits.get(req_id)
        if wait is not None:
            wait.registered = True

    def routed(self, key: Key, member: str) -> None:
        """The request's registration went to this broker member (its transfer's owner, or the owner a refusal named)."""
        wait = self._by_key_wait(key)
        if wait is not None and not wait.member_lost:
            wait.member = member

    def member_left(self, member: str, members: frozenset[str] = frozenset()) -> None:
        """A broker member left the shard map (members: those left): each request waiting on it fails, its blocks held until the hold rule frees them.

        No cancellation goes out: the transfer's new owner never ordered a
        WRITE for it, so its word cannot fence the lost member's orders. A
        request registered before the sharded map arrived (through the seed,
        which answered only as its owner) was the member's if it hashed to it.
        """
        for wait in self._waits.values():
            if wait.member is None and wait.registered and wait.key is not None:
                wait.member = shards.owner(wait.key[0], members | {member})
            if wait.member == member and not wait.member_lost:
                wait.member_lost = True
                wait.cancel_sent = True
                wait.failure = wait.failure or (f"{transfer_pb2.EndReason.Name(transfer_pb2.END_REASON_BROKER_SHARD_LOST)}: "
                                                f"broker member {member} left the shard map")

    def registration_refused(self, key: Key, message: str, fenced: bool) -> None:
        wait = self._by_key_wait(key)
        if wait is not None:
            wait.failure = wait.failure or f"registration refused: {message}"
            wait.safe = wait.safe or (fenced and not wait.member_lost)

    def registration_answered(self, key: Key, state: int, fenced: bool) -> None:
        """A registration answer: an ended attempt (a repeat) fails the request, at once if fenced."""
        wait = self._by_key_wait(key)
        if wait is None or state not in (transfer_pb2.TRANSFER_STATE_FAILED, transfer_pb2.TRANSFER_STATE_CANCELLED, transfer_pb2.TRANSFER_STATE_SUPERSEDED):
            return
        wait.failure = wait.failure or f"the attempt already ended ({transfer_pb2.TransferState.Name(state)})"
        wait.safe = wait.safe or (fenced and not wait.member_lost)

    def on_event(self, event: transfer_pb2.TransferEvent) -> None:
        """Applies one of the broker's events; a COMPLETED one (from a broker that streams every type) changes nothing."""
        wait = self._by_key_wait((event.key.transfer_id, event.key.attempt))
        if wait is None or event.type == transfer_pb2.TRANSFER_EVENT_TYPE_COMPLETED:
            return  # completion is the workers' to see (every notification counted)
        if event.type in (transfer_pb2.TRANSFER_EVENT_TYPE_FAILED, transfer_pb2.TRANSFER_EVENT_TYPE_ENDED):
            wait.failure = wait.failure or f"{transfer_pb2.EndReason.Name(event.reason)}: {event.detail}"
            wait.safe = wait.safe or (event.type == transfer_pb2.TRANSFER_EVENT_TYPE_ENDED and not wait.member_lost)

    def received(self, req_id: str) -> DecodeWait | None:
        """The workers counted every notification: the KV is in place."""
        return self._remove(req_id)

    def aborted(self, req_id: str) -> None:
        """vLLM finished the request while it waited (vLLM keeps its blocks until the receive is reported)."""
        wait = self._waits.get(req_id)
        if wait is not None and not wait.failure:
            wait.failure = "the request was aborted while waiting for its KV"

    def due(self) -> tuple[dict[str, str], list[Key]]:
        """(requests to report failed now: their blocks are safe, keys to cancel at the broker)."""
        now = self.clock.now()
        fails: dict[str, str] = {}
        cancels: list[Key] = []
        for wait in list(self._waits.values()):
            if not wait.failure and now >= wait.deadline:
                wait.failure = "no KV before the transfer deadline"
            if wait.failure and wait.registered and not wait.safe and not wait.cancel_sent:
                wait.cancel_sent = True  # the broker ends and fences the attempt, and tells us ENDED
                assert wait.key is not None, "only a wait with its key was registered"
                cancels.append(wait.key)
            if not wait.safe and now >= wait.hold_until:
                logger.warning("kvpush: reusing the blocks of %s %s after its deadline and hold margin without the broker's word",
                               wait.req_id, wait.key)
                wait.safe = True
            if wait.failure and wait.safe:
                fails[wait.req_id] = wait.failure
                self._remove(wait.req_id)
        return fails, cancels

    def next_due(self) -> float | None:
        times = [w.hold_until if w.failure else w.deadline for w in self._waits.values()]
        return min(times) if times else None

    def _by_key_wait(self, key: Key) -> DecodeWait | None:
        req_id = self._by_key.get(key)
        return self._waits.get(req_id) if req_id is not None else None

    def _remove(self, req_id: str) -> DecodeWait | None:
        wait = self._waits.pop(req_id, None)
        if wait is not None and wait.key is not None and self._by_key.get(wait.key) == req_id:
            del self._by_key[wait.key]
        return wait
