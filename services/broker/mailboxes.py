# SPDX-License-Identifier: Apache-2.0
"""Where the broker's messages to producer ranks and decode engines wait for their stream.

Each stream is a Subscription with its own bounded Outbox. Nothing is queued
for a subscriber that is not connected and nothing is ever dropped from a
connected one: an outbox that overflows closes, its stream ends, and the
subscriber's next stream starts with a resync — the core regenerates every
order, revocation and closure that is still owed (AttemptMachine.resync_*).
A lost message therefore costs a reconnect, never a fencing answer.

A producer mailbox also tracks when its rank last had a stream: orders reach
a rank only on a stream, and a rank acts on them only while that stream's
lease holds (stream_lease past the last message), so once no stream has been
attached for stream_lease, nothing the broker sent can still be acted on.
"""

from __future__ import annotations

from collections import deque
from typing import Generic, Self, TypeVar

from kvpush.errors import Reason, Unavailable
from kvpush.rendezvous.v1 import rendezvous_service_pb2 as rv_pb
from kvpush.services.broker.attempts import RankKey
from kvpush.services.broker.plans import Planner
from kvpush.services.common.outbox import Outbox

DecodeKey = tuple[str, str]  # (engine_id, incarnation)
# How many final events a decode engine's new stream gets again.
RESYNC_EVENTS = 4096
# A subscription's mailbox, so a decode stream's subscription says it holds a DecodeMailbox.
MailboxT = TypeVar("MailboxT", bound="_Mailbox")


class Subscription(Generic[MailboxT]):
    """One stream's claim on a mailbox; a newer subscription for the same key replaces it."""

    __slots__ = ("mailbox", "outbox", "event_types")

    def __init__(self, mailbox: MailboxT, event_types: frozenset[int] | None = None):
        self.mailbox = mailbox
        # Unbounded while the core queues the resync; BrokerCore bounds it after.
        self.outbox: Outbox = Outbox(None)
        self.event_types = event_types  # a decode stream's event types (None: every type)

    def offer(self, event: rv_pb.StreamTransferEventsResponse) -> None:
        """Queues a decode event when this stream asked for its type (every type when it named none)."""
        if self.event_types is None or event.event.type in self.event_types:
            self.outbox.put(event)

    @property
    def active(self) -> bool:
        """False once replaced by a newer subscription or closed (overflow, engine gone, broker stopping)."""
        return self.mailbox.subscriber is self and not self.outbox.closed


class _Mailbox:
    __slots__ = ("subscriber", "quiet_since", "closed")

    def __init__(self, now: float):
        self.subscriber: Subscription | None = None
        self.quiet_since = now  # when the last stream ended (creation time before the first)
        self.closed = False  # the engine (rank) left; no stream may attach any more

    def put(self, message) -> None:
        """Queues message on the connected stream, if any (a resync regenerates what a later stream needs)."""
        subscriber = self.subscriber
        if subscriber is not None:
            subscriber.outbox.put(message)

    def claim(self, event_types: frozenset[int] | None = None) -> Subscription[Self]:
        subscription = Subscription(self, event_types)
        previous = self.subscriber
        self.subscriber = subscription
        if previous is not None:
            previous.outbox.close()  # the replaced stream wakes, sees it is no longer active and ends
        return subscription

    def release(self, subscription: Subscription, now: float) -> bool:
        """The stream of subscription ended; True when it was the current one."""
        if self.subscriber is not subscription:
            return False
        self.subscriber = None
        self.quiet_since = now
        return True

    def close(self, now: float) -> None:
        self.closed = True
        if self.subscriber is not None:
            self.subscriber.outbox.close()
            self.subscriber = None
            self.quiet_since = now


class ProducerMailbox(_Mailbox):
    """One producer rank's stream state."""

    __slots__ = ("key", "early_orders")

    def __init__(self, key: RankKey, now: float):
        super().__init__(now)
        self.key = key
        self.early_orders = False

    def lease_bound(self, stream_lease: float) -> float:
        """The broker time after which the rank acts on nothing it was sent (inf while a stream is attached)."""
        return float("inf") if self.subscriber is not None else self.quiet_since + stream_lease

    def release(self, subscription: Subscription, now: float) -> bool:
        if super().release(subscription, now):
            self.early_orders = False
            return True
        return False


