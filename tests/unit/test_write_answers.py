# SPDX-License-Identifier: Apache-2.0
"""ProducerCore over real NIXL: at most one WRITE per key, truthful answers, writes that never complete."""

from __future__ import annotations

from nixl_pair import (
    FAILED,
    REVOKED,
    STREAM,
    WRITE_TIMEOUT_S,
    WRITTEN,
    Pair,
)

from kvpush.registrar.v1 import registrar_service_pb2 as reg_pb

# ----- at most one WRITE per key, truthful answers -----


def test_at_most_one_write_per_key_and_a_repeated_order_gets_the_recorded_answer(pair: Pair):
    pair.expect("t1")
    pair.source("t1")
    pair.send("order", "t1")  # posted at once
    assert pair.producer.busy
    pair.send("order", "t1")  # a resync's copy while the WRITE is in flight: the job answers
    pair.pump(pair.results)
    pair.settle()
    assert pair.answers() == [("t1", WRITTEN, 0)]
    pair.send("order", "t1")  # a copy after the answer: the same answer, no second WRITE
    assert [(r.outcome, r.bytes_written) for r in pair.reports] == [(WRITTEN, 0)]
    assert not pair.producer.busy
    pair.producer.stream_opened(STREAM + 1)
    pair.send("order", "t1", stream=STREAM + 1)  # and on a new stream too
    assert [r.outcome for r in pair.reports] == [WRITTEN, WRITTEN] and not pair.producer.busy


def test_a_revocation_before_any_post_is_answered_revoked_and_the_source_goes_back(pair: Pair):
    pair.send("order", "t3", blocks=(4,), num_tokens=20)
    pair.send("revocation", "t3")
    assert pair.answers() == [("t3", REVOKED, 0)]
    pair.source("t3", blocks=(1,), num_tokens=20)
    assert pair.released() == {"p-req"}  # this rank answered for the key: it will never write it
    pair.send("order", "t3", blocks=(4,), num_tokens=20)  # a stale copy of the revoked order
    assert pair.answers() == [("t3", REVOKED, 0)]
    pair.settle()
    assert pair.d_block_is_zero(4) and not pair.producer.busy
    pair.send("revocation", "t9")  # a revocation of an order never seen: nothing was posted
    assert pair.answers() == [("t9", REVOKED, 0)]


def test_a_closure_releases_a_source_no_order_came_for(pair: Pair):
    pair.source("t5", blocks=(1,), num_tokens=20)
    pair.settle()
    assert pair.released() == set()  # held for an order
    pair.send("closed", "t5")
    assert pair.released() == {"p-req"} and pair.reports == []


def test_a_revocation_of_a_posted_write_is_answered_by_the_write(pair: Pair):
    pair.expect("t1")
    pair.source("t1")
    pair.send("order", "t1")
    pair.send("revocation", "t1")  # too late: the WRITE is in flight
    assert pair.reports == []
    pair.pump(pair.results)
    pair.settle()
    assert pair.answers() == [("t1", WRITTEN, 0)]
    pair.send("revocation", "t1")  # again after completion: the same truth
    assert pair.answers() == [("t1", WRITTEN, 0)]


def test_a_closure_before_the_order_refuses_the_late_order(pair: Pair):
    pair.send("closed", "t1")
    pair.send("order", "t1")
    assert pair.answers() == [("t1", REVOKED, 0)]
    pair.source("t1")
    assert pair.released() == {"p-req"}  # the attempt ended: its source goes back at once


def test_a_second_source_with_a_key_another_request_holds_is_released_at_once(pair: Pair):
    pair.source("t1", req_id="p-first")
    pair.source("t1", req_id="p-second")
    assert pair.released() == {"p-second"}
    pair.expect("t1")
    pair.send("order", "t1")
    pair.pump(pair.results)
    pair.settle()
    assert pair.released() == {"p-first"} and pair.answers() == [("t1", WRITTEN, 0)]
    pair.check_bytes((7, 2, 9, 4), (5, 1), 0, 110)


