# SPDX-License-Identifier: Apache-2.0
"""The attempt state machine: every transition, and what each one sends.

    first arrival ─▶ WAITING_FOR_* ─▶ (second arrival) MATCHED ─▶ WRITING ─▶ DONE
    any live state ─▶ FAILED | CANCELLED | SUPERSEDED ─▶ fenced ─▶ settled

Matching orders every producer rank; a completed attempt is fenced at once
(every rank answered WRITTEN). An attempt that ends without completing
revokes every unanswered order and counts as fenced once each ordered rank
answered or its fencing bound passed — min(budget end, stream lease end) +
write timeout + margin, after which the rank can no longer post nor have a
WRITE in flight. Only then does the decode engine get TransferEvent{ENDED}
(FAILED before that) and may reuse its blocks. A new broker fences nothing
for its first startup_grace_s: a predecessor's orders may still be acted on;
a broker member that gains transfers does the same for them (ownership.py).
"""

from __future__ import annotations

from collections.abc import Callable

from opentelemetry.context import Context

from kvpush.clock import Clock
from kvpush.errors import KvpushError
from kvpush.rendezvous.v1 import rendezvous_service_pb2 as rv_pb
from kvpush.rendezvous.v1 import transfer_pb2 as tr_pb
from kvpush.services.broker import attempts as a
from kvpush.services.broker import checks
from kvpush.services.broker.attempts import Attempt, OrderRecord, RankKey, rank_name
from kvpush.services.broker.config import BrokerConfig
from kvpush.services.broker.mailboxes import DecodeMailbox, Mailboxes, ProducerMailbox, Subscription
from kvpush.services.broker.messages import Messages
from kvpush.services.broker.metrics import BrokerMetrics
from kvpush.services.broker.plans import Planner
from kvpush.services.broker.store import AttemptStore
from kvpush.services.broker.tracing import RendezvousTracing
from kvpush.services.common import validation


def owes_closure(att: Attempt, rank_key) -> bool:
    """Whether an ended attempt's closure must reach this producer rank.

    A rank that answered WRITTEN released its source when its WRITE
    completed and answers a repeated order from its own record, so a closure
    would tell it nothing: one message per rank and transfer spared. Every
    other rank may still hold the source (its order never came, or it was
    revoked) and learns from the closure that it can let go.
    """
    order = att.orders.get(rank_key)
    return order is None or order.answer != a.WRITTEN


