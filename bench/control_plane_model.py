# SPDX-License-Identifier: Apache-2.0
"""Control-plane load of a scaled-out kvpush fleet, from measured per-message costs: a small seeded discrete-event model.

For each fleet (engines x in-flight transfers) it prints, per broker shard:
messages/s, CPU utilisation, the queueing wait a message sees at the
shard's core (p50/p99, from the simulation), live attempts and memory; for
the fleet: registrar keep-alives and replicas, etcd writes and lease
renewals, failover time and the attempts one shard's loss fails. A second
table gives the shards a 1,000-engine fleet needs per rendezvous rate at a
target utilisation. Every cost is an option; the defaults and where they
were measured:

* --rendezvous-us 300: server CPU per rendezvous over the engines'
  EngineReports streams (RegisterDestination + ReportPrefillDone in, one
  write order out), 293-305 us at the top of `bench/broker_capacity.py
  --transport streams` (bench/results/LOG.md, "Rendezvous per second over
  EngineReports vs unary calls", 2026-12-01; unary calls: 791-835 us, pass
  --rendezvous-us 800 for them). --item-us (default a third of it) is each
  further stream item a transfer brings: an order to each other producer
  rank, each rank's write result, the decode engine's event.
* --keepalive-us 800: registrar CPU per rank KeepAlive, one unary call in
  and the etcd lease keep-alive it makes: the measured ~800 us of a unary
  rendezvous (two calls in, one order out) taken as that pair's cost.
* memory: bytes per live and per retained attempt (the engine streams a
  member holds are counted, not costed: their memory is not measured yet), measured here with
  tracemalloc on a real BrokerCore (bench/broker_memory.py) unless
  --live-attempt-bytes/--retained-attempt-bytes are given.
* owner() CPU: rendezvous hashing costs one keyed BLAKE2b per member per
  lookup (kvpush/shards.py); measured here unless --owner-us-per-member is
  given. A broker that checks ownership on every message pays it per
  inbound message; one that caches the owner per attempt pays it once.

The simulation: transfers arrive as a Poisson stream (rate = in-flight /
--attempt-lifetime-s, Little's law) and owner() spreads them evenly over
the shards (each member's weight for a transfer is an independent uniform
draw), so each shard sees a Poisson stream of rate / shards. In steady
state each of a transfer's three bursts at its owner (registration; prefill
done and the orders; the write results and the event) is a Poisson stream
too (a Poisson stream delayed by i.i.d. lifetimes is Poisson), so the model
draws each burst's time uniformly over the simulated window. The shard is
one core serving its bursts first come first served (a kvpush broker is one
Python process); the waits follow from Lindley's recursion. Rates,
utilisation, memory and etcd load are the fleet's arithmetic.

    python -m bench.control_plane_model [--engines 100,1000] [--in-flight 10000,100000] [--seed 1] [--json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import time

from kvpush.etcd.lease import RENEWALS_PER_TTL
from kvpush.report.percentiles import percentile
from kvpush.shards import owner

MEMBER = "kvpush-broker-{}"  # the StatefulSet's pod names (deploy/k8s/scaled/13-broker.yaml)


@dataclasses.dataclass(frozen=True)
class Costs:
    """Server CPU seconds per message kind and bytes per attempt (the options' defaults: the module docstring's measurements)."""

    rendezvous_s: float
    item_s: float
    keepalive_s: float
    owner_s_per_member: float
    live_attempt_bytes: int
    retained_attempt_bytes: int


@dataclasses.dataclass(frozen=True)
class Fleet:
    """What the control plane serves."""

    engines: int
    in_flight: int
    ranks_per_engine: int = 8  # TP 8, as deploy/k8s's engines
    prefill_fraction: float = 0.5
    attempt_lifetime_s: float = 2.0  # registration to settled
    lease_ttl_s: float = 3.0  # the connector's lease_ttl_s: ranks renew every ttl/3
    shard_lease_ttl_s: float = 2.0  # --shard-lease-ttl: members renew every ttl/3
    engine_restarts_per_day: float = 1.0
    retention_s: float = 60.0  # BrokerConfig.retention_s
    max_retained_attempts: int = 500_000  # BrokerConfig.max_retained_attempts, per shard
    owner_cached: bool = True  # the owner is hashed once per attempt, not per message

    @property
    def rate(self) -> float:
        """Rendezvous (transfer attempts) per second."""
        return self.in_flight / self.attempt_lifetime_s

    @property
    def messages_per_transfer(self) -> int:
        """Registration, prefill done, an order and a write result per producer rank, one event."""
        return 3 + 2 * self.ranks_per_engine

    @property
    def ranks(self) -> int:
        return self.engines * self.ranks_per_engine

    @property
    def streams_per_member(self) -> int:
        """Engine streams every broker member holds: each prefill rank's orders and reports (connector/worker.py), each
        decode engine scheduler's reports and events (connector/scheduler.py). A rank holds O(shards) streams, so a
        member holds O(ranks)."""
        prefill = round(self.engines * self.prefill_fraction)
        return prefill * self.ranks_per_engine * 2 + (self.engines - prefill) * 2

    @property
    def owner_lookups_per_transfer(self) -> int:
        """Ownership checks a transfer costs its owner: once, or per inbound message (registration, prefill done, write results)."""
        return 1 if self.owner_cached else 2 + self.ranks_per_engine


@dataclasses.dataclass(frozen=True)
class Failover:
    """What one shard's death costs (its parts are options; bench/failover.py measures the whole)."""

    watch_propagation_s: float = 0.1
    router_retry_s: float = 0.005

    def seconds(self, fleet: Fleet) -> tuple[float, float]:
        """(mean, worst) seconds until new transfers succeed again: the dead member's lease lapses, etcd's watch tells
        members and clients, the router's retry (a new attempt) rendezvous on the new owner. The member renewed every
        ttl/RENEWALS_PER_TTL (P), so its lease lapses between ttl - P and ttl after it died (ttl - P/2 on average)."""
        tail = self.watch_propagation_s + self.router_retry_s
        ttl = fleet.shard_lease_ttl_s
        return ttl * (1 - 1 / (2 * RENEWALS_PER_TTL)) + tail, ttl + tail


