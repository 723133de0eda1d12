# SPDX-License-Identifier: Apache-2.0
"""WRITEs made while the forward runs (non-progressive push), over real NIXL: the forward's end only posts them, fenced as ever.

The worker hands a completing prefill over twice: when its last forward
starts (`computing(..., whole=True)`) and when it ends (`source_ready`).
With its order already here, the transfer thread plans and makes the WRITE
in between; the post, and every fencing check, waits for the end. A made
WRITE whose order or decode engine changed is freed, never posted.
"""

from __future__ import annotations

from nixl_pair import REVOKED, TOKEN_BYTES, WRITTEN, Pair

from kvpush.registrar.v1 import registrar_service_pb2 as reg_pb


def test_the_write_is_made_during_the_forward_and_only_posted_at_its_end(pair: Pair):
    pair.expect("t1", num_tokens=110)
    pair.send("order", "t1", blocks=(5, 1), num_tokens=110)
    pair.source("t1", blocks=(7, 2, 9, 4), num_tokens=110, computing=True, whole=True)
    assert pair.p_agent.calls == ["make"]
    pair.settle()
    assert pair.received() == (set(), set()) and pair.d_block_is_zero(5)  # made, not posted: nothing moved
    pair.source("t1", blocks=(7, 2, 9, 4), num_tokens=110)
    assert pair.p_agent.calls == ["make", "start"]  # nothing is made again at the end
    assert pair.pump(pair.results) == ({"d-req"}, set())
    [report] = pair.reports
    assert (report.outcome, report.bytes_written) == (WRITTEN, 110 * TOKEN_BYTES)
    pair.check_bytes((7, 2, 9, 4), (5, 1), 0, 110)


def test_an_order_arriving_during_the_forward_is_made_at_once(pair: Pair):
    pair.expect("t1", num_tokens=110)
    pair.source("t1", blocks=(7, 2, 9, 4), num_tokens=110, computing=True, whole=True)
    assert pair.p_agent.calls == []
    pair.send("order", "t1", blocks=(5, 1), num_tokens=110)
    assert pair.p_agent.calls == ["make"]
    pair.source("t1", blocks=(7, 2, 9, 4), num_tokens=110)
    assert pair.pump(pair.results) == ({"d-req"}, set())
    assert pair.p_agent.calls[:2] == ["make", "start"]
    pair.check_bytes((7, 2, 9, 4), (5, 1), 0, 110)


def test_a_write_made_for_a_revoked_order_is_freed_and_never_posted(pair: Pair):
    pair.send("order", "t1", blocks=(5, 1), num_tokens=110)
    pair.source("t1", blocks=(7, 2, 9, 4), num_tokens=110, computing=True, whole=True)
    pair.send("revocation", "t1")
    assert pair.answers() == [("t1", REVOKED, 0)]  # nothing was posted: the truth
    pair.source("t1", blocks=(7, 2, 9, 4), num_tokens=110)
    assert pair.p_agent.calls == ["make", "release"]
    assert pair.released() == {"p-req"}
    pair.settle()
    assert pair.d_block_is_zero(5) and pair.d_block_is_zero(1) and pair.answers() == []


def test_a_resent_order_on_a_new_stream_gets_a_write_of_its_own(pair: Pair):
    """The stream broke during the forward: its order is void, the broker resends it on the next stream."""
    pair.expect("t1", num_tokens=110)
    pair.send("order", "t1", blocks=(5, 1), num_tokens=110)
    pair.source("t1", blocks=(7, 2, 9, 4), num_tokens=110, computing=True, whole=True)
    pair.producer.stream_opened(2)
    pair.send("order", "t1", stream=2, blocks=(5, 1), num_tokens=110)
    assert pair.p_agent.calls == ["make", "release", "make"]  # the first stream's WRITE is never posted
    pair.source("t1", blocks=(7, 2, 9, 4), num_tokens=110)
    assert pair.pump(pair.results) == ({"d-req"}, set())
    assert pair.p_agent.calls[3] == "start" and pair.p_agent.calls.count("start") == 1
    assert pair.answers() == [("t1", WRITTEN, 0)]
    pair.check_bytes((7, 2, 9, 4), (5, 1), 0, 110)


def test_a_write_made_for_a_departed_decode_engine_is_freed_before_its_agent_is_unloaded(pair: Pair):
    pair.send("order", "t1", blocks=(5, 1), num_tokens=110)
    pair.source("t1", blocks=(7, 2, 9, 4), num_tokens=110, computing=True, whole=True)
    pair.producer.engine_event(reg_pb.WatchEnginesResponse(type=reg_pb.ENGINE_EVENT_TYPE_REMOVED, engine=pair.engine))
    pair.step()
    assert pair.p_agent.calls == ["make", "release", "remove_peer test-d"]
    pair.source("t1", blocks=(7, 2, 9, 4), num_tokens=110)
    assert "start" not in pair.p_agent.calls


def test_a_forward_that_cannot_fill_the_destination_makes_nothing(pair: Pair):
    pair.send("order", "t1", blocks=(4, 6), num_tokens=110)
    pair.source("t1", blocks=(1, 2, 3), num_tokens=96, computing=True, whole=True)
    assert pair.p_agent.calls == []
    pair.source("t1", blocks=(1, 2, 3), num_tokens=96)
    [report] = pair.reports
    assert report.outcome == REVOKED and pair.released() == {"p-req"}
    assert pair.p_agent.calls == []


def test_a_budget_run_out_at_the_forwards_end_frees_the_made_write(pair: Pair):
    """The checks run at the post: a WRITE made in time is still not posted past its order's budget."""
    pair.send("order", "t1", blocks=(5, 1), num_tokens=110, budget_s=1.0)
    pair.source("t1", blocks=(7, 2, 9, 4), num_tokens=110, computing=True, whole=True)
    pair.clock.advance(1.5)
    pair.source("t1", blocks=(7, 2, 9, 4), num_tokens=110)
    assert pair.p_agent.calls == ["make", "release"]
    assert [a[1] for a in pair.answers()] == [REVOKED]
    pair.settle()
    assert pair.d_block_is_zero(5)
