# SPDX-License-Identifier: Apache-2.0
"""ProducerCore and ConsumerCore over real NIXL: layers leave as they are computed, in parts."""

from __future__ import annotations

import numpy as np
import pytest
from nixl_pair import (
    D_BLOCK,
    FAILED,
    LAYERS,
    P_BLOCK,
    REVOKED,
    STREAM,
    TOKEN_BYTES,
    WRITTEN,
    Pair,
    cells,
    order_body,
)

from kvpush.connector.handoff import SourceReady
from kvpush.connector.notification import notification
from kvpush.connector.write_plans import build_write_plans
from kvpush.rendezvous.v1 import transfer_pb2

# ----- layer-progressive push -----


@pytest.mark.parametrize("block_sizes", [(P_BLOCK, D_BLOCK), (P_BLOCK, P_BLOCK)], ids=["segments", "prepared-pages"])
def test_layers_leave_as_they_are_computed_and_the_request_is_received_only_after_the_last_part(block_sizes):
    pair = Pair(p_block=block_sizes[0], d_block=block_sizes[1]).start()
    try:
        blocks = (5, 1) if block_sizes[1] == D_BLOCK else (5, 1, 8, 3)
        pair.expect("t1", num_tokens=110)
        pair.send("order", "t1", blocks=blocks, num_tokens=110)  # early: D registered while P computes
        pair.source("t1", blocks=(7, 2, 9, 4), num_tokens=110, computing=True)
        pair.producer.layer_done((("t1", 1),), 0)
        assert pair.producer.busy  # layer 0 is on its way; the last layer waits for the source
        pair.settle()
        assert pair.received() == (set(), set())  # a part landed, but its notification names no count
        layer0 = [cells(pair.d_layout, list(blocks), pair.d_block, 0, range(110))]
        assert np.any(layer0[0] != 0) and not pair.reports
        pair.source("t1", blocks=(7, 2, 9, 4), num_tokens=110)
        assert pair.pump(pair.results) == ({"d-req"}, set())
        pair.settle()
        [report] = pair.reports
        assert (report.outcome, report.reason) == (WRITTEN, 0)
        assert report.bytes_written >= 110 * TOKEN_BYTES  # whole pages when prepared, exact rows otherwise
        pair.check_bytes((7, 2, 9, 4), blocks, 0, 110)
        assert pair.released() == {"p-req"} and not pair.producer.busy
    finally:
        pair.close()


def test_prepared_pages_are_used_when_both_sides_lay_blocks_out_alike():
    pair = Pair(p_block=P_BLOCK, d_block=P_BLOCK).start()
    try:
        peer = pair.producer._peers["decode-t"]
        assert peer.ranks[0].prepared is not None
        order = order_body("t1", blocks=(5, 1, 8, 3), num_tokens=110)
        ready = SourceReady("r", "t1", 1, "r", "decode-t", ((7, 2, 9, 4),), 110, 30.0, "", 0, 0)
        [plan] = build_write_plans(pair.producer.local, ready, order, peer)
        assert plan.plan is None and len(plan.pages) == LAYERS * 4  # a page per (layer, block): NIXL merges neighbours
        [layer1] = build_write_plans(pair.producer.local, ready, order, peer, frozenset({1}))
        assert len(layer1.pages) == 4
    finally:
        pair.close()
    mixed = Pair().start()  # P and D blocks of different sizes: byte segments, built per request
    try:
        [plan] = build_write_plans(mixed.producer.local, ready, order_body("t1", blocks=(5, 1)), mixed.producer._peers["decode-t"])
        assert plan.pages is None and len(plan.plan) > 0
    finally:
        mixed.close()


def test_a_revocation_between_parts_stops_the_parts_and_is_answered_failed(pair: Pair):
    pair.expect("t1")
    pair.send("order", "t1")
    pair.source("t1", computing=True)
    pair.producer.layer_done((("t1", 1),), 0)
    pair.send("revocation", "t1")  # a part is posted: REVOKED would be a lie
    pair.source("t1")  # the forward ends: no last part
    pair.pump(lambda: pair.reports)
    assert pair.answers() == [("t1", FAILED, 0)]
    assert pair.released() == {"p-req"}
    pair.settle()
    assert pair.received() == (set(), set())  # never complete: D's deadline fails it, after the broker's word
    pair.send("revocation", "t1")
    assert pair.answers() == [("t1", FAILED, 0)]


def test_a_lost_stream_between_parts_posts_nothing_more(pair: Pair):
    pair.expect("t1")
    pair.send("order", "t1")
    pair.source("t1", computing=True)
    pair.producer.layer_done((("t1", 1),), 0)
    pair.producer.stream_lost(STREAM)
    pair.source("t1")
    pair.pump(lambda: pair.reports)
    assert [(r.outcome, "stream" in r.error_message) for r in pair.reports] == [(FAILED, True)]
    assert pair.released() == {"p-req"}


def test_a_computing_source_for_another_prompt_refuses_the_order_before_any_part(pair: Pair):
    pair.send("order", "t1", prompt=[1, 2, 3] * 40)
    pair.source("t1", prompt=[9, 2, 3] * 40, computing=True)
    pair.producer.layer_done((("t1", 1),), 0)
    assert pair.answers() == [("t1", REVOKED, transfer_pb2.END_REASON_PROMPT_MISMATCH)]
    assert not pair.producer.busy
    pair.source("t1", prompt=[9, 2, 3] * 40)
    assert pair.released() == {"p-req"}
    pair.settle()
    assert pair.d_block_is_zero(5) and pair.d_block_is_zero(1)


def test_an_order_after_the_source_is_one_write_as_without_progression(pair: Pair):
    pair.expect("t1")
    pair.source("t1", computing=True)
    pair.producer.layer_done((("t1", 1),), 0)  # no order yet: nothing to post
    assert not pair.producer.busy
    pair.source("t1")
    pair.send("order", "t1")
    assert pair.pump(pair.results) == ({"d-req"}, set())
    pair.check_bytes((7, 2, 9, 4), (5, 1), 0, 110)


def test_the_consumer_counts_every_part_whatever_order_their_notifications_come_in(pair: Pair):
    pair.expect("t1", num_tokens=110)
    last = notification("t1", 1, 0, 1, 0, 110, 3, 3)
    pair.consumer._on_notification("p", last)  # the last part's notification overtakes the others
    pair.consumer._on_notification("p", notification("t1", 1, 0, 1, 0, 110, 1, 0))
    assert pair.received() == (set(), set())
    pair.consumer._on_notification("p", notification("t1", 1, 0, 1, 0, 110, 2, 0))
    assert pair.received() == ({"d-req"}, set())
