# SPDX-License-Identifier: Apache-2.0
"""The producer and consumer cores inside their transfer threads (Producer, Consumer), over real NIXL."""

from __future__ import annotations

import time

import pytest
from nixl_pair import (
    WRITTEN,
    transfer_threads,
)

from kvpush.connector.handoff import DestinationReady, SourceReady

# ----- the transfer threads -----


@pytest.fixture
def threads():
    with transfer_threads() as started:
        yield started


def wait(predicate, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.005)
    raise AssertionError("timed out")


def test_the_threads_move_the_kv_and_hand_results_back(threads):
    pair, producer, consumer = threads
    deliver = producer.open_stream()
    consumer.expect(DestinationReady("d-req", "t1", 1, 0, 110, time.time_ns(), ""))
    assert consumer.has_work()
    deliver(pair.message("order", "t1"))
    producer.source_ready(SourceReady("p-req", "t1", 1, "p-req", "decode-t", ((7, 2, 9, 4),), 110, 30.0, "", 0, 0))
    assert wait(lambda: consumer.take_results() if consumer.ready.wait(0.05) else None) == ({"d-req"}, set())
    assert not consumer.has_work()
    assert wait(lambda: producer.take_finished() if producer.ready.wait(0.05) else None) == {"p-req"}
    assert [r.outcome for r in wait(lambda: list(pair.reports))] == [WRITTEN]
    pair.check_bytes((7, 2, 9, 4), (5, 1), 0, 110)
    assert not producer.has_work()


def test_the_producer_thread_ignores_a_lost_streams_orders_and_acts_on_the_next(threads):
    pair, producer, consumer = threads
    deliver = producer.open_stream()
    deliver(pair.message("order", "t1"))
    producer.stream_lost()
    producer.source_ready(SourceReady("p-req", "t1", 1, "p-req", "decode-t", ((7, 2, 9, 4),), 110, 30.0, "", 0, 0))
    late = deliver  # a message the lost stream still delivers
    late(pair.message("order", "t1"))
    time.sleep(0.2)
    assert pair.reports == [] and producer.has_work()
    producer.open_stream()(pair.message("order", "t1"))
    assert [r.outcome for r in wait(lambda: list(pair.reports))] == [WRITTEN]


def test_the_consumer_thread_reports_a_failure_once(threads):
    pair, producer, consumer = threads
    consumer.expect(DestinationReady("d-req", "t5", 1, 0, 20, time.time_ns(), ""))
    consumer.fail("d-req", "broker ended it")
    consumer.fail("d-req", "again")
    assert wait(lambda: consumer.take_results() if consumer.ready.wait(0.05) else None) == ({"d-req"}, {"d-req"})
    time.sleep(0.1)
    assert consumer.take_results() == (set(), set())
    assert not consumer.has_work()


def test_a_receive_left_without_a_due_notification_is_polled_at_the_waiting_interval_not_the_idle_one():
    """After its fresh window, a receive P never said was due is still polled every waiting interval (5 ms), not every idle_poll (60 s here)."""
    with transfer_threads(idle=60.0) as (pair, producer, consumer):
        pair.consumer.waiting_poll_s, pair.consumer.fresh_poll_s = 0.005, 0.02
        deliver = producer.open_stream()
        consumer.expect(DestinationReady("d-req", "t1", 1, 0, 110, time.time_ns(), ""))
        time.sleep(0.1)  # the fresh window is over; P never says the WRITE is due (its source is ready at once)
        deliver(pair.message("order", "t1"))
        producer.source_ready(SourceReady("p-req", "t1", 1, "p-req", "decode-t", ((7, 2, 9, 4),), 110, 30.0, "", 0, 0))
        assert wait(lambda: consumer.take_results() if consumer.ready.wait(0.05) else None) == ({"d-req"}, set())


def test_the_engine_thread_takes_a_landed_kv_itself_while_the_transfer_thread_polls_only_at_the_waiting_pace():
    """vLLM acts on a landed KV only when the engine thread asks: it polls NIXL then itself, so nothing polls fast while it
    computes. Here the transfer thread would not poll for a minute (waiting_poll 60 s, idle_poll 60 s), yet the engine
    thread's poll() reports the KV once it landed."""
    with transfer_threads(idle=60.0, waiting_poll=60.0) as (pair, producer, consumer):
        deliver = producer.open_stream()
        consumer.expect(DestinationReady("d-req", "t1", 1, 0, 110, time.time_ns(), ""))
        assert wait(lambda: ("t1", 1) in pair.consumer._pending)  # the transfer thread took the item (and polled once)
        deliver(pair.message("order", "t1"))
        producer.source_ready(SourceReady("p-req", "t1", 1, "p-req", "decode-t", ((7, 2, 9, 4),), 110, 30.0, "", 0, 0))
        time.sleep(0.5)  # the WRITE lands meanwhile
        assert consumer.take_results() == (set(), set()), "nothing polled NIXL since"
        assert wait(lambda: consumer.poll()[0]) == {"d-req"}
        assert not consumer.has_work()
        pair.check_bytes((7, 2, 9, 4), (5, 1), 0, 110)


def test_an_idle_engine_step_polls_while_a_write_is_due_and_returns_when_it_lands():
    """A step with nothing to compute waits (wait) up to its idle wait: while a WRITE is due (here: the receive is fresh) the
    engine thread polls every poll_interval and returns as the KV lands, not at the end of the wait nor the transfer
    thread's next poll (a minute away)."""
    with transfer_threads(idle=60.0, waiting_poll=60.0) as (pair, producer, consumer):
        pair.consumer.fresh_poll_s = 30.0
        deliver = producer.open_stream()
        consumer.expect(DestinationReady("d-req", "t1", 1, 0, 110, time.time_ns(), ""))
        assert wait(lambda: pair.consumer.busy)
        assert consumer.wait(0.05) == (set(), set()), "nothing landed: empty at the end of the wait"
        deliver(pair.message("order", "t1"))
        producer.source_ready(SourceReady("p-req", "t1", 1, "p-req", "decode-t", ((7, 2, 9, 4),), 110, 30.0, "", 0, 0))
        started = time.monotonic()
        assert consumer.wait(20.0) == ({"d-req"}, set())
        assert time.monotonic() - started < 10.0


def test_an_idle_engine_steps_wait_polls_when_no_write_is_due():
    """After its fresh window, a receive P never said was due (its source was ready at once) is found by the engine
    thread's idle wait (it polls at least every waiting_poll and at its end), though the transfer thread would not poll
    for a minute (waiting_poll 60 s)."""
    with transfer_threads(idle=60.0, waiting_poll=60.0) as (pair, producer, consumer):
        pair.consumer.fresh_poll_s = 0.02
        deliver = producer.open_stream()
        consumer.expect(DestinationReady("d-req", "t1", 1, 0, 110, time.time_ns(), ""))
        time.sleep(0.1)  # the fresh window is over
        deliver(pair.message("order", "t1"))
        producer.source_ready(SourceReady("p-req", "t1", 1, "p-req", "decode-t", ((7, 2, 9, 4),), 110, 30.0, "", 0, 0))
        assert not pair.consumer.busy
        assert wait(lambda: consumer.wait(0.05)[0]) == {"d-req"}