def bursts(fleet: Fleet, costs: Costs, shards: int) -> tuple[float, float, float]:
    """CPU seconds of a transfer's three bursts at its owner, owner() lookups included."""
    lookup = costs.owner_s_per_member * shards * fleet.owner_lookups_per_transfer / 3
    extra_orders, results = fleet.ranks_per_engine - 1, fleet.ranks_per_engine
    return (
        costs.rendezvous_s / 3 + lookup,  # RegisterDestination
        2 * costs.rendezvous_s / 3 + extra_orders * costs.item_s + lookup,  # ReportPrefillDone and an order per rank
        (results + 1) * costs.item_s + lookup,  # a write result per rank, the event to D
    )


def cpu_per_transfer(fleet: Fleet, costs: Costs, shards: int) -> float:
    return sum(bursts(fleet, costs, shards))


@dataclasses.dataclass(frozen=True)
class ShardLoad:
    """One shard's load: rates and utilisation from the fleet, waits from the simulation."""

    messages_per_s: float
    utilisation: float
    wait_p50_ms: float
    wait_p99_ms: float
    live_attempts: int


def simulate(fleet: Fleet, costs: Costs, shards: int, *, sample_transfers: int, seed: int) -> ShardLoad:
    """The discrete-event part: sample_transfers transfers at one shard, its core serving their bursts first come first served."""
    rng = random.Random(seed)
    rate = fleet.rate / shards  # owner() spreads transfers evenly: each member's weight is an independent uniform draw
    window_s = sample_transfers / rate
    service = bursts(fleet, costs, shards)
    arrivals = sorted((rng.uniform(0.0, window_s), cpu) for _ in range(sample_transfers) for cpu in service)
    free_at, waits = 0.0, []
    for arrival, cpu in arrivals:
        start = max(arrival, free_at)
        waits.append(start - arrival)
        free_at = start + cpu
    utilisation = rate * cpu_per_transfer(fleet, costs, shards)
    overloaded = utilisation >= 1.0  # waits grow with the window: there is no steady state to report
    return ShardLoad(
        messages_per_s=rate * fleet.messages_per_transfer,
        utilisation=utilisation,
        wait_p50_ms=math.inf if overloaded else percentile(waits, 50) * 1e3,
        wait_p99_ms=math.inf if overloaded else percentile(waits, 99) * 1e3,
        live_attempts=round(fleet.in_flight / shards),
    )


