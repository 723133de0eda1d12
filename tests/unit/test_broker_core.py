# SPDX-License-Identifier: Apache-2.0
"""BrokerCore: rendezvous in either order, orders, fencing (by answers, by time, after the startup grace),
supersession, tombstones, cancel, deadlines, engine loss, resyncs, validation and memory bounds."""

from __future__ import annotations

import pytest
from broker_harness import D, Harness, P
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvpush import errors
from kvpush.errors import Reason
from kvpush.rendezvous.v1 import rendezvous_service_pb2 as rv_pb
from kvpush.rendezvous.v1 import transfer_pb2 as tr_pb
from kvpush.services.broker.config import BrokerConfig
from kvpush.services.common import sample_engines as sample
from kvpush.services.common.clock import timestamp

S = tr_pb  # state and reason names are long; S.TRANSFER_STATE_DONE reads fine
COMPLETED = tr_pb.TRANSFER_EVENT_TYPE_COMPLETED
ENDED = tr_pb.TRANSFER_EVENT_TYPE_ENDED
FAILED_EVENT = tr_pb.TRANSFER_EVENT_TYPE_FAILED  # ended, not fenced yet: the decode side keeps its blocks
WRITTEN = tr_pb.WRITE_OUTCOME_WRITTEN
REVOKED = tr_pb.WRITE_OUTCOME_REVOKED
FAILED = tr_pb.WRITE_OUTCOME_FAILED

# The harness's BrokerConfig defaults: the numbers the fencing bounds are made of.
SKEW, WRITE_TIMEOUT, STREAM_LEASE, FENCE_MARGIN = 0.25, 3.0, 3.0, 1.0


def expect(error_type: type[errors.KvpushError], reason: str, field: str, call, *args, **kwargs) -> errors.KvpushError:
    with pytest.raises(error_type) as info:
        call(*args, **kwargs)
    assert (info.value.reason, info.value.field) == (reason, field), str(info.value)
    return info.value


def seconds(duration) -> float:
    return duration.ToNanoseconds() / 1e9


# ----- rendezvous -----


def test_decode_first_then_prefill_done_orders_the_producer_once():
    h = Harness()
    response = h.register()
    assert (response.state, response.first_arrival, response.fenced) == (S.TRANSFER_STATE_WAITING_FOR_PREFILL, S.TRANSFER_SIDE_DECODE, False)
    assert list(response.expected_notifications) == [1]
    assert response.deadline == timestamp(h.clock.wall() + 30)
    assert h.messages() == []  # no early orders asked for
    response = h.prefill_done()
    assert (response.state, response.first_arrival) == (S.TRANSFER_STATE_MATCHED, S.TRANSFER_SIDE_DECODE)
    [message] = h.messages()
    order = message.order
    assert order.HasField("source") and order.source.num_tokens == 40
    assert order.destination.engine_id == D and list(order.decode_tp_ranks) == [0]
    # The budget runs to the deadline less the skew allowance, measured by the rank from send_time.
    assert seconds(order.write_budget) == 30 - SKEW
    assert seconds(order.write_timeout) == WRITE_TIMEOUT
    assert message.send_time == timestamp(h.clock.wall())
    assert seconds(message.stream_lease) == STREAM_LEASE - SKEW
    assert h.write() == S.TRANSFER_STATE_DONE
    assert h.events() == [("t1", 1, COMPLETED, S.END_REASON_COMPLETED)]
    assert h.kinds() == [("closed", "t1", 1)]
    transfer = h.broker.get_transfer("t1", 1)
    assert transfer.fenced and transfer.bytes_written == 4096 and transfer.end_reason == S.END_REASON_COMPLETED
    assert [entry.kind for entry in transfer.timeline] == [
        S.TIMELINE_ENTRY_KIND_REGISTERED,
        S.TIMELINE_ENTRY_KIND_PREFILL_DONE,
        S.TIMELINE_ENTRY_KIND_ORDER_SENT,
        S.TIMELINE_ENTRY_KIND_WRITE_RESULT,
        S.TIMELINE_ENTRY_KIND_ENDED,
        S.TIMELINE_ENTRY_KIND_FENCED,
    ]
    # A completed attempt's blocks hold the KV: its repeat is not "fenced" (nothing to reuse).
    assert not h.register().fenced


def test_prefill_first_then_registration():
    h = Harness()
    response = h.prefill_done(timeout_s=20)
    assert (response.state, response.first_arrival) == (S.TRANSFER_STATE_WAITING_FOR_REGISTRATION, S.TRANSFER_SIDE_PREFILL)
    assert h.messages() == []
    h.clock.advance(2)
    response = h.register(timeout_s=30)
    assert (response.state, response.first_arrival) == (S.TRANSFER_STATE_MATCHED, S.TRANSFER_SIDE_PREFILL)
    [message] = h.messages()
    assert message.order.HasField("source")
    assert seconds(message.order.write_budget) == 18 - SKEW  # the prefill side's deadline is earlier
    assert h.broker.metrics.registry.get_sample_value("kvpush_broker_rendezvous_wait_seconds_sum") == pytest.approx(2.0)
    assert h.broker.metrics.registry.get_sample_value("kvpush_broker_rendezvous_total") == 1


