# SPDX-License-Identifier: Apache-2.0
"""The rendezvous broker's grpc-free core: a state machine over transfer attempts.

An attempt is keyed (transfer_id, attempt). The decode side's
RegisterDestination and the prefill side's ReportPrefillDone arrive in either
order; the broker then sends WriteOrders to the producer ranks (early orders,
without source, as soon as the destination is known to ranks that asked for
them), collects their write results and tells both sides how it ended.

Fencing: an attempt that ends without completing after orders went out
sends a Revocation to each ordered rank that has not answered, and counts
as fenced once every ordered rank answered or lost its lease; only then does
the decode engine get TransferEvent{ENDED} and may reuse its blocks. Every
attempt that ends sends TransferClosed to all ranks of its prefill engine.

Outputs go to per-subscriber Outboxes (one per producer rank, one per
decode engine) that the servicer's streams drain; messages for a subscriber
that is not connected wait there, bounded.

The core reads time only from its Clock and never sleeps: tick() ends
attempts whose deadline passed, forgets settled attempts after the
retention time, and returns when it next needs to run.
"""

from __future__ import annotations

import enum
import heapq
import logging
from collections import deque
from collections.abc import Callable
from typing import Protocol

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from kvpush.engine.v1 import engine_pb2
from kvpush.errors import (
    Aborted,
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    Reason,
    ResourceExhausted,
    Unavailable,
)
from kvpush.layout import heads
from kvpush.registrar.v1 import registrar_service_pb2 as reg_pb
from kvpush.rendezvous.v1 import rendezvous_service_pb2 as rv_pb
from kvpush.rendezvous.v1 import transfer_pb2 as tr_pb
from kvpush.services.broker.config import BrokerConfig
from kvpush.services.broker.metrics import BrokerMetrics
from kvpush.services.common import validation
from kvpush.services.common.clock import Clock, timestamp
from kvpush.services.common.outbox import Outbox

logger = logging.getLogger(__name__)

TRACER_NAME = "kvpush.broker"
_PROPAGATOR = TraceContextTextMapPropagator()

# (engine_id, incarnation, tp_rank, pp_rank): one producer rank.
RankKey = tuple[str, str, int, int]

_PREFILL = engine_pb2.ENGINE_ROLE_PREFILL
_DECODE = engine_pb2.ENGINE_ROLE_DECODE
_READY = reg_pb.ENGINE_STATE_READY

_WAITING_FOR_PREFILL = tr_pb.TRANSFER_STATE_WAITING_FOR_PREFILL
_WAITING_FOR_REGISTRATION = tr_pb.TRANSFER_STATE_WAITING_FOR_REGISTRATION
_MATCHED = tr_pb.TRANSFER_STATE_MATCHED
_WRITING = tr_pb.TRANSFER_STATE_WRITING
_DONE = tr_pb.TRANSFER_STATE_DONE
_FAILED = tr_pb.TRANSFER_STATE_FAILED
_CANCELLED = tr_pb.TRANSFER_STATE_CANCELLED
_SUPERSEDED = tr_pb.TRANSFER_STATE_SUPERSEDED
_NEW = tr_pb.TRANSFER_STATE_UNSPECIFIED  # an attempt being created, before its first state
_TERMINAL = frozenset((_DONE, _FAILED, _CANCELLED, _SUPERSEDED))

# Per ordered rank: what it answered. _PENDING: nothing yet; _LOST: its lease
# ended before it answered (it can no longer write either).
_PENDING = 0
_LOST = -1
_WRITTEN = tr_pb.WRITE_OUTCOME_WRITTEN
_OUTCOMES = frozenset(tr_pb.WriteOutcome.values()) - {0}

_TL_REGISTERED = tr_pb.TIMELINE_ENTRY_KIND_REGISTERED
_TL_PREFILL_DONE = tr_pb.TIMELINE_ENTRY_KIND_PREFILL_DONE
_TL_ORDER_SENT = tr_pb.TIMELINE_ENTRY_KIND_ORDER_SENT
_TL_WRITE_RESULT = tr_pb.TIMELINE_ENTRY_KIND_WRITE_RESULT
_TL_REVOKED = tr_pb.TIMELINE_ENTRY_KIND_REVOKED
_TL_ENDED = tr_pb.TIMELINE_ENTRY_KIND_ENDED
_TL_FENCED = tr_pb.TIMELINE_ENTRY_KIND_FENCED


class Actor(enum.Enum):
    """Who cancels a transfer; the value is the EndReason it ends with."""

    ROUTER = tr_pb.END_REASON_CANCELLED_BY_ROUTER
    PREFILL = tr_pb.END_REASON_CANCELLED_BY_PREFILL
    DECODE = tr_pb.END_REASON_CANCELLED_BY_DECODE


class EngineDirectory(Protocol):
    """Where the broker looks engines up: the RegistrarCore in process, or a RemoteEngineDirectory."""

    def get_engine(self, engine_id: str) -> reg_pb.Engine | None:
        """The engine's current snapshot (shared, never mutated; a new object after each change), or None."""

    def add_removal_listener(self, listener: Callable[[str, str, str], None]) -> None:
        """listener(engine_id, incarnation, reason) is called whenever ranks of an engine incarnation leave."""


class _EngineInfo:
    """What the broker derives from one engine snapshot; cached by the snapshot's identity."""

    __slots__ = ("engine", "groups", "rank_keys", "positions", "rank_heads", "plans")

    def __init__(self, engine: reg_pb.Engine):
        self.engine = engine
        groups: dict[int, tuple[int, int]] = {}
        for registered in engine.ranks:
            for group in registered.layout.groups:
                known = groups.get(group.group_index)
                # Ranks of one engine share block tables; the smallest pool is the safe bound.
                groups[group.group_index] = (group.block_size, group.num_blocks if known is None else min(known[1], group.num_blocks))
        self.groups = groups
        self.rank_keys: tuple[RankKey, ...] = tuple(
            (engine.engine_id, engine.incarnation, r.rank.tp_rank, r.rank.pp_rank) for r in engine.ranks
        )
        self.positions = frozenset((r.rank.tp_rank, r.rank.pp_rank) for r in engine.ranks)
        self.rank_heads = [heads.RankHeads(r.rank.tp_rank, r.layout.first_head, r.layout.num_local_heads) for r in engine.ranks]
        self.plans: dict[str, _Plan] = {}  # by decode engine id, for a prefill engine


