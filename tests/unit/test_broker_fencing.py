# SPDX-License-Identifier: Apache-2.0
"""BrokerCore: supersession, fencing by answers and by time, the startup grace, refusals the decode side may act on."""

from __future__ import annotations

from broker_harness import (
    ENDED,
    FAILED,
    FAILED_EVENT,
    FENCE_MARGIN,
    REVOKED,
    STREAM_LEASE,
    WRITE_TIMEOUT,
    WRITTEN,
    D,
    Harness,
    P,
    S,
    expect,
)

from kvpush import errors
from kvpush.errors import Reason
from kvpush.rendezvous.v1 import transfer_pb2 as tr_pb
from kvpush.services.broker.config import BrokerConfig

# ----- supersession and fencing by answers -----


def test_a_reissue_supersedes_the_old_attempt_and_decode_reuses_its_blocks_only_once_fenced():
    h = Harness()
    h.register(attempt=1)
    h.prefill_done(attempt=1)
    assert h.kinds() == [("order", "t1", 1)]
    h.register(attempt=2, first_block=10)
    assert h.state(attempt=1) == S.TRANSFER_STATE_SUPERSEDED
    assert h.kinds() == [("revocation", "t1", 1), ("closed", "t1", 1)]
    # The old order is unanswered: its blocks may still be written, so FAILED, not ENDED.
    assert h.events() == [("t1", 1, FAILED_EVENT, S.END_REASON_SUPERSEDED)]
    assert not h.fenced(attempt=1)
    # Other messages for attempt 1 are refused; its rank's answer is still taken.
    expect(errors.FailedPrecondition, Reason.TRANSFER_ENDED, "key", h.prefill_done, attempt=1, num_tokens=48)
    assert h.write(attempt=1, outcome=REVOKED) == S.TRANSFER_STATE_SUPERSEDED
    assert h.events() == [("t1", 1, ENDED, S.END_REASON_SUPERSEDED)]
    assert h.fenced(attempt=1)
    # Attempt 2 runs normally and never orders attempt 1 again.
    h.prefill_done(attempt=2)
    assert h.kinds() == [("order", "t1", 2)]
    assert h.write(attempt=2) == S.TRANSFER_STATE_DONE
    assert h.broker.metrics.registry.get_sample_value("kvpush_broker_supersessions_total") == 1


def test_a_stale_write_after_supersession_counts_as_its_fencing_answer():
    h = Harness()
    h.register(attempt=1)
    h.prefill_done(attempt=1)
    h.prefill_done(attempt=3)
    assert h.write(attempt=1, outcome=WRITTEN) == S.TRANSFER_STATE_SUPERSEDED
    assert h.events() == [("t1", 1, FAILED_EVENT, S.END_REASON_SUPERSEDED), ("t1", 1, ENDED, S.END_REASON_SUPERSEDED)]
    assert h.broker.get_transfer("t1", 1).bytes_written == 4096
    expect(errors.Aborted, Reason.TRANSFER_SUPERSEDED, "key.attempt", h.register, attempt=2)


def test_a_superseded_attempt_without_orders_is_fenced_at_once():
    h = Harness()
    h.register(attempt=1)
    h.register(attempt=2)
    assert h.events() == [("t1", 1, ENDED, S.END_REASON_SUPERSEDED)]
    assert h.kinds() == [("closed", "t1", 1)]


def test_a_failed_write_fails_the_attempt_and_revokes_the_other_ranks():
    h = Harness(p_tp=2, d_tp=2)
    h.register()
    h.prefill_done()
    h.messages(0), h.messages(1)
    assert h.write(tp=0, outcome=FAILED) == S.TRANSFER_STATE_FAILED
    assert h.kinds(1) == [("revocation", "t1", 1), ("closed", "t1", 1)]
    assert h.events() == [("t1", 1, FAILED_EVENT, S.END_REASON_WRITE_FAILED)]
    h.write(tp=1, outcome=WRITTEN)  # it had already posted
    assert h.events() == [("t1", 1, ENDED, S.END_REASON_WRITE_FAILED)]
    assert h.broker.metrics.registry.get_sample_value("kvpush_broker_failures_total", {"reason": "END_REASON_WRITE_FAILED"}) == 1