def test_each_written_result_feeds_the_write_histogram():
    h = Harness()
    h.register()
    h.prefill_done()
    request = sample.write_result_request("t1")
    request.transfer_duration.FromMilliseconds(3)
    assert h.broker.report_write_result(request, P).state == S.TRANSFER_STATE_DONE
    registry = h.broker.metrics.registry
    assert registry.get_sample_value("kvpush_broker_write_seconds_count") == 1
    assert registry.get_sample_value("kvpush_broker_write_seconds_sum") == pytest.approx(0.003)


def test_early_orders_go_out_at_registration_without_source_and_only_once():
    h = Harness(early=True)
    h.register()
    [message] = h.messages()
    assert not message.order.HasField("source")
    h.prefill_done()
    assert h.messages() == []
    assert h.write() == S.TRANSFER_STATE_DONE
    assert h.broker.metrics.registry.get_sample_value("kvpush_broker_orders_sent_total") == 1


def test_early_writes_may_finish_before_prefill_done_arrives():
    h = Harness(early=True)
    h.register()
    h.messages()
    assert h.write() == S.TRANSFER_STATE_DONE
    assert h.events() == [("t1", 1, COMPLETED, S.END_REASON_COMPLETED)]
    assert h.prefill_done().state == S.TRANSFER_STATE_DONE  # late, not wrong
    assert h.kinds() == [("closed", "t1", 1)]  # and no second order


def test_a_late_prefill_done_after_early_writes_completed_is_checked_for_its_token_count():
    h = Harness(early=True)
    h.register(num_tokens=40)
    h.messages()
    assert h.write() == S.TRANSFER_STATE_DONE
    expect(errors.FailedPrecondition, Reason.TOKEN_COUNT_MISMATCH, "source.num_tokens", h.prefill_done, num_tokens=32)
    assert h.state() == S.TRANSFER_STATE_DONE  # what was written stays written
    assert h.prefill_done(num_tokens=40).state == S.TRANSFER_STATE_DONE
    # The accepted report is now the recorded arrival: its identical repeat gets the same answer.
    assert h.prefill_done(num_tokens=40).state == S.TRANSFER_STATE_DONE


def test_early_and_late_ranks_each_get_one_order():
    h = Harness(p_tp=2, d_tp=2, early=[True, False])
    h.register()
    assert [m.order.HasField("source") for m in h.messages(0)] == [False]
    assert h.messages(1) == []
    h.prefill_done()
    assert h.messages(0) == []
    assert [m.order.HasField("source") for m in h.messages(1)] == [True]
    assert h.write(tp=0) == S.TRANSFER_STATE_WRITING
    assert h.write(tp=1) == S.TRANSFER_STATE_DONE


def test_a_rank_without_a_stream_gets_its_order_when_it_subscribes():
    h = Harness(subscribe=False)
    h.register()
    h.prefill_done()
    subscription = h.subscribe_producer(0, early=True)
    assert [m.WhichOneof("message") for m in subscription.outbox.drain()] == ["order"]


def test_nothing_is_queued_for_a_rank_whose_stream_ended():
    h = Harness()
    ended = h.producers[0]
    h.unsubscribe_producer(0)
    h.register()
    h.prefill_done()
    assert ended.outbox.drain() == []  # the order waits for the next stream, as a resync
    assert h.kinds() == []
    h.subscribe_producer(0, early=False)
    assert h.kinds() == [("order", "t1", 1)]


def test_a_newer_stream_replaces_the_older_one():
    h = Harness()
    old = h.producers[0]
    new = h.subscribe_producer(0, early=False)
    assert not old.active and new.active
    h.broker.unsubscribe(old)  # the replaced stream ending must not release the new one
    assert new.active


@pytest.mark.parametrize(
    "p_tp, d_tp, heads, expected_orders, expected_notifications",
    [
        (1, 2, 2, {0: [0, 1]}, [1, 1]),
        (2, 1, 2, {0: [0], 1: [0]}, [2]),
        (2, 4, 2, {0: [0, 1], 1: [2, 3]}, [1, 1, 1, 1]),
        (4, 2, 4, {0: [0], 1: [0], 2: [1], 3: [1]}, [2, 2]),
    ],
    ids=["P tp1 to D tp2", "P tp2 to D tp1", "P tp2 to D tp4 (replicated heads)", "P tp4 to D tp2"],
)
def test_heterogeneous_tp_routing(p_tp, d_tp, heads, expected_orders, expected_notifications):
    h = Harness(p_tp=p_tp, d_tp=d_tp, heads=heads)
    response = h.register()
    assert list(response.expected_notifications) == expected_notifications
    h.prefill_done()
    orders = {}
    for tp in range(p_tp):
        for message in h.messages(tp):
            orders[tp] = list(message.order.decode_tp_ranks)
    assert orders == expected_orders
    for tp in expected_orders:
        h.write(tp=tp)
    assert h.state() == S.TRANSFER_STATE_DONE


def test_a_rank_whose_heads_are_all_written_by_others_gets_no_order():
    h = Harness(p_tp=2, d_tp=1, heads=1)  # both P ranks hold the one head; rank 0 writes it
    assert list(h.register().expected_notifications) == [1]
    h.prefill_done()
    assert len(h.messages(0)) == 1 and h.messages(1) == []
    assert h.write() == S.TRANSFER_STATE_DONE
    assert h.kinds(1) == [("closed", "t1", 1)]  # every P rank releases its blocks


# ----- idempotency -----


