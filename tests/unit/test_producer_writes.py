# SPDX-License-Identifier: Apache-2.0
"""ProducerCore over real NIXL: what it writes, and how stream generations, the stream lease and the write budget stop a write."""

from __future__ import annotations

import pytest
from nixl_pair import (
    LEASE_S,
    REVOKED,
    STREAM,
    TOKEN_BYTES,
    WRITTEN,
    Pair,
)

from kvpush.connector.handoff import packed_prompt, prompt_digest
from kvpush.rendezvous.v1 import transfer_pb2

# ----- writes -----


def test_early_order_then_source_writes_exactly_the_tokens(pair: Pair):
    pair.expect("t1", num_tokens=110)
    pair.send("order", "t1", blocks=(5, 1), num_tokens=110)  # early: no source in it
    pair.source("t1", blocks=(7, 2, 9, 4), num_tokens=110)
    finished, failed = pair.pump(pair.results)
    assert (finished, failed) == ({"d-req"}, set())
    [report] = pair.reports
    assert (report.key.transfer_id, report.outcome, report.bytes_written) == ("t1", WRITTEN, 110 * TOKEN_BYTES)
    assert report.HasField("post_time") and report.descriptor_count > 0
    released, written = pair.producer.take_released()
    assert released == {"p-req"} and written["p-req"][0] > 0  # released after its WRITE completed
    pair.check_bytes((7, 2, 9, 4), (5, 1), 0, 110)
    assert not pair.producer.busy and not pair.producer.holds_sources


def test_source_then_late_order_with_a_locally_cached_prefix(pair: Pair):
    p_blocks, d_blocks, tokens, first = (3, 6, 8, 10, 11), (0, 2), 150, 64  # D already holds its first 64-token block
    pair.source("t2", blocks=p_blocks, num_tokens=tokens)
    pair.expect("t2", first_token=first, num_tokens=tokens - first)
    pair.send("order", "t2", blocks=d_blocks, first_token=first, num_tokens=tokens - first, source=True)
    assert pair.pump(pair.results) == ({"d-req"}, set())
    assert pair.answers() == [("t2", WRITTEN, 0)]
    pair.check_bytes(p_blocks, d_blocks, first, tokens - first)
    assert pair.d_block_is_zero(1)  # nothing outside the destination blocks


def test_a_source_with_too_few_tokens_refuses_the_order_and_writes_nothing(pair: Pair):
    pair.send("order", "t1", blocks=(4, 6), num_tokens=110)
    pair.source("t1", blocks=(1, 2, 3), num_tokens=96)  # a tokenizer drift: P computed fewer tokens than D wants
    [report] = pair.reports
    assert (report.outcome, report.reason) == (REVOKED, transfer_pb2.END_REASON_TOKEN_COUNT_MISMATCH)
    assert "96" in report.error_message and "110" in report.error_message
    assert pair.released() == {"p-req"}  # never written: the source goes back at once
    pair.settle()
    assert pair.d_block_is_zero(4) and pair.d_block_is_zero(6)
    pair.send("revocation", "t1")  # the broker's revocation gets the same answer again
    assert [(r.outcome, r.reason) for r in pair.reports[1:]] == [(REVOKED, transfer_pb2.END_REASON_TOKEN_COUNT_MISMATCH)]


def test_a_source_with_another_prompt_refuses_the_order_and_writes_nothing(pair: Pair):
    """A colliding transfer id (or a template drift): the destination needs the KV of other tokens than this prefill's."""
    mine = list(range(1000, 1110))
    pair.send("order", "t1", blocks=(4, 6), num_tokens=40, prompt=[7] + mine[1:40])
    pair.source("t1", blocks=(1, 2, 3, 5), num_tokens=110, prompt=mine)
    [report] = pair.reports
    assert (report.outcome, report.reason) == (REVOKED, transfer_pb2.END_REASON_PROMPT_MISMATCH)
    assert pair.released() == {"p-req"}
    pair.settle()
    assert pair.d_block_is_zero(4) and pair.d_block_is_zero(6)


def test_a_destination_that_needs_a_prefix_of_this_prompt_is_written(pair: Pair):
    mine = list(range(1000, 1110))
    pair.expect("t1", num_tokens=40)
    pair.send("order", "t1", blocks=(4, 6), num_tokens=40, prompt=mine[:40])
    pair.source("t1", blocks=(1, 2, 3, 5), num_tokens=110, prompt=mine)
    assert pair.pump(pair.results) == ({"d-req"}, set())
    assert pair.answers() == [("t1", WRITTEN, 0)]


