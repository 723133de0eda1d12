# SPDX-License-Identifier: Apache-2.0
"""How many rendezvous per second one `kvpush control-plane` process sustains, and how fast orders arrive.

Starts the control plane as kvpush.localstack does (127.0.0.1:0, its own
process group, its log in a temporary work directory), registers a fake
prefill engine (one rank, no early orders, so the broker does the match)
and a fake decode engine over real RPCs, then drives RegisterDestination +
ReportPrefillDone pairs from this process (alternating which side arrives
second) while a StreamWriteOrders consumer for the prefill rank measures
the latency from sending the second call to receiving the order. With
`--transport streams` the two engines send the same messages the way the
connector does, in batches on their EngineReports streams (the connector's
own ReportStream), instead of one unary call each. Phases:
open-loop offered rates (default 2,000/s) and a closed loop at maximum
throughput. Each phase also reports the CPU time the server and this load
generator spent per rendezvous, which bounds capacity whatever else the
machine runs. Prints a table beside the targets and one JSON line.

With `--shards N` the control plane is the scaled-out form instead
(kvpush.localstack.scaled: a 3-member etcd cluster, one registrar replica,
N broker shards): each rendezvous goes to the shard that owns its transfer
id (kvpush.shards), the prefill rank holds one order stream per shard, and
the server CPU is the sum over the shards.

    python bench/broker_capacity.py [--rates 1000,2000] [--duration 10] [--concurrency 64] [--transport unary|streams] [--shards N]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time

import grpc

from kvpush.client import BrokerClient, ClientConfig
from kvpush.connector.report_stream import Report, ReportStream
from kvpush.errors import KvpushError
from kvpush.localstack.control_plane import DEFAULT_ENGINE_IDS, start_control_plane
from kvpush.localstack.scaled import ScaledControlPlane, ScaledSpec
from kvpush.processes import cpu_seconds
from kvpush.registrar.v1 import registrar_service_pb2 as reg_pb
from kvpush.registrar.v1 import registrar_service_pb2_grpc as reg_grpc
from kvpush.rendezvous.v1 import rendezvous_service_pb2 as rv_pb
from kvpush.rendezvous.v1 import rendezvous_service_pb2_grpc as rv_grpc
from kvpush.services.broker.config import BrokerConfig
from kvpush.services.broker.core import BrokerCore
from kvpush.services.common import sample_engines as sample
from kvpush.services.common.clock import SystemClock
from kvpush.services.common.server import run_event_loop
from kvpush.services.registrar.config import RegistrarConfig
from kvpush.services.registrar.core import RegistrarCore
from kvpush.shards import owner

TARGET_RATE = 2_000
TARGET_P99_MS = 5.0
ASPIRATION_RATE = 10_000
CALL_TIMEOUT_S = 5.0
START_TIMEOUT_S = 20.0  # for the order stream to open
TRANSFER_TIMEOUT_S = 300.0  # no attempt may expire while the benchmark runs
TOKENS = 256


def core_only(count: int) -> dict:
    """Rendezvous per second of BrokerCore alone, in this process (no gRPC): the core's own ceiling."""
    clock = SystemClock()
    registrar = RegistrarCore(RegistrarConfig(), clock)
    for engine_id, role in (("prefill-0", sample.PREFILL), ("decode-0", sample.DECODE)):
        registrar.register(sample.rank_request(engine_id, role, num_blocks=100_000))
    broker = BrokerCore(registrar, BrokerConfig(), clock)
    orders = broker.subscribe_producer(rv_pb.StreamWriteOrdersRequest(engine_id="prefill-0", incarnation="inc-1"), "prefill-0")
    pairs = [
        (
            sample.destination_request(f"c{i}", num_tokens=TOKENS, timeout_s=TRANSFER_TIMEOUT_S),
            sample.prefill_done_request(f"c{i}", num_tokens=TOKENS, timeout_s=TRANSFER_TIMEOUT_S),
        )
        for i in range(count)
    ]
    started = time.perf_counter()
    for i, (destination, prefill_done) in enumerate(pairs):
        if i % 2:
            broker.register_destination(destination, "decode-0")
            broker.report_prefill_done(prefill_done, "prefill-0")
        else:
            broker.report_prefill_done(prefill_done, "prefill-0")
            broker.register_destination(destination, "decode-0")
    elapsed = time.perf_counter() - started
    assert len(orders.outbox) == count
    return {"phase": "core alone", "rendezvous_per_s": count / elapsed}


