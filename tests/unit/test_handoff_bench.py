# SPDX-License-Identifier: Apache-2.0
"""bench/handoff.py's arithmetic: the hand-off chain from spans, the py-spy summary, its options."""

from __future__ import annotations

import argparse

import pytest

from bench import handoff


def span(start_ms: float, end_ms: float) -> dict:
    return {"start_ns": int(start_ms * 1e6), "end_ns": int(end_ms * 1e6)}


def test_segments_follow_the_chain_and_add_up():
    named = {
        "p.prefill": span(0.0, 10.0),
        "p.descriptor_prep": span(10.5, 10.8),
        "p.write_post": span(10.8, 11.2),
        "p.write_transfer": span(11.2, 11.4),
        "d.wait_for_kv": span(1.0, 11.9),
        "d.first_decode_step": span(12.6, 17.0),
    }
    got = handoff.segment_samples(named)
    assert got["until_matched"] == pytest.approx(0.5)
    assert got["descriptor_prep"] == pytest.approx(0.3)
    assert got["write_post"] == pytest.approx(0.4)
    assert got["write_transfer"] == pytest.approx(0.7)
    assert got["d_wait_tail"] == pytest.approx(0.7)
    assert got["posted"] == pytest.approx(1.2)
    assert got["p_saw_done"] == pytest.approx(0.2)
    chain = ("until_matched", "descriptor_prep", "write_post", "write_transfer", "d_wait_tail")
    assert got["scheduled"] == pytest.approx(sum(got[name] for name in chain)) == pytest.approx(2.6)


def test_profile_summary_counts_gil_samples_per_thread_and_kvpush_frames(tmp_path):
    (tmp_path / "early-qps4-P-100.txt").write_text(
        "thread (101): MainThread;<module> (x.py:1) 50\n"
        "thread (102): kvpush-producer-0;TransferThread._run (t.py:64);ProducerCore.handle (p.py:113) 3\n"
        "thread (102): kvpush-producer-0;TransferThread._run (t.py:64);nixl_agent.transfer (a.py:665) 1\n"
    )
    (tmp_path / "early-qps4-D-200.txt").write_text("thread (201): kvpush-consumer;TransferThread._run (t.py:64) 2\n\n")
    (tmp_path / "other-qps1-P-100.txt").write_text("thread (101): MainThread;<module> (x.py:1) 999\n")
    summary = handoff.profile_summary(tmp_path, "early-qps4", transfers=10)
    assert summary["gil_ms_per_transfer"] == {"P 100 MainThread": 50.0, "P 100 kvpush-producer-0": 4.0, "D 200 kvpush-consumer": 2.0}
    assert summary["kvpush_top_frames_ms_per_transfer"]["P 100 kvpush-producer-0"] == {"ProducerCore.handle (p.py:113)": 3.0,
                                                                                       "nixl_agent.transfer (a.py:665)": 1.0}
    assert "P 100 MainThread" not in summary["kvpush_top_frames_ms_per_transfer"]


@pytest.mark.parametrize("text", ["", "0", "1,-4", "fast"])
def test_bad_qps_is_refused_naming_it(text):
    with pytest.raises(argparse.ArgumentTypeError, match="--qps"):
        handoff.qps_list(text)


def test_bad_options_are_refused():
    assert handoff.qps_list("1, 4") == [1.0, 4.0]
    with pytest.raises(argparse.ArgumentTypeError, match="--orders"):
        handoff.orders_list("early,eager")
    with pytest.raises(argparse.ArgumentTypeError, match="--kvpush-extra must be a JSON object"):
        handoff.json_object("[1]")
