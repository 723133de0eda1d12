# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""bench/control_plane_model.py's arithmetic and simulation, and bench/broker_memory.py on a real BrokerCore, with small inputs."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from bench import broker_memory
from bench import control_plane_model as cpm

COSTS = cpm.Costs(rendezvous_s=300e-6, item_s=100e-6, keepalive_s=800e-6, owner_s_per_member=0.0, live_attempt_bytes=4000, retained_attempt_bytes=6000)
FLEET = cpm.Fleet(engines=100, in_flight=10_000)
FAST = dict(sample_transfers=2000, seed=3)


def test_a_transfer_costs_the_measured_rendezvous_plus_an_item_per_further_message():
    # 8 producer ranks: 7 more orders, 8 write results, 1 event beyond the measured rendezvous.
    assert cpm.cpu_per_transfer(FLEET, COSTS, 4) == pytest.approx(300e-6 + 16 * 100e-6)
    assert FLEET.messages_per_transfer == 19 and FLEET.rate == 5000


def test_doubling_shards_halves_per_shard_load_and_memory_but_not_the_fleets_etcd_or_registrar_load():
    one = cpm.model(FLEET, COSTS, cpm.Failover(), target_utilisation=0.6, shards=20, **FAST)
    two = cpm.model(FLEET, COSTS, cpm.Failover(), target_utilisation=0.6, shards=40, **FAST)
    assert two.load.messages_per_s == pytest.approx(one.load.messages_per_s / 2)
    assert two.load.utilisation == pytest.approx(one.load.utilisation / 2)
    assert two.load.live_attempts == one.load.live_attempts / 2 and two.memory_mib == pytest.approx(one.memory_mib / 2, rel=1e-3)
    assert two.load.wait_p99_ms < one.load.wait_p99_ms  # a less busy core makes messages wait less
    assert (two.registrar_keepalives_per_s, two.registrar_replicas) == (one.registrar_keepalives_per_s, one.registrar_replicas)
    # 50 prefill engines: orders and reports per rank; 50 decode engines: their scheduler's reports and events.
    assert two.streams_per_shard == one.streams_per_shard == 50 * 8 * 2 + 50 * 2
    assert two.etcd_writes_per_s > one.etcd_writes_per_s > 0  # more members to (re)join, nothing else
    # 20 shards: 5,000 rdv/s x 1.9 ms / 20; 8 ranks x 100 engines renew every second, members every 2/3 s.
    assert one.load.utilisation == pytest.approx(5000 * 1.9e-3 / 20)
    assert one.registrar_keepalives_per_s == 800 and one.etcd_lease_renewals_per_s == pytest.approx(800 + 20 * 3)  # 20 members renewing every 2 s / 6


def test_memory_is_live_attempts_plus_retained_ones_capped_per_shard():
    # 10,000 live over 10 shards, 500 settle per shard per second and are kept 60 s.
    assert cpm.memory_bytes(FLEET, COSTS, 1000, 10) == 1000 * 4000 + 500 * 60 * 6000
    capped = dataclasses.replace(FLEET, max_retained_attempts=100)
    assert cpm.memory_bytes(capped, COSTS, 1000, 10) == 1000 * 4000 + 100 * 6000


def test_shards_needed_is_the_fewest_that_meet_the_target_and_owner_lookups_can_make_it_unreachable():
    needed = cpm.shards_needed(FLEET, COSTS, 0.6)
    assert FLEET.rate * cpm.cpu_per_transfer(FLEET, COSTS, needed) / needed <= 0.6
    assert FLEET.rate * cpm.cpu_per_transfer(FLEET, COSTS, needed - 1) / (needed - 1) > 0.6
    assert needed == math.ceil(5000 * 1.9e-3 / 0.6)
    # Per shard: 5,000 x 1.9 ms / shards + 5,000 x lookups x 10 us (each lookup hashes every member).
    hashing = dataclasses.replace(COSTS, owner_s_per_member=10e-6)
    assert cpm.shards_needed(FLEET, hashing, 0.6) == 18  # 9.5 / (0.6 - 0.05) = 17.3
    assert cpm.shards_needed(dataclasses.replace(FLEET, owner_cached=False), hashing, 0.6) == 95  # 9.5 / (0.6 - 0.5)
    # 50,000 rdv/s x 10 lookups x 1 us per member is half of every shard's core, whatever the count.
    unreachable = dataclasses.replace(FLEET, in_flight=100_000, owner_cached=False)
    assert cpm.shards_needed(unreachable, dataclasses.replace(COSTS, owner_s_per_member=1e-6), 0.5) is None


def test_failover_is_the_shard_lease_then_the_watch_then_the_retry():
    mean, worst = cpm.Failover(0.1, 0.005).seconds(dataclasses.replace(FLEET, shard_lease_ttl_s=2.0))
    # The member renewed every ttl/6 (RENEWALS_PER_TTL): its lease lapses 5/6 ttl to ttl after its death.
    assert (mean, worst) == (pytest.approx(2.0 * 11 / 12 + 0.105), pytest.approx(2.105))


def test_the_simulation_is_seeded_and_an_overloaded_shard_has_no_steady_wait():
    assert cpm.simulate(FLEET, COSTS, 16, **FAST) == cpm.simulate(FLEET, COSTS, 16, **FAST)
    assert cpm.simulate(FLEET, COSTS, 16, **FAST) != cpm.simulate(FLEET, COSTS, 16, sample_transfers=2000, seed=4)
    assert math.isinf(cpm.simulate(FLEET, COSTS, 8, **FAST).wait_p99_ms)  # 1.19 of a core


def test_the_command_prints_both_tables_and_a_json_line(capsys):
    cpm.main(["--engines", "100", "--in-flight", "1000,2000", "--sample-transfers", "500", "--owner-us-per-member", "1",
              "--live-attempt-bytes", "4000", "--retained-attempt-bytes", "6000", "--sizing-rates", "1000,100000", "--json"])
    out = capsys.readouterr().out
    assert "| 100 | 1,000 | 500 | 2 |" in out and "| 100 | 2,000 | 1,000 | 4 |" in out
    assert "| 1,000 | 100,000 | 1.90 |" in out
    rows = json.loads(out.strip().splitlines()[-1])["rows"]
    assert [r["in_flight"] for r in rows] == [1000, 2000]


def test_broker_memory_measures_a_real_core_holding_attempts():
    one_rank = broker_memory.measure(attempts=60, producer_ranks=1, tokens=256)
    four_ranks = broker_memory.measure(attempts=60, producer_ranks=4, tokens=256)
    assert 1000 < one_rank.live < 20_000 and 1000 < one_rank.retained < 20_000
    assert four_ranks.live > one_rank.live  # an attempt keeps each producer rank's order and write state