class AttemptMachine:
    """Moves attempts between states; the BrokerCore checks each request before it calls in here."""

    def __init__(
        self,
        config: BrokerConfig,
        clock: Clock,
        store: AttemptStore,
        mailboxes: Mailboxes,
        planner: Planner,
        messages: Messages,
        tracing: RendezvousTracing,
        metrics: BrokerMetrics,
        grace_end: Callable[[str], float],
    ):
        self._config = config
        self._clock = clock
        self._store = store
        self._mailboxes = mailboxes
        self._planner = planner
        self._messages = messages
        self._tracing = tracing
        self._metrics = metrics
        # Until when the broker vouches for nothing about a transfer (Ownership.grace_end).
        self._grace_end = grace_end
        self.end_listeners: list[Callable[[str, int], None]] = []

    def vouching(self, transfer_id: str) -> bool:
        """Whether this broker may say "fenced" of what it holds no record of about transfer_id (past its grace)."""
        return self._clock.now() >= self._grace_end(transfer_id)

    # ----- live transitions -----

    def wait(self, att: Attempt, side: tr_pb.TransferSide, parent: Context | None, now: float) -> None:
        """The first side arrived: wait for the other (and send early orders to ranks that asked for them)."""
        decode = side == a.DECODE_SIDE
        att.first_arrival = side
        att.first_time = now
        self._store.set_state(att, a.WAITING_FOR_PREFILL if decode else a.WAITING_FOR_REGISTRATION)
        self._tracing.first_arrival(att, parent, "decode" if decode else "prefill", now)
        if decode:
            self.send_orders(att, now, full=False)

    def match(self, att: Attempt, parent: Context | None, now: float) -> None:
        """Both sides are in: end the rendezvous span and order every producer rank not yet ordered."""
        if att.state != a.WRITING:
            self._store.set_state(att, a.MATCHED)
        self._tracing.matched(att, parent)
        self._metrics.rendezvous.inc()
        self._metrics.rendezvous_wait.observe(now - att.first_time)
        self.send_orders(att, now, full=True)

    def send_orders(self, att: Attempt, now: float, *, full: bool) -> None:
        """Sends one order to each producer rank not yet ordered (early: only to ranks with an early-order stream)."""
        assert att.plan is not None, "orders go out once the decode side registered, which sets the plan"
        sent = 0
        for rank_key, _ in att.plan.orders:
            if rank_key in att.orders:
                continue
            mailbox = self._mailboxes.producer(rank_key)
            if not full and (mailbox is None or mailbox.closed or mailbox.subscriber is None or not mailbox.early_orders):
                continue
            if self._planner.rank_lost(rank_key):
                continue  # engine loss ends the attempt; the rank never got anything
            if att.deadline - now <= self._config.max_clock_skew_s:
                continue  # no budget left: the deadline ends the attempt
            mailbox = self._mailboxes.open_producer(rank_key, now)
            att.orders[rank_key] = OrderRecord(att.deadline, att.write_timeout, early=not full)
            mailbox.put(self._messages.order(att, rank_key, now, full=full))
            att.note(a.TL_ORDER_SENT, now, f"{rank_name(rank_key)}{'' if full else ' early'}")
            sent += 1
        if sent:
            self._metrics.orders_sent.inc(sent)

    def written(self, att: Attempt, now: float) -> None:
        """One more rank wrote its part: the attempt is WRITING, or DONE once every ordered rank did."""
        att.written += 1
        if att.plan is not None and att.written == len(att.plan.orders):
            self._complete(att, now)
        elif att.state != a.WRITING:
            self._store.set_state(att, a.WRITING)

    def supersede_older(self, att: Attempt, now: float) -> None:
        """A new attempt supersedes every older live one of its transfer."""
        record = self._store.record(att.transfer_id)
        assert record is not None, "att is one of its attempts"
        record.newest = max(record.newest, att.number)
        for older in list(record.attempts.values()):
            if older.number < att.number and not older.ended:
                self._metrics.supersessions.inc()
                self.end(older, a.SUPERSEDED, tr_pb.END_REASON_SUPERSEDED, f"attempt {att.number} superseded it", now)

    # ----- ending -----

    def _complete(self, att: Attempt, now: float) -> None:
        self._store.set_state(att, a.DONE)
        att.end_reason = tr_pb.END_REASON_COMPLETED
        att.note(a.TL_ENDED, now, "DONE")
        self._tracing.ended(att)
        self._notify_decode(att, tr_pb.TRANSFER_EVENT_TYPE_COMPLETED)
        self._close_producers(att)
        att.fenced = True
        att.note(a.TL_FENCED, now)
        self._store.settle(att, now)
        self._announce_end(att)

    def end(self, att: Attempt, state: tr_pb.TransferState, reason: tr_pb.EndReason, detail: str, now: float) -> None:
        """Ends a live attempt without the KV: revoke unanswered orders, release producers, fence when safe."""
        self._store.set_state(att, state)
        att.end_reason = reason
        att.detail = detail
        att.note(a.TL_ENDED, now, f"{tr_pb.TransferState.Name(state)} {tr_pb.EndReason.Name(reason)}")
        if state == a.FAILED:
            self._metrics.failure(reason).inc()
        self._tracing.ended(att)
        unanswered = att.unanswered()
        if unanswered:
            revocation = self._messages.revocation(att)
            for rank_key, _ in unanswered:
                mailbox = self._mailboxes.producer(rank_key)
                if mailbox is not None:
                    mailbox.put(revocation)
                att.note(a.TL_REVOKED, now, rank_name(rank_key))
        self._close_producers(att)
        self.check_fenced(att, now)
        if not att.fenced:
            self._notify_decode(att, tr_pb.TRANSFER_EVENT_TYPE_FAILED)
        self._announce_end(att)

    def fence_bound(self, rank_key: RankKey, order: OrderRecord) -> float:
        """When an unanswered order can no longer lead to a landing WRITE (broker monotonic time)."""
        mailbox = self._mailboxes.producer(rank_key)
        # No mailbox: never delivered, or closed long enough ago to be forgotten.
        stream_end = mailbox.lease_bound(self._config.stream_lease_s) if mailbox is not None else float("-inf")
        return min(order.budget_end, stream_end) + order.write_timeout + self._config.fence_margin_s

    def check_fenced(self, att: Attempt, now: float) -> None:
        """Once every ordered rank answered or its bound passed (and the startup grace is over), the attempt is fenced."""
        if att.fenced:
            return
        next_check = None
        for rank_key, order in att.unanswered():
            bound = self.fence_bound(rank_key, order)
            if bound <= now:
                order.answer = a.TIMED_OUT
                att.note(a.TL_WRITE_RESULT, now, f"{rank_name(rank_key)} no answer: fenced by time")
            else:
                next_check = bound if next_check is None else min(next_check, bound)
        if next_check is None and (att.orders or att.dest is not None):
            grace_end = self._grace_end(att.transfer_id)
            if now < grace_end:
                # A predecessor broker's (or previous owner's) orders for this key may still be acted on.
                next_check = grace_end
        if next_check is not None:
            self._store.schedule(att, next_check)
            return
        att.fenced = True
        att.note(a.TL_FENCED, now)
        self._notify_decode(att, tr_pb.TRANSFER_EVENT_TYPE_ENDED)
        self._store.settle(att, now)

    def refuse_registration(self, request: rv_pb.RegisterDestinationRequest, caller: str, error: KvpushError) -> bool:
        """Whether a refused registration's blocks can never be written; remembers the refusal until its deadline."""
        if not self.vouching(request.key.transfer_id):
            return False
        key = request.key
        if validation.ID_PATTERN.fullmatch(key.transfer_id) is None or key.attempt == 0:
            return True  # no broker ever accepts it
        if not request.HasField("destination") or request.destination.engine_id != caller:
            return True  # not the caller's own blocks: nothing of it is ever accepted from this caller
        now = self._clock.now()
        keep_until = now + self._config.max_timeout_s
        timeout = request.timeout.seconds + request.timeout.nanos * 1e-9
        if 0 < timeout <= self._config.max_timeout_s:
            keep_until = min(keep_until, now + timeout)
        att = self._store.find(key.transfer_id, key.attempt)
        if att is not None:
            if att.dest is not None and checks.same_arrival(att.dest, request, a.DECODE_SIDE):
                return att.fenced  # this very registration is recorded (a repeat of a refused second arrival)
            att.keep_until = max(att.keep_until, keep_until)
            return True
        record = self._store.record(key.transfer_id)
        try:
            att = self._store.create(key.transfer_id, key.attempt, now, tombstone=True)
        except KvpushError:
            return False  # cannot remember the refusal: the blocks wait for their deadline
        superseded = record is not None and key.attempt < record.newest
        att.keep_until = keep_until
        att.d_engine_id, att.d_incarnation = caller, request.destination.incarnation
        if record is not None and superseded:
            self.end(att, a.SUPERSEDED, tr_pb.END_REASON_SUPERSEDED, f"attempt {record.newest} superseded it", now)
        else:
            self.end(att, a.FAILED, tr_pb.END_REASON_REGISTRATION_REFUSED, error.message[: self._config.max_text_length], now)
            self.supersede_older(att, now)
        return True

    # ----- what is owed to a new stream -----

    def resync_producer(self, mailbox: ProducerMailbox, now: float) -> None:
        """Queues every order, revocation and closure still owed to the producer rank (early orders too, if it asks for them)."""
        rank_key = mailbox.key
        engine_id, incarnation = rank_key[0], rank_key[1]
        for att in self._store.of_engine(engine_id):
            if att.p_engine_id != engine_id or att.p_incarnation != incarnation:
                continue
            order = att.orders.get(rank_key)
            if order is not None and order.answer == a.UNANSWERED:
                mailbox.put(self._messages.revocation(att) if att.ended else self._messages.order(att, rank_key, now, full=not order.early))
            elif order is None and att.state == a.WAITING_FOR_PREFILL and mailbox.early_orders:
                self.send_orders(att, now, full=False)
            if att.ended and owes_closure(att, rank_key):
                mailbox.put(self._messages.closed(att))

    def resync_decode(self, subscription: Subscription[DecodeMailbox]) -> None:
        """Queues the decode engine's recent final events again, and a FAILED event for each ended attempt not yet fenced."""
        mailbox = subscription.mailbox
        engine_id, incarnation = mailbox.key
        for message in mailbox.recent:
            subscription.offer(message)
        for att in self._store.of_engine(engine_id):
            if att.ended and att.dest is not None and att.d_incarnation == incarnation:
                subscription.offer(self._messages.event(att, tr_pb.TRANSFER_EVENT_TYPE_FAILED))

    # ----- what an end sends -----

    def _close_producers(self, att: Attempt) -> None:
        self.close_ranks(att, att.p_ranks)

    def close_ranks(self, att: Attempt, rank_keys) -> None:
        """Sends an ended attempt's closure to these producer ranks (those that may still hold its source)."""
        closed = None
        for rank_key in rank_keys:
            mailbox = self._mailboxes.producer(rank_key)
            if mailbox is not None and owes_closure(att, rank_key):
                closed = closed or self._messages.closed(att)
                mailbox.put(closed)

    def _notify_decode(self, att: Attempt, event_type: tr_pb.TransferEventType) -> None:
        if att.dest is None:
            return  # the decode side never registered: nothing of it to release
        mailbox = self._mailboxes.decoder((att.d_engine_id, att.d_incarnation), self._clock.now())
        if mailbox is None:
            return
        message = self._messages.event(att, event_type)
        if event_type == tr_pb.TRANSFER_EVENT_TYPE_FAILED:
            mailbox.put(message)
        else:
            mailbox.put_final(message)

    def _announce_end(self, att: Attempt) -> None:
        for listener in self.end_listeners:
            listener(att.transfer_id, att.number)
