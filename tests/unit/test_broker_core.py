# SPDX-License-Identifier: Apache-2.0
"""BrokerCore: rendezvous in either order, orders, fencing, supersession, cancel, deadlines, engine loss, validation."""

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
from kvpush.services.broker.core import Actor
from kvpush.services.common import sample_engines as sample
from kvpush.services.registrar.core import RemovalReason

S = tr_pb  # state and reason names are long; S.TRANSFER_STATE_DONE reads fine
COMPLETED = tr_pb.TRANSFER_EVENT_TYPE_COMPLETED
ENDED = tr_pb.TRANSFER_EVENT_TYPE_ENDED
WRITTEN = tr_pb.WRITE_OUTCOME_WRITTEN
REVOKED = tr_pb.WRITE_OUTCOME_REVOKED
FAILED = tr_pb.WRITE_OUTCOME_FAILED


def expect(error_type: type[errors.KvpushError], reason: str, field: str, call, *args, **kwargs) -> errors.KvpushError:
    with pytest.raises(error_type) as info:
        call(*args, **kwargs)
    assert (info.value.reason, info.value.field) == (reason, field), str(info.value)
    return info.value


# ----- rendezvous -----


def test_decode_first_then_prefill_done_orders_the_producer_once():
    h = Harness()
    response = h.register()
    assert (response.state, response.first_arrival) == (S.TRANSFER_STATE_WAITING_FOR_PREFILL, S.TRANSFER_SIDE_DECODE)
    assert list(response.expected_notifications) == [1]
    assert h.messages() == []  # no early orders asked for
    response = h.prefill_done()
    assert (response.state, response.first_arrival) == (S.TRANSFER_STATE_MATCHED, S.TRANSFER_SIDE_DECODE)
    [message] = h.messages()
    order = message.order
    assert order.HasField("source") and order.source.num_tokens == 40
    assert order.destination.engine_id == D and list(order.decode_tp_ranks) == [0]
    assert order.write_budget.ToNanoseconds() == 30 * 10**9
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
    assert message.order.write_budget.ToNanoseconds() == 18 * 10**9  # the prefill side's deadline is earlier
    assert h.broker.metrics.registry.get_sample_value("kvpush_broker_rendezvous_wait_seconds_sum") == pytest.approx(2.0)
    assert h.broker.metrics.registry.get_sample_value("kvpush_broker_rendezvous_total") == 1


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


# ----- supersession and fencing -----


def test_a_reissue_supersedes_and_fences_the_old_attempt_before_decode_is_told():
    h = Harness()
    h.register(attempt=1)
    h.prefill_done(attempt=1)
    assert h.kinds() == [("order", "t1", 1)]
    h.register(attempt=2, first_block=10)
    assert h.state(attempt=1) == S.TRANSFER_STATE_SUPERSEDED
    assert h.kinds() == [("revocation", "t1", 1), ("closed", "t1", 1)]
    assert h.events() == []  # the old order is unanswered: its blocks may still be written
    assert not h.broker.get_transfer("t1", 1).fenced
    # Stale messages for attempt 1 are refused; its rank's answer is still taken.
    expect(errors.Aborted, Reason.TRANSFER_SUPERSEDED, "key.attempt", h.prefill_done, attempt=1)
    expect(errors.Aborted, Reason.TRANSFER_SUPERSEDED, "key.attempt", h.register, attempt=1)
    assert h.write(attempt=1, outcome=REVOKED) == S.TRANSFER_STATE_SUPERSEDED
    assert h.events() == [("t1", 1, ENDED, S.END_REASON_SUPERSEDED)]
    assert h.broker.get_transfer("t1", 1).fenced
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
    assert h.events() == [("t1", 1, ENDED, S.END_REASON_SUPERSEDED)]
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
    assert h.events() == []
    h.write(tp=1, outcome=WRITTEN)  # it had already posted
    assert h.events() == [("t1", 1, ENDED, S.END_REASON_WRITE_FAILED)]
    assert h.broker.metrics.registry.get_sample_value("kvpush_broker_failures_total", {"reason": "END_REASON_WRITE_FAILED"}) == 1