class StreamSender:
    """One engine's messages on its EngineReports stream through the connector's ReportStream; send() awaits the item's answer."""

    def __init__(self, address: str, engine_id: str, token: str):
        self.client = BrokerClient(ClientConfig(target=address, token=token, default_timeout_s=CALL_TIMEOUT_S))
        self.closed = False
        self.stream = ReportStream(self.client, engine_id, asyncio.get_running_loop(), CALL_TIMEOUT_S, lambda: self.closed)
        self.task = asyncio.create_task(self.stream.run())

    async def send(self, kind: str, message) -> None:
        answered = asyncio.get_running_loop().create_future()

        def on_answer(answer, error) -> None:
            if not answered.done():
                answered.set_result(error)

        self.stream.send(Report(kind, message, on_answer))
        error = await answered
        if error is not None:
            raise error

    async def close(self) -> None:
        self.closed = True
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        await self.client.close(0.1)


class Shard:
    """One broker member as the load generator sees it: its unary stub and, with --transport streams, each engine's stream to it."""

    def __init__(self, member_id: str, address: str, channel: grpc.aio.Channel):
        self.member_id = member_id
        self.address = address
        self.stub = rv_grpc.RendezvousServiceStub(channel)
        self.senders: dict[str, StreamSender] = {}  # engine id -> its EngineReports stream to this member