def test_the_prompt_digest_covers_exactly_the_tokens_it_names():
    tokens = [1, 2, 3, 70_000, 2**32 - 1]
    packed = packed_prompt(tokens)
    assert len(packed) == 4 * len(tokens) and packed[12:16] == (70_000).to_bytes(4, "little")
    assert prompt_digest(packed, 3) == prompt_digest(packed_prompt(tokens[:3]), 3) != prompt_digest(packed, 4)
    assert len(prompt_digest(packed, 5)) == 16


# ----- stream generations and the stream lease -----


def test_a_replaced_streams_late_message_is_ignored(pair: Pair):
    pair.producer.stream_opened(STREAM + 1)
    pair.send("order", "t1", stream=STREAM)  # sent on the stream that was replaced
    pair.source("t1")
    pair.settle()
    assert pair.reports == [] and pair.d_block_is_zero(5)
    pair.producer.stream_lost(STREAM)  # the old stream's end does not touch the new one
    pair.send("order", "t1", stream=STREAM + 1)
    pair.pump(lambda: pair.reports)
    assert pair.answers() == [("t1", WRITTEN, 0)]


@pytest.mark.parametrize("how", ["stream lost", "stream replaced"])
def test_unposted_orders_are_dropped_when_their_stream_goes(pair: Pair, how: str):
    pair.send("order", "t1")
    if how == "stream lost":
        pair.producer.stream_lost(STREAM)
    else:
        pair.producer.stream_opened(STREAM + 1)
    pair.source("t1")
    pair.settle()
    assert pair.reports == [] and not pair.producer.busy  # the broker resends it on the next stream if still wanted
    assert pair.released() == set()  # the source waits for that order, its closure or its hold deadline
    pair.producer.stream_opened(STREAM + 2)
    pair.send("order", "t1", stream=STREAM + 2)
    pair.pump(lambda: pair.reports)
    assert pair.answers() == [("t1", WRITTEN, 0)]


# ----- one order stream per broker member (a sharded broker) -----


def test_a_members_lost_stream_drops_only_its_own_orders(pair: Pair):
    """Member "" holds STREAM (the fixture's), member b a second one: losing b's voids b's orders, not the others'."""
    pair.producer.stream_opened(STREAM + 1, "b")
    pair.send("order", "t1", blocks=(5,), num_tokens=20)
    pair.send("order", "t2", stream=STREAM + 1, blocks=(1,), num_tokens=20)
    pair.producer.stream_lost(STREAM + 1)
    pair.source("t1", req_id="p1", blocks=(7,), num_tokens=20)
    pair.source("t2", req_id="p2", blocks=(2,), num_tokens=20)
    pair.pump(lambda: pair.reports)
    pair.settle()
    assert pair.answers() == [("t1", WRITTEN, 0)] and pair.d_block_is_zero(1)
    pair.producer.stream_opened(STREAM + 2, "b")  # b's next stream resends what it still wants
    pair.send("order", "t2", stream=STREAM + 2, blocks=(1,), num_tokens=20)
    pair.pump(lambda: pair.reports)
    assert pair.answers() == [("t2", WRITTEN, 0)]


def test_an_answer_goes_to_the_member_whose_order_or_revocation_it_answers(pair: Pair):
    pair.producer.stream_opened(STREAM + 1, "b")
    pair.send("order", "t1", stream=STREAM + 1, blocks=(5,), num_tokens=20)
    pair.send("revocation", "t2")
    assert pair.producer.answer_member(("t1", 1)) == "b" and pair.producer.answer_member(("t2", 1)) == ""
    assert pair.producer.answer_member(("t3", 1)) is None


def test_a_members_new_stream_replaces_only_that_members_old_one(pair: Pair):
    pair.producer.stream_opened(STREAM + 1, "b")
    pair.send("order", "t1", blocks=(5,), num_tokens=20)
    pair.send("order", "t2", stream=STREAM + 1, blocks=(1,), num_tokens=20)
    pair.producer.stream_opened(STREAM + 2, "b")
    pair.send("order", "t2", stream=STREAM + 1, blocks=(1,), num_tokens=20)  # the replaced stream's late message
    pair.source("t1", req_id="p1", blocks=(7,), num_tokens=20)
    pair.source("t2", req_id="p2", blocks=(2,), num_tokens=20)
    pair.pump(lambda: pair.reports)
    pair.settle()
    assert pair.answers() == [("t1", WRITTEN, 0)]


def test_each_members_stream_lease_runs_out_on_its_own(pair: Pair):
    pair.producer.stream_opened(STREAM + 1, "b")
    pair.send("order", "t1", blocks=(5,), num_tokens=20, lease_s=LEASE_S)
    pair.send("order", "t2", stream=STREAM + 1, blocks=(1,), num_tokens=20, lease_s=LEASE_S)
    pair.clock.advance(LEASE_S - 0.5)
    pair.send("heartbeat", "")  # renews member ""'s stream only
    pair.clock.advance(0.5)
    pair.step()
    pair.source("t1", req_id="p1", blocks=(7,), num_tokens=20)
    pair.source("t2", req_id="p2", blocks=(2,), num_tokens=20)
    pair.pump(lambda: pair.reports)
    pair.settle()
    assert pair.answers() == [("t1", WRITTEN, 0)] and pair.d_block_is_zero(1)


