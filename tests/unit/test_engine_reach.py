# SPDX-License-Identifier: Apache-2.0
"""services/broker/engine_reach.py: when a broker member no engine reaches steps out of the shard map."""

from __future__ import annotations

import pytest

from kvpush.services.broker.engine_reach import HOLD_OFF_FIRST_S, HOLD_OFF_MAX_S, EngineReach

SILENCE_S = 1.0


def serving_reach(now: float = 0.0) -> EngineReach:
    reach = EngineReach(SILENCE_S, now)
    reach.observe(streams=0, serving=True, now=now)
    return reach


def test_a_member_no_engine_reaches_steps_down_after_the_silence_bound_only_while_another_member_is_reached():
    reach = serving_reach()
    reach.observe(streams=2, serving=True, now=0.5)
    reach.observe(streams=0, serving=True, now=1.0)
    assert reach.attached(0.9) and not reach.attached(0.5 + SILENCE_S / 2)
    assert not reach.cut_off(now=1.4, peers_attached=True)
    assert reach.cut_off(now=1.5, peers_attached=True)
    # No member reached (every engine restarting): nobody steps down, however long it lasts.
    assert not reach.cut_off(now=100.0, peers_attached=False)


def test_a_member_that_just_joined_gives_engines_the_silence_bound_to_find_it():
    reach = EngineReach(SILENCE_S, now=0.0)
    reach.observe(streams=0, serving=False, now=50.0)
    assert not reach.cut_off(now=50.0, peers_attached=True)  # not serving: nothing to step down from
    reach.observe(streams=0, serving=True, now=60.0)
    assert not reach.cut_off(now=60.0 + SILENCE_S - 0.01, peers_attached=True)
    assert reach.cut_off(now=60.0 + SILENCE_S, peers_attached=True)


def test_hold_offs_double_while_it_stays_cut_off_and_start_over_once_engines_reach_it_again():
    reach = serving_reach()
    hold_offs = []
    for _ in range(6):
        hold_offs.append(reach.next_hold_off())
        reach.observe(streams=0, serving=True, now=0.0)  # joined again, still cut off
    assert hold_offs == [min(HOLD_OFF_FIRST_S * 2**i, HOLD_OFF_MAX_S) for i in range(6)]
    assert not reach.cut_off(now=0.1, peers_attached=True)  # a fresh silence bound after each step-down
    reach.observe(streams=1, serving=True, now=1.0)
    assert reach.next_hold_off() == HOLD_OFF_FIRST_S and reach.step_downs == 7


def test_the_silence_bound_must_be_positive():
    with pytest.raises(ValueError, match="positive"):
        EngineReach(0.0, now=0.0)


def test_a_member_reports_itself_reached_only_for_a_stream_not_for_having_just_joined():
    """Joining gives engines time to attach, but must not tell the others it is reached (they would step down)."""
    reach = EngineReach(SILENCE_S, now=0.0)
    assert not reach.attached(0.0)
    reach.observe(streams=0, serving=True, now=5.0)
    assert not reach.attached(5.0)
    reach.observe(streams=1, serving=True, now=5.1)
    assert reach.attached(5.1)
