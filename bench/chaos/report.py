# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""A chaos run's totals, its verdict against the targets and its text report."""

from __future__ import annotations

import collections
from typing import Any

from kvpush.services.router.core import BROKER_MEMBER_UNREACHABLE
from kvpush.services.router.shard_watch import BROKER_SHARD_LOST, BROKER_SHARD_MOVED


def verdict(faults: list[dict[str, Any]], soak_checks: dict[str, Any] | None) -> dict[str, Any]:
    """The targets: 0 hung, 0 wrong, every block free after each fault, failures answered in time with a reason, memory back."""
    routed = [f["routed"] for f in faults]
    direct = [f["direct"] for f in faults]
    out = {
        "hung": sum(r["hung"] for r in routed + direct),
        "wrong": sum(r["wrong"] for r in routed + direct),
        "faults_not_settled": [f["fault"] for f in faults if not f["kv"]["all_free"]],
        "faults_not_recovered": [f["fault"] for f in faults if f["recovered_s"] is None],
        "late_failures": sum(r["late_failures"] for r in routed),
        "failures_without_reason": sum(r["failures_without_reason"] for r in routed),
        "max_failure_minus_deadline_s": max((r["max_failure_minus_deadline_s"] for r in routed if r["max_failure_minus_deadline_s"] is not None), default=None),
    }
    collisions = [case for f in faults for case in f["notes"].get("collisions", [])]
    out["collisions_ok"] = all(c["at_most_one_decode_answered"] and c["no_wrong_or_hung"] for c in collisions)
    targets = {
        "0 hung": out["hung"] == 0,
        "0 wrong outputs": out["wrong"] == 0,
        "0 blocks left allocated after any fault": not out["faults_not_settled"],
        "every failure answered <= deadline + 1 s with its reason": out["late_failures"] == 0 and out["failures_without_reason"] == 0,
        "router serves again after every fault": not out["faults_not_recovered"],
        "colliding keys: at most one decode answered, never wrong": out["collisions_ok"],
    }
    targets.update(failover_targets(faults))
    if soak_checks is not None:
        targets["control-plane memory back near its baseline after the soak"] = soak_checks["passed"]
    out["targets"] = targets
    out["passed"] = all(targets.values())
    return out


# The scaled-out control plane's failover targets: a dead member's transfers move within FAILOVER_TARGET_S, a hung one's
# (it stays in etcd until its lease lapses, 2 s), or one killed with etcd's leader, within PAUSE_FAILOVER_TARGET_S.
FAILOVER_TARGET_S = 2.0
PAUSE_FAILOVER_TARGET_S = 3.0
# The router's reasons that name the attempt's broker member: it left the map, another owns the transfer, or it did not
# answer and had not left the map by the request's deadline (etcd had not revoked its lease yet).
SHARD_LOSS_REASONS = (BROKER_SHARD_LOST, BROKER_SHARD_MOVED, BROKER_MEMBER_UNREACHABLE)
# The faults that lose one broker shard, and how the report names the fault and its undoing.
SHARD_FAULT_WORDS = {
    "shard-kill": ("kill", "its restart"), "leader-shard-kill": ("kill", "its restart"), "shard-pause": ("pause", "it resumed"),
    "shard-cut-engines": ("cut", "the heal"), "shard-cut-etcd": ("cut", "the heal"),
}
# A member that hangs or is cut off rather than dies.
GRAY_FAULTS = ("shard-pause", "shard-cut-engines", "shard-cut-etcd")


def failover_s(fault: dict[str, Any]) -> float | None:
    """When the lost shard's transfers succeeded again: the first successful probe's answer (a probe begun before may
    succeed late, waiting at its engine for the new owner), or its start where answers were not recorded."""
    failover = fault["notes"]["failover"]
    return failover.get("answered_s", failover["seconds"])


def failover_targets(faults: list[dict[str, Any]]) -> dict[str, bool]:
    """Per scaled-out fault run: shard loss fails over within FAILOVER_TARGET_S, failing only the dead shard's transfers; etcd and registrar losses fail nothing."""
    targets = {}
    for f in faults:
        failed = f["routed"]["failures_by_reason"]
        if f["fault"] == "shard-kill":
            seconds = failover_s(f)
            targets[f"shard-kill: its transfers succeed again <= {FAILOVER_TARGET_S:g} s after the kill"] = seconds is not None and seconds <= FAILOVER_TARGET_S
            # Probes go straight to D, whose HTTP error carries no reason: only the router's failures are checked here.
            targets["shard-kill: every routed failure names the lost shard"] = all(any(reason in name for reason in SHARD_LOSS_REASONS) for name in failed)
            targets["shard-kill: the restarted shard serves its transfers again"] = f["notes"]["rejoin"]["seconds"] is not None
        elif f["fault"] == "leader-shard-kill":
            seconds = failover_s(f)
            targets[f"leader-shard-kill: its transfers succeed again <= {PAUSE_FAILOVER_TARGET_S:g} s after the kill"] = (
                seconds is not None and seconds <= PAUSE_FAILOVER_TARGET_S)
        elif f["fault"] in GRAY_FAULTS:
            seconds, (what, back) = failover_s(f), SHARD_FAULT_WORDS[f["fault"]]
            targets[f"{f['fault']}: its transfers succeed again <= {PAUSE_FAILOVER_TARGET_S:g} s after the {what}"] = (
                seconds is not None and seconds <= PAUSE_FAILOVER_TARGET_S)
            targets[f"{f['fault']}: every routed failure names the shard"] = all(any(reason in name for reason in SHARD_LOSS_REASONS) for name in failed)
            targets[f"{f['fault']}: the shard serves its transfers again after {back}"] = f["notes"]["rejoin"]["seconds"] is not None
        elif f["fault"] in ("etcd-kill", "registrar-kill", "registrars-down"):
            targets[f"{f['fault']}: no request fails"] = f["routed"]["failed"] == 0 and f["direct"]["failed"] == 0
    return targets


