# SPDX-License-Identifier: Apache-2.0
"""BrokerCore: rendezvous in either order, orders per rank and TP layout, idempotent repeats, the rendezvous span."""

from __future__ import annotations

import pytest
from broker_harness import (
    COMPLETED,
    FAILED,
    REVOKED,
    SKEW,
    STREAM_LEASE,
    WRITE_TIMEOUT,
    WRITTEN,
    D,
    Harness,
    P,
    S,
    expect,
    seconds,
)
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvpush import errors
from kvpush.clock import timestamp
from kvpush.dev import sample_engines as sample
from kvpush.errors import Reason

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
    assert h.kinds() == []  # the rank that wrote holds nothing more: no closure for it
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
    assert h.kinds() == []  # no second order (and no closure: the only rank wrote)


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
    "p_tp, d_tp, heads, mla, expected_orders, expected_notifications",
    [
        (1, 2, 2, False, {0: [0, 1]}, [1, 1]),
        (2, 1, 2, False, {0: [0], 1: [0]}, [2]),
        (2, 4, 2, False, {0: [0, 1], 1: [2, 3]}, [1, 1, 1, 1]),
        (4, 2, 4, False, {0: [0], 1: [0], 2: [1], 3: [1]}, [2, 2]),
        (4, 4, 2, False, {0: [0], 1: [1], 2: [2], 3: [3]}, [1, 1, 1, 1]),
        (1, 2, 1, True, {0: [0, 1]}, [1, 1]),
        (2, 1, 1, True, {0: [0]}, [1]),
        (2, 2, 1, True, {0: [0], 1: [1]}, [1, 1]),
        (2, 4, 1, True, {0: [0, 2], 1: [1, 3]}, [1, 1, 1, 1]),
    ],
    ids=["P tp1 to D tp2", "P tp2 to D tp1", "P tp2 to D tp4 (replicated heads)", "P tp4 to D tp2",
         "P tp4 to D tp4 (each replica writes its own rank)", "MLA P tp1 to D tp2 (every D rank gets the latent)",
         "MLA P tp2 to D tp1 (one P rank writes)", "MLA P tp2 to D tp2 (rank i writes rank i)", "MLA P tp2 to D tp4"],
)
def test_heterogeneous_tp_routing(p_tp, d_tp, heads, mla, expected_orders, expected_notifications):
    h = Harness(p_tp=p_tp, d_tp=d_tp, heads=heads, mla=mla)
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
    assert h.kinds(1) == [("closed", "t1", 1)]  # the rank that was not ordered learns it may release its blocks
    assert h.kinds(0) == []  # the rank that wrote released them with its WRITE: no closure for it


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