class _Plan:
    """Which producer rank writes to which decode ranks, for one (prefill, decode) incarnation pair."""

    __slots__ = ("decode_engine", "orders", "expected", "producers")

    def __init__(self, decode_engine: reg_pb.Engine, orders: tuple[tuple[RankKey, tuple[int, ...]], ...], expected: tuple[int, ...], producers: tuple[RankKey, ...]):
        self.decode_engine = decode_engine
        self.orders = orders  # producer ranks with at least one consumer, and their consumers
        self.expected = expected  # notifications per decode tp rank
        self.producers = producers  # every rank of the prefill engine


class _Transfer:
    __slots__ = ("transfer_id", "newest", "attempts")

    def __init__(self, transfer_id: str):
        self.transfer_id = transfer_id
        self.newest = 0
        self.attempts: dict[int, Attempt] = {}


class Attempt:
    """One (transfer_id, attempt): both sides' requests, orders and answers, state and timeline."""

    __slots__ = (
        "transfer_id",
        "number",
        "key",
        "state",
        "end_reason",
        "detail",
        "first_arrival",
        "first_time",
        "client_request_id",
        "dest",
        "src",
        "p_engine_id",
        "p_incarnation",
        "p_ranks",
        "d_engine_id",
        "d_incarnation",
        "dest_deadline",
        "src_deadline",
        "deadline",
        "plan",
        "orders",
        "written",
        "bytes_written",
        "timeline",
        "span",
        "trace_carrier",
        "fenced",
        "rejection",
    )

    def __init__(self, transfer_id: str, number: int, now: float):
        self.transfer_id = transfer_id
        self.number = number
        self.key = tr_pb.TransferKey(transfer_id=transfer_id, attempt=number)
        self.state = _NEW
        self.end_reason = tr_pb.END_REASON_UNSPECIFIED
        self.detail = ""
        self.first_arrival = tr_pb.TRANSFER_SIDE_UNSPECIFIED
        self.first_time = now
        self.client_request_id = ""
        self.dest: rv_pb.RegisterDestinationRequest | None = None
        self.src: rv_pb.ReportPrefillDoneRequest | None = None
        self.p_engine_id = ""
        self.p_incarnation = ""
        self.p_ranks: tuple[RankKey, ...] = ()
        self.d_engine_id = ""
        self.d_incarnation = ""
        self.dest_deadline = float("inf")
        self.src_deadline = float("inf")
        self.deadline = float("inf")
        self.plan: _Plan | None = None
        self.orders: dict[RankKey, int] = {}
        self.written = 0
        self.bytes_written = 0
        self.timeline: list[tuple[int, float, str]] = []
        self.span: trace.Span | None = None
        self.trace_carrier: dict[str, str] = {}
        self.fenced = False
        # rejection: (side, error) when the second arrival was refused and
        # failed the attempt, so an identical repeat gets the same error.
        self.rejection: tuple[int, Exception] | None = None

    @property
    def ended(self) -> bool:
        return self.state in _TERMINAL


class _Mailbox:
    """The outbox of one subscriber key (producer rank or decode engine) and who is draining it."""

    __slots__ = ("outbox", "subscriber", "early_orders")

    def __init__(self, capacity: int):
        self.outbox: Outbox = Outbox(capacity)
        self.subscriber: Subscription | None = None
        self.early_orders = False


class Subscription:
    """One stream's claim on a mailbox; a newer subscription for the same key replaces it."""

    __slots__ = ("_mailbox",)

    def __init__(self, mailbox: _Mailbox):
        self._mailbox = mailbox

    @property
    def outbox(self) -> Outbox:
        return self._mailbox.outbox

    @property
    def active(self) -> bool:
        """False once replaced by a newer subscription or closed (engine gone, broker stopping)."""
        return self._mailbox.subscriber is self and not self._mailbox.outbox.closed


def _identity_mismatch(field: str, named: str, caller: str) -> PermissionDenied:
    return PermissionDenied(f"the caller is engine {caller!r}, not {named!r}", reason=Reason.ENGINE_IDENTITY_MISMATCH, field=field)


def _check_caller(engine_id: str, caller_engine_id: str, field: str) -> None:
    """engine_id must be the caller's (an authenticated, hence well-formed, id)."""
    if engine_id == caller_engine_id and engine_id:
        return
    validation.check_id(engine_id, field)
    raise _identity_mismatch(field, engine_id, caller_engine_id)


def _invalid(message: str, field: str) -> InvalidArgument:
    return InvalidArgument(message, reason=Reason.FIELD_INVALID, field=field)