# ----- writes that never complete (StalledWriteAgent) -----


def test_a_write_still_in_flight_at_its_write_timeout_is_aborted_and_reported_failed(stalled: Pair):
    stalled.send("order", "t1", write_timeout_s=WRITE_TIMEOUT_S)
    stalled.source("t1")
    assert stalled.producer.busy and stalled.reports == []
    posted = stalled.clock.now()
    assert stalled.producer.step() == posted + WRITE_TIMEOUT_S
    stalled.clock.advance(WRITE_TIMEOUT_S - 0.01)
    stalled.step()
    assert stalled.producer.busy and stalled.reports == []
    stalled.clock.advance(0.01)
    stalled.p_agent.calls.clear()
    stalled.producer.step()
    # Released before any call that makes progress: an aborted WRITE can no longer land.
    assert stalled.p_agent.calls[0] == "release"
    [report] = stalled.reports
    assert report.outcome == FAILED and "aborted" in report.error_message
    assert stalled.released() == {"p-req"} and not stalled.producer.busy


def test_a_removed_decode_engines_agent_is_unloaded_only_once_no_write_to_it_is_in_flight(stalled: Pair):
    stalled.send("order", "t1")
    stalled.source("t1")
    assert stalled.producer.busy
    removed = reg_pb.WatchEnginesResponse(type=reg_pb.ENGINE_EVENT_TYPE_REMOVED, engine=stalled.engine)
    stalled.producer.engine_event(removed)
    stalled.clock.advance(1.0)
    stalled.producer.step()
    assert not [c for c in stalled.p_agent.calls if c.startswith("remove_peer")]  # a WRITE to it is in flight
    stalled.clock.advance(WRITE_TIMEOUT_S)
    stalled.producer.step()
    assert [c for c in stalled.p_agent.calls if c.startswith("remove_peer")] == ["remove_peer test-d"]
    assert stalled.p_agent.calls.index("release") < stalled.p_agent.calls.index("remove_peer test-d")
    assert [r.outcome for r in stalled.reports] == [FAILED]


def test_an_engine_back_before_its_agent_was_unloaded_keeps_the_agent(pair: Pair):
    """Found by the simulation: its rank's lease lapsed and it registered again (same incarnation) before P's next
    step; that step unloaded the agent the engine's new entry used, and no WRITE could reach it any more."""
    pair.producer.engine_event(reg_pb.WatchEnginesResponse(type=reg_pb.ENGINE_EVENT_TYPE_REMOVED, engine=pair.engine))
    pair.producer.engine_event(reg_pb.WatchEnginesResponse(type=reg_pb.ENGINE_EVENT_TYPE_UPSERTED, engine=pair.engine))
    pair.step()
    assert not [c for c in pair.p_agent.calls if c.startswith("remove_peer")]
    pair.expect("t1", num_tokens=110)
    pair.send("order", "t1", blocks=(5, 1), num_tokens=110)
    pair.source("t1", blocks=(7, 2, 9, 4), num_tokens=110)
    assert pair.pump(pair.results) == ({"d-req"}, set())
    assert pair.answers() == [("t1", WRITTEN, 0)]
    pair.check_bytes((7, 2, 9, 4), (5, 1), 0, 110)


def test_an_idle_removed_engines_agent_is_unloaded_at_the_next_step(stalled: Pair):
    stalled.producer.engine_event(reg_pb.WatchEnginesResponse(type=reg_pb.ENGINE_EVENT_TYPE_REMOVED, engine=stalled.engine))
    stalled.producer.step()
    assert "remove_peer test-d" in stalled.p_agent.calls
    # An order for it now waits for the engine to come back (the broker fails it meanwhile).
    stalled.send("order", "t1")
    stalled.source("t1")
    assert not stalled.producer.busy and stalled.reports == []
