# SPDX-License-Identifier: Apache-2.0
"""The rendezvous broker's grpc-free core: checks each request, then moves its attempt.

The decode side's RegisterDestination and the prefill side's
ReportPrefillDone arrive in either order (one arrival path, parameterized by
side: arrivals.py); the broker then sends WriteOrders to the producer ranks (early orders,
without source, as soon as the destination is known, to ranks that asked for
them), collects their write results and tells both sides how it ended. The
transitions and fencing live in machine.py, the tables in store.py, the
streams in mailboxes.py, the rendered protos in messages.py.

A sharded broker's member serves only the transfers it owns (ownership.py):
on a membership change it ends the live attempts it no longer owns
(BROKER_SHARD_MOVED), or every one when it stops serving
(BROKER_SHARD_LOST), through the same fencing path as every other end.

The core reads time only from its Clock and never sleeps: tick() ends
attempts whose deadline passed, fences those whose bound passed, forgets
settled attempts after retention, and returns when it next needs to run.
"""

from __future__ import annotations

from collections.abc import Callable

from opentelemetry import trace
from opentelemetry.context import Context

from kvpush.clock import Clock
from kvpush.errors import Aborted, AlreadyExists, FailedPrecondition, KvpushError, NotFound, Reason
from kvpush.rendezvous.v1 import rendezvous_service_pb2 as rv_pb
from kvpush.rendezvous.v1 import transfer_pb2 as tr_pb
from kvpush.services.broker import attempts as a
from kvpush.services.broker import checks
from kvpush.services.broker.arrivals import Arrivals
from kvpush.services.broker.attempts import Attempt, rank_name
from kvpush.services.broker.cancels import Actor, actor_of, authorize
from kvpush.services.broker.config import BrokerConfig
from kvpush.services.broker.machine import AttemptMachine
from kvpush.services.broker.mailboxes import DecodeMailbox, Mailboxes, ProducerMailbox, Subscription
from kvpush.services.broker.membership import Membership, ShardWatches, StaticMembership
from kvpush.services.broker.messages import Messages
from kvpush.services.broker.metrics import BrokerMetrics
from kvpush.services.broker.ownership import SHARD_REASONS, Ownership
from kvpush.services.broker.plans import DECODE, PREFILL, EngineDirectory, Planner, invalid
from kvpush.services.broker.store import AttemptStore
from kvpush.services.broker.tracing import RendezvousTracing
from kvpush.services.common import validation
from kvpush.services.common.outbox import Outbox