def shards_needed(fleet: Fleet, costs: Costs, target_utilisation: float, *, limit: int = 10_000) -> int | None:
    """The fewest shards whose mean utilisation is at most the target (None: owner() lookups alone exceed it)."""
    # Each shard's owner() share is rate x lookups x cost per member whatever the shard count (a shard
    # sees 1/shards of the transfers, each lookup hashes every member): past the target no count helps.
    if fleet.rate * fleet.owner_lookups_per_transfer * costs.owner_s_per_member >= target_utilisation:
        return None
    for shards in range(1, limit + 1):
        if fleet.rate * cpu_per_transfer(fleet, costs, shards) / shards <= target_utilisation:
            return shards
    return None


def memory_bytes(fleet: Fleet, costs: Costs, live_attempts: int, shards: int) -> int:
    """Attempts a shard holds: its live ones, and its settled ones for retention_s (capped per shard)."""
    retained = min(fleet.rate / shards * fleet.retention_s, fleet.max_retained_attempts)
    return round(live_attempts * costs.live_attempt_bytes + retained * costs.retained_attempt_bytes)


def registrar_keepalives_per_s(fleet: Fleet) -> float:
    return fleet.ranks / (fleet.lease_ttl_s / 3)


def etcd_writes_per_s(fleet: Fleet, shards: int) -> float:
    """Raft writes: per rank (re)registration a lease grant and a Txn, per deregistration a Txn and a revoke; members likewise."""
    restarts_per_s = fleet.engine_restarts_per_day / 86_400
    return (fleet.ranks + shards) * restarts_per_s * 4


def etcd_lease_renewals_per_s(fleet: Fleet, shards: int) -> float:
    """Lease keep-alives etcd's leader answers (served by the leader, not written through raft): every rank's and member's."""
    return registrar_keepalives_per_s(fleet) + shards * RENEWALS_PER_TTL / fleet.shard_lease_ttl_s


@dataclasses.dataclass(frozen=True)
class Row:
    engines: int
    in_flight: int
    rate: float
    shards: int
    load: ShardLoad
    memory_mib: float
    streams_per_shard: int
    registrar_keepalives_per_s: float
    registrar_replicas: int
    etcd_writes_per_s: float
    etcd_lease_renewals_per_s: float
    failover_mean_s: float
    failover_worst_s: float
    attempts_lost_per_shard: int


def model(fleet: Fleet, costs: Costs, failover: Failover, *, target_utilisation: float, shards: int | None,
          sample_transfers: int, seed: int) -> Row | None:
    """One fleet's row; shards None picks shards_needed (None back: no shard count reaches the target)."""
    shards = shards or shards_needed(fleet, costs, target_utilisation)
    if shards is None:
        return None
    load = simulate(fleet, costs, shards, sample_transfers=sample_transfers, seed=seed)
    keepalives = registrar_keepalives_per_s(fleet)
    return Row(
        engines=fleet.engines,
        in_flight=fleet.in_flight,
        rate=fleet.rate,
        shards=shards,
        load=load,
        memory_mib=memory_bytes(fleet, costs, load.live_attempts, shards) / 2**20,
        streams_per_shard=fleet.streams_per_member,
        registrar_keepalives_per_s=keepalives,
        registrar_replicas=max(2, math.ceil(keepalives * costs.keepalive_s / target_utilisation)),
        etcd_writes_per_s=etcd_writes_per_s(fleet, shards),
        etcd_lease_renewals_per_s=etcd_lease_renewals_per_s(fleet, shards),
        failover_mean_s=failover.seconds(fleet)[0],
        failover_worst_s=failover.seconds(fleet)[1],
        attempts_lost_per_shard=load.live_attempts,
    )


def measured_owner_s_per_member(members: int = 64, lookups: int = 300) -> float:
    """CPU seconds kvpush.shards.owner spends per member per lookup, timed here."""
    ids = [MEMBER.format(i) for i in range(members)]
    started = time.process_time()
    for i in range(lookups):
        owner(f"{i:032x}", ids)
    return (time.process_time() - started) / (lookups * members)


HEADER = ("engines", "in-flight", "rdv/s", "shards", "msgs/s/shard", "CPU/shard", "wait p50 ms", "wait p99 ms",
          "live/shard", "MiB/shard", "streams/shard", "registrar KA/s", "registrars", "etcd writes/s", "etcd renewals/s", "failover s mean/worst", "lost/shard")


