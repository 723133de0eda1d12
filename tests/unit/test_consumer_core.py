# SPDX-License-Identifier: Apache-2.0
"""ConsumerCore over real NIXL: notifications, their TTL, failing once; the notification format."""

from __future__ import annotations

from nixl_pair import Pair

from kvpush.connector.consumer import EARLY_NOTIFICATION_TTL_S
from kvpush.connector.nixl_agent import HELLO
from kvpush.connector.notification import Notification, notification, parse_notification

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
