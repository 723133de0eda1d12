# SPDX-License-Identifier: Apache-2.0
"""BrokerCore: cancel by each actor and its tombstones, deadlines, the decode side's hold margin."""

from __future__ import annotations

import pytest
from broker_harness import (
    ENDED,
    FAILED_EVENT,
    FENCE_MARGIN,
    REVOKED,
    SKEW,
    STREAM_LEASE,
    WRITE_TIMEOUT,
    D,
    Harness,
    P,
    S,
    expect,
    seconds,
)

from kvpush import errors
from kvpush.clock import timestamp
from kvpush.dev import sample_engines as sample
from kvpush.errors import Reason
from kvpush.rendezvous.v1 import transfer_pb2 as tr_pb

# ----- cancel -----


@pytest.mark.parametrize(
    "caller, reason",
    [
        (None, S.END_REASON_CANCELLED_BY_ROUTER),
        (P, S.END_REASON_CANCELLED_BY_PREFILL),
        (D, S.END_REASON_CANCELLED_BY_DECODE),
    ],
)
def test_cancel_by_each_actor(caller, reason):
    """The router cancels as the router, an engine as the role it registered with."""
    h = Harness()
    h.register()
    h.prefill_done()
    h.messages()
    response = h.broker.cancel(tr_pb.TransferKey(transfer_id="t1", attempt=1), caller, "client left")
    assert (response.state, response.fenced) == (S.TRANSFER_STATE_CANCELLED, False)
    transfer = h.broker.get_transfer("t1", 1)
    assert (transfer.end_reason, transfer.detail) == (reason, "client left")
    assert h.kinds() == [("revocation", "t1", 1), ("closed", "t1", 1)]
    assert h.events() == [("t1", 1, FAILED_EVENT, reason)]
    h.write(outcome=REVOKED)
    assert h.events() == [("t1", 1, ENDED, reason)]
    assert h.broker.cancel(tr_pb.TransferKey(transfer_id="t1", attempt=1), caller, "again").fenced
    expect(errors.FailedPrecondition, Reason.TRANSFER_ENDED, "key", h.prefill_done, num_tokens=48)


def test_an_engine_may_cancel_only_its_own_transfers():
    h = Harness()
    h.registrar.register(sample.rank_request("decode-1", sample.DECODE))
    h.registrar.register(sample.rank_request("prefill-9", sample.PREFILL))
    h.register()
    key = tr_pb.TransferKey(transfer_id="t1", attempt=1)
    expect(errors.PermissionDenied, Reason.ENGINE_IDENTITY_MISMATCH, "key", h.broker.cancel, key, "decode-1")
    expect(errors.PermissionDenied, Reason.ENGINE_IDENTITY_MISMATCH, "key", h.broker.cancel, key, "prefill-9")
    assert h.state() == S.TRANSFER_STATE_WAITING_FOR_PREFILL


def test_a_caller_neither_the_router_nor_a_registered_engine_may_cancel_nothing_and_is_told_to_retry():
    """An engine this member's directory lacks may be one it has not caught up with yet (a member just restarted)."""
    h = Harness()
    h.register()
    for key in (tr_pb.TransferKey(transfer_id="t1", attempt=1), tr_pb.TransferKey(transfer_id="t1"), tr_pb.TransferKey(transfer_id="t2", attempt=1)):
        expect(errors.Unavailable, Reason.ENGINE_NOT_FOUND, "", h.broker.cancel, key, "stranger")
    assert h.state() == S.TRANSFER_STATE_WAITING_FOR_PREFILL
    assert h.broker.newest_attempt("t2") == 0  # not even a tombstone


def test_an_engine_that_left_cancels_nothing_more():
    h = Harness()
    h.register()
    h.prefill_done()
    for lease_id in h.leases[P]:
        h.registrar.deregister(lease_id, P)
    assert h.state() == S.TRANSFER_STATE_FAILED
    expect(errors.Unavailable, Reason.ENGINE_NOT_FOUND, "", h.cancel, caller=P)


def test_a_decode_cancel_of_an_attempt_only_prefill_reached_counts_when_prefill_named_that_engine():
    """A restarted member learns an attempt from whichever side speaks first: P's report names its decode engine."""
    h = Harness()
    h.prefill_done(decode_engine_id=D)
    assert h.cancel(caller=D).state == S.TRANSFER_STATE_CANCELLED
    assert h.broker.get_transfer("t1", 1).end_reason == S.END_REASON_CANCELLED_BY_DECODE
    h.prefill_done(transfer_id="t2")  # names no decode engine: D's cancel waits for what says whose attempt it is
    expect(errors.Unavailable, Reason.TRANSFER_NOT_FOUND, "", h.cancel, transfer_id="t2", caller=D)
    h.registrar.register(sample.rank_request("decode-1", sample.DECODE))
    h.prefill_done(transfer_id="t3", decode_engine_id="decode-1")
    expect(errors.PermissionDenied, Reason.ENGINE_IDENTITY_MISMATCH, "key", h.cancel, transfer_id="t3", caller=D)


