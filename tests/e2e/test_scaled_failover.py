# SPDX-License-Identifier: Apache-2.0
"""The short form of `python -m bench.failover` in CI: the real local stack on the scaled-out control plane (a
3-member etcd cluster, 2 registrar replicas, 3 broker shards, P and D vLLM CPU engines, the router) under steady
load while one broker shard is paused, cut off from the engines and then from etcd, one broker shard, one etcd member,
one registrar replica and then every registrar replica are killed with SIGKILL and restarted. Transfers the lost shard
owned fail over to their new owner, failures name the lost shard, losing etcd or registrar members fails nothing,
nothing hangs or is wrong, and every KV block is free again.

How fast the dead shard's transfers succeed again is a benchmark figure (the 2 s target, bench.failover); here
it must only happen, in two parts: etcd drops the dead member within what its lease rules allow (a shard lease,
longer after an etcd leader change), and within one request deadline of that drop (when every party has heard the
member left) a transfer it owned runs on its new owner. Every failure is answered by its deadline + 1 s with its reason,
however late etcd is (the router waits for the map's drop only within a request's own bound)."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
from pathlib import Path

import pytest

from bench.chaos.report import FAILOVER_TARGET_S, PAUSE_FAILOVER_TARGET_S, format_report
from bench.chaos.runner import run
from bench.chaos.settings import FAILOVER_ORDER, short_settings
from kvpush.dev.etcd_cluster import ELECTION_TIMEOUT_MS

pytestmark = pytest.mark.engine

TIMED_TARGET = f"shard-kill: its transfers succeed again <= {FAILOVER_TARGET_S:g} s after the kill"
# A hung member leaves the map when etcd drops its lease, on etcd's timing as a killed one does: here it must only have
# left before it woke up (before clients followed another member, they kept its map until then).
PAUSE_TIMED_TARGET = f"shard-pause: its transfers succeed again <= {PAUSE_FAILOVER_TARGET_S:g} s after the pause"
# A member cut off from the engines steps out of the map by itself, one from etcd stops serving when unsure of its lease:
# here each must only have handed its transfers over before the path healed.
CUTS = ("shard-cut-engines", "shard-cut-etcd")
CUT_TIMED_TARGETS = {f"{cut}: its transfers succeed again <= {PAUSE_FAILOVER_TARGET_S:g} s after the cut" for cut in CUTS}
# etcd's side of the failover (etcd 3.4; docs/scale-out.md, timing assumptions): the dead member's lease lapses a TTL after
# its last renewal, or a TTL after the election timeout that follows an etcd leader change (a new leader renews every lease);
# the leader's lessor then finds it within a 0.5 s tick and revokes it through raft, trying again every 3 s
# (expiredLeaseRetryInterval) while a revoke does not apply: one retry allowed.
ETCD_LEASE_SLACK_S = 0.5 + 3.0
# The loggers whose lines say what a process knew of the shard map and its members (printed when the test fails).
MAP_LINES = ("kvpush.client.shard_map", "kvpush.connector.control")
# A broker member's own: its etcd lease given up, its place in the map lost and taken again.
MEMBER_LINES = ("kvpush.etcd.lease", "kvpush.services.broker.etcd_membership")
# An etcd member's: elections, and what it found slow (a slow disk sync or apply delays a lease's revoke).
ETCD_LINES = ("leader", "took too long", "slow", "lease")


def test_the_scaled_control_plane_fails_over(model_dir, tmp_path):
    settings = dataclasses.replace(short_settings(run_dir=tmp_path / "failover", model_dir=model_dir), scaled=True, faults=FAILOVER_ORDER)
    result = run(settings, quiet=True)
    report = format_report(result)
    print(report)
    assert [fault["fault"] for fault in result["faults"]] == list(FAILOVER_ORDER)
    by_name = {fault["fault"]: fault for fault in result["faults"]}
    notes = by_name["shard-kill"]["notes"]
    failover = notes["failover"]
    etcd = etcd_side(settings, notes)
    relaxed = {TIMED_TARGET, PAUSE_TIMED_TARGET, *CUT_TIMED_TARGETS}
    missed = [name for name, held in result["verdict"]["targets"].items() if not held and name not in relaxed]
    paused = by_name["shard-pause"]["notes"]["failover"]["seconds"]
    if paused is None or paused >= settings.pause_s:
        missed.append(f"shard-pause: its transfers succeed again before the member wakes ({settings.pause_s:g} s), not after {paused} s")
    for cut in CUTS:
        seconds = by_name[cut]["notes"]["failover"]["seconds"]
        if seconds is None or seconds >= settings.pause_s:
            missed.append(f"{cut}: its transfers succeed again before the path heals ({settings.pause_s:g} s), not after {seconds} s")
    if etcd["dropped_s"] is None or etcd["dropped_s"] > etcd["bound_s"]:
        missed.append(f"etcd drops the killed member within {etcd['bound_s']:g} s (dropped after {etcd['dropped_s']} s)")
    # kvpush's side counts from the drop: by then every party has heard the member left.
    elif failover["seconds"] is None or failover["seconds"] > etcd["dropped_s"] + settings.deadline_s:
        missed.append(f"shard-kill: its transfers succeed again within {settings.deadline_s:g} s of the member's drop "
                      f"({etcd['dropped_s']} s after the kill)")
    assert not missed, f"targets missed: {missed}\n{report}\netcd: {etcd}\n{map_log(settings.run_dir)}"
    for fault in result["faults"]:
        assert fault["routed"]["requests"] > 0 and fault["routed"]["ok"] > 0, fault["fault"]
    assert failover["probes"] > 0 and failover["wrong"] == 0
    assert notes["rejoin"]["seconds"] is not None


def etcd_side(settings, notes: dict) -> dict:
    """When the router's shard map dropped the killed member (seconds after the kill), etcd's leader changes meanwhile, and
    the latest drop etcd's lease rules allow (ETCD_LEASE_SLACK_S after the lease's last possible lapse)."""
    run_dir = settings.run_dir
    killed = notes["killed_unix"]
    dropped = map_drop_unix(run_dir / "router.log", notes["member"], killed)
    changes = [t - killed for t in etcd_leader_changes(run_dir / "control-plane" / "etcd") if killed <= t <= (dropped or float("inf"))]
    lapse_s = max([0.0] + [t + ELECTION_TIMEOUT_MS / 1000 for t in changes]) + settings.shard_lease_ttl_s
    return {"dropped_s": None if dropped is None else round(dropped - killed, 2), "leader_changes_s": [round(t, 2) for t in changes],
            "bound_s": round(lapse_s + ETCD_LEASE_SLACK_S, 2)}


def map_drop_unix(router_log: Path, member: str, since_unix: float) -> float | None:
    """When the router's shard map first dropped member at or after since_unix (its log line's time), or None."""
    for line in router_log.read_text(errors="replace").splitlines() if router_log.exists() else []:
        if "kvpush.client.shard_map" in line and f"'{member}'" in line.partition("removed")[2]:
            logged = datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
            if logged >= since_unix:
                return logged
    return None


def etcd_leader_changes(etcd_dir: Path) -> list[float]:
    """Unix times at which an etcd member became leader (its zap log lines)."""
    times = []
    for path in sorted(etcd_dir.glob("*.log")):
        for line in path.read_text(errors="replace").splitlines():
            if "became leader at term" in line:
                with contextlib.suppress(ValueError, KeyError):
                    times.append(datetime.datetime.fromisoformat(json.loads(line)["ts"].replace("Z", "+00:00")).timestamp())
    return sorted(times)


def map_log(run_dir: Path, last: int = 12) -> str:
    """The last lines about the shard map in each engine's and the router's log (who heard a member leave, and when), and
    each broker member's lines about its own lease and place in the map."""
    logs = [(run_dir / f"{name}.log", MAP_LINES) for name in ("prefill", "decode", "router")]
    logs += [(path, MEMBER_LINES) for path in sorted((run_dir / "control-plane").glob("broker-*.log"))]
    logs += [(path, ETCD_LINES) for path in sorted((run_dir / "control-plane" / "etcd").glob("*.log"))]
    parts = []
    for path, loggers in logs:
        lines = [line for line in path.read_text(errors="replace").splitlines() if any(k in line for k in loggers)] if path.exists() else []
        parts.append(f"--- {path.name}, lines ({len(lines)}, last {last}):\n" + "\n".join(lines[-last:]))
    return "\n".join(parts)
