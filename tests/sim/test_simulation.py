# SPDX-License-Identifier: Apache-2.0
"""The protocol simulation: thousands of seeded schedules under faults, no invariant violated, every seed replayable."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvpush.dev.sim.run import run_many, run_schedule
from kvpush.dev.sim.simulation import Simulation

CI_SCHEDULES = 3000


@pytest.mark.slow
def test_thousands_of_faulty_schedules_violate_no_invariant():
    failing, totals = run_many(0, CI_SCHEDULES, workers=2)
    assert not failing, [(o.seed, o.violations[:2]) for o in failing[:5]]
    # The schedules did exercise the faults and both outcomes.
    assert totals["client requests"] > 5 * CI_SCHEDULES
    assert totals["answered ok"] > totals["client requests"] // 3
    assert totals["answered failed"] > 0
    for fault in ("kills", "pauses", "lease_outages", "stream_resets", "disconnects", "collisions", "malformed"):
        assert totals[f"fault {fault}"] > CI_SCHEDULES // 10, fault
    assert totals["schedules with stuck WRITEs"] > 0 and totals["schedules with message loss"] > 0
    assert totals["schedules with refused posts"] > 0
    # A sharded broker's members lost, gave up and took back transfers.
    assert totals["schedules with broker shards"] > CI_SCHEDULES // 3
    for fault in ("member_pauses", "etcd_cuts", "engine_cuts", "leaves", "member_kills"):
        assert totals[f"fault {fault}"] > CI_SCHEDULES // 20, fault
    assert totals["shard map changes"] > CI_SCHEDULES // 2


def test_a_seed_replays_exactly():
    for seed in (7, 436, 2760):
        first, second = run_schedule(seed), run_schedule(seed)
        assert first.stats == second.stats
        assert first.violations == second.violations


def test_a_seed_replays_exactly_in_another_process():
    """`kvpush sim --replay` in a process with another string-hash seed runs the very same schedule."""
    expected = run_schedule(436).stats
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run(
        [sys.executable, "-m", "kvpush.cli", "sim", "--replay", "436"], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"'events': {expected['events']}" in out.stdout
    assert "no invariant violated" in out.stdout


def test_state_is_bounded_after_a_schedule():
    sim = Simulation(11)
    assert not sim.run()
    sizes = sim.cp.broker.memory_sizes
    assert sizes["remembered_attempts"] <= 3 * len(sim.router.requests) + 10  # settled ones age out with retention
    assert sim.cp.broker.unsettled_attempts == 0
