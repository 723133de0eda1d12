# SPDX-License-Identifier: Apache-2.0
"""The rendezvous broker's grpc-free core: a state machine over transfer attempts.

The decode side's RegisterDestination and the prefill side's
ReportPrefillDone arrive in either order (one arrival path, parameterized by
side); the broker then sends WriteOrders to the producer ranks (early orders,
without source, as soon as the destination is known, to ranks that asked for
them), collects their write results and tells both sides how it ended.

Fencing (docs/design.md): an attempt that ends without completing revokes
every unanswered order and counts as fenced once each ordered rank answered
or its fencing bound passed — min(budget end, stream lease end) + write
timeout + margin, after which the rank can no longer post nor have a WRITE
in flight. Only then does the decode engine get TransferEvent{ENDED} (FAILED
before that) and may reuse its blocks. A new broker fences nothing for its
first startup_grace_s: a predecessor's orders may still be acted on.

The core reads time only from its Clock and never sleeps: tick() ends
attempts whose deadline passed, fences those whose bound passed, forgets
settled attempts after retention, and returns when it next needs to run.
"""

from __future__ import annotations

import enum
import heapq
import logging
from collections import deque
from collections.abc import Callable

from opentelemetry import trace
from opentelemetry.context import Context

from kvpush.errors import (
    Aborted,
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    KvpushError,
    NotFound,
    PermissionDenied,
    Reason,
    ResourceExhausted,
    Unavailable,
)
from kvpush.rendezvous.v1 import rendezvous_service_pb2 as rv_pb
from kvpush.rendezvous.v1 import transfer_pb2 as tr_pb
from kvpush.services.broker import attempts as a
from kvpush.services.broker.attempts import Attempt, OrderRecord, RankKey, TransferRecord, rank_name
from kvpush.services.broker.config import BrokerConfig
from kvpush.services.broker.mailboxes import DecodeKey, DecodeMailbox, ProducerMailbox, Subscription
from kvpush.services.broker.metrics import BrokerMetrics
from kvpush.services.broker.plans import DECODE, PREFILL, EngineDirectory, Planner, check_blocks, invalid
from kvpush.services.broker.tracing import RendezvousTracing
from kvpush.services.common import validation
from kvpush.services.common.clock import Clock, timestamp

logger = logging.getLogger(__name__)

_OUTCOMES = frozenset(tr_pb.WriteOutcome.values()) - {0}
_END_REASONS = frozenset(tr_pb.EndReason.values()) - {0}
# How many final events a decode engine's new stream gets again.
_RESYNC_EVENTS = 4096


class Actor(enum.Enum):
    """Who cancels a transfer; the value is the EndReason it ends with."""

    ROUTER = tr_pb.END_REASON_CANCELLED_BY_ROUTER
    PREFILL = tr_pb.END_REASON_CANCELLED_BY_PREFILL
    DECODE = tr_pb.END_REASON_CANCELLED_BY_DECODE


def _identity_mismatch(field: str, named: str, caller: str) -> PermissionDenied:
    return PermissionDenied(f"the caller is {caller!r}, not engine {named!r}", reason=Reason.ENGINE_IDENTITY_MISMATCH, field=field)


def _check_caller(engine_id: str, caller_engine_id: str, field: str) -> None:
    """engine_id must be the caller's (an authenticated, hence well-formed, id)."""
    if engine_id == caller_engine_id and engine_id:
        return
    validation.check_id(engine_id, field)
    raise _identity_mismatch(field, engine_id, caller_engine_id)


def _check_key(key: tr_pb.TransferKey) -> tuple[str, int]:
    validation.check_id(key.transfer_id, "key.transfer_id")
    if key.attempt == 0:
        raise InvalidArgument("key.attempt counts from 1", reason=Reason.FIELD_REQUIRED, field="key.attempt")
    return key.transfer_id, key.attempt


def _same_arrival(held, request, side: int) -> bool:
    if side == a.DECODE_SIDE:
        return (held.destination == request.destination and held.prefill_engine_id == request.prefill_engine_id
                and held.client_request_id == request.client_request_id)
    return held.source == request.source and held.decode_engine_id == request.decode_engine_id and held.client_request_id == request.client_request_id