class Bench:
    def __init__(self, registrar: grpc.aio.Channel, shards: list[Shard], tokens: dict[str, str], server_pids: list[int]):
        self.server_pids = server_pids
        self._cpu_at_start = (0.0, 0.0)
        self.registrar = reg_grpc.RegistrarServiceStub(registrar)
        self.shards = shards
        self.tokens = tokens  # engine id -> its token
        self.prefill_md: tuple = ()
        self.decode_md: tuple = ()
        self.leases: dict[str, str] = {}  # engine id -> lease id
        self.sent_second: dict[str, float] = {}  # transfer id -> perf_counter at the second call's send
        self.latencies: list[float] = []
        self.delivered = 0
        self.errors: collections.Counter[str] = collections.Counter()
        self.sequence = 0
        self.streams = False  # --transport streams

    def owner(self, transfer_id: str) -> Shard:
        """The shard that owns transfer_id (the only one, unsharded)."""
        if len(self.shards) == 1:
            return self.shards[0]
        member = owner(transfer_id, [shard.member_id for shard in self.shards])
        return next(shard for shard in self.shards if shard.member_id == member)

    async def register_engines(self) -> None:
        for engine_id, role in (("prefill-0", sample.PREFILL), ("decode-0", sample.DECODE)):
            request = sample.rank_request(engine_id, role, num_blocks=100_000, lease_ttl_s=30)
            metadata = (("authorization", f"Bearer {self.tokens[engine_id]}"),)
            response = await self.registrar.RegisterEngineRank(request, metadata=metadata, timeout=CALL_TIMEOUT_S)
            self.leases[engine_id] = response.lease_id
            if role == sample.PREFILL:
                self.prefill_md = metadata
            else:
                self.decode_md = metadata

    async def keep_alive(self, engine_id: str, metadata: tuple) -> None:
        """Renews one engine's lease on its own stream (a stream acts for one engine)."""
        call = self.registrar.KeepAlive(metadata=metadata, timeout=3600)
        while True:
            await call.write(reg_pb.KeepAliveRequest(lease_ids=[self.leases[engine_id]]))
            response = await call.read()
            if response is grpc.aio.EOF or response.unknown_lease_ids:
                raise RuntimeError(f"the lease of {engine_id} was lost")
            await asyncio.sleep(3.0)

    async def consume_orders(self, shard: Shard, ready: asyncio.Event) -> None:
        request = rv_pb.StreamWriteOrdersRequest(engine_id="prefill-0", incarnation="inc-1", early_orders=False)
        call = shard.stub.StreamWriteOrders(request, metadata=self.prefill_md, timeout=3600)
        await call.initial_metadata()
        ready.set()
        sent = self.sent_second
        async for message in call:
            if message.WhichOneof("message") != "order":
                continue
            arrived = time.perf_counter()
            started = sent.pop(message.order.key.transfer_id, None)
            if started is not None:
                self.latencies.append(arrived - started)
                self.delivered += 1

    def requests(self) -> tuple[str, rv_pb.RegisterDestinationRequest, rv_pb.ReportPrefillDoneRequest]:
        self.sequence += 1
        transfer_id = f"b{self.sequence}"
        first_block = (self.sequence * 16) % 99_000
        destination = sample.destination_request(transfer_id, num_tokens=TOKENS, first_block=first_block, timeout_s=TRANSFER_TIMEOUT_S)
        prefill_done = sample.prefill_done_request(transfer_id, num_tokens=TOKENS, first_block=first_block, timeout_s=TRANSFER_TIMEOUT_S)
        return transfer_id, destination, prefill_done

    async def register_destination(self, request: rv_pb.RegisterDestinationRequest) -> None:
        shard = self.owner(request.key.transfer_id)
        if self.streams:
            await shard.senders["decode-0"].send("registrations", request)
        else:
            await shard.stub.RegisterDestination(request, metadata=self.decode_md, timeout=CALL_TIMEOUT_S)

    async def report_prefill_done(self, request: rv_pb.ReportPrefillDoneRequest) -> None:
        shard = self.owner(request.key.transfer_id)
        if self.streams:
            await shard.senders["prefill-0"].send("prefill_done", request)
        else:
            await shard.stub.ReportPrefillDone(request, metadata=self.prefill_md, timeout=CALL_TIMEOUT_S)

    async def rendezvous(self) -> None:
        transfer_id, destination, prefill_done = self.requests()
        decode_second = self.sequence % 2 == 0
        try:
            if decode_second:
                await self.report_prefill_done(prefill_done)
                self.sent_second[transfer_id] = time.perf_counter()
                await self.register_destination(destination)
            else:
                await self.register_destination(destination)
                self.sent_second[transfer_id] = time.perf_counter()
                await self.report_prefill_done(prefill_done)
        except grpc.aio.AioRpcError as exc:
            self.errors[exc.code().name] += 1
            self.sent_second.pop(transfer_id, None)
        except KvpushError as exc:
            self.errors[exc.code] += 1
            self.sent_second.pop(transfer_id, None)

    def reset(self) -> None:
        self._cpu_at_start = (self.server_cpu(), cpu_seconds(os.getpid()))
        self.latencies = []
        self.delivered = 0
        self.errors = collections.Counter()

    def server_cpu(self) -> float:
        return sum(cpu_seconds(pid) for pid in self.server_pids)

    async def drain(self, timeout: float = 5.0) -> None:
        """Waits until every sent rendezvous had its order delivered (bounded)."""
        deadline = time.perf_counter() + timeout
        while self.sent_second and time.perf_counter() < deadline:
            await asyncio.sleep(0.01)

    async def open_loop(self, rate: float, duration: float) -> dict:
        """Starts `rate` rendezvous per second on schedule, whatever the latency (an offered load)."""
        self.reset()
        tasks: set[asyncio.Task] = set()
        started = time.perf_counter()
        launched = 0
        while (now := time.perf_counter()) - started < duration:
            due = int((now - started) * rate)
            while launched < due:
                task = asyncio.create_task(self.rendezvous())
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                launched += 1
            # Sleep until the next launch is due: no wake-ups between launches
            # to steal CPU from the server on a small machine.
            await asyncio.sleep(max(0.0, started + (launched + 1) / rate - time.perf_counter()))
        if tasks:
            await asyncio.wait(tasks, timeout=10)
        await self.drain()
        elapsed = time.perf_counter() - started
        return self.summary(f"offered {rate:,.0f}/s", elapsed, launched)

    async def closed_loop(self, concurrency: int, duration: float) -> dict:
        """`concurrency` callers each run rendezvous back to back: the maximum throughput."""
        self.reset()
        started = time.perf_counter()
        stop_at = started + duration
        launched = 0

        async def caller() -> None:
            nonlocal launched
            while time.perf_counter() < stop_at:
                launched += 1
                await self.rendezvous()

        await asyncio.gather(*(caller() for _ in range(concurrency)))
        await self.drain()
        elapsed = time.perf_counter() - started
        return self.summary(f"max ({concurrency} callers)", elapsed, launched)

    def summary(self, name: str, elapsed: float, launched: int) -> dict:
        latencies = sorted(self.latencies)
        server_cpu = self.server_cpu() - self._cpu_at_start[0]
        client_cpu = cpu_seconds(os.getpid()) - self._cpu_at_start[1]
        per = 1e6 / max(1, self.delivered)

        def percentile(p: float) -> float:
            return latencies[min(len(latencies) - 1, int(p * len(latencies)))] * 1e3 if latencies else float("nan")

        return {
            "phase": name,
            "launched": launched,
            "delivered": self.delivered,
            "errors": dict(self.errors),
            "rendezvous_per_s": self.delivered / elapsed,
            "p50_ms": percentile(0.50),
            "p99_ms": percentile(0.99),
            "mean_ms": statistics.fmean(latencies) * 1e3 if latencies else float("nan"),
            # CPU per rendezvous bounds capacity on an idle core whatever else the machine runs.
            "server_cpu_us_per_rendezvous": server_cpu * per,
            "client_cpu_us_per_rendezvous": client_cpu * per,
        }