def test_identical_repeats_get_the_same_answer():
    h = Harness()
    first = h.register()
    assert h.register() == first
    h.prefill_done()
    again = h.prefill_done()
    assert again.state == S.TRANSFER_STATE_MATCHED
    assert len(h.messages()) == 1
    h.write()
    assert h.write() == S.TRANSFER_STATE_DONE  # a repeated write result too
    assert h.register().state == S.TRANSFER_STATE_DONE  # repeats of an ended attempt answer its state


@pytest.mark.parametrize(
    "changed",
    [dict(first_block=7), dict(client_request_id="other"), dict(prefill_engine_id="prefill-1")],
    ids=["blocks", "client_request_id", "engines"],
)
def test_conflicting_repeats_are_refused(changed):
    h = Harness()
    h.registrar.register(sample.rank_request("prefill-1", sample.PREFILL))
    h.register()
    expect(errors.AlreadyExists, Reason.CONFLICTING_DUPLICATE, "key", h.register, **changed)


def test_conflicting_prefill_done_and_write_result_are_refused():
    h = Harness()
    h.register()
    h.prefill_done()
    expect(errors.AlreadyExists, Reason.CONFLICTING_DUPLICATE, "key", h.prefill_done, num_tokens=48)
    h.write(outcome=WRITTEN)
    expect(errors.AlreadyExists, Reason.CONFLICTING_DUPLICATE, "outcome", h.write, outcome=FAILED)


def test_an_identical_repeat_of_a_superseded_registration_answers_its_state_and_whether_it_is_fenced():
    h = Harness()
    h.register(attempt=1)
    h.prefill_done(attempt=1)
    h.register(attempt=2, first_block=10)
    repeat = h.register(attempt=1)
    assert (repeat.state, repeat.fenced) == (S.TRANSFER_STATE_SUPERSEDED, False)  # its order is unanswered
    assert h.prefill_done(attempt=1).state == S.TRANSFER_STATE_SUPERSEDED
    h.write(attempt=1, outcome=REVOKED)
    repeat = h.register(attempt=1)
    assert (repeat.state, repeat.fenced) == (S.TRANSFER_STATE_SUPERSEDED, True)
    # Other content for the superseded attempt is refused.
    error = expect(errors.FailedPrecondition, Reason.TRANSFER_ENDED, "key", h.register, attempt=1, first_block=20)
    assert error.metadata["fenced"] == "true"  # those other blocks were never named by any attempt


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


def test_a_caller_neither_the_router_nor_a_registered_engine_may_cancel_nothing():
    h = Harness()
    h.register()
    for key in (tr_pb.TransferKey(transfer_id="t1", attempt=1), tr_pb.TransferKey(transfer_id="t1"), tr_pb.TransferKey(transfer_id="t2", attempt=1)):
        expect(errors.PermissionDenied, Reason.ENGINE_IDENTITY_MISMATCH, "", h.broker.cancel, key, "stranger")
    assert h.state() == S.TRANSFER_STATE_WAITING_FOR_PREFILL
    assert h.broker.newest_attempt("t2") == 0  # not even a tombstone


def test_an_engine_that_left_cancels_nothing_more():
    h = Harness()
    h.register()
    h.prefill_done()
    for lease_id in h.leases[P]:
        h.registrar.deregister(lease_id, P)
    assert h.state() == S.TRANSFER_STATE_FAILED
    expect(errors.PermissionDenied, Reason.ENGINE_IDENTITY_MISMATCH, "", h.cancel, caller=P)


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


# ----- engine loss -----


def test_losing_the_prefill_engine_fails_the_attempt_at_once_and_fences_it_by_time():
    h = Harness()
    h.register()
    h.prefill_done()
    h.messages()
    lost = h.clock.now()
    h.registrar.deregister(h.leases[P][0], P)
    transfer = h.broker.get_transfer("t1", 1)
    assert (transfer.state, transfer.end_reason, transfer.fenced) == (S.TRANSFER_STATE_FAILED, S.END_REASON_PREFILL_ENGINE_LOST, False)
    assert h.events() == [("t1", 1, FAILED_EVENT, S.END_REASON_PREFILL_ENGINE_LOST)]
    assert not h.producers[0].active  # its stream ends
    # The lost rank may still post what it got until its stream lease ran out; that WRITE is aborted within write_timeout.
    bound = lost + STREAM_LEASE + WRITE_TIMEOUT + FENCE_MARGIN
    assert h.broker.tick() == bound
    h.advance(bound - lost - 0.5)
    assert h.events() == []
    h.advance(0.5)
    assert h.events() == [("t1", 1, ENDED, S.END_REASON_PREFILL_ENGINE_LOST)]


def test_a_lost_ranks_own_answer_still_fences_at_once():
    h = Harness()
    h.register()
    h.prefill_done()
    h.registrar.deregister(h.leases[P][0], P)
    h.events()
    h.write(outcome=REVOKED)
    assert h.fenced() and h.events() == [("t1", 1, ENDED, S.END_REASON_PREFILL_ENGINE_LOST)]


def test_a_lapsed_prefill_lease_fails_the_attempt_and_fences_it_by_time():
    h = Harness()
    h.register(timeout_s=120)
    h.prefill_done(timeout_s=120)
    h.messages()
    h.clock.advance(29)
    h.registrar.keep_alive(h.leases[D], D)
    h.clock.advance(1)
    h.registrar.sweep()
    assert h.broker.get_transfer("t1", 1).end_reason == S.END_REASON_PREFILL_ENGINE_LOST
    assert "LEASE_EXPIRED" in h.broker.get_transfer("t1", 1).detail
    assert not h.fenced()
    h.advance(STREAM_LEASE + WRITE_TIMEOUT + FENCE_MARGIN)
    assert h.fenced()


