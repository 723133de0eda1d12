# SPDX-License-Identifier: Apache-2.0
"""ConsumerCore over real NIXL: notifications, their TTL, failing once, polling fast only while a WRITE is due; the notification formats."""

from __future__ import annotations

import time

import pytest
from nixl_pair import Pair

from kvpush.connector.consumer import EARLY_NOTIFICATION_TTL_S
from kvpush.connector.nixl_agent import HELLO
from kvpush.connector.notification import (
    Notification,
    due_notification,
    notification,
    parse_due,
    parse_notification,
    parse_posted,
    posted_notification,
)

WAITING_POLL_S, FRESH_POLL_S = 0.005, 0.02


def polls_slowly_while_waiting(pair: Pair) -> Pair:
    """The decode worker's settings: slow polling while receives wait, fast for fresh ones and due WRITEs."""
    pair.consumer.waiting_poll_s, pair.consumer.fresh_poll_s = WAITING_POLL_S, FRESH_POLL_S
    return pair

# ----- the consumer -----


def test_a_notification_for_other_tokens_than_the_request_registered_is_ignored(pair: Pair):
    pair.expect("t1", num_tokens=110)
    pair.send("order", "t1", num_tokens=100)  # the producer was told other tokens than this request waits for
    pair.source("t1")
    pair.pump(lambda: pair.reports)
    pair.settle()
    assert pair.received() == (set(), set())
    assert pair.consumer.busy  # it waits on: the scheduler's deadline fails it
    pair.consumer.fail("d-req", "deadline")
    assert pair.received() == ({"d-req"}, {"d-req"})
    assert not pair.consumer.busy


def test_a_notification_that_overtakes_the_schedulers_expectation_is_counted_when_it_comes(pair: Pair):
    pair.send("order", "t1")
    pair.source("t1")
    pair.pump(lambda: pair.reports)
    pair.settle()
    pair.expect("t1")
    assert pair.received() == ({"d-req"}, set())


def test_unclaimed_notifications_are_forgotten_after_their_ttl(pair: Pair):
    pair.send("order", "t1")
    pair.source("t1")
    pair.pump(lambda: pair.reports)
    pair.settle()
    pair.clock.advance(EARLY_NOTIFICATION_TTL_S + 1)
    pair.step()
    pair.expect("t1")
    assert pair.received() == (set(), set())


def test_fail_always_reports_once(pair: Pair):
    pair.expect("t5", req_id="d-req5")
    pair.consumer.fail("d-req5", "broker ended it")
    pair.consumer.fail("d-req5", "again")
    pair.consumer.fail("unknown-req", "never expected")  # reported too: the scheduler decides
    finished, failed = pair.received()
    assert finished == failed == {"d-req5", "unknown-req"}
    assert not pair.consumer.busy
    pair.consumer.fail("unknown-req", "again")
    assert pair.received() == (set(), set())


def test_fail_after_success_is_a_no_op(pair: Pair):
    pair.expect("t1")
    pair.send("order", "t1")
    pair.source("t1")
    assert pair.pump(pair.results) == ({"d-req"}, set())
    pair.consumer.fail("d-req", "the scheduler's deadline raced the success")
    assert pair.received() == (set(), set())


def test_a_receive_is_polled_slowly_until_p_says_its_write_is_due(pair: Pair):
    polls_slowly_while_waiting(pair)
    pair.expect("t1", num_tokens=110)
    assert pair.consumer.busy  # fresh: P may be done already
    # Even then the next poll is bounded: the fresh window may end before the thread next looks.
    assert pair.consumer.step() == pair.clock.now() + WAITING_POLL_S
    pair.clock.advance(FRESH_POLL_S)
    assert not pair.consumer.busy
    assert pair.consumer.step() == pair.clock.now() + WAITING_POLL_S  # waits, polled every WAITING_POLL_S
    pair.send("order", "t1", blocks=(5, 1), num_tokens=110)
    pair.source("t1", blocks=(7, 2, 9, 4), num_tokens=110, computing=True, whole=True)  # P's forward starts: P says so
    assert pair.pump(lambda: pair.consumer.busy)
    assert pair.received() == (set(), set())
    pair.source("t1", blocks=(7, 2, 9, 4), num_tokens=110)
    assert pair.pump(pair.results) == ({"d-req"}, set())
    assert not pair.consumer.busy and pair.consumer.step() is None  # nothing waits
    pair.check_bytes((7, 2, 9, 4), (5, 1), 0, 110)


def test_a_due_notification_ahead_of_the_schedulers_expectation_counts_when_it_comes(pair: Pair):
    polls_slowly_while_waiting(pair)
    pair.send("order", "t1", blocks=(5, 1), num_tokens=110)
    pair.source("t1", blocks=(7, 2, 9, 4), num_tokens=110, computing=True, whole=True)
    pair.settle()  # the due notification arrives before D's worker knows the request
    pair.expect("t1", num_tokens=110)
    pair.clock.advance(FRESH_POLL_S)
    assert pair.consumer.busy


def test_p_says_a_write_is_due_only_once_its_order_is_here(pair: Pair):
    polls_slowly_while_waiting(pair)
    pair.expect("t1", num_tokens=110)
    pair.clock.advance(FRESH_POLL_S)
    pair.source("t1", blocks=(7, 2, 9, 4), num_tokens=110, computing=True, whole=True)
    pair.settle()
    assert not pair.consumer.busy  # a forward with no order here yet: no WRITE is due
    pair.send("order", "t1", blocks=(5, 1), num_tokens=110)  # the order arrives during the forward
    assert pair.pump(lambda: pair.consumer.busy)