def test_a_write_result_from_a_rank_without_an_order_is_refused():
    h = Harness(p_tp=2, d_tp=1, heads=1)
    h.register()
    h.prefill_done()
    expect(errors.InvalidArgument, Reason.FIELD_INVALID, "tp_rank", h.write, tp=1)
    expect(errors.NotFound, Reason.TRANSFER_NOT_FOUND, "key", h.write, transfer_id="t9")


# ----- cancel -----


@pytest.mark.parametrize(
    "actor, caller, reason",
    [
        (Actor.ROUTER, "", S.END_REASON_CANCELLED_BY_ROUTER),
        (Actor.PREFILL, P, S.END_REASON_CANCELLED_BY_PREFILL),
        (Actor.DECODE, D, S.END_REASON_CANCELLED_BY_DECODE),
    ],
)
def test_cancel_by_each_actor(actor, caller, reason):
    h = Harness()
    h.register()
    h.prefill_done()
    h.messages()
    response = h.broker.cancel(tr_pb.TransferKey(transfer_id="t1", attempt=1), actor, "client left", caller)
    assert response.state == S.TRANSFER_STATE_CANCELLED
    transfer = h.broker.get_transfer("t1", 1)
    assert (transfer.end_reason, transfer.detail) == (reason, "client left")
    assert h.kinds() == [("revocation", "t1", 1), ("closed", "t1", 1)]
    h.write(outcome=REVOKED)
    assert h.events() == [("t1", 1, ENDED, reason)]
    expect(errors.FailedPrecondition, Reason.TRANSFER_ENDED, "key", h.prefill_done, num_tokens=48)


def test_an_engine_may_cancel_only_its_own_transfers():
    h = Harness()
    h.registrar.register(sample.rank_request("decode-1", sample.DECODE))
    h.register()
    key = tr_pb.TransferKey(transfer_id="t1", attempt=1)
    expect(errors.PermissionDenied, Reason.ENGINE_IDENTITY_MISMATCH, "key", h.broker.cancel, key, Actor.DECODE, "", "decode-1")
    expect(errors.PermissionDenied, Reason.ENGINE_IDENTITY_MISMATCH, "key", h.broker.cancel, key, Actor.PREFILL, "", "prefill-9")
    assert h.state() == S.TRANSFER_STATE_WAITING_FOR_PREFILL


def test_cancelling_every_attempt_and_unknown_attempts():
    h = Harness()
    h.register(attempt=1)
    h.prefill_done(attempt=2)
    assert h.broker.cancel(tr_pb.TransferKey(transfer_id="t1"), Actor.ROUTER).state == S.TRANSFER_STATE_CANCELLED
    assert h.state(attempt=1) == S.TRANSFER_STATE_SUPERSEDED
    expect(errors.NotFound, Reason.TRANSFER_NOT_FOUND, "key.transfer_id", h.broker.cancel, tr_pb.TransferKey(transfer_id="t9"), Actor.ROUTER)
    # Cancelling an attempt nobody reported yet refuses its late messages.
    h.broker.cancel(tr_pb.TransferKey(transfer_id="t2", attempt=1), Actor.ROUTER)
    expect(errors.FailedPrecondition, Reason.TRANSFER_ENDED, "key", h.register, transfer_id="t2")
    assert h.kinds() == [("closed", "t1", 1), ("closed", "t1", 2)]


# ----- deadlines -----


def test_registration_deadline_fails_the_attempt_and_tick_says_when():
    h = Harness()
    h.register(timeout_s=5)
    assert h.broker.tick() == h.clock.now() + 5
    h.clock.advance(4.999)
    h.broker.tick()
    assert h.state() == S.TRANSFER_STATE_WAITING_FOR_PREFILL
    h.clock.advance(0.001)
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
    assert h.broker.tick() is None  # nothing is due until the rank answers
    assert h.state() == S.TRANSFER_STATE_FAILED
    assert h.broker.get_transfer("t1", 1).end_reason == S.END_REASON_PREFILL_DEADLINE_EXCEEDED
    assert h.events() == []  # the order is unanswered
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


# ----- engine loss -----


