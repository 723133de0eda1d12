# SPDX-License-Identifier: Apache-2.0
"""How many rendezvous per second one `kvpush control-plane` process sustains, and how fast orders arrive.

Starts the control plane as kvpush.dev.localstack does (127.0.0.1:0, its own
process group, its log in a temporary work directory), registers
`--engines` fake prefill/decode engine pairs (one rank each, no early
orders, so the broker does the match) over real RPCs, then drives
RegisterDestination + ReportPrefillDone pairs (alternating which side
arrives second) while each prefill rank's StreamWriteOrders consumer
measures the latency from the second message leaving to the order
arriving. With `--transport streams` the engines send the same messages the
way the connector does, on their EngineReports streams (the connector's own
ReportStream); `--step-ms` makes each
engine send what one step produced in one message, as a decode engine sends
the registrations of one scheduler step. `--load-processes` spreads the
engines, the offered rate and the callers over that many load generator
processes (spawned, in step phase by phase), so the load generator is not
what runs out of CPU; `--pin` puts the control plane on CPU 0 and the load
on the others.

Phases: open-loop offered rates (default 2,000, 5,000 and 10,000/s) and a
closed loop at maximum throughput. Each phase also reports the CPU time the
server and the load generators spent per rendezvous, which bounds capacity
whatever else the machine runs. Two ceilings are measured beside them: the
broker core alone (no gRPC), and gRPC alone (a bare grpc.aio server on the
same event loop answering the same messages, doing nothing else). Prints a
table beside the target (>= 10,000/s per control-plane process with p99
<= 5 ms) and one JSON line.

With `--shards N` the control plane is the scaled-out form instead
(kvpush.dev.localstack.scaled: a 3-member etcd cluster, one registrar replica,
N broker shards): each rendezvous goes to the shard that owns its transfer
id (kvpush.shards), each prefill rank holds one order stream per shard, and
the server CPU is the sum over the shards.

    python bench/broker_capacity.py [--rates 2000,5000,10000] [--duration 10] [--concurrency 64] [--transport unary|streams]
        [--engines N] [--step-ms MS] [--load-processes K] [--pin] [--shards N]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import tempfile

if __package__ in (None, ""):
    # Run as `python bench/broker_capacity.py` (as the docs do): make this checkout's `bench` importable.
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from bench.broker_capacity_ceilings import core_only, transport_floor
from bench.broker_capacity_constants import TRANSFER_TIMEOUT_S
from bench.broker_capacity_phases import run
from kvpush.dev.localstack.control_plane import start_control_plane
from kvpush.dev.localstack.scaled import ScaledControlPlane, ScaledSpec

TARGET_RATE = 10_000  # per control-plane process, open loop at 2k / 5k / 10k offered
TARGET_P99_MS = 5.0
FLOOR_MESSAGES = 5_000


def report(core: dict, floor: dict, results: list[dict], args: argparse.Namespace) -> None:
    print(f"transport: {args.transport}; " + (f"{args.shards} broker shard(s) on etcd" if args.shards else "embedded control plane")
          + f"; {args.engines} engine pair(s), step {args.step_ms:g} ms, {args.load_processes} load process(es)"
          + (", pinned" if args.pin else ""))
    print(f"{'phase':<22}{'rendezvous/s':>14}{'p50 ms':>10}{'p99 ms':>10}{'errors':>8}{'server CPU us/rdv':>19}{'client CPU us/rdv':>19}")
    for r in results:
        print(
            f"{r['phase']:<22}{r['rendezvous_per_s']:>14,.0f}{r['p50_ms']:>10.2f}{r['p99_ms']:>10.2f}{sum(r['errors'].values()):>8}"
            f"{r['server_cpu_us_per_rendezvous']:>19,.0f}{r['client_cpu_us_per_rendezvous']:>19,.0f}"
        )
    *offered, maximum = results
    print(f"{'core alone (no gRPC)':<22}{core['rendezvous_per_s']:>14,.0f}")
    print(f"{'gRPC alone (no work)':<22}{floor['rendezvous_per_s']:>14,.0f}{'':>28}{floor['rendezvous_us']:>19,.0f}"
          f"   (a bare grpc.aio server: {floor['answered_message_us_1_in_flight']:,.0f} us per answered message one at a time, "
          f"{floor['answered_message_us_16_in_flight']:,.0f} with 16 in flight, {floor['streamed_message_us']:,.0f} per streamed message; "
          f"a rendezvous is 2 answered + 1 streamed)")
    # A rate is held when (nearly) all of it was delivered with p99 <= the target.
    held = {rate: r["rendezvous_per_s"] >= 0.98 * rate and r["p99_ms"] <= TARGET_P99_MS for rate, r in zip(args.rates, offered, strict=True)}
    for rate, ok in held.items():
        print(f"offered {rate:,.0f}/s: {'held' if ok else 'NOT held'} (>= 98 % delivered, p99 <= {TARGET_P99_MS:g} ms)")
    meets = any(ok for rate, ok in held.items() if rate >= TARGET_RATE)
    print(
        f"target: >= {TARGET_RATE:,}/s per control-plane process with p99 <= {TARGET_P99_MS:g} ms -> {'met' if meets else 'NOT met'}"
        f" (highest rate held: {max((rate for rate, ok in held.items() if ok), default=0):,.0f}/s; "
        f"max {maximum['rendezvous_per_s']:,.0f}/s closed loop, {core['rendezvous_per_s']:,.0f}/s in the core alone, "
        f"{floor['rendezvous_per_s']:,.0f}/s for gRPC alone at one item per message)"
    )
    print(
        json.dumps(
            {
                "benchmark": "broker_capacity",
                "transport": args.transport,
                "shards": args.shards,
                "engines": args.engines,
                "step_ms": args.step_ms,
                "load_processes": args.load_processes,
                "pinned": args.pin,
                "cpus": os.cpu_count(),
                "load_average": os.getloadavg(),
                "core_alone": core,
                "transport_floor": floor,
                "offered": offered,
                "max": maximum,
                "target_rate": TARGET_RATE,
                "target_p99_ms": TARGET_P99_MS,
                "held": {f"{rate:g}": ok for rate, ok in held.items()},
                "target_met": meets,
            }
        )
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--rates",
        type=lambda text: [float(rate) for rate in text.split(",")],
        default=[2_000.0, 5_000.0, 10_000.0],
        help="comma-separated offered rendezvous per second, one open-loop phase each",
    )
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per phase")
    parser.add_argument("--concurrency", type=int, default=64, help="callers in the maximum-throughput phase")
    parser.add_argument("--transport", choices=("unary", "streams"), default="unary",
                        help="one unary call per message, or the engines' EngineReports streams (as the connector sends them)")
    parser.add_argument("--shards", type=int, default=0, help="broker shards of a scaled-out control plane (0: the embedded control plane)")
    parser.add_argument("--engines", type=int, default=1, help="simulated prefill/decode engine pairs, each with its own streams")
    parser.add_argument("--step-ms", type=float, default=0.0,
                        help="streams: each engine sends what one step produced in one message every this many ms (0: each item at once)")
    parser.add_argument("--load-processes", type=int, default=1, help="load generator processes sharing the engines, rate and callers")
    parser.add_argument("--pin", action="store_true", help="the control plane on CPU 0, the load processes on the other CPUs")
    parser.add_argument("--answer-orders", action="store_true",
                        help="each order is answered with its write result, as a producer does, so attempts settle and retention fills")
    parser.add_argument("--transfer-timeout", type=float, default=TRANSFER_TIMEOUT_S,
                        help="each transfer's timeout in seconds; the broker holds an attempt at least this long (its deadline timer)")
    parser.add_argument("--keep-otel-env", action="store_true", help="pass OTEL_* variables on to the control plane")
    args = parser.parse_args()
    if args.engines < args.load_processes or args.load_processes < 1:
        parser.error("--engines must be at least --load-processes, which must be at least 1")
    if args.step_ms and args.transport != "streams":
        parser.error("--step-ms needs --transport streams")
    engine_ids = [f"{role}-{i}" for i in range(args.engines) for role in ("prefill", "decode")]
    # OTEL_* of this shell would make the control plane trace (and export) what is being measured.
    env = {} if args.keep_otel_env else dict.fromkeys((name for name in os.environ if name.startswith("OTEL_")), None)
    leases = ["--lease-ttl", "30", "--max-lease-ttl", "60"]
    with tempfile.TemporaryDirectory(prefix="kvpush-bench-") as workdir:
        if args.shards:
            scaled = ScaledControlPlane(pathlib.Path(workdir), ScaledSpec(registrars=1, brokers=args.shards, registrar_args=leases), env=env,
                                        engine_ids=engine_ids).start()
            try:
                tokens = {identity: scaled.token_file_of(identity).read_text().strip() for identity in engine_ids}
                members = {part.name: part.address for part in scaled.brokers}
                pids = [part.process.pid for part in scaled.brokers]
                results = run(args, scaled.registrars[0].address, members, tokens, pids)
            finally:
                scaled.stop()
        else:
            plane = start_control_plane(pathlib.Path(workdir), env=env, extra_args=leases, engine_ids=engine_ids)
            try:
                tokens = {identity: plane.token_file_of(identity).read_text().strip() for identity in engine_ids}
                results = run(args, plane.address, {"": plane.address}, tokens, [plane.process.pid])
            finally:
                plane.stop()
    report(core_only(20_000), transport_floor(FLOOR_MESSAGES, args.pin), results, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())