def summarize_totals(faults: list[dict[str, Any]]) -> dict[str, Any]:
    total: dict[str, Any] = {"requests": 0, "ok": 0, "failed": 0, "hung": 0, "wrong": 0, "disconnected": 0, "failures_by_reason": collections.Counter()}
    for fault in faults:
        for part in ("routed", "direct"):
            r = fault[part]
            for key in ("requests", "ok", "failed", "hung", "wrong", "disconnected"):
                total[key] += r[key]
            if part == "routed":
                total["failures_by_reason"].update(r["failures_by_reason"])
    total["failures_by_reason"] = dict(sorted(total["failures_by_reason"].items()))
    overs = [f["routed"]["max_failure_minus_deadline_s"] for f in faults if f["routed"]["max_failure_minus_deadline_s"] is not None]
    total["max_failure_minus_deadline_s"] = max(overs) if overs else None
    return total


def format_report(result: dict[str, Any]) -> str:
    """The figures as a text table: per fault, in total, the soak and the verdict."""
    lines = []
    deadline_ms = result["settings"]["timeout_ms"]
    lines.append(f"chaos run {result['date']}: deadline {deadline_ms} ms, {result['settings']['clients']} clients, wall {result.get('wall_s')} s")
    header = f"{'fault':<12}{'routed':>7}{'ok':>6}{'failed':>7}{'hung':>5}{'wrong':>6}{'disc':>5}{'fail-dl s':>10}{'late':>5}{'direct':>7}" \
             f"{'recover s':>10}{'KV P free':>11}{'KV D free':>11}{'settle s':>9}"
    lines.append(header)
    for f in result["faults"]:
        r, d, kv = f["routed"], f["direct"], f["kv"]
        over = "-" if r["max_failure_minus_deadline_s"] is None else f"{r['max_failure_minus_deadline_s']:+.2f}"
        recover = "never" if f["recovered_s"] is None else f"{f['recovered_s']:.1f}"
        kv_p = f"{kv['free'].get('prefill')}/{kv['baseline_free'].get('prefill')}"
        kv_d = f"{kv['free'].get('decode')}/{kv['baseline_free'].get('decode')}"
        lines.append(f"{f['fault']:<12}{r['requests']:>7}{r['ok']:>6}{r['failed']:>7}{r['hung']:>5}{r['wrong']:>6}{r['disconnected']:>5}{over:>10}"
                     f"{r['late_failures']:>5}{d['requests']:>7}{recover:>10}{kv_p:>11}{kv_d:>11}{kv['settle_s']:>9.1f}")
    t = result["total"]
    over = "-" if t["max_failure_minus_deadline_s"] is None else f"{t['max_failure_minus_deadline_s']:+.2f}"
    lines.append(f"{'total':<12}{t['requests']:>7}{t['ok']:>6}{t['failed']:>7}{t['hung']:>5}{t['wrong']:>6}{t['disconnected']:>5}{over:>10}")
    lines.append("(KV free: free/at start, after one tiny request to each engine; routed counts exclude the direct requests, totals include them)")
    for f in result["faults"]:
        if f["routed"]["failures_by_reason"]:
            lines.append(f"failures by reason, {f['fault']}: " + ", ".join(f"{k} x{v}" for k, v in f["routed"]["failures_by_reason"].items()))
        if f["direct"]["requests"]:
            lines.append(f"direct requests, {f['fault']}: ok {f['direct']['ok']}, failed {f['direct']['failed']} "
                         + "(" + ", ".join(f"{k} x{v}" for k, v in f["direct"]["failures_by_reason"].items()) + f"), hung {f['direct']['hung']}, "
                         f"wrong {f['direct']['wrong']}")
    for f in result["faults"]:
        if f["fault"] in SHARD_FAULT_WORDS:
            fo, rj = f["notes"]["failover"], f["notes"]["rejoin"]
            what, back = SHARD_FAULT_WORDS[f["fault"]]
            lines.append(f"{f['fault']} ({f['notes']['member']}): its transfers succeed again {fo['seconds']} s after the {what}, first answered "
                         f"{fo.get('answered_s')} s after ({fo['probes']} probes, "
                         f"failed {fo['failed_by_reason'] or 'none'}); after {back} {rj['seconds']} s ({rj['probes']} probes, "
                         f"failed {rj['failed_by_reason'] or 'none'})")
    soak_result = result.get("soak")
    if soak_result and "error" in soak_result["checks"]:
        lines.append(f"soak failed: {soak_result['checks']['error']}")
    elif soak_result:
        c = soak_result["checks"]
        lines.append(f"soak ({soak_result['raw']['external']['attempts']} attempts): live attempts peak {c['peak_live_attempts']}, after {c['live_attempts_after']}; "
                     f"RSS {c['rss_before_mib']} -> peak {c['rss_peak_mib']} -> after {c['rss_after_mib']} MiB (allowed {c['rss_allowed_after_mib']}); "
                     f"PSS {c['pss_before_mib']} -> {c['pss_peak_mib']} -> {c['pss_after_mib']} MiB")
        lines.append(f"soak memory_sizes (in-process): before {c['memory_sizes_before']}, peak {c['memory_sizes_peak']}, after {c['memory_sizes_after']}")
    v = result["verdict"]
    lines.append("targets:")
    for name, held in v["targets"].items():
        lines.append(f"  {'held  ' if held else 'MISSED'}  {name}")
    lines.append(f"verdict: {'all targets held' if v['passed'] else 'targets missed'}")
    return "\n".join(lines)