def test_losing_the_decode_engine_revokes_orders():
    h = Harness()
    h.register()
    h.prefill_done()
    h.messages()
    h.registrar.deregister(h.leases[D][0], D)
    assert h.broker.get_transfer("t1", 1).end_reason == S.END_REASON_DECODE_ENGINE_LOST
    assert h.kinds() == [("revocation", "t1", 1), ("closed", "t1", 1)]
    assert not h.decode.active
    h.write(outcome=REVOKED)
    assert h.fenced()


def test_a_lost_producer_among_two_is_fenced_by_time_not_at_once():
    h = Harness(p_tp=2, d_tp=2)
    h.register()
    h.prefill_done()
    h.cancel()
    h.write(tp=0, outcome=REVOKED)
    assert h.events() == [("t1", 1, FAILED_EVENT, S.END_REASON_CANCELLED_BY_ROUTER)]
    h.registrar.deregister(h.leases[P][1], P)
    assert h.events() == []  # rank 1 may still have a WRITE in flight
    h.advance(STREAM_LEASE + WRITE_TIMEOUT + FENCE_MARGIN)
    assert h.events() == [("t1", 1, ENDED, S.END_REASON_CANCELLED_BY_ROUTER)]


# ----- streams: resyncs, overflow, heartbeats -----


def test_a_new_stream_gets_every_unanswered_order_again_with_the_budget_left():
    h = Harness()
    for transfer_id in ("t1", "t2"):
        h.register(transfer_id)
        h.prefill_done(transfer_id)
    assert [k for k, _, _ in h.kinds()] == ["order", "order"]
    h.write("t2")
    h.messages()
    h.clock.advance(5)
    old = h.producers[0]
    new = h.subscribe_producer(0, early=False)
    assert not old.active and new.active
    [message] = new.outbox.drain()  # t2 was answered: nothing owed
    assert message.order.key.transfer_id == "t1" and message.order.HasField("source")
    assert seconds(message.order.write_budget) == 30 - 5 - SKEW
    assert message.send_time == timestamp(h.clock.wall())
    assert h.broker.metrics.registry.get_sample_value("kvpush_broker_orders_sent_total") == 2  # a resend is no new order


def test_a_new_stream_gets_the_revocations_and_closures_still_owed_for_ended_unfenced_attempts():
    h = Harness(p_tp=2, d_tp=1, heads=1)  # rank 0 writes the one head; rank 1 gets no order
    h.register(timeout_s=60)
    h.prefill_done(timeout_s=60)
    h.messages(0), h.messages(1)
    ended = [h.producers[0], h.producers[1]]
    h.unsubscribe_producer(0)
    h.unsubscribe_producer(1)
    h.cancel()
    assert [s.outbox.drain() for s in ended] == [[], []]  # nothing is queued without a stream
    h.subscribe_producer(0, early=False)
    h.subscribe_producer(1, early=False)
    assert h.kinds(0) == [("revocation", "t1", 1), ("closed", "t1", 1)]
    assert h.kinds(1) == [("closed", "t1", 1)]
    h.write(outcome=REVOKED)
    assert h.fenced()
    h.subscribe_producer(0, early=False)
    h.subscribe_producer(1, early=False)
    assert h.kinds(0) == h.kinds(1) == []  # settled: nothing is owed any more


def test_a_new_stream_asking_for_early_orders_gets_those_of_attempts_waiting_for_prefill():
    h = Harness(early=False)
    h.register("t1")
    h.clock.advance(1)
    h.register("t2")
    h.prefill_done("t2")
    assert h.kinds() == [("order", "t2", 1)]
    h.subscribe_producer(0, early=False)
    assert h.kinds() == [("order", "t2", 1)]  # no early orders asked for: only what is owed
    h.subscribe_producer(0, early=True)
    messages = h.messages()
    assert [(m.order.key.transfer_id, m.order.HasField("source")) for m in messages] == [("t1", False), ("t2", True)]
    # Once sent, an early order is owed like any other, and prefill-done sends no second one.
    h.subscribe_producer(0, early=False)
    assert [(m.order.key.transfer_id, m.order.HasField("source")) for m in h.messages()] == [("t1", False), ("t2", True)]
    h.prefill_done("t1")
    assert h.messages() == []
    assert h.broker.metrics.registry.get_sample_value("kvpush_broker_orders_sent_total") == 2


def test_a_decode_engines_new_stream_gets_its_recent_final_events_again_and_failed_for_unfenced_ones():
    h = Harness()
    h.register("t1")
    h.prefill_done("t1")
    h.write("t1")  # COMPLETED
    h.register("t2")
    h.cancel("t2")  # ENDED: nothing ordered
    h.register("t3")
    h.prefill_done("t3")
    h.cancel("t3")  # FAILED: its order is unanswered
    expected = [("t1", 1, COMPLETED, S.END_REASON_COMPLETED), ("t2", 1, ENDED, S.END_REASON_CANCELLED_BY_ROUTER), ("t3", 1, FAILED_EVENT, S.END_REASON_CANCELLED_BY_ROUTER)]
    assert h.events() == expected
    old = h.decode
    h.subscribe_decode()
    assert not old.active
    assert h.events() == expected
    # Without a stream nothing is queued; the next stream learns what it missed.
    h.broker.unsubscribe(h.decode)
    h.write("t3", outcome=REVOKED)
    h.register("t4")
    h.prefill_done("t4")
    h.cancel("t4")
    h.subscribe_decode()
    assert h.events() == [
        ("t1", 1, COMPLETED, S.END_REASON_COMPLETED),
        ("t2", 1, ENDED, S.END_REASON_CANCELLED_BY_ROUTER),
        ("t3", 1, ENDED, S.END_REASON_CANCELLED_BY_ROUTER),
        ("t4", 1, FAILED_EVENT, S.END_REASON_CANCELLED_BY_ROUTER),
    ]