async def run(args: argparse.Namespace, registrar: str, members: dict[str, str], tokens: dict[str, str], server_pids: list[int]) -> list[dict]:
    """members: broker member id -> address ({"": address} unsharded)."""
    options = [("grpc.max_receive_message_length", 16 * 1024 * 1024)]
    channels = [grpc.aio.insecure_channel(address, options=options) for address in (registrar, *members.values())]
    try:
        shards = [Shard(member_id, address, channel) for (member_id, address), channel in zip(members.items(), channels[1:], strict=True)]
        bench = Bench(channels[0], shards, tokens, server_pids)
        await bench.register_engines()
        if args.transport == "streams":
            bench.streams = True
            for shard in shards:
                shard.senders = {engine_id: StreamSender(shard.address, engine_id, tokens[engine_id]) for engine_id in ("prefill-0", "decode-0")}
        readies = [asyncio.Event() for _ in shards]
        background = [
            asyncio.create_task(bench.keep_alive("prefill-0", bench.prefill_md)),
            asyncio.create_task(bench.keep_alive("decode-0", bench.decode_md)),
            *(asyncio.create_task(bench.consume_orders(shard, ready)) for shard, ready in zip(shards, readies, strict=True)),
        ]
        try:
            async with asyncio.timeout(START_TIMEOUT_S):
                await asyncio.gather(*(ready.wait() for ready in readies))
            await bench.open_loop(500, min(2.0, args.duration))  # warm-up, not reported
            results = [await bench.open_loop(rate, args.duration) for rate in args.rates]
            results.append(await bench.closed_loop(args.concurrency, args.duration))
            for task in background:
                if task.done() and not task.cancelled() and task.exception() is not None:
                    raise RuntimeError("a keep-alive or the order stream failed during the run") from task.exception()
        finally:
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            for shard in shards:
                for sender in shard.senders.values():
                    await sender.close()
    finally:
        for channel in channels:
            await channel.close()
    return results


