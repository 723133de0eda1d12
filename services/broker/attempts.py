# SPDX-License-Identifier: Apache-2.0
"""What the broker remembers of one transfer attempt and of the orders it sent.

An Attempt is keyed (transfer_id, attempt). Its state moves only forward:

    NEW ─▶ WAITING_FOR_PREFILL ─┐
       └─▶ WAITING_FOR_REGISTRATION ─┴▶ MATCHED ─▶ WRITING ─▶ DONE
    any live state ─▶ FAILED | CANCELLED | SUPERSEDED      (ended)
    ended ─▶ fenced (no WRITE can land any more) ─▶ settled ─▶ forgotten

An OrderRecord is one WriteOrder to one producer rank. Until the rank
answers, it may still post a WRITE: at the latest at `budget_end` (the rank
drops an order its budget or its stream lease ran out on), and that WRITE
lands within `write_timeout` of its post (the rank aborts it then).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvpush.rendezvous.v1 import rendezvous_service_pb2 as rv_pb
from kvpush.rendezvous.v1 import transfer_pb2 as tr_pb

if TYPE_CHECKING:
    from kvpush.services.broker.plans import Plan  # plans.py imports RankKey from here

# (engine_id, incarnation, tp_rank, pp_rank): one producer rank.
RankKey = tuple[str, str, int, int]

WAITING_FOR_PREFILL = tr_pb.TRANSFER_STATE_WAITING_FOR_PREFILL
WAITING_FOR_REGISTRATION = tr_pb.TRANSFER_STATE_WAITING_FOR_REGISTRATION
MATCHED = tr_pb.TRANSFER_STATE_MATCHED
WRITING = tr_pb.TRANSFER_STATE_WRITING
DONE = tr_pb.TRANSFER_STATE_DONE
FAILED = tr_pb.TRANSFER_STATE_FAILED
CANCELLED = tr_pb.TRANSFER_STATE_CANCELLED
SUPERSEDED = tr_pb.TRANSFER_STATE_SUPERSEDED
NEW = tr_pb.TRANSFER_STATE_UNSPECIFIED  # an attempt being created, before its first state
TERMINAL = frozenset((DONE, FAILED, CANCELLED, SUPERSEDED))
LIVE = (WAITING_FOR_PREFILL, WAITING_FOR_REGISTRATION, MATCHED, WRITING)

DECODE_SIDE = tr_pb.TRANSFER_SIDE_DECODE
PREFILL_SIDE = tr_pb.TRANSFER_SIDE_PREFILL

# OrderRecord.answer besides the WriteOutcome values: nothing heard yet, or
# the fencing bound passed without an answer (the rank can no longer write).
UNANSWERED = 0
TIMED_OUT = -1
WRITTEN = tr_pb.WRITE_OUTCOME_WRITTEN

TL_REGISTERED = tr_pb.TIMELINE_ENTRY_KIND_REGISTERED
TL_PREFILL_DONE = tr_pb.TIMELINE_ENTRY_KIND_PREFILL_DONE
TL_ORDER_SENT = tr_pb.TIMELINE_ENTRY_KIND_ORDER_SENT
TL_WRITE_RESULT = tr_pb.TIMELINE_ENTRY_KIND_WRITE_RESULT
TL_REVOKED = tr_pb.TIMELINE_ENTRY_KIND_REVOKED
TL_ENDED = tr_pb.TIMELINE_ENTRY_KIND_ENDED
TL_FENCED = tr_pb.TIMELINE_ENTRY_KIND_FENCED


def rank_name(key: RankKey) -> str:
    return f"{key[0]} tp {key[2]} pp {key[3]}"


class OrderRecord:
    """One order to one producer rank, and its answer."""

    __slots__ = ("answer", "budget_end", "write_timeout", "early")

    def __init__(self, budget_end: float, write_timeout: float, early: bool):
        self.answer = UNANSWERED
        self.budget_end = budget_end  # broker monotonic time after which the rank posts nothing for it
        self.write_timeout = write_timeout
        self.early = early


class TransferRecord:
    """Every remembered attempt of one transfer_id, and the newest attempt number seen."""

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
        "write_timeout",
        "keep_until",
        "plan",
        "orders",
        "written",
        "bytes_written",
        "timeline",
        "trace",
        "fenced",
        "rejection",
    )

    def __init__(self, transfer_id: str, number: int, now: float):
        self.transfer_id = transfer_id
        self.number = number
        self.key = tr_pb.TransferKey(transfer_id=transfer_id, attempt=number)
        self.state: tr_pb.TransferState = NEW
        self.end_reason: tr_pb.EndReason = tr_pb.END_REASON_UNSPECIFIED
        self.detail = ""
        self.first_arrival: tr_pb.TransferSide = tr_pb.TRANSFER_SIDE_UNSPECIFIED
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
        self.write_timeout = 0.0
        # Not forgotten before this (monotonic): a refused registration's
        # identical late copy must find this record until its deadline.
        self.keep_until = now
        self.plan: Plan | None = None  # set by the decode side's arrival (the prefill side's, once it names its decode engine)
        self.orders: dict[RankKey, OrderRecord] = {}
        self.written = 0
        self.bytes_written = 0
        self.timeline: list[tuple[int, float, str]] = []
        self.trace = None  # the tracing adapter's per-attempt state
        self.fenced = False
        # rejection: (side, error) when the second arrival was refused and
        # failed the attempt, so an identical repeat gets the same error.
        self.rejection: tuple[tr_pb.TransferSide, Exception] | None = None

    @property
    def ended(self) -> bool:
        return self.state in TERMINAL

    def note(self, kind: int, now: float, detail: str = "") -> None:
        self.timeline.append((kind, now, detail))

    def unanswered(self) -> list[tuple[RankKey, OrderRecord]]:
        return [(rank, order) for rank, order in self.orders.items() if order.answer == UNANSWERED]
