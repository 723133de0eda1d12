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

    python bench/broker_capacity.py [--rates 1000,2000] [--duration 10] [--concurrency 64] [--transport unary|streams]
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

    def __init__(self, port: int, engine_id: str, token: str):
        self.client = BrokerClient(ClientConfig(target=f"127.0.0.1:{port}", token=token, default_timeout_s=CALL_TIMEOUT_S))
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


class Bench:
    def __init__(self, channel: grpc.aio.Channel, tokens: dict[str, str], server_pid: int):
        self.server_pid = server_pid
        self._cpu_at_start = (0.0, 0.0)
        self.registrar = reg_grpc.RegistrarServiceStub(channel)
        self.broker = rv_grpc.RendezvousServiceStub(channel)
        self.tokens = tokens  # engine id -> its token
        self.prefill_md: tuple = ()
        self.decode_md: tuple = ()
        self.leases: dict[str, str] = {}  # engine id -> lease id
        self.sent_second: dict[str, float] = {}  # transfer id -> perf_counter at the second call's send
        self.latencies: list[float] = []
        self.delivered = 0
        self.errors: collections.Counter[str] = collections.Counter()
        self.sequence = 0
        self.senders: dict[str, StreamSender] = {}  # engine id -> its EngineReports stream, with --transport streams

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

    async def consume_orders(self, ready: asyncio.Event) -> None:
        request = rv_pb.StreamWriteOrdersRequest(engine_id="prefill-0", incarnation="inc-1", early_orders=False)
        call = self.broker.StreamWriteOrders(request, metadata=self.prefill_md, timeout=3600)
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
        if self.senders:
            await self.senders["decode-0"].send("registrations", request)
        else:
            await self.broker.RegisterDestination(request, metadata=self.decode_md, timeout=CALL_TIMEOUT_S)

    async def report_prefill_done(self, request: rv_pb.ReportPrefillDoneRequest) -> None:
        if self.senders:
            await self.senders["prefill-0"].send("prefill_done", request)
        else:
            await self.broker.ReportPrefillDone(request, metadata=self.prefill_md, timeout=CALL_TIMEOUT_S)

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
        self._cpu_at_start = (cpu_seconds(self.server_pid), cpu_seconds(os.getpid()))
        self.latencies = []
        self.delivered = 0
        self.errors = collections.Counter()

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
        server_cpu = cpu_seconds(self.server_pid) - self._cpu_at_start[0]
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


async def run(args: argparse.Namespace, port: int, tokens: dict[str, str], server_pid: int) -> list[dict]:
    options = [("grpc.max_receive_message_length", 16 * 1024 * 1024)]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
        bench = Bench(channel, tokens, server_pid)
        await bench.register_engines()
        if args.transport == "streams":
            bench.senders = {engine_id: StreamSender(port, engine_id, tokens[engine_id]) for engine_id in ("prefill-0", "decode-0")}
        ready = asyncio.Event()
        background = [
            asyncio.create_task(bench.keep_alive("prefill-0", bench.prefill_md)),
            asyncio.create_task(bench.keep_alive("decode-0", bench.decode_md)),
            asyncio.create_task(bench.consume_orders(ready)),
        ]
        try:
            await asyncio.wait_for(ready.wait(), START_TIMEOUT_S)
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
            for sender in bench.senders.values():
                await sender.close()
    return results


def report(core: dict, results: list[dict], args: argparse.Namespace) -> None:
    print(f"transport: {args.transport}")
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
    parser.add_argument("--keep-otel-env", action="store_true", help="pass OTEL_* variables on to the control plane")
    args = parser.parse_args()
    # OTEL_* of this shell would make the control plane trace (and export) what is being measured.
    env = {} if args.keep_otel_env else dict.fromkeys((name for name in os.environ if name.startswith("OTEL_")), None)
    with tempfile.TemporaryDirectory(prefix="kvpush-bench-") as workdir:
        plane = start_control_plane(pathlib.Path(workdir), env=env, extra_args=["--lease-ttl", "30", "--max-lease-ttl", "60"])
        try:
            tokens = {identity: plane.token_file_of(identity).read_text().strip() for identity in DEFAULT_ENGINE_IDS}
            results = run_event_loop(run(args, plane.port, tokens, plane.process.pid))
        finally:
            plane.stop()
    report(core_only(20_000), results, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
