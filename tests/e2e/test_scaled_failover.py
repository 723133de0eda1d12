# SPDX-License-Identifier: Apache-2.0
"""The short form of `python -m bench.failover` in CI: the real local stack on the scaled-out control plane (a
3-member etcd cluster, 2 registrar replicas, 3 broker shards, P and D vLLM CPU engines, the router) under steady
load while one broker shard, one etcd member and one registrar replica are killed with SIGKILL and restarted.
Transfers the dead shard owned fail over to their new owner within the target, failures name the lost shard,
losing etcd or registrar members fails nothing, nothing hangs or is wrong, and every KV block is free again."""

from __future__ import annotations

import dataclasses

import pytest

from bench.chaos.report import format_report
from bench.chaos.runner import run
from bench.chaos.settings import FAILOVER_ORDER, short_settings

pytestmark = pytest.mark.engine


def test_the_scaled_control_plane_fails_over(model_dir, tmp_path):
    settings = dataclasses.replace(short_settings(run_dir=tmp_path / "failover", model_dir=model_dir), scaled=True, faults=FAILOVER_ORDER)
    result = run(settings, quiet=True)
    report = format_report(result)
    print(report)
    assert [fault["fault"] for fault in result["faults"]] == list(FAILOVER_ORDER)
    verdict = result["verdict"]
    missed = [name for name, held in verdict["targets"].items() if not held]
    assert not missed, f"targets missed: {missed}\n{report}"
    by_name = {fault["fault"]: fault for fault in result["faults"]}
    for fault in result["faults"]:
        assert fault["routed"]["requests"] > 0 and fault["routed"]["ok"] > 0, fault["fault"]
    failover = by_name["shard-kill"]["notes"]["failover"]
    assert failover["probes"] > 0 and failover["wrong"] == 0
    assert by_name["shard-kill"]["notes"]["rejoin"]["seconds"] is not None
