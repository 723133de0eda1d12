# SPDX-License-Identifier: Apache-2.0
"""BrokerCore: losing an engine, and order streams: resyncs, overflow, heartbeats."""

from __future__ import annotations

import pytest
from broker_harness import (
    COMPLETED,
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
    seconds,
)

from kvpush.clock import timestamp
from kvpush.errors import InvalidArgument
from kvpush.rendezvous.v1 import rendezvous_service_pb2 as rv_pb
from kvpush.services.broker.config import BrokerConfig

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


def test_a_decode_stream_that_asks_for_some_event_types_gets_only_those_live_and_on_resync():
    """The connector's decode engine asks for FAILED and ENDED only (it counts its WRITEs' notifications itself): no COMPLETED message."""
    h = Harness()
    wanted = (FAILED_EVENT, ENDED)
    h.decode = h.broker.subscribe_decode(rv_pb.StreamTransferEventsRequest(engine_id=D, incarnation="inc-1", event_types=wanted), D)
    h.register("t1")
    h.prefill_done("t1")
    h.write("t1")  # COMPLETED: not for this stream
    h.register("t2")
    h.prefill_done("t2")
    h.cancel("t2")  # FAILED: its order is unanswered
    assert h.events() == [("t2", 1, FAILED_EVENT, S.END_REASON_CANCELLED_BY_ROUTER)]
    h.write("t2", outcome=REVOKED)  # fenced: ENDED
    assert h.events() == [("t2", 1, ENDED, S.END_REASON_CANCELLED_BY_ROUTER)]
    # A new stream with the same filter gets the recent final events again, less COMPLETED; one asking for every type gets it.
    h.decode = h.broker.subscribe_decode(rv_pb.StreamTransferEventsRequest(engine_id=D, incarnation="inc-1", event_types=wanted), D)
    assert h.events() == [("t2", 1, ENDED, S.END_REASON_CANCELLED_BY_ROUTER)]
    h.subscribe_decode()
    assert h.events() == [("t1", 1, COMPLETED, S.END_REASON_COMPLETED), ("t2", 1, ENDED, S.END_REASON_CANCELLED_BY_ROUTER)]


def test_a_decode_stream_naming_an_unknown_event_type_is_refused_with_its_field():
    h = Harness(subscribe=False)
    for types, reason in (([0], "FIELD_REQUIRED"), ([ENDED, 99], "FIELD_INVALID")):
        with pytest.raises(InvalidArgument) as refused:
            h.broker.subscribe_decode(rv_pb.StreamTransferEventsRequest(engine_id=D, incarnation="inc-1", event_types=types), D)
        assert (refused.value.reason, refused.value.metadata["field"]) == (reason, "event_types")


def test_a_stream_whose_outbox_would_overflow_is_closed_and_its_next_stream_resyncs():
    h = Harness(config=BrokerConfig(outbox_capacity=2))
    for transfer_id in ("t1", "t2"):
        h.register(transfer_id)
        h.prefill_done(transfer_id)
    old = h.producers[0]
    assert old.active
    h.write("t1")  # DONE: the rank that wrote it gets no closure
    assert old.active
    h.register("t3")
    h.prefill_done("t3")  # t3's order would be a third message
    assert not old.active and old.outbox.closed and old.outbox.dropped == 1
    assert [m.order.key.transfer_id for m in old.outbox.drain()] == ["t1", "t2"]  # nothing queued was dropped
    h.unsubscribe_producer(0)
    h.subscribe_producer(0, early=False)
    assert h.producers[0].active
    assert h.kinds() == [("order", "t2", 1), ("order", "t3", 1)]


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