def table_line(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def render(rows: list[Row]) -> str:
    lines = [table_line(list(HEADER)), table_line(["---:"] * len(HEADER))]
    for r in rows:
        lines.append(table_line([
            f"{r.engines:,}", f"{r.in_flight:,}", f"{r.rate:,.0f}", f"{r.shards}", f"{r.load.messages_per_s:,.0f}", f"{r.load.utilisation:.2f}",
            f"{r.load.wait_p50_ms:.2f}", f"{r.load.wait_p99_ms:.2f}", f"{r.load.live_attempts:,}",
            f"{r.memory_mib:,.1f}", f"{r.streams_per_shard:,}", f"{r.registrar_keepalives_per_s:,.0f}", f"{r.registrar_replicas}", f"{r.etcd_writes_per_s:.2f}",
            f"{r.etcd_lease_renewals_per_s:,.0f}", f"{r.failover_mean_s:.2f} / {r.failover_worst_s:.2f}", f"{r.attempts_lost_per_shard:,}",
        ]))
    return "\n".join(lines)


def render_sizing(fleet: Fleet, costs: Costs, rates: list[float], target: float) -> str:
    """Shards a fleet needs per rendezvous rate, with the owner cached per attempt and looked up per message."""
    lines = [table_line(["engines", "rdv/s", "CPU per rendezvous ms", "shards (owner cached)", "shards (owner per message)"]),
             table_line(["---:"] * 5)]
    for rate in rates:
        at_rate = dataclasses.replace(fleet, in_flight=round(rate * fleet.attempt_lifetime_s))
        cells = []
        for cached in (True, False):
            needed = shards_needed(dataclasses.replace(at_rate, owner_cached=cached), costs, target)
            cells.append("none reaches it" if needed is None else str(needed))
        cpu_ms = cpu_per_transfer(at_rate, costs, 1) * 1e3 - costs.owner_s_per_member * 1e3 * at_rate.owner_lookups_per_transfer
        lines.append(table_line([f"{fleet.engines:,}", f"{rate:,.0f}", f"{cpu_ms:.2f}", *cells]))
    return "\n".join(lines)


def default(cls: type, name: str):
    """A dataclass field's default: the options show the model's own defaults."""
    return cls.__dataclass_fields__[name].default


def number_list(text: str) -> list[float]:
    return [float(item) for item in text.split(",") if item.strip()]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    fleet = parser.add_argument_group("fleet")
    fleet.add_argument("--engines", type=number_list, default=[100, 1000], help="engine counts (default 100,1000)")
    fleet.add_argument("--in-flight", type=number_list, default=[10_000, 100_000], help="transfers in flight (default 10000,100000)")
    fleet.add_argument("--ranks-per-engine", type=int, default=default(Fleet, "ranks_per_engine"), help="ranks per engine; a transfer has an order and a write result per producer rank")
    fleet.add_argument("--prefill-fraction", type=float, default=default(Fleet, "prefill_fraction"), help="share of the engines that are prefill engines")
    fleet.add_argument("--attempt-lifetime-s", type=float, default=default(Fleet, "attempt_lifetime_s"), help="registration to settled, mean (rate = in-flight / this)")
    fleet.add_argument("--lease-ttl-s", type=float, default=default(Fleet, "lease_ttl_s"), help="engine ranks' registrar lease (the connector's lease_ttl_s)")
    fleet.add_argument("--shard-lease-ttl-s", type=float, default=default(Fleet, "shard_lease_ttl_s"), help="broker members' etcd lease (--shard-lease-ttl)")
    fleet.add_argument("--engine-restarts-per-day", type=float, default=default(Fleet, "engine_restarts_per_day"), help="registrations and departures per engine and day")
    fleet.add_argument("--owner-per-message", action="store_true", help="brokers hash the owner on every inbound message, not once per attempt")
    costs = parser.add_argument_group("measured costs")
    costs.add_argument("--rendezvous-us", type=float, default=300.0, help="server CPU per rendezvous (default 300: streams; unary 800)")
    costs.add_argument("--item-us", type=float, default=None, help="server CPU per further stream item (default rendezvous-us / 3)")
    costs.add_argument("--keepalive-us", type=float, default=800.0, help="registrar CPU per rank KeepAlive (default 800)")
    costs.add_argument("--owner-us-per-member", type=float, default=None, help="owner() CPU per member per lookup (default: timed here)")
    costs.add_argument("--live-attempt-bytes", type=int, default=None, help="bytes per live attempt (default: measured with tracemalloc)")
    costs.add_argument("--retained-attempt-bytes", type=int, default=None, help="bytes per settled, retained attempt (default: measured)")
    costs.add_argument("--memory-attempts", type=int, default=500, help="attempts the memory measurement holds (default 500)")
    failover = parser.add_argument_group("failover (bench/failover.py measures the whole)")
    failover.add_argument("--watch-propagation-s", type=float, default=default(Failover, "watch_propagation_s"), help="etcd watch to members and clients' shard maps")
    failover.add_argument("--router-retry-s", type=float, default=default(Failover, "router_retry_s"), help="the router's new attempt on the new owner")
    run = parser.add_argument_group("model")
    run.add_argument("--shards", type=int, default=None, help="shards to model (default: the fewest at --target-utilisation)")
    run.add_argument("--target-utilisation", type=float, default=0.6, help="of one core per shard and registrar (default 0.6)")
    run.add_argument("--sizing-engines", type=int, default=1000, help="engines of the shard-count table (default 1000)")
    run.add_argument("--sizing-rates", type=number_list, default=[1_000, 5_000, 10_000, 50_000], help="rendezvous/s of that table")
    run.add_argument("--sample-transfers", type=int, default=20_000, help="transfers simulated per fleet (default 20000)")
    run.add_argument("--seed", type=int, default=1)
    run.add_argument("--json", action="store_true", help="also print one JSON line with every row")
    return parser


def costs_from(args: argparse.Namespace, ranks_per_engine: int) -> Costs:
    """Costs from the options, measuring what was not given (owner() CPU; bytes per attempt on a real BrokerCore)."""
    live, retained = args.live_attempt_bytes, args.retained_attempt_bytes
    if live is None or retained is None:
        from bench.broker_memory import measure  # imports the broker; only when the figures are not given

        measured = measure(args.memory_attempts, ranks_per_engine)
        live, retained = live if live is not None else measured.live, retained if retained is not None else measured.retained
    owner_s = measured_owner_s_per_member() if args.owner_us_per_member is None else args.owner_us_per_member * 1e-6
    item_us = args.rendezvous_us / 3 if args.item_us is None else args.item_us
    return Costs(args.rendezvous_us * 1e-6, item_us * 1e-6, args.keepalive_us * 1e-6, owner_s, live, retained)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    costs = costs_from(args, args.ranks_per_engine)
    common = dict(ranks_per_engine=args.ranks_per_engine, prefill_fraction=args.prefill_fraction, attempt_lifetime_s=args.attempt_lifetime_s, lease_ttl_s=args.lease_ttl_s,
                  shard_lease_ttl_s=args.shard_lease_ttl_s, engine_restarts_per_day=args.engine_restarts_per_day,
                  owner_cached=not args.owner_per_message)
    failover = Failover(args.watch_propagation_s, args.router_retry_s)
    rows, unreachable = [], []
    for engines in args.engines:
        for in_flight in args.in_flight:
            fleet = Fleet(int(engines), int(in_flight), **common)
            row = model(fleet, costs, failover, target_utilisation=args.target_utilisation, shards=args.shards,
                        sample_transfers=args.sample_transfers, seed=args.seed)
            if row is None:
                unreachable.append(fleet)
            else:
                rows.append(row)
    print(f"costs: rendezvous {costs.rendezvous_s * 1e6:.0f} us, item {costs.item_s * 1e6:.0f} us, keep-alive {costs.keepalive_s * 1e6:.0f} us, "
          f"owner() {costs.owner_s_per_member * 1e6:.2f} us per member, attempt {costs.live_attempt_bytes:,} B live / "
          f"{costs.retained_attempt_bytes:,} B retained; target utilisation {args.target_utilisation:g}, seed {args.seed}")
    print(render(rows))
    for fleet in unreachable:
        print(f"{fleet.engines:,} engines, {fleet.in_flight:,} in flight: no shard count reaches {args.target_utilisation:g} (owner() lookups alone exceed it)")
    print()
    print(render_sizing(Fleet(args.sizing_engines, 0, **common), costs, args.sizing_rates, args.target_utilisation))
    if args.json:
        print(json.dumps({"costs": dataclasses.asdict(costs), "rows": [dataclasses.asdict(r) for r in rows]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