def test_losing_the_prefill_engine_fails_and_fences_at_once():
    h = Harness()
    h.register()
    h.prefill_done()
    h.registrar.end_leases(h.leases[P], RemovalReason.KEEPALIVE_STREAM_CLOSED)
    transfer = h.broker.get_transfer("t1", 1)
    assert (transfer.state, transfer.end_reason, transfer.fenced) == (S.TRANSFER_STATE_FAILED, S.END_REASON_PREFILL_ENGINE_LOST, True)
    assert h.events() == [("t1", 1, ENDED, S.END_REASON_PREFILL_ENGINE_LOST)]
    assert not h.producers[0].active  # its stream ends


def test_losing_the_decode_engine_revokes_orders():
    h = Harness()
    h.register()
    h.prefill_done()
    h.messages()
    h.registrar.deregister(h.leases[D][0])
    assert h.broker.get_transfer("t1", 1).end_reason == S.END_REASON_DECODE_ENGINE_LOST
    assert h.kinds() == [("revocation", "t1", 1), ("closed", "t1", 1)]
    h.write(outcome=REVOKED)
    assert h.broker.get_transfer("t1", 1).fenced


def test_a_lost_producer_counts_as_fenced():
    h = Harness(p_tp=2, d_tp=2)
    h.register()
    h.prefill_done()
    h.broker.cancel(tr_pb.TransferKey(transfer_id="t1", attempt=1), Actor.ROUTER)
    h.write(tp=0, outcome=REVOKED)
    assert h.events() == []
    h.registrar.deregister(h.leases[P][1])
    assert h.events() == [("t1", 1, ENDED, S.END_REASON_CANCELLED_BY_ROUTER)]


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
    expect(error_type, reason, field, crowded.broker.register_destination, request, D)
    assert crowded.broker.live_attempts == 0


def test_bad_block_lists():
    h = Harness()
    request = sample.destination_request("t1")
    request.destination.blocks[0].group_index = 3
    expect(errors.InvalidArgument, Reason.FIELD_INVALID, "destination.blocks[0].group_index", h.broker.register_destination, request, D)
    request = sample.destination_request("t1")
    del request.destination.blocks[0].block_ids[-1]
    expect(errors.InvalidArgument, Reason.FIELD_INVALID, "destination.blocks[0].block_ids", h.broker.register_destination, request, D)
    request = sample.destination_request("t1")
    del request.destination.blocks[:]
    expect(errors.InvalidArgument, Reason.FIELD_REQUIRED, "destination.blocks", h.broker.register_destination, request, D)
    request = sample.prefill_done_request("t1", first_block=999)
    expect(errors.InvalidArgument, Reason.BLOCK_ID_OUT_OF_RANGE, "source.blocks[0].block_ids[1]", h.broker.report_prefill_done, request, P)


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


def test_settled_attempts_age_out_but_supersession_tombstones_last_while_newer_ones_live():
    h = Harness(config=BrokerConfig(retention_s=10.0))
    h.register(attempt=1)
    h.register(attempt=2, timeout_s=100)  # supersedes attempt 1, which settles at once
    assert h.broker.tick() == h.clock.now() + 10
    h.clock.advance(10)
    h.broker.tick()
    expect(errors.NotFound, Reason.TRANSFER_NOT_FOUND, "attempt", h.broker.get_transfer, "t1", 1)
    expect(errors.Aborted, Reason.TRANSFER_SUPERSEDED, "key.attempt", h.register, attempt=1)
    h.prefill_done(attempt=2)
    h.write(attempt=2)
    h.clock.advance(10)
    h.broker.tick()
    expect(errors.NotFound, Reason.TRANSFER_NOT_FOUND, "transfer_id", h.broker.get_transfer, "t1", 0)
    assert h.broker.remembered_attempts == 0


def test_the_number_of_settled_attempts_kept_is_capped():
    h = Harness(config=BrokerConfig(retention_s=1000.0, max_retained_attempts=2))
    for i in range(3):
        h.register(f"t{i}")
        h.broker.cancel(tr_pb.TransferKey(transfer_id=f"t{i}", attempt=1), Actor.ROUTER)
    h.broker.tick()
    assert h.broker.remembered_attempts == 2
    expect(errors.NotFound, Reason.TRANSFER_NOT_FOUND, "transfer_id", h.broker.get_transfer, "t0")


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