def test_a_ranks_reason_for_not_writing_becomes_the_attempts_end_reason():
    h = Harness(early=True)
    h.register()
    h.messages()
    # The rank's own prefill computed too few tokens for the early order.
    assert h.write(outcome=REVOKED, reason=S.END_REASON_TOKEN_COUNT_MISMATCH) == S.TRANSFER_STATE_FAILED
    transfer = h.broker.get_transfer("t1", 1)
    assert (transfer.end_reason, transfer.fenced) == (S.END_REASON_TOKEN_COUNT_MISMATCH, True)  # its only rank answered
    assert h.events() == [("t1", 1, ENDED, S.END_REASON_TOKEN_COUNT_MISMATCH)]
    assert h.kinds() == [("closed", "t1", 1)]  # nothing is left to revoke
    assert h.broker.metrics.registry.get_sample_value("kvpush_broker_failures_total", {"reason": "END_REASON_TOKEN_COUNT_MISMATCH"}) == 1
    expect(errors.InvalidArgument, Reason.FIELD_INVALID, "reason", lambda: h.write("t9", outcome=FAILED, reason=99))


def test_a_write_result_from_a_rank_without_an_order_is_refused():
    h = Harness(p_tp=2, d_tp=1, heads=1)
    h.register()
    h.prefill_done()
    expect(errors.InvalidArgument, Reason.FIELD_INVALID, "tp_rank", h.write, tp=1)
    expect(errors.NotFound, Reason.TRANSFER_NOT_FOUND, "key", h.write, transfer_id="t9")


# ----- fencing by time -----


def test_a_rank_still_attached_is_fenced_by_its_order_budget_plus_write_timeout():
    h = Harness(p_tp=2, d_tp=2)
    start = h.clock.now()
    h.register(timeout_s=60)
    h.prefill_done(timeout_s=60)
    h.cancel()
    h.write(tp=0, outcome=REVOKED)
    # Rank 1 never answers, but its stream stays attached: it may post until the order's budget end.
    bound = start + 60 + WRITE_TIMEOUT + FENCE_MARGIN
    h.clock.advance(bound - start - 0.5)
    h.broker.tick()
    assert not h.fenced() and h.events() == [("t1", 1, FAILED_EVENT, S.END_REASON_CANCELLED_BY_ROUTER)]
    h.advance(0.5)
    assert h.fenced() and h.events() == [("t1", 1, ENDED, S.END_REASON_CANCELLED_BY_ROUTER)]
    timeline = h.broker.get_transfer("t1", 1).timeline
    assert [e.detail for e in timeline if e.kind == S.TIMELINE_ENTRY_KIND_WRITE_RESULT][-1] == f"{P} tp 1 pp 0 no answer: fenced by time"
    h.write(tp=1, outcome=REVOKED)  # a late answer is still taken


def test_a_rank_whose_stream_ended_is_fenced_by_its_stream_lease_plus_write_timeout():
    h = Harness(p_tp=2, d_tp=2)
    h.register(timeout_s=60)
    h.prefill_done(timeout_s=60)
    h.unsubscribe_producer(1)  # rank 1 acts on nothing it got once stream_lease passed without a message
    quiet = h.clock.now()
    h.clock.advance(1)
    h.cancel()
    h.write(tp=0, outcome=REVOKED)
    bound = quiet + STREAM_LEASE + WRITE_TIMEOUT + FENCE_MARGIN
    assert h.broker.tick() == bound
    h.clock.advance(bound - h.clock.now() - 0.5)
    h.broker.tick()
    assert not h.fenced()
    h.advance(0.5)
    assert h.fenced()
    assert h.events() == [("t1", 1, FAILED_EVENT, S.END_REASON_CANCELLED_BY_ROUTER), ("t1", 1, ENDED, S.END_REASON_CANCELLED_BY_ROUTER)]


def test_a_rank_that_resubscribes_is_attached_again_and_gets_its_revocation():
    h = Harness()
    h.register(timeout_s=60)
    h.prefill_done(timeout_s=60)
    h.messages()
    h.unsubscribe_producer(0)
    h.cancel()
    h.subscribe_producer(0, early=False)
    assert h.kinds() == [("revocation", "t1", 1), ("closed", "t1", 1)]
    h.clock.advance(STREAM_LEASE + WRITE_TIMEOUT + FENCE_MARGIN)
    h.broker.tick()
    assert not h.fenced()  # attached again: only its budget end bounds it
    h.write(outcome=REVOKED)
    assert h.fenced()