def _rank_name(key: RankKey) -> str:
    return f"{key[0]} tp {key[2]} pp {key[3]}"


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
        self.metrics = metrics if metrics is not None else BrokerMetrics()
        self._tracer = trace.get_tracer(TRACER_NAME, tracer_provider=tracer_provider)
        # Whether spans record: a provider was given, or one is installed
        # globally (looked up at most once a second: the lookup is slow).
        self._tracing = tracer_provider is not None
        self._tracing_checked_at = float("-inf")
        self._transfers: dict[str, _Transfer] = {}
        self._deadlines: list[tuple[float, int, Attempt]] = []  # heap; stale entries skipped when popped
        self._deadline_seq = 0
        self._settled: deque[tuple[float, Attempt]] = deque()  # in settle order, so in time order
        self._state_counts = [0] * (max(tr_pb.TransferState.values()) + 1)
        self._unsettled = 0
        # Attempts not yet settled, by the engines they involve (for engine loss).
        self._by_engine: dict[str, set[Attempt]] = {}
        self._infos: dict[str, _EngineInfo] = {}
        self._producers: dict[RankKey, _Mailbox] = {}
        self._decoders: dict[tuple[str, str], _Mailbox] = {}
        self._wakeup: Callable[[float], None] | None = None
        self._end_listeners: list[Callable[[str, int], None]] = []
        self._closed = False
        directory.add_removal_listener(self.on_engine_removed)
        counts = self._state_counts
        self.metrics.read_gauges_from(
            lambda: counts[_WAITING_FOR_PREFILL],
            lambda: counts[_WAITING_FOR_REGISTRATION],
            lambda: counts[_WAITING_FOR_PREFILL] + counts[_WAITING_FOR_REGISTRATION] + counts[_MATCHED] + counts[_WRITING],
        )

    # ----- counts and hooks -----

    @property
    def live_attempts(self) -> int:
        """Attempts not yet in a terminal state."""
        c = self._state_counts
        return c[_WAITING_FOR_PREFILL] + c[_WAITING_FOR_REGISTRATION] + c[_MATCHED] + c[_WRITING]

    @property
    def unsettled_attempts(self) -> int:
        """Attempts live or ended but not yet fenced."""
        return self._unsettled

    @property
    def remembered_attempts(self) -> int:
        """Attempts held in memory (unsettled plus settled within retention)."""
        return self._unsettled + len(self._settled)

    def add_end_listener(self, listener: Callable[[str, int], None]) -> None:
        """listener(transfer_id, attempt) is called whenever an attempt reaches a terminal state."""
        self._end_listeners.append(listener)

    def newest_attempt(self, transfer_id: str) -> int:
        """The newest attempt number seen for transfer_id (0: none remembered)."""
        record = self._transfers.get(transfer_id)
        return record.newest if record is not None else 0

    def is_ended(self, transfer_id: str, attempt: int) -> bool:
        """True when the attempt is remembered in a terminal state."""
        record = self._transfers.get(transfer_id)
        att = record.attempts.get(attempt) if record is not None else None
        return att is not None and att.ended

    def _announce_end(self, att: Attempt) -> None:
        for listener in self._end_listeners:
            listener(att.transfer_id, att.number)

    def set_wakeup(self, wakeup: Callable[[float], None]) -> None:
        """wakeup(t) is called when tick() must run at t, earlier than it last said."""
        self._wakeup = wakeup

    # ----- the decode side -----

    def register_destination(self, request: rv_pb.RegisterDestinationRequest, caller_engine_id: str, parent: Context | None = None) -> rv_pb.RegisterDestinationResponse:
        """Registers the decode side's blocks; see RendezvousService.RegisterDestination.

        caller_engine_id is the authenticated caller; parent carries its span context.
        """
        transfer_id, number = self._check_key(request.key)
        if not request.HasField("destination"):
            raise InvalidArgument("destination is required", reason=Reason.FIELD_REQUIRED, field="destination")
        dest = request.destination
        _check_caller(dest.engine_id, caller_engine_id, "destination.engine_id")
        d_info = self._ready_engine(dest.engine_id, dest.incarnation, _DECODE, "destination.engine_id", "destination.incarnation")
        validation.check_text(request.client_request_id, "client_request_id", self._config.max_text_length, required=False)
        p_info = self._ready_engine(request.prefill_engine_id, None, _PREFILL, "prefill_engine_id", "")
        plan = self._plan(p_info, d_info, "prefill_engine_id")
        if dest.num_tokens == 0:
            raise InvalidArgument("destination.num_tokens must be positive", reason=Reason.FIELD_REQUIRED, field="destination.num_tokens")
        self._check_blocks(dest.blocks, d_info, dest.num_tokens, dest.first_token, "destination")
        timeout = validation.positive_seconds(request.timeout, "timeout", self._config.max_timeout_s)

        now = self._clock.now()
        att = self._attempt_for(transfer_id, number, now)
        if att.dest is not None:
            if att.dest.destination == dest and att.dest.prefill_engine_id == request.prefill_engine_id and att.dest.client_request_id == request.client_request_id:
                if att.rejection is not None and att.rejection[0] == tr_pb.TRANSFER_SIDE_DECODE:
                    raise att.rejection[1]
                return self._destination_response(att)
            raise self._ended_error(att) if att.ended else self._conflict(att, "RegisterDestination")
        if att.ended:
            raise self._ended_error(att)
        src_req = att.src
        if src_req is not None:
            if src_req.source.engine_id != request.prefill_engine_id:
                raise _invalid(f"prefill-done for this attempt came from engine {src_req.source.engine_id!r}", "prefill_engine_id")
            if att.d_engine_id and att.d_engine_id != dest.engine_id:
                raise _invalid(f"the prefill side named decode engine {att.d_engine_id!r}", "destination.engine_id")
            if att.d_incarnation and att.d_incarnation != dest.incarnation:
                raise FailedPrecondition(
                    "the decode engine restarted since the prefill side named it", reason=Reason.INCARNATION_MISMATCH, field="destination.incarnation"
                )

        created = att.state == _NEW
        att.dest = request
        if not att.client_request_id:
            att.client_request_id = request.client_request_id
        if not att.d_engine_id:
            att.d_engine_id = dest.engine_id
            self._index(att, dest.engine_id)
        att.d_incarnation = dest.incarnation
        if not att.p_engine_id:
            att.p_engine_id = request.prefill_engine_id
            att.p_incarnation = p_info.engine.incarnation
            att.p_ranks = p_info.rank_keys
            self._index(att, att.p_engine_id)
        att.plan = plan
        att.timeline.append((_TL_REGISTERED, now, dest.engine_id))
        att.dest_deadline = now + timeout
        self._set_deadline(att, min(att.dest_deadline, att.src_deadline))

        if src_req is None:
            att.first_arrival = tr_pb.TRANSFER_SIDE_DECODE
            att.first_time = now
            self._set_state(att, _WAITING_FOR_PREFILL)
            self._start_span(att, parent, "decode")
            self._send_early_orders(att, now)
            if created:
                self._supersede_older(att, now)
            return self._destination_response(att)

        self._check_token_counts(att, src_req.source, dest, tr_pb.TRANSFER_SIDE_DECODE, now)
        self._match(att, parent, now)
        return self._destination_response(att)

    # ----- the prefill side -----

    def report_prefill_done(self, request: rv_pb.ReportPrefillDoneRequest, caller_engine_id: str, parent: Context | None = None) -> rv_pb.ReportPrefillDoneResponse:
        """Records that the prefill side holds the KV; see RendezvousService.ReportPrefillDone."""
        transfer_id, number = self._check_key(request.key)
        if not request.HasField("source"):
            raise InvalidArgument("source is required", reason=Reason.FIELD_REQUIRED, field="source")
        src = request.source
        _check_caller(src.engine_id, caller_engine_id, "source.engine_id")
        p_info = self._ready_engine(src.engine_id, src.incarnation, _PREFILL, "source.engine_id", "source.incarnation")
        validation.check_text(request.client_request_id, "client_request_id", self._config.max_text_length, required=False)
        d_info = None
        if request.decode_engine_id:
            d_info = self._ready_engine(request.decode_engine_id, None, _DECODE, "decode_engine_id", "")
            self._plan(p_info, d_info, "decode_engine_id")
        if src.num_tokens == 0:
            raise InvalidArgument("source.num_tokens must be positive", reason=Reason.FIELD_REQUIRED, field="source.num_tokens")
        self._check_blocks(src.blocks, p_info, src.num_tokens, 0, "source")
        timeout = validation.positive_seconds(request.timeout, "timeout", self._config.max_timeout_s)

        now = self._clock.now()
        att = self._attempt_for(transfer_id, number, now)
        if att.src is not None:
            if att.src.source == src and att.src.decode_engine_id == request.decode_engine_id and att.src.client_request_id == request.client_request_id:
                if att.rejection is not None and att.rejection[0] == tr_pb.TRANSFER_SIDE_PREFILL:
                    raise att.rejection[1]
                return self._prefill_response(att)
            raise self._ended_error(att) if att.ended else self._conflict(att, "ReportPrefillDone")
        late_after_done = att.state == _DONE and att.src is None
        if att.ended and not late_after_done:
            raise self._ended_error(att)
        dest_req = att.dest
        if dest_req is not None:
            if dest_req.prefill_engine_id != src.engine_id:
                raise _invalid(f"the decode side registered for prefill engine {dest_req.prefill_engine_id!r}", "source.engine_id")
            if att.p_incarnation != src.incarnation:
                raise FailedPrecondition(
                    "the prefill engine restarted since the decode side registered", reason=Reason.INCARNATION_MISMATCH, field="source.incarnation"
                )
            if request.decode_engine_id and request.decode_engine_id != dest_req.destination.engine_id:
                raise _invalid(f"decode engine {dest_req.destination.engine_id!r} registered for this attempt", "decode_engine_id")
        if late_after_done:
            # Early orders let every producer rank write before rank 0's
            # report arrived: the report is late, not wrong.
            att.src = request
            att.timeline.append((_TL_PREFILL_DONE, now, src.engine_id))
            return self._prefill_response(att)

        created = att.state == _NEW
        att.src = request
        if not att.client_request_id:
            att.client_request_id = request.client_request_id
        if not att.p_engine_id:
            att.p_engine_id = src.engine_id
            att.p_incarnation = src.incarnation
            att.p_ranks = p_info.rank_keys
            self._index(att, src.engine_id)
        if d_info is not None and not att.d_engine_id:
            att.d_engine_id = request.decode_engine_id
            att.d_incarnation = d_info.engine.incarnation
            self._index(att, att.d_engine_id)
        att.timeline.append((_TL_PREFILL_DONE, now, src.engine_id))
        att.src_deadline = now + timeout
        self._set_deadline(att, min(att.dest_deadline, att.src_deadline))

        if dest_req is None:
            att.first_arrival = tr_pb.TRANSFER_SIDE_PREFILL
            att.first_time = now
            self._set_state(att, _WAITING_FOR_REGISTRATION)
            self._start_span(att, parent, "prefill")
            if created:
                self._supersede_older(att, now)
            return self._prefill_response(att)

        self._check_token_counts(att, src, dest_req.destination, tr_pb.TRANSFER_SIDE_PREFILL, now)
        self._match(att, parent, now)
        return self._prefill_response(att)

    def _check_token_counts(self, att: Attempt, src: tr_pb.Source, dest: tr_pb.Destination, second: int, now: float) -> None:
        """The second arrival completes the rendezvous only if P computed every token D wants; else both sides fail."""
        needed = dest.first_token + dest.num_tokens
        if src.num_tokens >= needed:
            return
        field = "destination.num_tokens" if second == tr_pb.TRANSFER_SIDE_DECODE else "source.num_tokens"
        error = FailedPrecondition(
            f"the prefill side computed {src.num_tokens} tokens; the destination needs {needed}",
            reason=Reason.TOKEN_COUNT_MISMATCH,
            field=field,
        )
        att.rejection = (second, error)
        self._end(att, _FAILED, tr_pb.END_REASON_TOKEN_COUNT_MISMATCH, error.message, now)
        raise error

    # ----- producer ranks -----

    def report_write_result(self, request: rv_pb.ReportWriteResultRequest, caller_engine_id: str) -> rv_pb.ReportWriteResultResponse:
        """Records what a producer rank did with its order or revocation."""
        transfer_id, number = self._check_key(request.key)
        _check_caller(request.engine_id, caller_engine_id, "engine_id")
        validation.check_enum(request.outcome, _OUTCOMES, "outcome")
        record = self._transfers.get(transfer_id)
        att = record.attempts.get(number) if record is not None else None
        if att is None:
            raise NotFound(f"transfer {transfer_id} attempt {number} is not known", reason=Reason.TRANSFER_NOT_FOUND, field="key")
        rank_key = (request.engine_id, att.p_incarnation, request.tp_rank, request.pp_rank)
        answer = att.orders.get(rank_key) if request.engine_id == att.p_engine_id else None
        if answer is None:
            raise _invalid(f"rank tp {request.tp_rank} pp {request.pp_rank} of {request.engine_id} got no order for this attempt", "tp_rank")
        if answer != _PENDING:
            if answer == request.outcome or answer == _LOST:
                return rv_pb.ReportWriteResultResponse(state=att.state)
            raise AlreadyExists(
                f"rank tp {request.tp_rank} pp {request.pp_rank} already reported {tr_pb.WriteOutcome.Name(answer)}",
                reason=Reason.CONFLICTING_DUPLICATE,
                field="outcome",
            )
        now = self._clock.now()
        outcome = request.outcome
        att.orders[rank_key] = outcome
        att.bytes_written += request.bytes_written
        att.timeline.append((_TL_WRITE_RESULT, now, f"{_rank_name(rank_key)} {tr_pb.WriteOutcome.Name(outcome)}"))
        if att.ended:
            self._check_fenced(att, now)
        elif outcome == _WRITTEN:
            att.written += 1
            if att.plan is not None and att.written == len(att.plan.orders):
                self._complete(att, now)
            elif att.state != _WRITING:
                self._set_state(att, _WRITING)
        else:
            why = request.error_message[: self._config.max_text_length] or tr_pb.WriteOutcome.Name(outcome)
            self._end(att, _FAILED, tr_pb.END_REASON_WRITE_FAILED, f"{_rank_name(rank_key)}: {why}", now)
        return rv_pb.ReportWriteResultResponse(state=att.state)

    # ----- router and queries -----

    def cancel(self, key: tr_pb.TransferKey, actor: Actor, detail: str = "", caller_engine_id: str = "") -> rv_pb.CancelTransferResponse:
        """Cancels an attempt (attempt 0: every attempt) on behalf of actor.

        A prefill or decode actor must be the attempt's engine of that role
        (caller_engine_id). Cancelling an attempt not seen yet records it as
        cancelled, so its late messages are refused.
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
                self._end(att, _CANCELLED, actor.value, detail, now)
            return rv_pb.CancelTransferResponse(state=record.attempts[max(record.attempts)].state)
        if record is not None and number < record.newest:
            att = record.attempts.get(number)
            if att is None:
                raise Aborted(f"attempt {record.newest} superseded attempt {number}", reason=Reason.TRANSFER_SUPERSEDED, field="key.attempt")
            return rv_pb.CancelTransferResponse(state=att.state)
        att = record.attempts.get(number) if record is not None else None
        if att is None:
            att = self._attempt_for(transfer_id, number, now)
            if actor is Actor.PREFILL:
                att.p_engine_id = caller_engine_id
            elif actor is Actor.DECODE:
                att.d_engine_id = caller_engine_id
            self._end(att, _CANCELLED, actor.value, detail, now)
            self._supersede_older(att, now)
        elif not att.ended:
            self._authorize_cancel(att, actor, caller_engine_id)
            self._end(att, _CANCELLED, actor.value, detail, now)
        return rv_pb.CancelTransferResponse(state=att.state)

    def get_transfer(self, transfer_id: str, attempt: int = 0) -> tr_pb.Transfer:
        """The attempt's record (attempt 0: the newest one remembered)."""
        validation.check_id(transfer_id, "transfer_id")
        record = self._transfers.get(transfer_id)
        att = None
        if record is not None and record.attempts:
            att = record.attempts.get(attempt or max(record.attempts))
        if att is None:
            raise NotFound(f"transfer {transfer_id} attempt {attempt} is not known", reason=Reason.TRANSFER_NOT_FOUND, field="attempt" if record else "transfer_id")
        now = self._clock.now()
        wall_offset = self._clock.wall() - now
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

    # ----- subscriptions -----

    def subscribe_producer(self, request: rv_pb.StreamWriteOrdersRequest, caller_engine_id: str) -> Subscription:
        """Claims a producer rank's mailbox for one stream (replacing any earlier stream)."""
        _check_caller(request.engine_id, caller_engine_id, "engine_id")
        info = self._subscribable_engine(request.engine_id, request.incarnation, _PREFILL)
        if (request.tp_rank, request.pp_rank) not in info.positions:
            raise FailedPrecondition(
                f"rank tp {request.tp_rank} pp {request.pp_rank} of {request.engine_id} is not registered",
                reason=Reason.ENGINE_NOT_READY,
                field="tp_rank",
            )
        key = (request.engine_id, request.incarnation, request.tp_rank, request.pp_rank)
        mailbox = self._producers.get(key)
        if mailbox is None:
            mailbox = self._producers[key] = _Mailbox(self._config.outbox_capacity)
        mailbox.early_orders = request.early_orders
        return self._claim(mailbox)

    def subscribe_decode(self, request: rv_pb.StreamTransferEventsRequest, caller_engine_id: str) -> Subscription:
        """Claims a decode engine's event mailbox for one stream (replacing any earlier stream)."""
        _check_caller(request.engine_id, caller_engine_id, "engine_id")
        self._subscribable_engine(request.engine_id, request.incarnation, _DECODE)
        key = (request.engine_id, request.incarnation)
        mailbox = self._decoders.get(key)
        if mailbox is None:
            mailbox = self._decoders[key] = _Mailbox(self._config.outbox_capacity)
        return self._claim(mailbox)

    def unsubscribe(self, subscription: Subscription) -> None:
        """Releases the mailbox when this stream still holds it; queued messages stay for the next."""
        mailbox = subscription._mailbox
        if mailbox.subscriber is subscription:
            mailbox.subscriber = None
            mailbox.early_orders = False

    # ----- engine loss, deadlines, shutdown -----

    def on_engine_removed(self, engine_id: str, incarnation: str, reason: str) -> None:
        """Ranks of an engine incarnation left: fail its live attempts and re-check fencing."""
        now = self._clock.now()
        for key in [k for k in self._producers if k[0] == engine_id and self._rank_lost(k)]:
            self._producers.pop(key).outbox.close()
        for key in [k for k in self._decoders if k[0] == engine_id and self._engine_lost(k[0], k[1])]:
            self._decoders.pop(key).outbox.close()
        for att in list(self._by_engine.get(engine_id, ())):
            if att.ended:
                self._check_fenced(att, now)
                continue
            if att.p_engine_id == engine_id and att.p_incarnation == incarnation:
                self._end(att, _FAILED, tr_pb.END_REASON_PREFILL_ENGINE_LOST, f"prefill engine {engine_id} lost ranks: {reason}", now)
            elif att.d_engine_id == engine_id and att.d_incarnation == incarnation:
                self._end(att, _FAILED, tr_pb.END_REASON_DECODE_ENGINE_LOST, f"decode engine {engine_id} lost ranks: {reason}", now)

    def tick(self) -> float | None:
        """Fails attempts past their deadline and forgets old settled ones; returns the next time to run (monotonic) or None."""
        now = self._clock.now()
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            deadline, _, att = heapq.heappop(heap)
            if att.ended or att.deadline != deadline:
                continue
            if att.dest_deadline <= att.src_deadline:
                reason, side = tr_pb.END_REASON_REGISTRATION_DEADLINE_EXCEEDED, "decode"
            else:
                reason, side = tr_pb.END_REASON_PREFILL_DEADLINE_EXCEEDED, "prefill"
            self.metrics.expiries.inc()
            self._end(att, _FAILED, reason, f"the {side} side's deadline passed", now)
        settled = self._settled
        horizon = now - self._config.retention_s
        while settled and (settled[0][0] <= horizon or len(settled) > self._config.max_retained_attempts):
            self._forget(settled.popleft()[1])
        while heap and (heap[0][2].ended or heap[0][2].deadline != heap[0][0]):
            heapq.heappop(heap)
        next_time = heap[0][0] if heap else None
        if settled:
            forget_at = settled[0][0] + self._config.retention_s
            next_time = forget_at if next_time is None else min(next_time, forget_at)
        return next_time

    def close(self) -> None:
        """Ends every subscription (the streams finish); later subscriptions are refused."""
        self._closed = True
        for mailbox in (*self._producers.values(), *self._decoders.values()):
            mailbox.outbox.close()

    # ----- validation helpers -----

    @staticmethod
    def _check_key(key: tr_pb.TransferKey) -> tuple[str, int]:
        validation.check_id(key.transfer_id, "key.transfer_id")
        if key.attempt == 0:
            raise InvalidArgument("key.attempt counts from 1", reason=Reason.FIELD_REQUIRED, field="key.attempt")
        return key.transfer_id, key.attempt

    def _info(self, engine: reg_pb.Engine) -> _EngineInfo:
        info = self._infos.get(engine.engine_id)
        if info is None or info.engine is not engine:
            info = self._infos[engine.engine_id] = _EngineInfo(engine)
        return info

    def _ready_engine(self, engine_id: str, incarnation: str | None, role: int, field: str, incarnation_field: str) -> _EngineInfo:
        """The engine's info; it must exist, have role, be READY and (if given) be that incarnation."""
        engine = self._directory.get_engine(engine_id)
        if engine is None:
            validation.check_id(engine_id, field)
            raise NotFound(f"engine {engine_id!r} is not registered", reason=Reason.ENGINE_NOT_FOUND, field=field)
        if engine.role != role:
            raise FailedPrecondition(
                f"engine {engine_id!r} is a {engine_pb2.EngineRole.Name(engine.role)} engine", reason=Reason.ENGINE_ROLE_MISMATCH, field=field
            )
        if incarnation is not None and engine.incarnation != incarnation:
            raise FailedPrecondition(
                f"engine {engine_id!r} is now incarnation {engine.incarnation!r}", reason=Reason.INCARNATION_MISMATCH, field=incarnation_field
            )
        if engine.state != _READY:
            raise FailedPrecondition(f"engine {engine_id!r} is not READY", reason=Reason.ENGINE_NOT_READY, field=field)
        return self._info(engine)

    def _subscribable_engine(self, engine_id: str, incarnation: str, role: int) -> _EngineInfo:
        if self._closed:
            raise Unavailable("the broker is shutting down", reason=Reason.UNAVAILABLE)
        engine = self._directory.get_engine(engine_id)
        if engine is None:
            raise NotFound(f"engine {engine_id!r} is not registered", reason=Reason.ENGINE_NOT_FOUND, field="engine_id")
        if engine.role != role:
            raise FailedPrecondition(
                f"engine {engine_id!r} is a {engine_pb2.EngineRole.Name(engine.role)} engine", reason=Reason.ENGINE_ROLE_MISMATCH, field="engine_id"
            )
        if engine.incarnation != incarnation:
            raise FailedPrecondition(
                f"engine {engine_id!r} is now incarnation {engine.incarnation!r}", reason=Reason.INCARNATION_MISMATCH, field="incarnation"
            )
        return self._info(engine)

    def _plan(self, p_info: _EngineInfo, d_info: _EngineInfo, field: str) -> _Plan:
        """The (cached) routing plan between two engines; they must be able to exchange KV."""
        p, d = p_info.engine, d_info.engine
        plan = p_info.plans.get(d.engine_id)
        if plan is not None and plan.decode_engine is d:
            return plan
        if p.compatibility_hash != d.compatibility_hash:
            raise FailedPrecondition(
                f"engines {p.engine_id!r} and {d.engine_id!r} have different compatibility hashes", reason=Reason.INCOMPATIBLE_LAYOUT, field=field
            )
        if p.pp_size != 1 or d.pp_size != 1:
            # Write notifications name only the producer's tp rank.
            raise FailedPrecondition("pipeline-parallel engines cannot exchange KV in kvpush v1", reason=Reason.INCOMPATIBLE_LAYOUT, field=field)
        try:
            routes = heads.routes(p_info.rank_heads, d_info.rank_heads)
        except ValueError as exc:
            raise FailedPrecondition(str(exc), reason=Reason.INCOMPATIBLE_LAYOUT, field=field) from None
        orders = []
        for rank_key in p_info.rank_keys:
            consumers = heads.consumers_of(rank_key[2], routes)
            if consumers:
                orders.append((rank_key, tuple(consumers)))
        expected = tuple(heads.expected_notifications(tp, routes) for tp in range(d.tp_size))
        plan = p_info.plans[d.engine_id] = _Plan(d, tuple(orders), expected, p_info.rank_keys)
        return plan

    @staticmethod
    def _check_blocks(blocks, info: _EngineInfo, num_tokens: int, first_token: int, side: str) -> None:
        if not blocks:
            raise InvalidArgument(f"{side}.blocks is required", reason=Reason.FIELD_REQUIRED, field=f"{side}.blocks")
        groups = info.groups
        seen: set[int] = set()
        for i, block_list in enumerate(blocks):
            group = groups.get(block_list.group_index)
            if group is None or block_list.group_index in seen:
                raise _invalid(f"group_index {block_list.group_index} is unknown or listed twice", f"{side}.blocks[{i}].group_index")
            seen.add(block_list.group_index)
            block_size, num_blocks = group
            if first_token % block_size:
                raise _invalid(f"first_token {first_token} is not a multiple of the block size {block_size}", f"{side}.first_token")
            ids = block_list.block_ids
            needed = -(-num_tokens // block_size)
            if len(ids) != needed:
                raise _invalid(f"{num_tokens} tokens in blocks of {block_size} need {needed} block ids, not {len(ids)}", f"{side}.blocks[{i}].block_ids")
            if max(ids) >= num_blocks:
                j = next(j for j, block_id in enumerate(ids) if block_id >= num_blocks)
                raise InvalidArgument(
                    f"block id {ids[j]} is not below num_blocks {num_blocks}",
                    reason=Reason.BLOCK_ID_OUT_OF_RANGE,
                    field=f"{side}.blocks[{i}].block_ids[{j}]",
                )
        if len(seen) != len(groups):
            missing = sorted(set(groups) - seen)
            raise InvalidArgument(f"{side}.blocks lacks groups {missing}", reason=Reason.FIELD_REQUIRED, field=f"{side}.blocks")

    def _authorize_cancel(self, att: Attempt, actor: Actor, caller_engine_id: str) -> None:
        named = att.p_engine_id if actor is Actor.PREFILL else att.d_engine_id if actor is Actor.DECODE else ""
        if named and named != caller_engine_id:
            raise _identity_mismatch("key", named, caller_engine_id)

    # ----- attempt lifecycle -----

    def _attempt_for(self, transfer_id: str, number: int, now: float) -> Attempt:
        """The attempt to apply a message to: existing, or new when number is the newest yet."""
        record = self._transfers.get(transfer_id)
        if record is not None:
            if number < record.newest:
                raise Aborted(f"attempt {record.newest} superseded attempt {number}", reason=Reason.TRANSFER_SUPERSEDED, field="key.attempt")
            att = record.attempts.get(number)
            if att is not None:
                return att
            if number == record.newest:
                raise FailedPrecondition(
                    f"transfer {transfer_id} attempt {number} ended and was forgotten", reason=Reason.TRANSFER_ENDED, field="key"
                )
        if self._unsettled >= self._config.max_unsettled_attempts:
            raise ResourceExhausted(
                f"the broker holds {self._unsettled} unsettled attempts, its limit", reason=Reason.TOO_MANY_TRANSFERS, field="key"
            )
        if record is None:
            record = self._transfers[transfer_id] = _Transfer(transfer_id)
        att = Attempt(transfer_id, number, now)
        record.attempts[number] = att
        record.newest = number
        self._unsettled += 1
        self._state_counts[_NEW] += 1
        return att

    def _supersede_older(self, att: Attempt, now: float) -> None:
        """A new attempt supersedes every older live one of its transfer."""
        record = self._transfers[att.transfer_id]
        if len(record.attempts) == 1:
            return
        for older in list(record.attempts.values()):
            if older.number < att.number and not older.ended:
                self.metrics.supersessions.inc()
                self._end(older, _SUPERSEDED, tr_pb.END_REASON_SUPERSEDED, f"attempt {att.number} superseded it", now)

    def _set_state(self, att: Attempt, state: int) -> None:
        counts = self._state_counts
        counts[att.state] -= 1
        counts[state] += 1
        att.state = state

    def _set_deadline(self, att: Attempt, deadline: float) -> None:
        if deadline == att.deadline:
            return
        att.deadline = deadline
        self._deadline_seq += 1
        heap = self._deadlines
        heapq.heappush(heap, (deadline, self._deadline_seq, att))
        if heap[0][2] is att and self._wakeup is not None:
            self._wakeup(deadline)

    def _index(self, att: Attempt, engine_id: str) -> None:
        attempts = self._by_engine.get(engine_id)
        if attempts is None:
            attempts = self._by_engine[engine_id] = set()
        attempts.add(att)

    def _start_span(self, att: Attempt, parent: Context | None, side: str) -> None:
        if not self._tracing and att.first_time >= self._tracing_checked_at + 1.0:
            self._tracing_checked_at = att.first_time
            self._tracing = not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)
        if not self._tracing:
            # No tracer provider: the span would be a no-op. Forward the
            # caller's context, so the producer's spans still join its trace.
            if parent is not None:
                _PROPAGATOR.inject(att.trace_carrier, context=parent)
            return
        links = []
        if parent is not None:
            caller = trace.get_current_span(parent).get_span_context()
            if caller.is_valid:
                links.append(trace.Link(caller, {"kvpush.side": side}))
        span = self._tracer.start_span(
            "broker.rendezvous",
            context=parent,
            links=links,
            attributes={"kvpush.transfer_id": att.transfer_id, "kvpush.attempt": att.number, "kvpush.first_arrival": side},
        )
        att.span = span
        _PROPAGATOR.inject(att.trace_carrier, context=trace.set_span_in_context(span))

    def _match(self, att: Attempt, parent: Context | None, now: float) -> None:
        """Both sides are in: close the rendezvous span and order every producer rank not yet ordered."""
        if att.state != _WRITING:
            self._set_state(att, _MATCHED)
        span = att.span
        if span is not None:
            if parent is not None:
                caller = trace.get_current_span(parent).get_span_context()
                if caller.is_valid:
                    side = "prefill" if att.first_arrival == tr_pb.TRANSFER_SIDE_DECODE else "decode"
                    span.add_link(caller, {"kvpush.side": side})
            span.end()
            att.span = None
        metrics = self.metrics
        metrics.rendezvous.inc()
        metrics.rendezvous_wait.observe(now - att.first_time)
        self._send_orders(att, now, full=True)

    def _send_early_orders(self, att: Attempt, now: float) -> None:
        producers = self._producers
        for rank_key, _ in att.plan.orders:
            mailbox = producers.get(rank_key)
            if mailbox is not None and mailbox.early_orders:
                self._send_orders(att, now, full=False)
                return

    def _send_orders(self, att: Attempt, now: float, *, full: bool) -> None:
        """Queues one order per producer rank not yet ordered (early: only to ranks that asked)."""
        dest = att.dest
        budget = validation.duration(att.deadline - now)
        send_time = timestamp(self._clock.wall())
        sent = 0
        for rank_key, consumers in att.plan.orders:
            if rank_key in att.orders:
                continue
            mailbox = self._producers.get(rank_key)
            if not full and (mailbox is None or not mailbox.early_orders):
                continue
            order = tr_pb.WriteOrder(
                key=att.key,
                client_request_id=att.client_request_id,
                destination=dest.destination,
                decode_tp_ranks=consumers,
                write_budget=budget,
                trace_context=att.trace_carrier,
            )
            if full:
                order.source.CopyFrom(att.src.source)
            if mailbox is None:
                mailbox = self._mailbox_for(rank_key)
            att.orders[rank_key] = _PENDING
            if mailbox is not None:
                mailbox.outbox.put(rv_pb.StreamWriteOrdersResponse(order=order, send_time=send_time))
                att.timeline.append((_TL_ORDER_SENT, now, f"{_rank_name(rank_key)}{'' if full else ' early'}"))
            else:
                # The rank left after the plan was made; engine loss ends the
                # attempt, and a lost rank counts as answered.
                att.orders[rank_key] = _LOST
            sent += 1
        if sent:
            self.metrics.orders_sent.inc(sent)

    def _mailbox_for(self, rank_key: RankKey) -> _Mailbox | None:
        """The producer rank's mailbox, created if the rank is registered; None if it is gone."""
        mailbox = self._producers.get(rank_key)
        if mailbox is None and not self._rank_lost(rank_key):
            mailbox = self._producers[rank_key] = _Mailbox(self._config.outbox_capacity)
        return mailbox

    def _complete(self, att: Attempt, now: float) -> None:
        self._set_state(att, _DONE)
        att.end_reason = tr_pb.END_REASON_COMPLETED
        att.timeline.append((_TL_ENDED, now, "DONE"))
        if att.span is not None:
            att.span.end()
            att.span = None
        self._notify_decode(att, tr_pb.TRANSFER_EVENT_TYPE_COMPLETED)
        self._close_producers(att)
        att.fenced = True
        att.timeline.append((_TL_FENCED, now, ""))
        self._settle(att, now)
        self._announce_end(att)

    def _end(self, att: Attempt, state: int, reason: int, detail: str, now: float) -> None:
        """Ends a live attempt without the KV: revoke unanswered orders, release producers, fence."""
        self._set_state(att, state)
        att.end_reason = reason
        att.detail = detail
        att.timeline.append((_TL_ENDED, now, f"{tr_pb.TransferState.Name(state)} {tr_pb.EndReason.Name(reason)}"))
        if state == _FAILED:
            self.metrics.failure(reason).inc()
        span = att.span
        if span is not None:
            span.set_attribute("kvpush.end_reason", tr_pb.EndReason.Name(reason))
            span.end()
            att.span = None
        if att.orders:
            revocation = None
            for rank_key, answer in att.orders.items():
                if answer != _PENDING:
                    continue
                mailbox = self._producers.get(rank_key)
                if mailbox is None or self._rank_lost(rank_key):
                    att.orders[rank_key] = _LOST
                    continue
                if revocation is None:
                    revocation = rv_pb.StreamWriteOrdersResponse(
                        revocation=tr_pb.Revocation(key=att.key, reason=reason), send_time=timestamp(self._clock.wall())
                    )
                mailbox.outbox.put(revocation)
                att.timeline.append((_TL_REVOKED, now, _rank_name(rank_key)))
        self._close_producers(att)
        self._check_fenced(att, now)
        self._announce_end(att)

    def _close_producers(self, att: Attempt) -> None:
        if not att.p_ranks:
            return
        closed = rv_pb.StreamWriteOrdersResponse(
            closed=tr_pb.TransferClosed(key=att.key, state=att.state, reason=att.end_reason), send_time=timestamp(self._clock.wall())
        )
        for rank_key in att.p_ranks:
            mailbox = self._mailbox_for(rank_key)
            if mailbox is not None:
                mailbox.outbox.put(closed)

    def _check_fenced(self, att: Attempt, now: float) -> None:
        """Once every ordered rank answered or is lost, the attempt is fenced and the decode side is told."""
        if att.fenced:
            return
        for rank_key, answer in att.orders.items():
            if answer == _PENDING:
                if not self._rank_lost(rank_key):
                    return
                att.orders[rank_key] = _LOST
        att.fenced = True
        att.timeline.append((_TL_FENCED, now, ""))
        self._notify_decode(att, tr_pb.TRANSFER_EVENT_TYPE_ENDED)
        self._settle(att, now)

    def _notify_decode(self, att: Attempt, event_type: int) -> None:
        if att.dest is None:
            return  # the decode side never registered: nothing of it to release
        key = (att.d_engine_id, att.d_incarnation)
        mailbox = self._decoders.get(key)
        if mailbox is None:
            if self._engine_lost(*key):
                return
            mailbox = self._decoders[key] = _Mailbox(self._config.outbox_capacity)
        event = tr_pb.TransferEvent(
            key=att.key,
            client_request_id=att.client_request_id,
            type=event_type,
            state=att.state,
            reason=att.end_reason,
            detail=att.detail,
            event_time=timestamp(self._clock.wall()),
        )
        mailbox.outbox.put(rv_pb.StreamTransferEventsResponse(event=event))

    def _settle(self, att: Attempt, now: float) -> None:
        self._unsettled -= 1
        for engine_id in {att.p_engine_id, att.d_engine_id}:
            attempts = self._by_engine.get(engine_id)
            if attempts is not None:
                attempts.discard(att)
                if not attempts:
                    del self._by_engine[engine_id]
        if not self._settled and self._wakeup is not None:
            self._wakeup(now + self._config.retention_s)
        self._settled.append((now, att))

    def _forget(self, att: Attempt) -> None:
        record = self._transfers.get(att.transfer_id)
        if record is not None and record.attempts.get(att.number) is att:
            del record.attempts[att.number]
            if not record.attempts:
                del self._transfers[att.transfer_id]
        # A stale deadline entry may still point here until its time comes.
        att.dest = att.src = None
        att.timeline = []

    def _rank_lost(self, rank_key: RankKey) -> bool:
        engine = self._directory.get_engine(rank_key[0])
        if engine is None or engine.incarnation != rank_key[1]:
            return True
        return (rank_key[2], rank_key[3]) not in self._info(engine).positions

    def _engine_lost(self, engine_id: str, incarnation: str) -> bool:
        engine = self._directory.get_engine(engine_id)
        return engine is None or engine.incarnation != incarnation

    def _claim(self, mailbox: _Mailbox) -> Subscription:
        subscription = Subscription(mailbox)
        previous = mailbox.subscriber
        mailbox.subscriber = subscription
        if previous is not None:
            mailbox.outbox.wake()  # the replaced stream wakes, sees it is no longer active and ends
        return subscription

    # ----- responses and errors -----

    def _destination_response(self, att: Attempt) -> rv_pb.RegisterDestinationResponse:
        response = rv_pb.RegisterDestinationResponse(state=att.state, first_arrival=att.first_arrival, expected_notifications=att.plan.expected)
        if att.deadline != float("inf"):
            response.deadline.CopyFrom(timestamp(att.deadline + self._clock.wall() - self._clock.now()))
        return response

    def _prefill_response(self, att: Attempt) -> rv_pb.ReportPrefillDoneResponse:
        response = rv_pb.ReportPrefillDoneResponse(state=att.state, first_arrival=att.first_arrival)
        if att.deadline != float("inf"):
            response.deadline.CopyFrom(timestamp(att.deadline + self._clock.wall() - self._clock.now()))
        return response

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