def test_a_stream_whose_outbox_would_overflow_is_closed_and_its_next_stream_resyncs():
    h = Harness(config=BrokerConfig(outbox_capacity=2))
    for transfer_id in ("t1", "t2"):
        h.register(transfer_id)
        h.prefill_done(transfer_id)
    old = h.producers[0]
    assert old.active
    h.write("t1")  # t1's closure would be a third message
    assert not old.active and old.outbox.closed and old.outbox.dropped == 1
    assert [m.order.key.transfer_id for m in old.outbox.drain()] == ["t1", "t2"]  # nothing queued was dropped
    h.unsubscribe_producer(0)
    h.subscribe_producer(0, early=False)
    assert h.producers[0].active
    assert h.kinds() == [("order", "t2", 1)]


def test_a_decode_stream_that_overflowed_gets_a_stream_that_lives_after_its_resync():
    h = Harness(config=BrokerConfig(outbox_capacity=4))
    for i in range(5):
        h.register(f"t{i}")
        h.prefill_done(f"t{i}")
        h.write(f"t{i}")
    assert not h.decode.active
    h.broker.unsubscribe(h.decode)
    h.subscribe_decode()
    # The resync must fit the new stream, or the decode engine never holds a stream again.
    assert h.decode.active
    assert ("t4", 1, COMPLETED, S.END_REASON_COMPLETED) in h.events()


def test_a_producer_resync_larger_than_the_outbox_fits_its_stream():
    h = Harness(config=BrokerConfig(outbox_capacity=2), subscribe=False)
    for i in range(5):
        h.register(f"t{i}")
        h.prefill_done(f"t{i}")
    subscription = h.subscribe_producer(0, early=False)
    assert subscription.active
    assert [m.order.key.transfer_id for m in subscription.outbox.drain()] == [f"t{i}" for i in range(5)]

def test_every_message_to_a_producer_carries_its_send_time_and_stream_lease_and_heartbeats_renew_it():
    h = Harness()
    h.register()
    h.prefill_done()
    h.clock.advance(1.5)
    h.cancel()
    messages = h.messages()
    assert [m.WhichOneof("message") for m in messages] == ["order", "revocation", "closed"]
    assert [m.send_time for m in messages] == [timestamp(h.clock.wall() - 1.5), timestamp(h.clock.wall()), timestamp(h.clock.wall())]
    assert {seconds(m.stream_lease) for m in messages} == {STREAM_LEASE - SKEW}
    assert messages[1].revocation.reason == S.END_REASON_CANCELLED_BY_ROUTER
    assert (messages[2].closed.state, messages[2].closed.reason) == (S.TRANSFER_STATE_CANCELLED, S.END_REASON_CANCELLED_BY_ROUTER)
    heartbeat = h.broker.heartbeat()
    assert heartbeat.WhichOneof("message") == "heartbeat"
    assert heartbeat.send_time == timestamp(h.clock.wall()) and seconds(heartbeat.stream_lease) == STREAM_LEASE - SKEW
    assert h.broker.heartbeat_interval_s == STREAM_LEASE / 3  # several heartbeats per lease


# ----- validation -----


def _bad(**kwargs):
    return kwargs


DESTINATION_ERRORS = [
    ("block id out of range", _bad(first_block=998), errors.InvalidArgument, Reason.BLOCK_ID_OUT_OF_RANGE, "destination.blocks[0].block_ids[2]"),
    ("first token not on a block boundary", _bad(first_token=8), errors.InvalidArgument, Reason.FIELD_INVALID, "destination.first_token"),
    ("no tokens", _bad(num_tokens=0), errors.InvalidArgument, Reason.FIELD_REQUIRED, "destination.num_tokens"),
    ("unknown prefill engine", _bad(prefill_engine_id="prefill-9"), errors.NotFound, Reason.ENGINE_NOT_FOUND, "prefill_engine_id"),
    ("prefill engine is a decode engine", _bad(prefill_engine_id="decode-1"), errors.FailedPrecondition, Reason.ENGINE_ROLE_MISMATCH, "prefill_engine_id"),
    ("incompatible prefill engine", _bad(prefill_engine_id="prefill-x"), errors.FailedPrecondition, Reason.INCOMPATIBLE_LAYOUT, "prefill_engine_id"),
    ("prefill engine not ready", _bad(prefill_engine_id="prefill-half"), errors.FailedPrecondition, Reason.ENGINE_NOT_READY, "prefill_engine_id"),
    ("old decode incarnation", _bad(incarnation="inc-0"), errors.FailedPrecondition, Reason.INCARNATION_MISMATCH, "destination.incarnation"),
    ("caller is another engine", _bad(decode_engine_id="decode-1"), errors.PermissionDenied, Reason.ENGINE_IDENTITY_MISMATCH, "destination.engine_id"),
    ("bad transfer id", _bad(transfer_id="t 1"), errors.InvalidArgument, Reason.FIELD_INVALID, "key.transfer_id"),
    ("attempt 0", _bad(attempt=0), errors.InvalidArgument, Reason.FIELD_REQUIRED, "key.attempt"),
    ("no timeout", _bad(timeout_s=0), errors.InvalidArgument, Reason.FIELD_REQUIRED, "timeout"),
    ("timeout too long", _bad(timeout_s=601), errors.InvalidArgument, Reason.FIELD_OUT_OF_RANGE, "timeout"),
]