def test_the_order_budget_bounds_fencing_when_it_ends_before_the_stream_lease():
    h = Harness()
    start = h.clock.now()
    h.register(timeout_s=2)
    h.prefill_done()
    h.messages()
    h.unsubscribe_producer(0)  # stream lease bound: start + 3; the budget ends at start + 2
    assert h.advance(2) == start + 2 + WRITE_TIMEOUT + FENCE_MARGIN
    assert h.state() == S.TRANSFER_STATE_FAILED
    assert h.events() == [("t1", 1, FAILED_EVENT, S.END_REASON_REGISTRATION_DEADLINE_EXCEEDED)]
    h.advance(3.5)
    assert not h.fenced()
    h.advance(0.5)
    assert h.fenced() and h.events() == [("t1", 1, ENDED, S.END_REASON_REGISTRATION_DEADLINE_EXCEEDED)]


# ----- the startup grace -----


def test_a_new_broker_fences_nothing_with_orders_or_a_destination_during_its_startup_grace():
    h = Harness(past_grace=False)
    grace_end = h.clock.now() + h.config.startup_grace_s
    assert h.config.startup_grace_s == STREAM_LEASE + WRITE_TIMEOUT + FENCE_MARGIN
    h.register("t1")
    h.prefill_done("t1")
    h.messages()
    h.cancel("t1")
    h.write("t1", outcome=REVOKED)  # even every answer in: a predecessor's order for the key may still be acted on
    h.register("t2")
    h.cancel("t2")  # a destination, no orders
    h.prefill_done("t3")
    h.cancel("t3")  # neither: nothing of it can be written anywhere
    assert (h.fenced("t1"), h.fenced("t2"), h.fenced("t3")) == (False, False, True)
    assert h.events() == [("t1", 1, FAILED_EVENT, S.END_REASON_CANCELLED_BY_ROUTER), ("t2", 1, FAILED_EVENT, S.END_REASON_CANCELLED_BY_ROUTER)]
    assert not h.broker.cancel(tr_pb.TransferKey(transfer_id="t1", attempt=1), None).fenced
    assert h.broker.tick() == grace_end
    h.advance(grace_end - h.clock.now() - 0.5)
    assert not h.fenced("t1")
    h.advance(0.5)
    assert h.fenced("t1") and h.fenced("t2")
    assert sorted(h.events()) == [("t1", 1, ENDED, S.END_REASON_CANCELLED_BY_ROUTER), ("t2", 1, ENDED, S.END_REASON_CANCELLED_BY_ROUTER)]


def test_refusals_during_the_startup_grace_vouch_for_nothing_and_leave_no_tombstone():
    h = Harness(past_grace=False)
    error = expect(errors.InvalidArgument, Reason.BLOCK_ID_OUT_OF_RANGE, "destination.blocks[0].block_ids[2]", h.register, first_block=998)
    assert error.metadata["fenced"] == "false"
    expect(errors.NotFound, Reason.TRANSFER_NOT_FOUND, "transfer_id", h.broker.get_transfer, "t1", 1)
    h.clock.advance(h.config.startup_grace_s)
    error = expect(errors.InvalidArgument, Reason.BLOCK_ID_OUT_OF_RANGE, "destination.blocks[0].block_ids[2]", h.register, first_block=998)
    assert error.metadata["fenced"] == "true"
    transfer = h.broker.get_transfer("t1", 1)
    assert (transfer.state, transfer.end_reason, transfer.fenced) == (S.TRANSFER_STATE_FAILED, S.END_REASON_REGISTRATION_REFUSED, True)


# ----- refusals the decode side may act on -----


