# SPDX-License-Identifier: Apache-2.0
"""Checks on one broker request that need no broker state beyond its attempt.

Who may name an engine, what a key must hold, whether a repeat is the same
arrival, whether the two sides agree, and the deadline and write timeout a
registration asks for. Each refusal names its reason and field.
"""

from __future__ import annotations

from kvpush.errors import AlreadyExists, FailedPrecondition, InvalidArgument, PermissionDenied, Reason
from kvpush.rendezvous.v1 import rendezvous_service_pb2 as rv_pb
from kvpush.rendezvous.v1 import transfer_pb2 as tr_pb
from kvpush.services.broker import attempts as a
from kvpush.services.broker.attempts import Attempt
from kvpush.services.broker.config import BrokerConfig
from kvpush.services.broker.plans import invalid
from kvpush.services.common import validation

_OUTCOMES = frozenset(tr_pb.WriteOutcome.values()) - {0}
_END_REASONS = frozenset(tr_pb.EndReason.values()) - {0}
_EVENT_TYPES = frozenset(tr_pb.TransferEventType.values()) - {0}


def identity_mismatch(field: str, named: str, caller: str) -> PermissionDenied:
    return PermissionDenied(f"the caller is {caller!r}, not engine {named!r}", reason=Reason.ENGINE_IDENTITY_MISMATCH, field=field)


def check_caller(engine_id: str, caller_engine_id: str, field: str) -> None:
    """engine_id must be the caller's (an authenticated, hence well-formed, id)."""
    if engine_id == caller_engine_id and engine_id:
        return
    validation.check_id(engine_id, field)
    raise identity_mismatch(field, engine_id, caller_engine_id)


def event_types(requested) -> frozenset[int] | None:
    """The event types a decode stream asked for (None: every type); each must be a defined type."""
    for value in requested:
        validation.check_enum(value, _EVENT_TYPES, "event_types")
    return frozenset(requested) if requested else None


def check_key(key: tr_pb.TransferKey) -> tuple[str, int]:
    validation.check_id(key.transfer_id, "key.transfer_id")
    if key.attempt == 0:
        raise InvalidArgument("key.attempt counts from 1", reason=Reason.FIELD_REQUIRED, field="key.attempt")
    return key.transfer_id, key.attempt


def check_write_result(request: rv_pb.ReportWriteResultRequest, caller_engine_id: str) -> tuple[str, int]:
    """The report's own fields; returns its (transfer_id, attempt)."""
    key = check_key(request.key)
    check_caller(request.engine_id, caller_engine_id, "engine_id")
    validation.check_enum(request.outcome, _OUTCOMES, "outcome")
    if request.reason and request.reason not in _END_REASONS:
        raise invalid(f"reason has unknown value {request.reason}", "reason")
    return key


def same_arrival(recorded, request, side: tr_pb.TransferSide) -> bool:
    """Whether request repeats the side's recorded request (a retry, answered as the first was)."""
    if side == a.DECODE_SIDE:
        return (recorded.destination == request.destination and recorded.prefill_engine_id == request.prefill_engine_id
                and recorded.client_request_id == request.client_request_id)
    return recorded.source == request.source and recorded.decode_engine_id == request.decode_engine_id and recorded.client_request_id == request.client_request_id


def check_sides_agree(att: Attempt, request, side: tr_pb.TransferSide) -> None:
    """The second arrival must name the engines the first one did."""
    if side == a.DECODE_SIDE:
        assert att.src is not None, "called for the second arrival: the prefill side came first"
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
    assert dest_req is not None, "called for the second arrival: the decode side came first"
    if dest_req.prefill_engine_id != src.engine_id:
        raise invalid(f"the decode side registered for prefill engine {dest_req.prefill_engine_id!r}", "source.engine_id")
    if att.p_incarnation != src.incarnation:
        raise FailedPrecondition(
            "the prefill engine restarted since the decode side registered", reason=Reason.INCARNATION_MISMATCH, field="source.incarnation"
        )
    if request.decode_engine_id and request.decode_engine_id != dest_req.destination.engine_id:
        raise invalid(f"decode engine {dest_req.destination.engine_id!r} registered for this attempt", "decode_engine_id")


def token_count_mismatch(src: tr_pb.Source, dest: tr_pb.Destination, second: tr_pb.TransferSide) -> FailedPrecondition | None:
    """The refusal of a rendezvous in which P computed fewer tokens than D wants (None: enough)."""
    needed = dest.first_token + dest.num_tokens
    if src.num_tokens >= needed:
        return None
    field = "destination.num_tokens" if second == a.DECODE_SIDE else "source.num_tokens"
    return FailedPrecondition(
        f"the prefill side computed {src.num_tokens} tokens; the destination needs {needed}", reason=Reason.TOKEN_COUNT_MISMATCH, field=field
    )


def requested_deadline(request: rv_pb.RegisterDestinationRequest, now: float, wall: float, config: BrokerConfig) -> float:
    """The decode engine's own deadline on the broker's monotonic clock, less the skew allowance (inf if unset)."""
    if not request.HasField("deadline"):
        return float("inf")
    requested_wall = request.deadline.seconds + request.deadline.nanos * 1e-9
    return now + (requested_wall - wall) - config.max_clock_skew_s


def write_timeout(request: rv_pb.RegisterDestinationRequest, config: BrokerConfig) -> float:
    """The write timeout of the attempt's orders: the broker's, shortened to fit the decode side's hold margin."""
    if not request.HasField("hold_margin"):
        return config.write_timeout_s
    margin = validation.positive_seconds(request.hold_margin, "hold_margin", config.max_timeout_s)
    fits = margin - config.fence_margin_s
    if fits < min(config.write_timeout_s, 0.1):
        raise InvalidArgument(
            f"hold_margin {margin:g}s leaves no time for a WRITE: it must exceed the broker's fence margin {config.fence_margin_s:g}s "
            f"by at least {min(config.write_timeout_s, 0.1):g}s",
            reason=Reason.FIELD_OUT_OF_RANGE,
            field="hold_margin",
        )
    return min(config.write_timeout_s, fits)


def conflict(att: Attempt, method: str) -> AlreadyExists:
    return AlreadyExists(
        f"{method} for transfer {att.transfer_id} attempt {att.number} already came with different content",
        reason=Reason.CONFLICTING_DUPLICATE,
        field="key",
    )


def ended_error(att: Attempt) -> FailedPrecondition:
    return FailedPrecondition(
        f"transfer {att.transfer_id} attempt {att.number} ended: {tr_pb.TransferState.Name(att.state)} ({att.detail})",
        reason=Reason.TRANSFER_ENDED,
        field="key",
    )