def report(core: dict, results: list[dict], args: argparse.Namespace) -> None:
    print(f"transport: {args.transport}; " + (f"{args.shards} broker shard(s) on etcd" if args.shards else "embedded control plane"))
    print(f"{'phase':<22}{'rendezvous/s':>14}{'p50 ms':>10}{'p99 ms':>10}{'errors':>8}{'server CPU us/rdv':>19}{'client CPU us/rdv':>19}")
    for r in results:
        print(
            f"{r['phase']:<22}{r['rendezvous_per_s']:>14,.0f}{r['p50_ms']:>10.2f}{r['p99_ms']:>10.2f}{sum(r['errors'].values()):>8}"
            f"{r['server_cpu_us_per_rendezvous']:>19,.0f}{r['client_cpu_us_per_rendezvous']:>19,.0f}"
        )
    *offered, maximum = results
    print(f"{'core alone (no gRPC)':<22}{core['rendezvous_per_s']:>14,.0f}")
    at_target = [r for rate, r in zip(args.rates, offered, strict=True) if rate >= TARGET_RATE]
    meets = bool(at_target) and at_target[0]["rendezvous_per_s"] >= 0.98 * TARGET_RATE and at_target[0]["p99_ms"] <= TARGET_P99_MS
    print(
        f"target: >= {TARGET_RATE:,}/s with p99 <= {TARGET_P99_MS:g} ms at that rate -> {'met' if meets else 'NOT met'}; "
        f"aim {ASPIRATION_RATE:,}/s -> max {maximum['rendezvous_per_s']:,.0f}/s over gRPC, {core['rendezvous_per_s']:,.0f}/s in the core alone"
    )
    print(
        json.dumps(
            {
                "benchmark": "broker_capacity",
                "transport": args.transport,
                "shards": args.shards,
                "cpus": os.cpu_count(),
                "load_average": os.getloadavg(),
                "core_alone": core,
                "offered": offered,
                "max": maximum,
                "target_rate": TARGET_RATE,
                "target_p99_ms": TARGET_P99_MS,
                "target_met": meets,
            }
        )
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--rates",
        type=lambda text: [float(rate) for rate in text.split(",")],
        default=[float(TARGET_RATE)],
        help="comma-separated offered rendezvous per second, one open-loop phase each",
    )
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per phase")
    parser.add_argument("--concurrency", type=int, default=64, help="callers in the maximum-throughput phase")
    parser.add_argument("--transport", choices=("unary", "streams"), default="unary",
                        help="one unary call per message, or the engines' EngineReports streams (as the connector sends them)")
    parser.add_argument("--shards", type=int, default=0, help="broker shards of a scaled-out control plane (0: the embedded control plane)")
    parser.add_argument("--keep-otel-env", action="store_true", help="pass OTEL_* variables on to the control plane")
    args = parser.parse_args()
    # OTEL_* of this shell would make the control plane trace (and export) what is being measured.
    env = {} if args.keep_otel_env else dict.fromkeys((name for name in os.environ if name.startswith("OTEL_")), None)
    leases = ["--lease-ttl", "30", "--max-lease-ttl", "60"]
    with tempfile.TemporaryDirectory(prefix="kvpush-bench-") as workdir:
        if args.shards:
            scaled = ScaledControlPlane(pathlib.Path(workdir), ScaledSpec(registrars=1, brokers=args.shards, registrar_args=leases), env=env).start()
            try:
                tokens = {identity: scaled.token_file_of(identity).read_text().strip() for identity in DEFAULT_ENGINE_IDS}
                members = {part.name: part.address for part in scaled.brokers}
                pids = [part.process.pid for part in scaled.brokers]
                results = run_event_loop(run(args, scaled.registrars[0].address, members, tokens, pids))
            finally:
                scaled.stop()
        else:
            plane = start_control_plane(pathlib.Path(workdir), env=env, extra_args=leases)
            try:
                tokens = {identity: plane.token_file_of(identity).read_text().strip() for identity in DEFAULT_ENGINE_IDS}
                results = run_event_loop(run(args, plane.address, {"": plane.address}, tokens, [plane.process.pid]))
            finally:
                plane.stop()
    report(core_only(20_000), results, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
