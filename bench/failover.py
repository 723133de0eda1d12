# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""`python -m bench.failover`: the scaled-out control plane under steady load, losing one part at a time.

Starts the local stack on a scaled-out control plane (a 3-member etcd
cluster, 2 registrar replicas, 3 broker shards; kvpush.dev.localstack.scaled)
with a P and a D vLLM engine and the router, then, under steady load through
the router, stops one broker shard with SIGSTOP for longer than its lease
(a hung member: the first address of every client's broker target), cuts
that member off from the engines and router (not etcd) and then from etcd
(not the engines) through TCP proxies, kills with SIGKILL one broker shard
(for each, measuring how long until transfers it owned succeed again,
probing with transfer ids that hash to it), one etcd member, one registrar
replica and then every registrar replica, each restarted after a while.
Every answer is checked against a single engine's tokens; after each fault
every KV block must be free again. It is bench.chaos with the scaled-out
faults: the same report, plus the failover targets.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path

from bench.chaos.runner import fault_list, run_and_report
from bench.chaos.settings import FAILOVER_ORDER, short_settings


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.failover", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--faults", default=",".join(FAILOVER_ORDER), help=f"comma-separated, in order (default {','.join(FAILOVER_ORDER)})")
    parser.add_argument("--clients", type=int, default=3, help="concurrent client threads through the router")
    parser.add_argument("--timeout-ms", type=int, default=4000, help="every request's deadline (the router's --transfer-timeout-ms)")
    parser.add_argument("--pre", type=float, default=10.0, help="seconds of load before each fault")
    parser.add_argument("--post", type=float, default=10.0, help="seconds of load after the router serves again")
    parser.add_argument("--down", type=float, default=3.0, help="seconds a killed part stays dead before its restart")
    parser.add_argument("--pause", type=float, default=6.0, help="seconds a paused (SIGSTOP) or cut-off broker member stays so")
    parser.add_argument("--registrar-outage", type=float, default=5.0, help="seconds no registrar replica runs (registrars-down)")
    parser.add_argument("--shard-lease-ttl", type=int, default=2, help="broker members' etcd lease TTL (seconds)")
    parser.add_argument("--run-dir", type=Path, help="where logs and result.json go (default runs/chaos-<timestamp>)")
    parser.add_argument("--model-dir", type=Path, help="the tiny model (built if missing)")
    parser.add_argument("--runs", type=int, default=1, help="run everything this many times, one after another, each on a fresh stack")
    parser.add_argument("--json", metavar="PATH", help="also write the result as JSON to PATH ('-' for stdout, after the report)")
    args = parser.parse_args(argv)
    settings = dataclasses.replace(
        short_settings(), scaled=True, faults=fault_list(args.faults), clients=args.clients, timeout_ms=args.timeout_ms,
        pre_s=args.pre, post_s=args.post, part_down_s=args.down, pause_s=args.pause, registrar_outage_s=args.registrar_outage, shard_lease_ttl_s=args.shard_lease_ttl, run_dir=args.run_dir,
        model_dir=args.model_dir,
    )
    if args.runs < 1:
        parser.error(f"--runs must be at least 1, not {args.runs}")
    return run_and_report(settings, args.json, "failover", runs=args.runs)


if __name__ == "__main__":
    sys.exit(main())