def test_unposted_orders_are_dropped_once_the_stream_lease_runs_out(pair: Pair):
    pair.send("order", "t1", lease_s=LEASE_S)
    pair.clock.advance(LEASE_S - 0.25)
    assert pair.producer.step() == pair.clock.now() + 0.25  # the lease end is when it must look again
    pair.clock.advance(0.25)
    pair.step()
    pair.source("t1")
    pair.settle()
    assert pair.reports == [] and pair.d_block_is_zero(5)


def test_any_message_renews_the_stream_lease_heartbeats_included(pair: Pair):
    pair.send("order", "t1")
    pair.clock.advance(2.0)
    pair.send("heartbeat", "")
    pair.clock.advance(2.0)  # past the order's own message's lease, within the heartbeat's
    pair.step()
    pair.source("t1")
    pair.pump(lambda: pair.reports)
    assert pair.answers() == [("t1", WRITTEN, 0)]


def test_the_stream_lease_counts_from_send_time_by_this_hosts_wall_clock(pair: Pair):
    # The broker's clock runs 2 s behind (or the message spent 2 s in flight): 0.75 s of the lease is left.
    pair.send("order", "t1", sent_ahead_s=-2.0)
    pair.clock.advance(0.75)
    pair.source("t1")
    pair.settle()
    assert pair.reports == []


# ----- the write budget -----


@pytest.mark.parametrize("sent_ahead_s, still_posts_after_s", [(0.0, 1.9), (1.0, 2.9), (-1.0, 0.9)], ids=["same clock", "broker ahead", "broker behind"])
def test_the_write_budget_runs_from_send_time_by_this_hosts_wall_clock(pair: Pair, sent_ahead_s: float, still_posts_after_s: float):
    pair.send("order", "t1", budget_s=2.0, lease_s=10.0, sent_ahead_s=sent_ahead_s)
    pair.clock.advance(still_posts_after_s)
    pair.step()
    pair.source("t1")
    pair.pump(lambda: pair.reports)
    assert pair.answers() == [("t1", WRITTEN, 0)]


@pytest.mark.parametrize("sent_ahead_s, dropped_after_s", [(0.0, 2.0), (1.0, 3.0), (-1.0, 1.0)], ids=["same clock", "broker ahead", "broker behind"])
def test_an_order_whose_budget_ran_out_is_never_written(pair: Pair, sent_ahead_s: float, dropped_after_s: float):
    pair.send("order", "t1", budget_s=2.0, lease_s=10.0, sent_ahead_s=sent_ahead_s)
    pair.clock.advance(dropped_after_s)
    pair.source("t1")  # the checks run again right before the post
    pair.settle()
    assert pair.d_block_is_zero(5) and not pair.producer.busy
    [report] = pair.reports
    assert report.outcome == REVOKED and "budget" in report.error_message  # refused by the check right before the post
    pair.reports.clear()
    pair.send("revocation", "t1")  # the broker revokes it and hears the truth: nothing was posted
    assert [(t, o) for t, o, _ in pair.answers()] == [("t1", REVOKED)]


@pytest.mark.parametrize("runs_out", ["budget", "stream lease"])
def test_the_checks_run_again_right_before_the_post(runs_out: str):
    slow = Pair(plan_time_s=1.0).start()  # building the plan takes 1 s
    try:
        if runs_out == "budget":
            slow.send("order", "t1", budget_s=1.5, lease_s=10.0)
        else:
            slow.send("order", "t1", budget_s=30.0, lease_s=1.5)
        slow.clock.advance(0.75)
        slow.source("t1")  # passes the checks, then the plan build outlasts what was left
        slow.settle()
        assert not slow.producer.busy and slow.d_block_is_zero(5)
        if runs_out == "budget":
            [report] = slow.reports
            assert report.outcome == REVOKED and "budget" in report.error_message
        else:
            assert slow.reports == []  # void with its stream's lease: the broker resends it if still wanted
    finally:
        slow.close()


def test_a_source_held_past_its_hold_deadline_is_released_without_a_write(pair: Pair):
    pair.source("t4", blocks=(2,), num_tokens=20, hold_s=0.3)
    assert pair.producer.step() == pair.clock.now() + 0.3
    pair.clock.advance(0.3)
    pair.step()
    assert pair.released() == {"p-req"} and pair.reports == []