def test_p_says_a_write_is_due_near_the_forwards_predicted_end(pair: Pair):
    polls_slowly_while_waiting(pair)
    pair.expect("t1", num_tokens=110)
    pair.clock.advance(FRESH_POLL_S)
    pair.send("order", "t1", blocks=(5, 1), num_tokens=110)
    pair.source("t1", blocks=(7, 2, 9, 4), num_tokens=110, computing=True, whole=True, announce_at=pair.clock.now() + 0.05)
    pair.settle()
    assert not pair.consumer.busy  # the forward runs, its end is not near yet
    assert pair.producer.step() == pytest.approx(pair.clock.now() + 0.05)  # the transfer thread wakes to say it
    pair.clock.advance(0.05)
    assert pair.pump(lambda: pair.consumer.busy)


def test_failing_a_due_receive_ends_the_fast_polling(pair: Pair):
    polls_slowly_while_waiting(pair)
    pair.expect("t1", num_tokens=110)
    pair.send("order", "t1", blocks=(5, 1), num_tokens=110)
    pair.source("t1", blocks=(7, 2, 9, 4), num_tokens=110, computing=True, whole=True)
    assert pair.pump(lambda: pair.consumer.busy)
    pair.consumer.fail("d-req", "deadline")
    assert not pair.consumer.busy and pair.received() == ({"d-req"}, {"d-req"})


def test_notification_format_round_trips():
    message = notification("xfer-1", 3, 1, 2, 64, 86)
    assert message == b"kvpush1|xfer-1|3|1|2|64|86|1|1"
    assert parse_notification(message) == Notification(("xfer-1", 3), 1, 2, 64, 86, 1, 1)
    # A part of a layer-progressive transfer: not the last (0), and the last, which names the count.
    assert parse_notification(notification("xfer-1", 3, 1, 2, 64, 86, 2, 0)) == Notification(("xfer-1", 3), 1, 2, 64, 86, 2, 0)
    assert parse_notification(notification("xfer-1", 3, 1, 2, 64, 86, 3, 3)).parts == 3
    assert parse_notification(b"kvpush1|xfer-1|3|1|2|64|86") == Notification(("xfer-1", 3), 1, 2, 64, 86, 1, 1)  # before parts
    assert parse_notification(b"garbage") is None
    assert parse_notification(b"other|a|1|2|3|0|1") is None  # another prefix
    assert parse_notification(b"kvpush1|a|1|2|3") is None  # the old five-field format
    assert parse_notification(b"kvpush1|a|x|2|3|0|1") is None
    assert parse_notification(HELLO) is None


def test_due_notification_format_round_trips():
    message = due_notification("xfer-1", 3)
    assert message == b"kvpush1|due|xfer-1|3"
    assert parse_due(message) == ("xfer-1", 3)
    assert parse_notification(message) is None  # never counted as a WRITE's completion
    assert parse_due(notification("xfer-1", 3, 1, 2, 64, 86)) is None
    assert parse_due(b"kvpush1|due|xfer-1|x") is None
    assert parse_due(HELLO) is None


def test_posted_notification_format_round_trips():
    message = posted_notification("xfer-1", 3, 1, 1_700_000_000_123_456_789)
    assert message == b"kvpush1|posted|xfer-1|3|1|1700000000123456789"
    assert parse_posted(message) == (("xfer-1", 3), 1_700_000_000_123_456_789)
    # Never taken for a completion or a due notification (a decode rank from before it logs and ignores it).
    assert parse_notification(message) is None and parse_due(message) is None
    assert parse_posted(due_notification("xfer-1", 3)) is None
    assert parse_posted(notification("xfer-1", 3, 1, 2, 64, 86)) is None
    assert parse_posted(b"kvpush1|posted|xfer-1|3|1|soon") is None
    assert parse_posted(HELLO) is None


def write_segments(pair: Pair) -> list[float]:
    data = pair.consumer.spans.segments.drain() or {"segments": {}}
    return data["segments"].get("write_transfer", [])


def test_d_measures_the_write_from_its_post_to_the_last_notification(pair: Pair):
    pair.expect("t1")
    posted_before = time.time_ns()
    pair.send("order", "t1")
    pair.source("t1")
    assert pair.pump(pair.results) == ({"d-req"}, set())
    (seconds,) = write_segments(pair)
    assert 0 <= seconds <= (time.time_ns() - posted_before) / 1e9  # from the post (P's wall clock, this host) to D's notification


def test_a_posted_notification_after_the_writes_own_still_gives_the_segment(pair: Pair):
    pair.expect("t1")
    pair.consumer._on_notification("p", notification("t1", 1, 0, 1, 0, 110))  # the WRITE's own notification came first
    assert pair.received() == ({"d-req"}, set())
    assert write_segments(pair) == []
    received_ns = pair.consumer._awaiting_posted[("t1", 1)]
    pair.consumer._on_notification("p", posted_notification("t1", 1, 0, received_ns - 2_000_000))
    assert write_segments(pair) == [pytest.approx(0.002)]
    pair.consumer._on_notification("p", posted_notification("t1", 1, 0, received_ns - 1_000_000))  # a repeat counts nothing
    assert write_segments(pair) == []


def test_posted_notifications_of_receives_that_never_complete_are_forgotten_after_their_ttl(pair: Pair):
    pair.consumer._on_notification("p", posted_notification("gone", 1, 0, time.time_ns()))
    assert ("gone", 1) in pair.consumer._posted
    pair.clock.advance(EARLY_NOTIFICATION_TTL_S + 1)
    pair.step()
    assert ("gone", 1) not in pair.consumer._posted
