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
