# SPDX-License-Identifier: Apache-2.0
"""`kvpush sim`: run many seeded schedules of the whole protocol under faults and report every invariant violation.

    kvpush sim --schedules 100000 --workers 2     # the benchmark run
    kvpush sim --replay 4242                      # one schedule again, exactly, with its violations in full

A schedule is fully determined by its seed: a failing seed replays exactly.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import sys
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from kvpush.dev.sim.simulation import Simulation


@dataclass
class Outcome:
    """What one schedule did and broke."""

    seed: int
    violations: list[tuple[str, str, float]]
    stats: Counter = field(default_factory=Counter)


def run_schedule(seed: int) -> Outcome:
    sim = Simulation(seed)
    violations = sim.run()
    stats: Counter = Counter()
    for request in sim.router.requests:
        stats["client requests"] += 1
        stats["answered ok" if request.ok else "answered failed"] += 1
        stats["attempts"] += request.attempt
    faults = sim.faults
    for name in ("stream_resets", "lease_outages", "pauses", "kills", "disconnects", "collisions", "malformed", "lease_doubts"):
        stats[f"fault {name}"] += getattr(faults, name)
    stats["schedules with message loss"] += faults.drop > 0
    stats["schedules with duplicates"] += faults.duplicate > 0
    stats["schedules with stuck WRITEs"] += faults.stuck_writes > 0
    stats["schedules with refused posts"] += faults.failed_posts > 0
    stats["schedules with clock skew"] += faults.skew_s > 0
    stats["schedules with pipeline stages"] += sim.prefill.pp_size > 1
    stats["schedules with hybrid KV cache groups"] += sim.hybrid
    stats["schedules with layer-progressive push"] += sim.prefill.progressive
    if sim.shards is not None:
        stats["schedules with broker shards"] += 1
        for name, n in sim.shard_faults.items():
            stats[f"fault {name}"] += n
        stats["shard map changes"] += sim.shards.etcd.revision - sim.shards.first_revision
    stats["events"] += sim.world.events
    return Outcome(seed, [(v.kind, v.detail, v.time) for v in violations.items], stats)


def _run_range(bounds: tuple[int, int]) -> tuple[list[Outcome], Counter]:
    logging.disable(logging.CRITICAL)  # the cores log every refusal; the verdict is the invariants
    failing: list[Outcome] = []
    totals: Counter = Counter()
    for seed in range(*bounds):
        outcome = run_schedule(seed)
        totals.update(outcome.stats)
        if outcome.violations:
            failing.append(outcome)
    return failing, totals


def run_many(first_seed: int, count: int, workers: int) -> tuple[list[Outcome], Counter]:
    """Runs seeds [first_seed, first_seed + count) over worker processes; returns failing outcomes and summed stats."""
    chunk = max(1, min(2000, count // (workers * 8) or 1))
    ranges = [(s, min(s + chunk, first_seed + count)) for s in range(first_seed, first_seed + count, chunk)]
    failing: list[Outcome] = []
    totals: Counter = Counter()
    results: Iterable[tuple[list[Outcome], Counter]]
    if workers <= 1:
        results = map(_run_range, ranges)
    else:
        pool = multiprocessing.get_context("spawn").Pool(workers)
        results = pool.imap_unordered(_run_range, ranges)
    for part_failing, part_totals in results:
        failing += part_failing
        totals.update(part_totals)
    if workers > 1:
        pool.close()
        pool.join()
    return sorted(failing, key=lambda o: o.seed), totals


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--schedules", type=int, default=2000, help="number of seeded schedules to run")
    parser.add_argument("--first-seed", type=int, default=0, help="seed of the first schedule")
    parser.add_argument("--workers", type=int, default=max(1, (multiprocessing.cpu_count() or 1)), help="worker processes")
    parser.add_argument("--replay", type=int, help="run this one seed and print its violations in full")


def run(args: argparse.Namespace) -> int:
    if args.replay is not None:
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
        outcome = run_schedule(args.replay)
        print(f"seed {args.replay}: {dict(outcome.stats)}")
        for kind, detail, when in outcome.violations:
            print(f"  t={when:.3f}s {kind}: {detail}")
        print("no invariant violated" if not outcome.violations else f"{len(outcome.violations)} violation(s)")
        return 1 if outcome.violations else 0
    if args.schedules < 1 or args.workers < 1:
        print("kvpush sim: --schedules and --workers must be at least 1", file=sys.stderr)
        return 2
    started = time.monotonic()
    failing, totals = run_many(args.first_seed, args.schedules, args.workers)
    elapsed = time.monotonic() - started
    kinds = Counter(kind for outcome in failing for kind, _, _ in outcome.violations)
    print(f"kvpush sim: {args.schedules} schedules (seeds {args.first_seed}..{args.first_seed + args.schedules - 1}) "
          f"in {elapsed:.1f} s on {args.workers} worker(s), {totals['events'] / max(elapsed, 1e-9):,.0f} events/s")
    print(f"  client requests {totals['client requests']}: ok {totals['answered ok']}, failed with a reason {totals['answered failed']}, "
          f"attempts {totals['attempts']}")
    print("  faults: " + ", ".join(f"{name[6:]} {totals[name]}" for name in sorted(totals) if name.startswith("fault ")))
    print(f"  shard map changes: {totals['shard map changes']}")
    print("  schedules with: " + ", ".join(f"{name[15:]} {totals[name]}" for name in sorted(totals) if name.startswith("schedules with ")))
    print(f"  invariant violations: {sum(kinds.values())} in {len(failing)} schedule(s)" + (f" {dict(kinds)}" if kinds else ""))
    for outcome in failing[:20]:
        kind, detail, when = outcome.violations[0]
        print(f"    seed {outcome.seed}: t={when:.3f}s {kind}: {detail[:200]}")
    if failing:
        print(f"  replay one with: kvpush sim --replay {failing[0].seed}")
    return 1 if failing else 0