def test_a_refused_registration_is_remembered_until_its_deadline_so_a_late_copy_is_refused_too():
    h = Harness(config=BrokerConfig(retention_s=5.0))
    request = h.destination(first_block=998, timeout_s=20)
    error = expect(errors.InvalidArgument, Reason.BLOCK_ID_OUT_OF_RANGE, "destination.blocks[0].block_ids[2]", h.broker.register_destination, request, D)
    assert error.metadata == {"field": "destination.blocks[0].block_ids[2]", "fenced": "true"}
    transfer = h.broker.get_transfer("t1", 1)
    assert (transfer.state, transfer.end_reason, transfer.fenced) == (S.TRANSFER_STATE_FAILED, S.END_REASON_REGISTRATION_REFUSED, True)
    assert "is not below num_blocks" in transfer.detail
    assert h.events() == [] and h.kinds() == []  # the refusal itself told the decode side
    h.advance(10)
    late = expect(errors.FailedPrecondition, Reason.TRANSFER_ENDED, "key", h.broker.register_destination, request, D)
    assert late.metadata["fenced"] == "true"
    corrected = expect(errors.FailedPrecondition, Reason.TRANSFER_ENDED, "key", h.register, timeout_s=20)
    assert corrected.metadata["fenced"] == "true"
    # Each copy keeps the tombstone until its own deadline (past retention).
    assert h.broker.tick() == h.clock.now() + 20
    h.advance(19.5)
    assert h.state() == S.TRANSFER_STATE_FAILED
    h.advance(0.5)
    expect(errors.NotFound, Reason.TRANSFER_NOT_FOUND, "transfer_id", h.broker.get_transfer, "t1", 1)
    assert h.broker.remembered_attempts == 0 and h.broker.memory_sizes["transfers"] == 0


def test_a_refusal_of_an_older_unknown_attempt_is_remembered_as_superseded():
    h = Harness()
    h.register(attempt=2)
    error = expect(errors.Aborted, Reason.TRANSFER_SUPERSEDED, "key.attempt", h.register, attempt=1)
    assert error.metadata["fenced"] == "true"
    transfer = h.broker.get_transfer("t1", 1)
    assert (transfer.state, transfer.end_reason, transfer.fenced) == (S.TRANSFER_STATE_SUPERSEDED, S.END_REASON_SUPERSEDED, True)
    assert h.broker.newest_attempt("t1") == 2
    expect(errors.FailedPrecondition, Reason.TRANSFER_ENDED, "key", h.register, attempt=1)  # a late copy
    assert h.state(attempt=2) == S.TRANSFER_STATE_WAITING_FOR_PREFILL
    assert h.events() == []


def test_a_refused_registration_of_a_new_attempt_still_supersedes_the_older_ones():
    h = Harness()
    h.register(attempt=1)
    expect(errors.InvalidArgument, Reason.BLOCK_ID_OUT_OF_RANGE, "destination.blocks[0].block_ids[2]", h.register, attempt=2, first_block=998)
    assert h.state(attempt=2) == S.TRANSFER_STATE_FAILED
    assert h.state(attempt=1) == S.TRANSFER_STATE_SUPERSEDED
    assert h.broker.newest_attempt("t1") == 2
    assert h.events() == [("t1", 1, ENDED, S.END_REASON_SUPERSEDED)]


def test_refusals_of_what_no_broker_accepts_from_this_caller_vouch_without_a_tombstone():
    h = Harness()
    error = expect(errors.InvalidArgument, Reason.FIELD_INVALID, "key.transfer_id", h.register, transfer_id="t 1")
    assert error.metadata["fenced"] == "true"
    request = h.destination(decode_engine_id="decode-1")  # not the caller's blocks
    error = expect(errors.PermissionDenied, Reason.ENGINE_IDENTITY_MISMATCH, "destination.engine_id", h.broker.register_destination, request, D)
    assert error.metadata["fenced"] == "true"
    assert h.broker.remembered_attempts == 0


def test_a_refusal_the_broker_cannot_remember_vouches_for_nothing():
    h = Harness(config=BrokerConfig(max_unsettled_attempts=1))
    h.register("t1")
    error = expect(errors.ResourceExhausted, Reason.TOO_MANY_TRANSFERS, "key", h.register, "t2")
    assert error.metadata["fenced"] == "false"  # its blocks wait for their deadline and hold margin


def test_a_refused_second_arrival_repeats_its_refusal_and_its_fencing():
    h = Harness()
    h.prefill_done(num_tokens=32)
    first = expect(errors.FailedPrecondition, Reason.TOKEN_COUNT_MISMATCH, "destination.num_tokens", h.register, num_tokens=40)
    again = expect(errors.FailedPrecondition, Reason.TOKEN_COUNT_MISMATCH, "destination.num_tokens", h.register, num_tokens=40)
    assert first.metadata["fenced"] == again.metadata["fenced"] == "true"  # no order was sent