class BrokerCore:
    """The broker's state machine. Not thread-safe: call it from one thread (the event loop)."""

    def __init__(
        self,
        directory: EngineDirectory,
        config: BrokerConfig,
        clock: Clock,
        *,
        metrics: BrokerMetrics | None = None,
        tracer_provider: trace.TracerProvider | None = None,
    ):
        self._directory = directory
        self._config = config
        self._clock = clock
        self._planner = Planner(directory)
        self._tracing = RendezvousTracing(tracer_provider)
        self.metrics = metrics if metrics is not None else BrokerMetrics()
        self._grace_end = clock.now() + config.startup_grace_s
        self._order_lease = config.stream_lease_s - config.max_clock_skew_s
        self._transfers: dict[str, TransferRecord] = {}
        # Deadlines and fencing bounds, one heap; an entry only says "look at this attempt then".
        self._timers: list[tuple[float, int, Attempt]] = []
        self._timer_seq = 0
        self._settled: deque[tuple[float, Attempt]] = deque()  # in settle order, so in time order
        self._state_counts = [0] * (max(tr_pb.TransferState.values()) + 1)
        self._unsettled = 0
        # Attempts not yet settled, by the engines they involve (engine loss, resyncs); dicts as
        # ordered sets, so every walk over them is in arrival order (a simulation replays exactly).
        self._by_engine: dict[str, dict[Attempt, None]] = {}
        self._producers: dict[RankKey, ProducerMailbox] = {}
        self._decoders: dict[DecodeKey, DecodeMailbox] = {}
        self._wakeup: Callable[[float], None] | None = None
        self._end_listeners: list[Callable[[str, int], None]] = []
        self._closed = False
        directory.add_removal_listener(self.on_engine_removed)
        counts = self._state_counts
        self.metrics.read_gauges_from(
            lambda: counts[a.WAITING_FOR_PREFILL],
            lambda: counts[a.WAITING_FOR_REGISTRATION],
            lambda: sum(counts[s] for s in a.LIVE),
        )

    # ----- counts and hooks -----

    @property
    def live_attempts(self) -> int:
        """Attempts not yet in a terminal state."""
        return sum(self._state_counts[s] for s in a.LIVE)

    @property
    def unsettled_attempts(self) -> int:
        """Attempts live or ended but not yet fenced."""
        return self._unsettled

    @property
    def remembered_attempts(self) -> int:
        """Attempts held in memory (unsettled plus settled within retention)."""
        return self._unsettled + len(self._settled)

    @property
    def memory_sizes(self) -> dict[str, int]:
        """Sizes of every table the core keeps (for leak checks: all bounded)."""
        return {
            "transfers": len(self._transfers),
            "remembered_attempts": self.remembered_attempts,
            "timers": len(self._timers),
            "engines_indexed": len(self._by_engine),
            "producer_mailboxes": len(self._producers),
            "decode_mailboxes": len(self._decoders),
            "engine_infos": self._planner.cached_engines,
        }

    def set_wakeup(self, wakeup: Callable[[float], None]) -> None:
        """wakeup(t) is called when tick() must run at t, earlier than it last said."""
        self._wakeup = wakeup

    def add_end_listener(self, listener: Callable[[str, int], None]) -> None:
        """listener(transfer_id, attempt) is called whenever an attempt reaches a terminal state."""
        self._end_listeners.append(listener)

    def newest_attempt(self, transfer_id: str) -> int:
        """The newest attempt number seen for transfer_id (0: none remembered)."""
        record = self._transfers.get(transfer_id)
        return record.newest if record is not None else 0

    def is_ended(self, transfer_id: str, attempt: int) -> bool:
        """True when the attempt is remembered in a terminal state."""
        att = self._find(transfer_id, attempt)
        return att is not None and att.ended

    @property
    def _vouching(self) -> bool:
        """Whether this broker may say "fenced" of what it holds no record of (past its startup grace)."""
        return self._clock.now() >= self._grace_end

    # ----- arrivals: the decode side's registration, the prefill side's prefill-done -----

    def register_destination(self, request: rv_pb.RegisterDestinationRequest, caller_engine_id: str, parent: Context | None = None) -> rv_pb.RegisterDestinationResponse:
        """Registers the decode side's blocks; see RendezvousService.RegisterDestination.

        A refusal carries ErrorInfo metadata "fenced": "true" when no WRITE
        can ever land in the blocks it named, so the decode side may reuse
        them at once; the broker then remembers the refusal until the
        request's deadline, so a late copy of it is refused too.
        """
        try:
            att = self._arrive(a.DECODE_SIDE, request, caller_engine_id, parent)
        except KvpushError as error:
            error.metadata["fenced"] = "true" if self._refusal_fenced(request, caller_engine_id, error) else "false"
            raise
        response = rv_pb.RegisterDestinationResponse(
            state=att.state, first_arrival=att.first_arrival, expected_notifications=att.plan.expected, fenced=self._answer_fenced(att)
        )
        self._put_deadline(response, att)
        return response

    def report_prefill_done(self, request: rv_pb.ReportPrefillDoneRequest, caller_engine_id: str, parent: Context | None = None) -> rv_pb.ReportPrefillDoneResponse:
        """Records that the prefill side holds the KV; see RendezvousService.ReportPrefillDone."""
        att = self._arrive(a.PREFILL_SIDE, request, caller_engine_id, parent)
        response = rv_pb.ReportPrefillDoneResponse(state=att.state, first_arrival=att.first_arrival)
        self._put_deadline(response, att)
        return response

    def _arrive(self, side: int, request, caller_engine_id: str, parent: Context | None) -> Attempt:
        decode = side == a.DECODE_SIDE
        transfer_id, number = _check_key(request.key)
        mine_field = "destination" if decode else "source"
        if not request.HasField(mine_field):
            raise InvalidArgument(f"{mine_field} is required", reason=Reason.FIELD_REQUIRED, field=mine_field)
        mine = request.destination if decode else request.source
        _check_caller(mine.engine_id, caller_engine_id, f"{mine_field}.engine_id")
        now = self._clock.now()

        att = self._find(transfer_id, number)
        if att is not None:
            held = att.dest if decode else att.src
            if held is not None:
                if not _same_arrival(held, request, side):
                    raise self._ended_error(att) if att.ended else self._conflict(att, "RegisterDestination" if decode else "ReportPrefillDone")
                if att.rejection is not None and att.rejection[0] == side:
                    raise att.rejection[1]
                return att  # an identical repeat gets the same answer
            late_prefill_done = not decode and att.state == a.DONE
            if att.ended and not late_prefill_done:
                raise self._ended_error(att)

        # Checks that depend on the engines and the request's content.
        my_info = self._planner.engine(
            mine.engine_id, DECODE if decode else PREFILL, f"{mine_field}.engine_id", incarnation=mine.incarnation, incarnation_field=f"{mine_field}.incarnation"
        )
        validation.check_text(request.client_request_id, "client_request_id", self._config.max_text_length, required=False)
        peer_id, peer_field = (request.prefill_engine_id, "prefill_engine_id") if decode else (request.decode_engine_id, "decode_engine_id")
        plan = peer_info = None
        if decode or peer_id:
            peer_info = self._planner.engine(peer_id, PREFILL if decode else DECODE, peer_field)
            plan = self._planner.plan(peer_info, my_info, peer_field) if decode else self._planner.plan(my_info, peer_info, peer_field)
        check_blocks(mine.blocks, my_info, mine.num_tokens, mine.first_token if decode else 0, mine_field)
        deadline = now + validation.positive_seconds(request.timeout, "timeout", self._config.max_timeout_s)
        write_timeout = 0.0
        if decode:
            deadline = min(deadline, self._requested_deadline(request, now))
            if deadline <= now:
                raise FailedPrecondition("the registration's deadline has passed", reason=Reason.DEADLINE_PASSED, field="deadline")
            write_timeout = self._write_timeout(request)

        if att is None:
            att = self._attempt_for(transfer_id, number, now)
        other = att.src if decode else att.dest
        if other is not None:
            self._check_sides_agree(att, request, side)
        if not decode and att.state == a.DONE:
            # Early orders let every producer rank write before rank 0's
            # report arrived: the report is late, not wrong.
            self._check_token_counts(att, mine, att.dest.destination, side, now)
            att.src, att.rejection = request, None  # an earlier refused report is not this one's answer
            att.note(a.TL_PREFILL_DONE, now, mine.engine_id)
            return att

        created = att.state == a.NEW
        if decode:
            att.dest = request
            att.write_timeout = write_timeout
            att.dest_deadline = deadline
            att.keep_until = max(att.keep_until, deadline)
            att.note(a.TL_REGISTERED, now, mine.engine_id)
        else:
            att.src = request
            att.src_deadline = deadline
            att.note(a.TL_PREFILL_DONE, now, mine.engine_id)
        if not att.client_request_id:
            att.client_request_id = request.client_request_id
        if decode:
            self._bind_decode(att, mine.engine_id, mine.incarnation)
            self._bind_prefill(att, peer_id, peer_info.engine.incarnation, peer_info.rank_keys)
            att.plan = plan
        else:
            self._bind_prefill(att, mine.engine_id, mine.incarnation, my_info.rank_keys)
            if plan is not None:
                self._bind_decode(att, peer_id, plan.decode_engine.incarnation)
        self._set_deadline(att, min(att.dest_deadline, att.src_deadline))

        if other is None:
            att.first_arrival = side
            att.first_time = now
            self._set_state(att, a.WAITING_FOR_PREFILL if decode else a.WAITING_FOR_REGISTRATION)
            self._tracing.first_arrival(att, parent, "decode" if decode else "prefill", now)
            if decode:
                self._send_orders(att, now, full=False)
            if created:
                self._supersede_older(att, now)
            return att
        src, dest = (att.src.source, mine) if decode else (mine, att.dest.destination)
        self._check_token_counts(att, src, dest, side, now)
        self._match(att, parent, now)
        return att

    def _requested_deadline(self, request: rv_pb.RegisterDestinationRequest, now: float) -> float:
        """The decode engine's own deadline on this broker's monotonic clock, less the skew allowance (inf if unset)."""
        if not request.HasField("deadline"):
            return float("inf")
        wall = request.deadline.seconds + request.deadline.nanos * 1e-9
        return now + (wall - self._clock.wall()) - self._config.max_clock_skew_s

    def _write_timeout(self, request: rv_pb.RegisterDestinationRequest) -> float:
        """The write timeout of the attempt's orders: the broker's, shortened to fit the decode side's hold margin."""
        cfg = self._config
        if not request.HasField("hold_margin"):
            return cfg.write_timeout_s
        margin = validation.positive_seconds(request.hold_margin, "hold_margin", cfg.max_timeout_s)
        fits = margin - cfg.fence_margin_s
        if fits < min(cfg.write_timeout_s, 0.1):
            raise InvalidArgument(
                f"hold_margin {margin:g}s leaves no time for a WRITE: it must exceed the broker's fence margin {cfg.fence_margin_s:g}s "
                f"by at least {min(cfg.write_timeout_s, 0.1):g}s",
                reason=Reason.FIELD_OUT_OF_RANGE,
                field="hold_margin",
            )
        return min(cfg.write_timeout_s, fits)

    def _check_sides_agree(self, att: Attempt, request, side: int) -> None:
        """The second arrival must name the engines the first one did."""
        if side == a.DECODE_SIDE:
            dest, src = request.destination, att.src.source
            if src.engine_id != request.prefill_engine_id:
                raise invalid(f"prefill-done for this attempt came from engine {src.engine_id!r}", "prefill_engine_id")
            if att.d_engine_id and att.d_engine_id != dest.engine_id:
                raise invalid(f"the prefill side named decode engine {att.d_engine_id!r}", "destination.engine_id")
            if att.d_incarnation and att.d_incarnation != dest.incarnation:
                raise FailedPrecondition(
                    "the decode engine restarted since the prefill side named it", reason=Reason.INCARNATION_MISMATCH, field="destination.incarnation"
                )
            return
        src, dest_req = request.source, att.dest
        if dest_req.prefill_engine_id != src.engine_id:
            raise invalid(f"the decode side registered for prefill engine {dest_req.prefill_engine_id!r}", "source.engine_id")
        if att.p_incarnation != src.incarnation:
            raise FailedPrecondition(
                "the prefill engine restarted since the decode side registered", reason=Reason.INCARNATION_MISMATCH, field="source.incarnation"
            )
        if request.decode_engine_id and request.decode_engine_id != dest_req.destination.engine_id:
            raise invalid(f"decode engine {dest_req.destination.engine_id!r} registered for this attempt", "decode_engine_id")

    def _check_token_counts(self, att: Attempt, src: tr_pb.Source, dest: tr_pb.Destination, second: int, now: float) -> None:
        """The rendezvous completes only if P computed every token D wants; else both sides fail."""
        needed = dest.first_token + dest.num_tokens
        if src.num_tokens >= needed:
            return
        field = "destination.num_tokens" if second == a.DECODE_SIDE else "source.num_tokens"
        error = FailedPrecondition(
            f"the prefill side computed {src.num_tokens} tokens; the destination needs {needed}", reason=Reason.TOKEN_COUNT_MISMATCH, field=field
        )
        att.rejection = (second, error)
        if not att.ended:
            self._end(att, a.FAILED, tr_pb.END_REASON_TOKEN_COUNT_MISMATCH, error.message, now)
        raise error

    def _bind_decode(self, att: Attempt, engine_id: str, incarnation: str) -> None:
        if not att.d_engine_id:
            att.d_engine_id = engine_id
            self._index(att, engine_id)
        att.d_incarnation = incarnation

    def _bind_prefill(self, att: Attempt, engine_id: str, incarnation: str, rank_keys: tuple[RankKey, ...]) -> None:
        if not att.p_engine_id:
            att.p_engine_id, att.p_incarnation, att.p_ranks = engine_id, incarnation, rank_keys
            self._index(att, engine_id)

    # ----- refusals the decode side may act on -----

    def _refusal_fenced(self, request: rv_pb.RegisterDestinationRequest, caller: str, error: KvpushError) -> bool:
        """Whether a refused registration's blocks can never be written; remembers the refusal until its deadline."""
        if not self._vouching:
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
        att = self._find(key.transfer_id, key.attempt)
        if att is not None:
            if att.dest is not None and _same_arrival(att.dest, request, a.DECODE_SIDE):
                return att.fenced  # this very registration is held (a repeat of a refused second arrival)
            att.keep_until = max(att.keep_until, keep_until)
            return True
        record = self._transfers.get(key.transfer_id)
        try:
            att = self._attempt_for(key.transfer_id, key.attempt, now, tombstone=True)
        except KvpushError:
            return False  # cannot remember the refusal: the blocks wait for their deadline
        superseded = record is not None and key.attempt < record.newest
        att.keep_until = keep_until
        att.d_engine_id, att.d_incarnation = caller, request.destination.incarnation
        if superseded:
            self._end(att, a.SUPERSEDED, tr_pb.END_REASON_SUPERSEDED, f"attempt {record.newest} superseded it", now)
        else:
            self._end(att, a.FAILED, tr_pb.END_REASON_REGISTRATION_REFUSED, error.message[: self._config.max_text_length], now)
            self._supersede_older(att, now)
        return True

    @staticmethod
    def _answer_fenced(att: Attempt) -> bool:
        """Whether the decode side of an ended attempt may reuse its blocks now."""
        return att.fenced and att.state != a.DONE

    # ----- producer ranks -----

    def report_write_result(self, request: rv_pb.ReportWriteResultRequest, caller_engine_id: str) -> rv_pb.ReportWriteResultResponse:
        """Records what a producer rank did with its order or revocation."""
        transfer_id, number = _check_key(request.key)
        _check_caller(request.engine_id, caller_engine_id, "engine_id")
        validation.check_enum(request.outcome, _OUTCOMES, "outcome")
        if request.reason and request.reason not in _END_REASONS:
            raise invalid(f"reason has unknown value {request.reason}", "reason")
        att = self._find(transfer_id, number)
        if att is None:
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
            self._check_fenced(att, now)
        elif outcome == a.WRITTEN:
            if request.HasField("transfer_duration"):
                self.metrics.write_duration.observe(request.transfer_duration.ToTimedelta().total_seconds())
            att.written += 1
            if att.plan is not None and att.written == len(att.plan.orders):
                self._complete(att, now)
            elif att.state != a.WRITING:
                self._set_state(att, a.WRITING)
        else:
            why = request.error_message[: self._config.max_text_length] or tr_pb.WriteOutcome.Name(outcome)
            self._end(att, a.FAILED, request.reason or tr_pb.END_REASON_WRITE_FAILED, f"{rank_name(rank_key)}: {why}", now)
        return rv_pb.ReportWriteResultResponse(state=att.state)

    # ----- router and queries -----

    def cancel(self, key: tr_pb.TransferKey, actor: Actor, detail: str = "", caller_engine_id: str = "") -> rv_pb.CancelTransferResponse:
        """Cancels an attempt (attempt 0: every attempt) on behalf of actor.

        A prefill or decode actor must be the attempt's engine of that role
        (caller_engine_id). Cancelling an attempt not seen yet records it as
        cancelled, so its late messages are refused; only the router's such
        cancel supersedes older attempts (an engine acts for itself only).
        """
        validation.check_id(key.transfer_id, "key.transfer_id")
        validation.check_text(detail, "detail", self._config.max_text_length, required=False)
        transfer_id, number = key.transfer_id, key.attempt
        record = self._transfers.get(transfer_id)
        now = self._clock.now()
        detail = detail or f"cancelled by {actor.name.lower()}"
        if number == 0:
            if record is None or not record.attempts:
                raise NotFound(f"transfer {transfer_id} is not known", reason=Reason.TRANSFER_NOT_FOUND, field="key.transfer_id")
            live = [att for att in record.attempts.values() if not att.ended]
            for att in live:
                self._authorize_cancel(att, actor, caller_engine_id)
            for att in live:
                self._end(att, a.CANCELLED, actor.value, detail, now)
            latest = record.attempts[max(record.attempts)]
            return rv_pb.CancelTransferResponse(state=latest.state, fenced=all(att.fenced for att in record.attempts.values()))
        att = self._find(transfer_id, number)
        if att is None:
            if actor is not Actor.ROUTER and record is not None and number < record.newest:
                raise Aborted(f"attempt {record.newest} superseded attempt {number}", reason=Reason.TRANSFER_SUPERSEDED, field="key.attempt")
            att = self._attempt_for(transfer_id, number, now, tombstone=actor is not Actor.ROUTER)
            if actor is Actor.PREFILL:
                att.p_engine_id = caller_engine_id
            elif actor is Actor.DECODE:
                att.d_engine_id = caller_engine_id
            self._end(att, a.CANCELLED, actor.value, detail, now)
            if actor is Actor.ROUTER:
                self._supersede_older(att, now)
        elif not att.ended:
            self._authorize_cancel(att, actor, caller_engine_id)
            self._end(att, a.CANCELLED, actor.value, detail, now)
        else:
            self._authorize_cancel(att, actor, caller_engine_id)
        return rv_pb.CancelTransferResponse(state=att.state, fenced=att.fenced)

    def _authorize_cancel(self, att: Attempt, actor: Actor, caller_engine_id: str) -> None:
        named = att.p_engine_id if actor is Actor.PREFILL else att.d_engine_id if actor is Actor.DECODE else ""
        if actor is not Actor.ROUTER and named != caller_engine_id:
            raise _identity_mismatch("key", named or "(none)", caller_engine_id)

    def get_transfer(self, transfer_id: str, attempt: int = 0) -> tr_pb.Transfer:
        """The attempt's record (attempt 0: the newest one remembered)."""
        validation.check_id(transfer_id, "transfer_id")
        record = self._transfers.get(transfer_id)
        att = None
        if record is not None and record.attempts:
            # Attempt 0 means the newest attempt; an engine's tombstone never is one.
            att = record.attempts.get(attempt or record.newest or max(record.attempts))
        if att is None:
            raise NotFound(f"transfer {transfer_id} attempt {attempt} is not known", reason=Reason.TRANSFER_NOT_FOUND, field="attempt" if record else "transfer_id")
        wall_offset = self._clock.wall() - self._clock.now()
        transfer = tr_pb.Transfer(
            key=att.key,
            client_request_id=att.client_request_id,
            state=att.state,
            prefill_engine_id=att.p_engine_id,
            decode_engine_id=att.d_engine_id,
            first_arrival=att.first_arrival,
            end_reason=att.end_reason,
            detail=att.detail,
            fenced=att.fenced,
            bytes_written=att.bytes_written,
        )
        if att.deadline != float("inf"):
            transfer.deadline.CopyFrom(timestamp(att.deadline + wall_offset))
        for kind, when, detail in att.timeline:
            transfer.timeline.add(kind=kind, time=timestamp(when + wall_offset), detail=detail)
        return transfer

    # ----- streams -----

    def subscribe_producer(self, request: rv_pb.StreamWriteOrdersRequest, caller_engine_id: str) -> Subscription:
        """Claims a producer rank's mailbox for one stream (replacing any earlier one) and queues everything still owed to it."""
        _check_caller(request.engine_id, caller_engine_id, "engine_id")
        self._check_open()
        info = self._planner.engine(request.engine_id, PREFILL, "engine_id", incarnation=request.incarnation, incarnation_field="incarnation", ready=False)
        if (request.tp_rank, request.pp_rank) not in info.positions:
            raise FailedPrecondition(
                f"rank tp {request.tp_rank} pp {request.pp_rank} of {request.engine_id} is not registered", reason=Reason.ENGINE_NOT_READY, field="tp_rank"
            )
        rank_key = (request.engine_id, request.incarnation, request.tp_rank, request.pp_rank)
        now = self._clock.now()
        mailbox = self._producer_mailbox(rank_key, now)
        subscription = mailbox.claim()
        mailbox.early_orders = request.early_orders
        for att in list(self._by_engine.get(request.engine_id, ())):
            if att.p_engine_id != request.engine_id or att.p_incarnation != request.incarnation:
                continue
            order = att.orders.get(rank_key)
            if order is not None and order.answer == a.UNANSWERED:
                mailbox.put(self._revocation(att) if att.ended else self._order_message(att, rank_key, now, full=not order.early))
            elif order is None and att.state == a.WAITING_FOR_PREFILL and request.early_orders:
                self._send_orders(att, now, full=False)
            if att.ended:
                mailbox.put(self._closed_message(att))
        subscription.outbox.limit(self._config.outbox_capacity)  # the resync always fits; what follows may overflow
        return subscription

    def subscribe_decode(self, request: rv_pb.StreamTransferEventsRequest, caller_engine_id: str) -> Subscription:
        """Claims a decode engine's event mailbox for one stream and queues its recent final events and pending failures."""
        _check_caller(request.engine_id, caller_engine_id, "engine_id")
        self._check_open()
        self._planner.engine(request.engine_id, DECODE, "engine_id", incarnation=request.incarnation, incarnation_field="incarnation", ready=False)
        key = (request.engine_id, request.incarnation)
        now = self._clock.now()
        mailbox = self._decoders.get(key)
        if mailbox is None or mailbox.closed:
            mailbox = self._decoders[key] = DecodeMailbox(key, now, _RESYNC_EVENTS)
        subscription = mailbox.claim()
        for message in mailbox.recent:
            subscription.outbox.put(message)
        for att in self._by_engine.get(request.engine_id, ()):
            if att.ended and att.dest is not None and att.d_incarnation == request.incarnation:
                subscription.outbox.put(self._event(att, tr_pb.TRANSFER_EVENT_TYPE_FAILED))
        subscription.outbox.limit(self._config.outbox_capacity)  # the resync always fits; what follows may overflow
        return subscription

    def unsubscribe(self, subscription: Subscription) -> None:
        """The stream of subscription ended (nothing more reaches its subscriber through it)."""
        subscription.mailbox.release(subscription, self._clock.now())

    def heartbeat(self) -> rv_pb.StreamWriteOrdersResponse:
        """A message that renews a producer's stream lease (the servicer sends it on quiet streams)."""
        return rv_pb.StreamWriteOrdersResponse(
            heartbeat=rv_pb.StreamHeartbeat(), send_time=timestamp(self._clock.wall()), stream_lease=validation.duration(self._order_lease)
        )

    @property
    def heartbeat_interval_s(self) -> float:
        return self._config.stream_lease_s / 3

    def _check_open(self) -> None:
        if self._closed:
            raise Unavailable("the broker is shutting down", reason=Reason.UNAVAILABLE)

    def _producer_mailbox(self, rank_key: RankKey, now: float) -> ProducerMailbox:
        mailbox = self._producers.get(rank_key)
        if mailbox is None or mailbox.closed:
            mailbox = self._producers[rank_key] = ProducerMailbox(rank_key, now)
        return mailbox

    # ----- engine loss, deadlines, shutdown -----

    def on_engine_removed(self, engine_id: str, incarnation: str, reason: str) -> None:
        """Ranks of an engine incarnation left: close their streams, fail its live attempts, re-check fencing."""
        now = self._clock.now()
        for key, mailbox in self._producers.items():
            if key[0] == engine_id and not mailbox.closed and self._planner.rank_lost(key):
                mailbox.close(now)
        for key in [k for k in self._decoders if k[0] == engine_id and self._planner.engine_lost(*k)]:
            self._decoders.pop(key).close(now)
        self._planner.forget(engine_id)
        for att in list(self._by_engine.get(engine_id, ())):
            if att.ended:
                self._check_fenced(att, now)
            elif att.p_engine_id == engine_id and att.p_incarnation == incarnation:
                self._end(att, a.FAILED, tr_pb.END_REASON_PREFILL_ENGINE_LOST, f"prefill engine {engine_id} lost ranks: {reason}", now)
            elif att.d_engine_id == engine_id and att.d_incarnation == incarnation:
                self._end(att, a.FAILED, tr_pb.END_REASON_DECODE_ENGINE_LOST, f"decode engine {engine_id} lost ranks: {reason}", now)

    def tick(self) -> float | None:
        """Fails attempts past their deadline, fences those past their bound, forgets old settled ones; returns the next time to run."""
        now = self._clock.now()
        timers = self._timers
        while timers and timers[0][0] <= now:
            _, _, att = heapq.heappop(timers)
            if not att.ended and att.deadline <= now:
                if att.dest_deadline <= att.src_deadline:
                    reason, side = tr_pb.END_REASON_REGISTRATION_DEADLINE_EXCEEDED, "decode"
                else:
                    reason, side = tr_pb.END_REASON_PREFILL_DEADLINE_EXCEEDED, "prefill"
                self.metrics.expiries.inc()
                self._end(att, a.FAILED, reason, f"the {side} side's deadline passed", now)
            elif att.ended and not att.fenced:
                self._check_fenced(att, now)
        settled, cfg = self._settled, self._config
        while settled:
            settled_at, att = settled[0]
            old = settled_at <= now - cfg.retention_s or len(settled) > cfg.max_retained_attempts
            if not old or att.keep_until > now:
                break
            settled.popleft()
            self._forget(att)
        self._prune_mailboxes(now)
        next_time = timers[0][0] if timers else None
        if settled:
            forget_at = max(settled[0][0] + cfg.retention_s, settled[0][1].keep_until)
            next_time = forget_at if next_time is None else min(next_time, forget_at)
        return next_time

    def _prune_mailboxes(self, now: float) -> None:
        """Forgets closed producer mailboxes once nothing sent through them can still be acted on."""
        horizon = now - self._config.startup_grace_s
        for key in [k for k, m in self._producers.items() if m.closed and m.quiet_since < horizon]:
            del self._producers[key]

    def close(self) -> None:
        """Ends every subscription (the streams finish); later subscriptions are refused."""
        self._closed = True
        now = self._clock.now()
        for mailbox in (*self._producers.values(), *self._decoders.values()):
            if mailbox.subscriber is not None:
                mailbox.subscriber.outbox.close()
                mailbox.release(mailbox.subscriber, now)

    # ----- attempt lifecycle -----

    def _find(self, transfer_id: str, number: int) -> Attempt | None:
        record = self._transfers.get(transfer_id)
        return record.attempts.get(number) if record is not None else None

    def _attempt_for(self, transfer_id: str, number: int, now: float, *, tombstone: bool = False) -> Attempt:
        """A new attempt; it must be the newest yet unless it is a tombstone (a refusal remembered), which never becomes the newest."""
        record = self._transfers.get(transfer_id)
        if record is not None and not tombstone:
            if number < record.newest:
                raise Aborted(f"attempt {record.newest} superseded attempt {number}", reason=Reason.TRANSFER_SUPERSEDED, field="key.attempt")
            if number == record.newest:
                raise FailedPrecondition(f"transfer {transfer_id} attempt {number} ended and was forgotten", reason=Reason.TRANSFER_ENDED, field="key")
        cfg = self._config
        if self._unsettled >= cfg.max_unsettled_attempts or len(self._settled) >= cfg.max_retained_attempts + cfg.max_unsettled_attempts:
            raise ResourceExhausted(f"the broker holds {self.remembered_attempts} attempts, its limit", reason=Reason.TOO_MANY_TRANSFERS, field="key")
        if record is None:
            record = self._transfers[transfer_id] = TransferRecord(transfer_id)
        att = Attempt(transfer_id, number, now)
        record.attempts[number] = att
        if not tombstone:
            record.newest = max(record.newest, number)
        self._unsettled += 1
        self._state_counts[a.NEW] += 1
        return att

    def _supersede_older(self, att: Attempt, now: float) -> None:
        """A new attempt supersedes every older live one of its transfer."""
        record = self._transfers[att.transfer_id]
        record.newest = max(record.newest, att.number)
        for older in list(record.attempts.values()):
            if older.number < att.number and not older.ended:
                self.metrics.supersessions.inc()
                self._end(older, a.SUPERSEDED, tr_pb.END_REASON_SUPERSEDED, f"attempt {att.number} superseded it", now)

    def _set_state(self, att: Attempt, state: int) -> None:
        counts = self._state_counts
        counts[att.state] -= 1
        counts[state] += 1
        att.state = state

    def _schedule(self, att: Attempt, when: float) -> None:
        self._timer_seq += 1
        heap = self._timers
        heapq.heappush(heap, (when, self._timer_seq, att))
        if heap[0][2] is att and self._wakeup is not None:
            self._wakeup(when)

    def _set_deadline(self, att: Attempt, deadline: float) -> None:
        if deadline != att.deadline:
            att.deadline = deadline
            self._schedule(att, deadline)

    def _index(self, att: Attempt, engine_id: str) -> None:
        attempts = self._by_engine.get(engine_id)
        if attempts is None:
            attempts = self._by_engine[engine_id] = {}
        attempts[att] = None

    def _match(self, att: Attempt, parent: Context | None, now: float) -> None:
        """Both sides are in: end the rendezvous span and order every producer rank not yet ordered."""
        if att.state != a.WRITING:
            self._set_state(att, a.MATCHED)
        self._tracing.matched(att, parent)
        self.metrics.rendezvous.inc()
        self.metrics.rendezvous_wait.observe(now - att.first_time)
        self._send_orders(att, now, full=True)

    def _send_orders(self, att: Attempt, now: float, *, full: bool) -> None:
        """Sends one order to each producer rank not yet ordered (early: only to ranks with an early-order stream)."""
        sent = 0
        for rank_key, _ in att.plan.orders:
            if rank_key in att.orders:
                continue
            mailbox = self._producers.get(rank_key)
            if not full and (mailbox is None or mailbox.closed or mailbox.subscriber is None or not mailbox.early_orders):
                continue
            if self._planner.rank_lost(rank_key):
                continue  # engine loss ends the attempt; the rank never got anything
            if att.deadline - now <= self._config.max_clock_skew_s:
                continue  # no budget left: the deadline ends the attempt
            mailbox = self._producer_mailbox(rank_key, now)
            att.orders[rank_key] = OrderRecord(att.deadline, att.write_timeout, early=not full)
            mailbox.put(self._order_message(att, rank_key, now, full=full))
            att.note(a.TL_ORDER_SENT, now, f"{rank_name(rank_key)}{'' if full else ' early'}")
            sent += 1
        if sent:
            self.metrics.orders_sent.inc(sent)

    def _order_message(self, att: Attempt, rank_key: RankKey, now: float, *, full: bool) -> rv_pb.StreamWriteOrdersResponse:
        cfg = self._config
        consumers = next(c for r, c in att.plan.orders if r == rank_key)
        order = tr_pb.WriteOrder(
            key=att.key,
            client_request_id=att.client_request_id,
            destination=att.dest.destination,
            decode_tp_ranks=consumers,
            # Measured by the rank from send_time: the skew allowance keeps
            # its last post before the deadline whatever its clock says.
            write_budget=validation.duration(att.orders[rank_key].budget_end - now - cfg.max_clock_skew_s),
            trace_context=self._tracing.carrier(att),
            write_timeout=validation.duration(att.write_timeout),
        )
        if full:
            order.source.CopyFrom(att.src.source)
        return rv_pb.StreamWriteOrdersResponse(order=order, send_time=timestamp(self._clock.wall()), stream_lease=validation.duration(self._order_lease))

    def _revocation(self, att: Attempt) -> rv_pb.StreamWriteOrdersResponse:
        return rv_pb.StreamWriteOrdersResponse(
            revocation=tr_pb.Revocation(key=att.key, reason=att.end_reason),
            send_time=timestamp(self._clock.wall()),
            stream_lease=validation.duration(self._order_lease),
        )

    def _closed_message(self, att: Attempt) -> rv_pb.StreamWriteOrdersResponse:
        return rv_pb.StreamWriteOrdersResponse(
            closed=tr_pb.TransferClosed(key=att.key, state=att.state, reason=att.end_reason),
            send_time=timestamp(self._clock.wall()),
            stream_lease=validation.duration(self._order_lease),
        )

    def _complete(self, att: Attempt, now: float) -> None:
        self._set_state(att, a.DONE)
        att.end_reason = tr_pb.END_REASON_COMPLETED
        att.note(a.TL_ENDED, now, "DONE")
        self._tracing.ended(att)
        self._notify_decode(att, tr_pb.TRANSFER_EVENT_TYPE_COMPLETED)
        self._close_producers(att)
        att.fenced = True
        att.note(a.TL_FENCED, now)
        self._settle(att, now)
        self._announce_end(att)

    def _end(self, att: Attempt, state: int, reason: int, detail: str, now: float) -> None:
        """Ends a live attempt without the KV: revoke unanswered orders, release producers, fence when safe."""
        self._set_state(att, state)
        att.end_reason = reason
        att.detail = detail
        att.note(a.TL_ENDED, now, f"{tr_pb.TransferState.Name(state)} {tr_pb.EndReason.Name(reason)}")
        if state == a.FAILED:
            self.metrics.failure(reason).inc()
        self._tracing.ended(att)
        unanswered = att.unanswered()
        if unanswered:
            revocation = self._revocation(att)
            for rank_key, _ in unanswered:
                mailbox = self._producers.get(rank_key)
                if mailbox is not None:
                    mailbox.put(revocation)
                att.note(a.TL_REVOKED, now, rank_name(rank_key))
        self._close_producers(att)
        self._check_fenced(att, now)
        if not att.fenced:
            self._notify_decode(att, tr_pb.TRANSFER_EVENT_TYPE_FAILED)
        self._announce_end(att)

    def _close_producers(self, att: Attempt) -> None:
        if not att.p_ranks:
            return
        closed = self._closed_message(att)
        for rank_key in att.p_ranks:
            mailbox = self._producers.get(rank_key)
            if mailbox is not None:
                mailbox.put(closed)

    def _fence_bound(self, rank_key: RankKey, order: OrderRecord) -> float:
        """When an unanswered order can no longer lead to a landing WRITE (broker monotonic time)."""
        mailbox = self._producers.get(rank_key)
        # No mailbox: never delivered, or closed long enough ago to be forgotten.
        stream_end = mailbox.lease_bound(self._config.stream_lease_s) if mailbox is not None else float("-inf")
        return min(order.budget_end, stream_end) + order.write_timeout + self._config.fence_margin_s

    def _check_fenced(self, att: Attempt, now: float) -> None:
        """Once every ordered rank answered or its bound passed (and the startup grace is over), the attempt is fenced."""
        if att.fenced:
            return
        next_check = None
        for rank_key, order in att.unanswered():
            bound = self._fence_bound(rank_key, order)
            if bound <= now:
                order.answer = a.TIMED_OUT
                att.note(a.TL_WRITE_RESULT, now, f"{rank_name(rank_key)} no answer: fenced by time")
            else:
                next_check = bound if next_check is None else min(next_check, bound)
        if next_check is None and now < self._grace_end and (att.orders or att.dest is not None):
            # A predecessor broker's orders for this key may still be acted on.
            next_check = self._grace_end
        if next_check is not None:
            self._schedule(att, next_check)
            return
        att.fenced = True
        att.note(a.TL_FENCED, now)
        self._notify_decode(att, tr_pb.TRANSFER_EVENT_TYPE_ENDED)
        self._settle(att, now)

    def _event(self, att: Attempt, event_type: int) -> rv_pb.StreamTransferEventsResponse:
        return rv_pb.StreamTransferEventsResponse(
            event=tr_pb.TransferEvent(
                key=att.key,
                client_request_id=att.client_request_id,
                type=event_type,
                state=att.state,
                reason=att.end_reason,
                detail=att.detail,
                event_time=timestamp(self._clock.wall()),
            )
        )

    def _notify_decode(self, att: Attempt, event_type: int) -> None:
        if att.dest is None:
            return  # the decode side never registered: nothing of it to release
        key = (att.d_engine_id, att.d_incarnation)
        mailbox = self._decoders.get(key)
        if mailbox is None:
            if self._planner.engine_lost(*key):
                return
            mailbox = self._decoders[key] = DecodeMailbox(key, self._clock.now(), _RESYNC_EVENTS)
        message = self._event(att, event_type)
        if event_type == tr_pb.TRANSFER_EVENT_TYPE_FAILED:
            mailbox.put(message)
        else:
            mailbox.put_final(message)

    def _announce_end(self, att: Attempt) -> None:
        for listener in self._end_listeners:
            listener(att.transfer_id, att.number)

    def _settle(self, att: Attempt, now: float) -> None:
        self._unsettled -= 1
        for engine_id in (att.p_engine_id, att.d_engine_id):
            attempts = self._by_engine.get(engine_id)
            if attempts is not None:
                attempts.pop(att, None)
                if not attempts:
                    del self._by_engine[engine_id]
        if not self._settled and self._wakeup is not None:
            self._wakeup(max(now + self._config.retention_s, att.keep_until))
        self._settled.append((now, att))

    def _forget(self, att: Attempt) -> None:
        record = self._transfers.get(att.transfer_id)
        if record is not None and record.attempts.get(att.number) is att:
            del record.attempts[att.number]
            if not record.attempts:
                del self._transfers[att.transfer_id]
        # A stale timer entry may still point here until its time comes.
        att.dest = att.src = None
        att.timeline = []

    # ----- responses and errors -----

    def _put_deadline(self, response, att: Attempt) -> None:
        if att.deadline != float("inf"):
            response.deadline.CopyFrom(timestamp(att.deadline + self._clock.wall() - self._clock.now()))

    @staticmethod
    def _conflict(att: Attempt, method: str) -> AlreadyExists:
        return AlreadyExists(
            f"{method} for transfer {att.transfer_id} attempt {att.number} already came with different content",
            reason=Reason.CONFLICTING_DUPLICATE,
            field="key",
        )

    @staticmethod
    def _ended_error(att: Attempt) -> FailedPrecondition:
        return FailedPrecondition(
            f"transfer {att.transfer_id} attempt {att.number} ended: {tr_pb.TransferState.Name(att.state)} ({att.detail})",
            reason=Reason.TRANSFER_ENDED,
            field="key",
        )