def test_cancelling_every_attempt_and_unknown_attempts():
    h = Harness()
    h.register(attempt=1)
    h.prefill_done(attempt=2)
    response = h.broker.cancel(tr_pb.TransferKey(transfer_id="t1"), None)
    assert (response.state, response.fenced) == (S.TRANSFER_STATE_CANCELLED, True)
    assert h.state(attempt=1) == S.TRANSFER_STATE_SUPERSEDED
    expect(errors.NotFound, Reason.TRANSFER_NOT_FOUND, "key.transfer_id", h.broker.cancel, tr_pb.TransferKey(transfer_id="t9"), None)
    # The router cancelling an attempt nobody reported yet refuses its late messages and supersedes older ones.
    h.register("t2", attempt=1)
    h.broker.cancel(tr_pb.TransferKey(transfer_id="t2", attempt=2), None)
    assert h.state("t2", attempt=1) == S.TRANSFER_STATE_SUPERSEDED
    assert h.broker.newest_attempt("t2") == 2
    expect(errors.FailedPrecondition, Reason.TRANSFER_ENDED, "key", h.register, transfer_id="t2", attempt=2)
    assert h.kinds() == [("closed", "t1", 1), ("closed", "t1", 2), ("closed", "t2", 1)]


def test_an_engines_cancel_of_an_unseen_attempt_is_a_tombstone_that_supersedes_nothing():
    h = Harness()
    h.register(attempt=1)
    response = h.cancel(attempt=2, caller=D)
    assert (response.state, response.fenced) == (S.TRANSFER_STATE_CANCELLED, True)
    # Attempt 1 lives on: an engine acts for itself only.
    assert h.state(attempt=1) == S.TRANSFER_STATE_WAITING_FOR_PREFILL
    assert h.broker.newest_attempt("t1") == 1
    error = expect(errors.FailedPrecondition, Reason.TRANSFER_ENDED, "key", h.register, attempt=2)  # its late registration
    assert error.metadata["fenced"] == "true"
    h.prefill_done(attempt=1)
    assert h.write(attempt=1) == S.TRANSFER_STATE_DONE
    # The same for the prefill side; an attempt older than the newest is superseded already.
    h.register("t2", attempt=1)
    h.cancel("t2", attempt=3, caller=P)
    expect(errors.FailedPrecondition, Reason.TRANSFER_ENDED, "key", h.prefill_done, "t2", attempt=3)
    assert h.state("t2", attempt=1) == S.TRANSFER_STATE_WAITING_FOR_PREFILL
    h.register("t3", attempt=2)
    expect(errors.Aborted, Reason.TRANSFER_SUPERSEDED, "key.attempt", h.cancel, "t3", attempt=1, caller=D)
    # Only the router's cancel supersedes.
    h.cancel("t2", attempt=4)
    assert h.state("t2", attempt=1) == S.TRANSFER_STATE_SUPERSEDED


def test_a_prefill_arriving_after_the_decode_side_cancelled_is_closed_on_every_rank():
    """D's full prefix hit cancels before P is done: every P rank lets its blocks go at once, not at its hold's end."""
    h = Harness(p_tp=2)
    h.cancel("t-hit", caller=D, detail="decode side had the whole prompt cached")
    assert h.kinds(0) == h.kinds(1) == []
    expect(errors.FailedPrecondition, Reason.TRANSFER_ENDED, "key", h.prefill_done, "t-hit")
    assert h.kinds(0) == h.kinds(1) == [("closed", "t-hit", 1)]
    # A prefill-done from an incarnation of P that is not the registered one closes nothing.
    h.cancel("t-hit2", caller=D)
    expect(errors.FailedPrecondition, Reason.TRANSFER_ENDED, "key", h.prefill_done, "t-hit2", incarnation="inc-0")
    assert h.kinds(0) == h.kinds(1) == []


def test_an_engines_tombstone_is_not_the_transfers_newest_attempt_for_queries_either():
    h = Harness()
    h.register(attempt=1)
    h.cancel(attempt=2, caller=D)
    assert h.broker.newest_attempt("t1") == 1
    # GetTransfer's attempt 0 means the newest attempt: the live one, not the engine's tombstone.
    transfer = h.broker.get_transfer("t1", 0)
    assert (transfer.key.attempt, transfer.state) == (1, S.TRANSFER_STATE_WAITING_FOR_PREFILL)


# ----- deadlines -----


def test_registration_deadline_fails_the_attempt_and_tick_says_when():
    h = Harness()
    h.register(timeout_s=5)
    assert h.broker.tick() == h.clock.now() + 5
    h.clock.advance(4.5)
    h.broker.tick()
    assert h.state() == S.TRANSFER_STATE_WAITING_FOR_PREFILL
    h.clock.advance(0.5)
    h.broker.tick()
    assert h.state() == S.TRANSFER_STATE_FAILED
    assert h.events() == [("t1", 1, ENDED, S.END_REASON_REGISTRATION_DEADLINE_EXCEEDED)]
    assert h.kinds() == [("closed", "t1", 1)]  # P may hold blocks for it: release
    assert h.broker.metrics.registry.get_sample_value("kvpush_broker_expiries_total") == 1