@pytest.fixture
def crowded() -> Harness:
    h = Harness()
    h.registrar.register(sample.rank_request("decode-1", sample.DECODE))
    h.registrar.register(sample.rank_request("prefill-x", sample.PREFILL, compatibility_hash="other-model"))
    h.registrar.register(sample.rank_request("prefill-half", sample.PREFILL, tp_size=2))
    return h


@pytest.mark.parametrize("change, error_type, reason, field", [c[1:] for c in DESTINATION_ERRORS], ids=[c[0] for c in DESTINATION_ERRORS])
def test_bad_destinations(crowded: Harness, change, error_type, reason, field):
    transfer_id = change.pop("transfer_id", "t1")
    attempt = change.pop("attempt", 1)
    request = sample.destination_request(transfer_id, attempt, **change)
    error = expect(error_type, reason, field, crowded.broker.register_destination, request, D)
    assert error.metadata["fenced"] == "true"  # no WRITE can land in the blocks it named
    assert crowded.broker.live_attempts == 0


def test_bad_block_lists():
    h = Harness()  # each refused registration is remembered (a tombstone), so each uses its own transfer
    request = sample.destination_request("t1")
    request.destination.blocks[0].group_index = 3
    expect(errors.InvalidArgument, Reason.FIELD_INVALID, "destination.blocks[0].group_index", h.broker.register_destination, request, D)
    request = sample.destination_request("t2")
    del request.destination.blocks[0].block_ids[-1]
    expect(errors.InvalidArgument, Reason.FIELD_INVALID, "destination.blocks[0].block_ids", h.broker.register_destination, request, D)
    request = sample.destination_request("t3")
    del request.destination.blocks[:]
    expect(errors.InvalidArgument, Reason.FIELD_REQUIRED, "destination.blocks", h.broker.register_destination, request, D)
    request = sample.prefill_done_request("t4", first_block=999)
    expect(errors.InvalidArgument, Reason.BLOCK_ID_OUT_OF_RANGE, "source.blocks[0].block_ids[1]", h.broker.report_prefill_done, request, P)
    expect(errors.NotFound, Reason.TRANSFER_NOT_FOUND, "transfer_id", h.broker.get_transfer, "t4")  # a refused prefill-done leaves nothing


def test_prefill_done_validation(crowded: Harness):
    broker = crowded.broker
    expect(errors.PermissionDenied, Reason.ENGINE_IDENTITY_MISMATCH, "source.engine_id", broker.report_prefill_done, sample.prefill_done_request("t1"), "prefill-x")
    expect(errors.FailedPrecondition, Reason.ENGINE_ROLE_MISMATCH, "decode_engine_id", crowded.prefill_done, decode_engine_id="prefill-x")
    expect(errors.FailedPrecondition, Reason.INCARNATION_MISMATCH, "source.incarnation", crowded.prefill_done, incarnation="inc-7")
    request = sample.prefill_done_request("t1", prefill_engine_id="prefill-x", decode_engine_id=D)
    expect(errors.FailedPrecondition, Reason.INCOMPATIBLE_LAYOUT, "decode_engine_id", broker.report_prefill_done, request, "prefill-x")
    expect(errors.InvalidArgument, Reason.FIELD_REQUIRED, "source", broker.report_prefill_done, rv_pb.ReportPrefillDoneRequest(key=tr_pb.TransferKey(transfer_id="t1", attempt=1)), P)


def test_the_two_sides_must_name_each_other(crowded: Harness):
    crowded.prefill_done(decode_engine_id="decode-1")
    expect(errors.InvalidArgument, Reason.FIELD_INVALID, "destination.engine_id", crowded.register)
    crowded.register("t2")
    request = sample.prefill_done_request("t2", prefill_engine_id="prefill-half")
    expect(errors.FailedPrecondition, Reason.ENGINE_NOT_READY, "source.engine_id", crowded.broker.report_prefill_done, request, "prefill-half")
    crowded.registrar.register(sample.rank_request("prefill-half", sample.PREFILL, tp_rank=1, tp_size=2))
    expect(errors.InvalidArgument, Reason.FIELD_INVALID, "source.engine_id", crowded.broker.report_prefill_done, request, "prefill-half")
    assert crowded.state("t2") == S.TRANSFER_STATE_WAITING_FOR_PREFILL