class DecodeMailbox(_Mailbox):
    """One decode engine incarnation's stream state, with its recent final events for a resync."""

    __slots__ = ("key", "recent")

    def __init__(self, key: DecodeKey, now: float, recent_capacity: int):
        super().__init__(now)
        self.key = key
        # Final events (COMPLETED/ENDED) already sent: a new stream gets them
        # again, since the old one may have lost them in flight.
        self.recent: deque[rv_pb.StreamTransferEventsResponse] = deque(maxlen=recent_capacity)

    def put(self, message: rv_pb.StreamTransferEventsResponse) -> None:
        """Queues the event on the connected stream, if any, when that stream asked for its type."""
        subscriber = self.subscriber
        if subscriber is not None:
            subscriber.offer(message)

    def put_final(self, message: rv_pb.StreamTransferEventsResponse) -> None:
        self.recent.append(message)
        self.put(message)


class Mailboxes:
    """Every producer rank's and decode engine incarnation's mailbox; no stream attaches once closed."""

    def __init__(self, planner: Planner):
        self._planner = planner
        self._producers: dict[RankKey, ProducerMailbox] = {}
        self._decoders: dict[DecodeKey, DecodeMailbox] = {}
        self._closed = False

    @property
    def memory_sizes(self) -> dict[str, int]:
        return {"producer_mailboxes": len(self._producers), "decode_mailboxes": len(self._decoders)}

    def producer(self, rank_key: RankKey) -> ProducerMailbox | None:
        return self._producers.get(rank_key)

    def open_producer(self, rank_key: RankKey, now: float) -> ProducerMailbox:
        """The rank's mailbox; a new one when it has none or its old one closed."""
        mailbox = self._producers.get(rank_key)
        if mailbox is None or mailbox.closed:
            mailbox = self._producers[rank_key] = ProducerMailbox(rank_key, now)
        return mailbox

    def decoder(self, key: DecodeKey, now: float) -> DecodeMailbox | None:
        """The decode engine incarnation's mailbox, opened on first use (None once that incarnation is gone)."""
        mailbox = self._decoders.get(key)
        if mailbox is None:
            if self._planner.engine_lost(*key):
                return None
            mailbox = self._decoders[key] = DecodeMailbox(key, now, RESYNC_EVENTS)
        return mailbox

    def open_decoder(self, key: DecodeKey, now: float) -> DecodeMailbox:
        """The mailbox a new decode stream claims; a new one when it has none or its old one closed."""
        mailbox = self._decoders.get(key)
        if mailbox is None or mailbox.closed:
            mailbox = self._decoders[key] = DecodeMailbox(key, now, RESYNC_EVENTS)
        return mailbox

    def attached_streams(self) -> int:
        """How many producer ranks and decode engines have a stream attached now."""
        return sum(m.subscriber is not None for m in (*self._producers.values(), *self._decoders.values()))

    def check_open(self) -> None:
        if self._closed:
            raise Unavailable("the broker is shutting down", reason=Reason.UNAVAILABLE)

    def close_lost(self, engine_id: str, now: float) -> None:
        """Closes the mailboxes of the engine's ranks and incarnations that left."""
        for key, mailbox in self._producers.items():
            if key[0] == engine_id and not mailbox.closed and self._planner.rank_lost(key):
                mailbox.close(now)
        for decoder in [k for k in self._decoders if k[0] == engine_id and self._planner.engine_lost(*k)]:
            self._decoders.pop(decoder).close(now)

    def prune(self, horizon: float) -> None:
        """Forgets producer mailboxes closed before horizon: nothing sent through them can still be acted on."""
        for key in [k for k, m in self._producers.items() if m.closed and m.quiet_since < horizon]:
            del self._producers[key]

    def close(self, now: float) -> None:
        """Ends every stream; later ones are refused."""
        self._closed = True
        for mailbox in (*self._producers.values(), *self._decoders.values()):
            if mailbox.subscriber is not None:
                mailbox.subscriber.outbox.close()
                mailbox.release(mailbox.subscriber, now)