def test_prefill_deadline_when_it_is_the_earlier():
    h = Harness()
    h.prefill_done(timeout_s=3)
    h.register(timeout_s=30)
    h.messages()
    h.clock.advance(3)
    # Nothing more is due until the rank answers or its order's bound passes.
    assert h.broker.tick() == h.clock.now() + WRITE_TIMEOUT + FENCE_MARGIN
    assert h.state() == S.TRANSFER_STATE_FAILED
    assert h.broker.get_transfer("t1", 1).end_reason == S.END_REASON_PREFILL_DEADLINE_EXCEEDED
    assert h.events() == [("t1", 1, FAILED_EVENT, S.END_REASON_PREFILL_DEADLINE_EXCEEDED)]  # the order is unanswered
    h.write(outcome=REVOKED)
    assert h.events() == [("t1", 1, ENDED, S.END_REASON_PREFILL_DEADLINE_EXCEEDED)]


def test_wakeup_is_called_only_for_an_earlier_deadline():
    h = Harness()
    wakes: list[float] = []
    h.broker.set_wakeup(wakes.append)
    h.register("t1", timeout_s=10)
    h.register("t2", timeout_s=20)
    h.register("t3", timeout_s=5)
    assert wakes == [h.clock.now() + 10, h.clock.now() + 5]


def test_the_registrations_own_deadline_less_the_skew_allowance_bounds_the_attempt():
    h = Harness()
    start = h.clock.now()
    response = h.register(timeout_s=30, deadline_in=10)
    assert response.deadline == timestamp(h.clock.wall() + 10 - SKEW)
    h.prefill_done()
    [message] = h.messages()
    assert seconds(message.order.write_budget) == 10 - 2 * SKEW  # the rank's clock may run ahead too
    assert h.broker.tick() == start + 10 - SKEW
    h.advance(9.5)
    assert h.state() == S.TRANSFER_STATE_MATCHED
    h.advance(0.25)
    transfer = h.broker.get_transfer("t1", 1)
    assert (transfer.state, transfer.end_reason) == (S.TRANSFER_STATE_FAILED, S.END_REASON_REGISTRATION_DEADLINE_EXCEEDED)
    # The timeout still counts when it ends first.
    assert h.register("t2", timeout_s=5, deadline_in=60).deadline == timestamp(h.clock.wall() + 5)


@pytest.mark.parametrize("deadline_in", [SKEW, 0.1, -5.0], ids=["within the skew allowance", "sooner", "in the past"])
def test_a_registration_whose_deadline_has_passed_is_refused(deadline_in):
    h = Harness()
    error = expect(errors.FailedPrecondition, Reason.DEADLINE_PASSED, "deadline", h.register, deadline_in=deadline_in)
    assert error.metadata["fenced"] == "true"
    assert h.state() == S.TRANSFER_STATE_FAILED  # remembered: a late copy is refused too
    assert h.broker.live_attempts == 0


def test_a_deadline_too_close_for_any_write_sends_no_order():
    h = Harness(early=True)
    h.register(deadline_in=0.4)  # accepted, but under the skew allowance is left for a write
    h.prefill_done()
    assert h.messages() == []
    h.advance(0.2)
    assert h.state() == S.TRANSFER_STATE_FAILED
    assert h.events() == [("t1", 1, ENDED, S.END_REASON_REGISTRATION_DEADLINE_EXCEEDED)]  # nothing ordered: fenced at once


# ----- the decode side's hold margin -----


def test_a_hold_margin_shortens_the_write_timeout_of_the_attempts_orders_and_its_fencing_bound():
    h = Harness()
    h.register(hold_margin=2.5)
    h.prefill_done()
    [message] = h.messages()
    assert seconds(message.order.write_timeout) == 2.5 - FENCE_MARGIN
    h.unsubscribe_producer(0)
    h.cancel()
    assert h.broker.tick() == h.clock.now() + STREAM_LEASE + (2.5 - FENCE_MARGIN) + FENCE_MARGIN
    # A hold margin with room for the broker's own write timeout leaves it alone.
    h.subscribe_producer(0, early=False)
    h.register("t2", hold_margin=60)
    h.prefill_done("t2")
    assert [seconds(m.order.write_timeout) for m in h.messages() if m.HasField("order")] == [WRITE_TIMEOUT]


@pytest.mark.parametrize(
    "hold_margin, reason",
    [(FENCE_MARGIN + 0.05, Reason.FIELD_OUT_OF_RANGE), (601.0, Reason.FIELD_OUT_OF_RANGE), (0.0, Reason.FIELD_REQUIRED)],
    ids=["no room for a write", "too long", "zero"],
)
def test_a_hold_margin_without_room_for_a_write_is_refused(hold_margin, reason):
    h = Harness()
    expect(errors.InvalidArgument, reason, "hold_margin", h.register, hold_margin=hold_margin)