class BrokerCore:
    """The broker's request handlers. Not thread-safe: call it from one thread (the event loop)."""

    def __init__(
        self,
        directory: EngineDirectory,
        config: BrokerConfig,
        clock: Clock,
        *,
        metrics: BrokerMetrics | None = None,
        tracer_provider: trace.TracerProvider | None = None,
        membership: Membership | None = None,
    ):
        """membership None: an unsharded broker (StaticMembership)."""
        self._directory = directory
        self._config = config
        self._clock = clock
        self.metrics = metrics if metrics is not None else BrokerMetrics()
        self._planner = Planner(directory)
        tracing = RendezvousTracing(tracer_provider)
        self._messages = Messages(config, clock, tracing)
        self._store = AttemptStore(config)
        self._mailboxes = Mailboxes(self._planner)
        self._ownership = Ownership(membership if membership is not None else StaticMembership(), clock, config.startup_grace_s)
        self._ownership.refresh()
        self._shard_watches = ShardWatches()
        self._machine = AttemptMachine(
            config, clock, self._store, self._mailboxes, self._planner, self._messages, tracing, self.metrics, self._ownership.grace_end
        )
        self._arrivals = Arrivals(config, clock, self._store, self._machine, self._planner, self._find_held, self._check_owner)
        directory.add_removal_listener(self.on_engine_removed)
        self._ownership.membership.add_listener(self.on_membership_change)
        counts = self._store.state_counts
        self.metrics.read_gauges_from(
            lambda: counts[a.WAITING_FOR_PREFILL],
            lambda: counts[a.WAITING_FOR_REGISTRATION],
            lambda: sum(counts[s] for s in a.LIVE),
        )
        membership = self._ownership.membership
        self.metrics.read_shard_gauges_from(lambda: len(membership.members()), lambda: float(membership.serving()))

    # ----- counts and hooks -----

    @property
    def live_attempts(self) -> int:
        """Attempts not yet in a terminal state."""
        return self._store.live

    @property
    def unsettled_attempts(self) -> int:
        """Attempts live or ended but not yet fenced."""
        return self._store.unsettled

    @property
    def remembered_attempts(self) -> int:
        """Attempts held in memory (unsettled plus settled within retention)."""
        return self._store.remembered

    @property
    def memory_sizes(self) -> dict[str, int]:
        """Sizes of every table the core keeps (for leak checks: all bounded)."""
        return {
            **self._store.memory_sizes, **self._mailboxes.memory_sizes, "engine_infos": self._planner.cached_engines, "shard_watches": len(self._shard_watches)
        }

    def set_wakeup(self, wakeup: Callable[[float], None]) -> None:
        """wakeup(t) is called when tick() must run at t, earlier than it last said."""
        self._store.wakeup = wakeup

    def add_end_listener(self, listener: Callable[[str, int], None]) -> None:
        """listener(transfer_id, attempt) is called whenever an attempt reaches a terminal state."""
        self._machine.end_listeners.append(listener)

    @property
    def membership(self) -> Membership:
        """The shard map this broker serves by."""
        return self._ownership.membership

    def newest_attempt(self, transfer_id: str) -> int:
        """The newest attempt number seen for transfer_id (0: none remembered)."""
        record = self._store.record(transfer_id)
        return record.newest if record is not None else 0

    def is_ended(self, transfer_id: str, attempt: int) -> bool:
        """True when the attempt is remembered in a terminal state."""
        att = self._store.find(transfer_id, attempt)
        return att is not None and att.ended

    # ----- arrivals: the decode side's registration, the prefill side's prefill-done -----

    def register_destination(self, request: rv_pb.RegisterDestinationRequest, caller_engine_id: str, parent: Context | None = None) -> rv_pb.RegisterDestinationResponse:
        """Registers the decode side's blocks; see RendezvousService.RegisterDestination.

        A refusal carries ErrorInfo metadata "fenced": "true" when no WRITE
        can ever land in the blocks it named, so the decode side may reuse
        them at once; the broker then remembers the refusal until the
        request's deadline, so a late copy of it is refused too.
        """
        try:
            att = self._arrivals.arrive(a.DECODE_SIDE, request, caller_engine_id, parent)
        except KvpushError as error:
            # Another member may serve this transfer (or this one again, later): a shard refusal vouches for nothing.
            fenced = error.reason not in SHARD_REASONS and self._machine.refuse_registration(request, caller_engine_id, error)
            error.metadata["fenced"] = "true" if fenced else "false"
            raise
        assert att.plan is not None, "the decode side's arrival sets the plan"
        response = rv_pb.RegisterDestinationResponse(
            # The decode side may reuse its blocks now only if the attempt ended without them.
            state=att.state, first_arrival=att.first_arrival, expected_notifications=att.plan.expected, fenced=att.fenced and att.state != a.DONE
        )
        self._messages.put_deadline(response, att)
        return response

    def report_prefill_done(self, request: rv_pb.ReportPrefillDoneRequest, caller_engine_id: str, parent: Context | None = None) -> rv_pb.ReportPrefillDoneResponse:
        """Records that the prefill side holds the KV; see RendezvousService.ReportPrefillDone."""
        att = self._arrivals.arrive(a.PREFILL_SIDE, request, caller_engine_id, parent)
        response = rv_pb.ReportPrefillDoneResponse(state=att.state, first_arrival=att.first_arrival)
        self._messages.put_deadline(response, att)
        return response

    # ----- producer ranks -----

    def report_write_result(self, request: rv_pb.ReportWriteResultRequest, caller_engine_id: str) -> rv_pb.ReportWriteResultResponse:
        """Records what a producer rank did with its order or revocation."""
        transfer_id, number = checks.check_write_result(request, caller_engine_id)
        att = self._find_held(transfer_id, number)
        if att is None:
            # The member that sent an order fences it, owner or not: it takes the answer while it holds the attempt.
            self._check_owner(transfer_id, "key.transfer_id")
            raise NotFound(f"transfer {transfer_id} attempt {number} is not known", reason=Reason.TRANSFER_NOT_FOUND, field="key")
        rank_key = (request.engine_id, att.p_incarnation, request.tp_rank, request.pp_rank)
        order = att.orders.get(rank_key) if request.engine_id == att.p_engine_id else None
        if order is None:
            raise invalid(f"rank tp {request.tp_rank} pp {request.pp_rank} of {request.engine_id} got no order for this attempt", "tp_rank")
        outcome = request.outcome
        if order.answer != a.UNANSWERED:
            if order.answer in (outcome, a.TIMED_OUT):
                return rv_pb.ReportWriteResultResponse(state=att.state)
            raise AlreadyExists(
                f"rank tp {request.tp_rank} pp {request.pp_rank} already reported {tr_pb.WriteOutcome.Name(order.answer)}",
                reason=Reason.CONFLICTING_DUPLICATE,
                field="outcome",
            )
        now = self._clock.now()
        order.answer = outcome
        att.bytes_written += request.bytes_written
        att.note(a.TL_WRITE_RESULT, now, f"{rank_name(rank_key)} {tr_pb.WriteOutcome.Name(outcome)}")
        if att.ended:
            self._machine.check_fenced(att, now)
        elif outcome == a.WRITTEN:
            if request.HasField("transfer_duration"):
                self.metrics.write_duration.observe(request.transfer_duration.ToTimedelta().total_seconds())
            self._machine.written(att, now)
        else:
            why = request.error_message[: self._config.max_text_length] or tr_pb.WriteOutcome.Name(outcome)
            self._machine.end(att, a.FAILED, request.reason or tr_pb.END_REASON_WRITE_FAILED, f"{rank_name(rank_key)}: {why}", now)
        return rv_pb.ReportWriteResultResponse(state=att.state)

    # ----- router and queries -----

    def cancel(self, key: tr_pb.TransferKey, caller_engine_id: str | None, detail: str = "") -> rv_pb.CancelTransferResponse:
        """Cancels an attempt (attempt 0: every attempt) for the router (caller_engine_id None) or an engine.

        An engine cancels as the role it registered with, and only attempts
        it is that role's engine of. Cancelling an attempt not seen yet
        records it as cancelled, so its late messages are refused; only the
        router's such cancel supersedes older attempts (an engine acts for
        itself only).
        """
        actor = actor_of(self._directory, caller_engine_id)
        caller_engine_id = caller_engine_id or ""
        validation.check_id(key.transfer_id, "key.transfer_id")
        validation.check_text(detail, "detail", self._config.max_text_length, required=False)
        transfer_id, number = key.transfer_id, key.attempt
        if number == 0 or self._find_held(transfer_id, number) is None:
            self._check_owner(transfer_id, "key.transfer_id")  # every attempt, or one it does not hold: the owner's
        record = self._store.record(transfer_id)
        now = self._clock.now()
        detail = detail or f"cancelled by {actor.name.lower()}"
        if number == 0:
            if record is None or not record.attempts:
                raise NotFound(f"transfer {transfer_id} is not known", reason=Reason.TRANSFER_NOT_FOUND, field="key.transfer_id")
            live = [att for att in record.attempts.values() if not att.ended]
            for live_att in live:
                authorize(live_att, actor, caller_engine_id)
            for live_att in live:
                self._machine.end(live_att, a.CANCELLED, actor.value, detail, now)
            latest = record.attempts[max(record.attempts)]
            return rv_pb.CancelTransferResponse(state=latest.state, fenced=all(att.fenced for att in record.attempts.values()))
        att = self._store.find(transfer_id, number)
        if att is None:
            if actor is not Actor.ROUTER and record is not None and number < record.newest:
                raise Aborted(f"attempt {record.newest} superseded attempt {number}", reason=Reason.TRANSFER_SUPERSEDED, field="key.attempt")
            att = self._store.create(transfer_id, number, now, tombstone=actor is not Actor.ROUTER)
            if actor is Actor.PREFILL:
                att.p_engine_id = caller_engine_id
            elif actor is Actor.DECODE:
                att.d_engine_id = caller_engine_id
            self._machine.end(att, a.CANCELLED, actor.value, detail, now)
            if actor is Actor.ROUTER:
                self._machine.supersede_older(att, now)
        elif not att.ended:
            authorize(att, actor, caller_engine_id)
            self._machine.end(att, a.CANCELLED, actor.value, detail, now)
        else:
            authorize(att, actor, caller_engine_id)
        return rv_pb.CancelTransferResponse(state=att.state, fenced=att.fenced)

    def get_transfer(self, transfer_id: str, attempt: int = 0) -> tr_pb.Transfer:
        """The attempt's record (attempt 0: the newest one remembered)."""
        validation.check_id(transfer_id, "transfer_id")
        if attempt == 0 or self._find_held(transfer_id, attempt) is None:
            self._check_owner(transfer_id, "transfer_id")
        record = self._store.record(transfer_id)
        att = None
        if record is not None and record.attempts:
            # Attempt 0 means the newest attempt; an engine's tombstone never is one.
            att = record.attempts.get(attempt or record.newest or max(record.attempts))
        if att is None:
            raise NotFound(f"transfer {transfer_id} attempt {attempt} is not known", reason=Reason.TRANSFER_NOT_FOUND, field="attempt" if record else "transfer_id")
        return self._messages.transfer(att)

    # ----- streams -----

    def subscribe_producer(self, request: rv_pb.StreamWriteOrdersRequest, caller_engine_id: str) -> Subscription[ProducerMailbox]:
        """Claims a producer rank's mailbox for one stream (replacing any earlier one) and queues everything still owed to it."""
        checks.check_caller(request.engine_id, caller_engine_id, "engine_id")
        self._mailboxes.check_open()
        info = self._planner.engine(request.engine_id, PREFILL, "engine_id", incarnation=request.incarnation, incarnation_field="incarnation", ready=False)
        if (request.tp_rank, request.pp_rank) not in info.positions:
            raise FailedPrecondition(
                f"rank tp {request.tp_rank} pp {request.pp_rank} of {request.engine_id} is not registered", reason=Reason.ENGINE_NOT_READY, field="tp_rank"
            )
        rank_key = (request.engine_id, request.incarnation, request.tp_rank, request.pp_rank)
        now = self._clock.now()
        mailbox = self._mailboxes.open_producer(rank_key, now)
        subscription = mailbox.claim()
        mailbox.early_orders = request.early_orders
        self._machine.resync_producer(mailbox, now)
        subscription.outbox.limit(self._config.outbox_capacity)  # the resync always fits; what follows may overflow
        return subscription

    def subscribe_decode(self, request: rv_pb.StreamTransferEventsRequest, caller_engine_id: str) -> Subscription[DecodeMailbox]:
        """Claims a decode engine's event mailbox for one stream and queues its recent final events and pending failures."""
        checks.check_caller(request.engine_id, caller_engine_id, "engine_id")
        self._mailboxes.check_open()
        self._planner.engine(request.engine_id, DECODE, "engine_id", incarnation=request.incarnation, incarnation_field="incarnation", ready=False)
        event_types = checks.event_types(request.event_types)
        subscription = self._mailboxes.open_decoder((request.engine_id, request.incarnation), self._clock.now()).claim(event_types)
        self._machine.resync_decode(subscription)
        subscription.outbox.limit(self._config.outbox_capacity)  # the resync always fits; what follows may overflow
        return subscription

    def unsubscribe(self, subscription: Subscription) -> None:
        """The stream of subscription ended (nothing more reaches its subscriber through it)."""
        subscription.mailbox.release(subscription, self._clock.now())

    def engine_streams(self) -> int:
        """How many engine streams (producer ranks' and decode engines') are attached now."""
        return self._mailboxes.attached_streams()

    def heartbeat(self) -> rv_pb.StreamWriteOrdersResponse:
        """A message that renews a producer's stream lease (the servicer sends it on quiet streams)."""
        return self._messages.heartbeat()

    @property
    def heartbeat_interval_s(self) -> float:
        return self._config.stream_lease_s / 3

    # ----- shards -----

    def watch_shards(self) -> Outbox:
        """An outbox that gets the shard map now and after every change; it closes when this member stops serving."""
        self._mailboxes.check_open()
        self.on_membership_change()
        self._ownership.check_serving()
        return self._shard_watches.open(self.membership)

    def unwatch_shards(self, outbox: Outbox) -> None:
        """The WatchShards stream of outbox ended."""
        self._shard_watches.release(outbox)

    def check_serving(self) -> None:
        """Refuses (UNAVAILABLE BROKER_SHARD_LOST) while this member is not serving."""
        self.on_membership_change()
        self._ownership.check_serving()

    def _find_held(self, transfer_id: str, number: int) -> Attempt | None:
        """The attempt if this member holds it, once any membership change is acted on.

        A member answers about the attempts it holds, owner or not (an
        identical repeat gets the recorded answer; an order's answer reaches
        the member that sent it); whatever would start an attempt, or is
        about one it does not hold or every attempt, is the owner's.
        """
        self.on_membership_change()
        return self._store.find(transfer_id, number)

    def _check_owner(self, transfer_id: str, field: str) -> None:
        """Acts on a membership change not acted on yet, then refuses a transfer this member may not serve."""
        self.on_membership_change()
        self._ownership.check(transfer_id, field)

    def on_membership_change(self) -> None:
        """Acts on a change of the shard map or of serving not acted on yet.

        Ends the live attempts this member no longer serves and sends the
        new map to its watchers; a member that stopped serving ends their
        streams instead (its map may be stale: they should watch another).
        """
        ownership = self._ownership
        if not ownership.refresh():
            return
        now = self._clock.now()
        me = ownership.membership.member_id
        for att in self._store.live_attempts():
            if not ownership.serving:
                self._machine.end(att, a.FAILED, tr_pb.END_REASON_BROKER_SHARD_LOST, f"broker member {me} lost its membership", now)
            elif not ownership.owns(att.transfer_id):
                owner = ownership.owner(att.transfer_id)
                self._machine.end(att, a.FAILED, tr_pb.END_REASON_BROKER_SHARD_MOVED, f"the transfer moved to broker member {owner}", now)
        if ownership.serving:
            self._shard_watches.changed(ownership.membership)
        else:
            self._shard_watches.close()

    # ----- engine loss, deadlines, shutdown -----

    def on_engine_removed(self, engine_id: str, incarnation: str, reason: str) -> None:
        """Ranks of an engine incarnation left: close their streams, fail its live attempts, re-check fencing."""
        now = self._clock.now()
        self._mailboxes.close_lost(engine_id, now)
        self._planner.forget(engine_id)
        for att in self._store.of_engine(engine_id):
            if att.ended:
                self._machine.check_fenced(att, now)
            elif att.p_engine_id == engine_id and att.p_incarnation == incarnation:
                self._machine.end(att, a.FAILED, tr_pb.END_REASON_PREFILL_ENGINE_LOST, f"prefill engine {engine_id} lost ranks: {reason}", now)
            elif att.d_engine_id == engine_id and att.d_incarnation == incarnation:
                self._machine.end(att, a.FAILED, tr_pb.END_REASON_DECODE_ENGINE_LOST, f"decode engine {engine_id} lost ranks: {reason}", now)

    def tick(self) -> float | None:
        """Fails attempts past their deadline, fences those past their bound, forgets old settled ones; returns the next time to run."""
        now = self._clock.now()
        for att in self._store.due(now):
            if not att.ended and att.deadline <= now:
                if att.dest_deadline <= att.src_deadline:
                    reason, side = tr_pb.END_REASON_REGISTRATION_DEADLINE_EXCEEDED, "decode"
                else:
                    reason, side = tr_pb.END_REASON_PREFILL_DEADLINE_EXCEEDED, "prefill"
                self.metrics.expiries.inc()
                self._machine.end(att, a.FAILED, reason, f"the {side} side's deadline passed", now)
            elif att.ended and not att.fenced:
                self._machine.check_fenced(att, now)
        self._store.forget_retained(now)
        # A closed producer mailbox is forgotten once nothing sent through it can still be acted on.
        self._mailboxes.prune(now - self._config.startup_grace_s)
        return self._store.next_time()

    def close(self) -> None:
        """Ends every subscription and shard watch (the streams finish); later ones are refused."""
        self._mailboxes.close(self._clock.now())
        self._shard_watches.close()