def test_too_few_prefill_tokens_fail_the_attempt_and_tell_both_sides():
    h = Harness(early=True)
    h.register(num_tokens=40)
    assert h.kinds() == [("order", "t1", 1)]
    error = expect(errors.FailedPrecondition, Reason.TOKEN_COUNT_MISMATCH, "source.num_tokens", h.prefill_done, num_tokens=32)
    expect(errors.FailedPrecondition, Reason.TOKEN_COUNT_MISMATCH, "source.num_tokens", h.prefill_done, num_tokens=32)  # same answer again
    assert "40" in error.message
    transfer = h.broker.get_transfer("t1", 1)
    assert (transfer.state, transfer.end_reason) == (S.TRANSFER_STATE_FAILED, S.END_REASON_TOKEN_COUNT_MISMATCH)
    assert h.kinds() == [("revocation", "t1", 1), ("closed", "t1", 1)]
    assert h.events() == [("t1", 1, FAILED_EVENT, S.END_REASON_TOKEN_COUNT_MISMATCH)]
    h.write(outcome=REVOKED)
    assert h.events() == [("t1", 1, ENDED, S.END_REASON_TOKEN_COUNT_MISMATCH)]


def test_a_registration_wanting_more_tokens_than_prefill_computed_fails_the_attempt():
    h = Harness(early=False)
    h.prefill_done(num_tokens=32)
    error = expect(errors.FailedPrecondition, Reason.TOKEN_COUNT_MISMATCH, "destination.num_tokens", h.register, num_tokens=40)
    assert "32" in error.message and "40" in error.message
    transfer = h.broker.get_transfer("t1", 1)
    assert (transfer.state, transfer.end_reason) == (S.TRANSFER_STATE_FAILED, S.END_REASON_TOKEN_COUNT_MISMATCH)
    assert ("order", "t1", 1) not in h.kinds()
    assert h.events() == [("t1", 1, ENDED, S.END_REASON_TOKEN_COUNT_MISMATCH)]


def test_a_partially_cached_destination_needs_only_its_tail():
    h = Harness()
    h.prefill_done(num_tokens=40)
    response = h.register(first_token=16, num_tokens=24)
    assert response.state == S.TRANSFER_STATE_MATCHED
    [message] = h.messages()
    assert list(message.order.destination.blocks[0].block_ids) == [0, 1]


def test_subscriptions_are_validated():
    h = Harness()
    broker = h.broker
    expect(errors.PermissionDenied, Reason.ENGINE_IDENTITY_MISMATCH, "engine_id", broker.subscribe_producer, rv_pb.StreamWriteOrdersRequest(engine_id=P, incarnation="inc-1"), D)
    expect(errors.FailedPrecondition, Reason.ENGINE_ROLE_MISMATCH, "engine_id", broker.subscribe_producer, rv_pb.StreamWriteOrdersRequest(engine_id=D, incarnation="inc-1"), D)
    expect(errors.FailedPrecondition, Reason.INCARNATION_MISMATCH, "incarnation", broker.subscribe_decode, rv_pb.StreamTransferEventsRequest(engine_id=D, incarnation="x"), D)
    expect(errors.FailedPrecondition, Reason.ENGINE_NOT_READY, "tp_rank", broker.subscribe_producer, rv_pb.StreamWriteOrdersRequest(engine_id=P, incarnation="inc-1", tp_rank=3), P)
    expect(errors.NotFound, Reason.ENGINE_NOT_FOUND, "engine_id", broker.subscribe_decode, rv_pb.StreamTransferEventsRequest(engine_id="decode-9", incarnation="x"), "decode-9")
    broker.close()
    assert not h.producers[0].active
    expect(errors.Unavailable, Reason.UNAVAILABLE, "", broker.subscribe_decode, rv_pb.StreamTransferEventsRequest(engine_id=D, incarnation="inc-1"), D)


# ----- memory bounds -----


def test_settled_attempts_age_out_after_retention_and_their_registrations_deadline():
    h = Harness(config=BrokerConfig(retention_s=10.0))
    h.register(attempt=1)  # deadline: now + 30
    h.register(attempt=2, timeout_s=100)  # supersedes attempt 1, which settles at once
    assert h.broker.tick() == h.clock.now() + 30  # kept past retention until its registration's deadline
    h.advance(10)
    assert h.state(attempt=1) == S.TRANSFER_STATE_SUPERSEDED
    h.advance(20)
    expect(errors.NotFound, Reason.TRANSFER_NOT_FOUND, "attempt", h.broker.get_transfer, "t1", 1)
    expect(errors.Aborted, Reason.TRANSFER_SUPERSEDED, "key.attempt", h.register, attempt=1)  # the newest attempt still refuses it
    h.prefill_done(attempt=2)
    h.write(attempt=2)
    h.advance(10)
    assert h.state(attempt=2) == S.TRANSFER_STATE_DONE  # its registration's deadline is 70 s away
    h.advance(70)
    expect(errors.NotFound, Reason.TRANSFER_NOT_FOUND, "transfer_id", h.broker.get_transfer, "t1", 0)
    assert h.broker.remembered_attempts == 0


def test_a_completed_attempt_answers_repeats_of_its_registration_until_its_deadline():
    h = Harness(config=BrokerConfig(retention_s=5.0))
    h.register(timeout_s=20)
    h.prefill_done()
    h.write()
    assert h.broker.tick() == h.clock.now() + 20
    h.advance(19.5)
    assert h.register(timeout_s=20).state == S.TRANSFER_STATE_DONE
    h.advance(0.5)
    expect(errors.NotFound, Reason.TRANSFER_NOT_FOUND, "transfer_id", h.broker.get_transfer, "t1", 1)


def test_the_number_of_settled_attempts_kept_is_capped_once_their_deadlines_passed():
    h = Harness(config=BrokerConfig(retention_s=1000.0, max_retained_attempts=2, max_unsettled_attempts=2))
    for i in range(3):
        h.register(f"t{i}", timeout_s=10)
        h.cancel(f"t{i}")
    h.broker.tick()
    assert h.broker.remembered_attempts == 3  # each refuses late copies of its registration until its deadline
    h.register("t3", timeout_s=10)
    h.cancel("t3")
    # The hard bound: settled attempts past the cap plus the unsettled cap refuse new ones.
    expect(errors.ResourceExhausted, Reason.TOO_MANY_TRANSFERS, "key", h.register, "t4")
    h.advance(10)
    assert h.broker.remembered_attempts == 2
    expect(errors.NotFound, Reason.TRANSFER_NOT_FOUND, "transfer_id", h.broker.get_transfer, "t0")
    expect(errors.NotFound, Reason.TRANSFER_NOT_FOUND, "transfer_id", h.broker.get_transfer, "t1")
    assert h.state("t3") == S.TRANSFER_STATE_CANCELLED
    h.register("t4")


def test_too_many_unsettled_attempts_are_refused():
    h = Harness(config=BrokerConfig(max_unsettled_attempts=2))
    h.register("t1")
    h.prefill_done("t2")
    expect(errors.ResourceExhausted, Reason.TOO_MANY_TRANSFERS, "key", h.register, "t3")
    h.prefill_done("t1")
    h.messages()
    h.write("t1")
    h.register("t3")
    assert h.broker.metrics.registry.get_sample_value("kvpush_broker_live_attempts") == 2
    assert h.broker.metrics.registry.get_sample_value("kvpush_broker_pending_registrations") == 1
    assert h.broker.metrics.registry.get_sample_value("kvpush_broker_pending_prefill_dones") == 1


def test_every_table_shrinks_back_once_everything_settled_and_aged_out():
    h = Harness(p_tp=2, d_tp=2, config=BrokerConfig(retention_s=5.0))
    lease = h.registrar.register(sample.rank_request("prefill-1", sample.PREFILL)).lease_id
    baseline = h.broker.memory_sizes
    assert baseline == {
        "transfers": 0,
        "remembered_attempts": 0,
        "timers": 0,
        "engines_indexed": 0,
        "producer_mailboxes": 2,
        "decode_mailboxes": 1,
        "engine_infos": 2,
    }
    h.register("done")  # completed
    h.prefill_done("done")
    h.write("done", tp=0)
    h.write("done", tp=1)
    h.register("sup", 1)  # superseded with unanswered orders: fenced by time
    h.prefill_done("sup", 1)
    h.register("sup", 2, first_block=10)
    h.register("cancelled")  # cancelled, one rank answers, the other lost its stream
    h.prefill_done("cancelled")
    h.unsubscribe_producer(1)
    h.cancel("cancelled")
    h.write("cancelled", tp=0, outcome=REVOKED)
    h.register("expired", timeout_s=2)
    h.cancel("unseen", 3, D)
    expect(errors.InvalidArgument, Reason.BLOCK_ID_OUT_OF_RANGE, "destination.blocks[0].block_ids[2]", h.register, "refused", first_block=998)
    expect(errors.FailedPrecondition, Reason.DEADLINE_PASSED, "deadline", h.register, "late", deadline_in=-1)
    # An attempt with an engine that leaves, its order unanswered.
    h.broker.subscribe_producer(rv_pb.StreamWriteOrdersRequest(engine_id="prefill-1", incarnation="inc-1"), "prefill-1")
    h.broker.register_destination(sample.destination_request("lost", prefill_engine_id="prefill-1"), D)
    h.broker.report_prefill_done(sample.prefill_done_request("lost", prefill_engine_id="prefill-1"), "prefill-1")
    h.registrar.deregister(lease, "prefill-1")
    assert h.broker.unsettled_attempts > 0 and h.broker.memory_sizes["transfers"] == 8
    for _ in range(100):  # past every deadline, fencing bound, keep_until and retention
        h.advance(10)
    assert h.broker.unsettled_attempts == 0
    assert h.broker.memory_sizes == baseline


# ----- tracing -----


def test_rendezvous_span_links_both_callers_and_travels_in_the_order():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    h = Harness(tracer_provider=provider)
    tracer = provider.get_tracer("test")
    with tracer.start_as_current_span("decode-call") as decode_span:
        h.broker.register_destination(sample.destination_request("t1"), D, otel_context.get_current())
    with tracer.start_as_current_span("prefill-call") as prefill_span:
        h.broker.report_prefill_done(sample.prefill_done_request("t1"), P, otel_context.get_current())
    [rendezvous] = [span for span in exporter.get_finished_spans() if span.name == "broker.rendezvous"]
    assert dict(rendezvous.attributes) == {"kvpush.transfer_id": "t1", "kvpush.attempt": 1, "kvpush.first_arrival": "decode"}
    assert [link.context.span_id for link in rendezvous.links] == [decode_span.get_span_context().span_id, prefill_span.get_span_context().span_id]
    assert rendezvous.parent.span_id == decode_span.get_span_context().span_id
    [message] = h.messages()
    assert message.order.trace_context["traceparent"].split("-")[2] == f"{rendezvous.context.span_id:016x}"
    assert trace.get_tracer_provider() is not provider  # the global provider was left alone
