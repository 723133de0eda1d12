# SPDX-License-Identifier: Apache-2.0
"""How many rendezvous per second one `kvpush control-plane` process sustains, and how fast orders arrive.

Starts the control plane as kvpush.localstack does (127.0.0.1:0, its own
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
(kvpush.localstack.scaled: a 3-member etcd cluster, one registrar replica,
N broker shards): each rendezvous goes to the shard that owns its transfer
id (kvpush.shards), each prefill rank holds one order stream per shard, and
the server CPU is the sum over the shards.

    python bench/broker_capacity.py [--rates 2000,5000,10000] [--duration 10] [--concurrency 64] [--transport unary|streams]
        [--engines N] [--step-ms MS] [--load-processes K] [--pin] [--shards N]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import json
import multiprocessing
import multiprocessing.synchronize
import os
import pathlib
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable

import grpc

from kvpush.client import BrokerClient, ClientConfig
from kvpush.clock import SystemClock
from kvpush.connector.report_stream import Report, ReportStream
from kvpush.errors import KvpushError
from kvpush.localstack.control_plane import start_control_plane
from kvpush.localstack.scaled import ScaledControlPlane, ScaledSpec
from kvpush.processes import cpu_seconds, pin_threads
from kvpush.registrar.v1 import registrar_service_pb2 as reg_pb
from kvpush.registrar.v1 import registrar_service_pb2_grpc as reg_grpc
from kvpush.rendezvous.v1 import rendezvous_service_pb2 as rv_pb
from kvpush.rendezvous.v1 import rendezvous_service_pb2_grpc as rv_grpc
from kvpush.rendezvous.v1 import transfer_pb2 as tr_pb
from kvpush.report.percentiles import percentile
from kvpush.services.broker.config import BrokerConfig
from kvpush.services.broker.core import BrokerCore
from kvpush.services.common import sample_engines as sample
from kvpush.services.common.server import run_event_loop
from kvpush.services.registrar.config import RegistrarConfig
from kvpush.services.registrar.core import RegistrarCore
from kvpush.shards import owner

TARGET_RATE = 10_000  # per control-plane process, open loop at 2k / 5k / 10k offered
TARGET_P99_MS = 5.0
CALL_TIMEOUT_S = 5.0
START_TIMEOUT_S = 20.0  # for the order streams to open
SERVER_CPU = 0  # --pin: the control plane's CPU
BARRIER_TIMEOUT_S = 120.0  # one phase with its drain, or the load processes' start
TOKENS = 256
TRANSFER_TIMEOUT_S = 300.0  # by default no attempt expires while the benchmark runs
FLOOR_SERVICE = "kvpush.bench.Floor"  # the bare server of transport_floor
FLOOR_MESSAGES = 5_000


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


def _floor_server(port_out: multiprocessing.Queue, cpu: int | None, answer: bytes, order: bytes) -> None:
    """A bare grpc.aio server on the control plane's event loop: answers each stream message with `answer`, or streams `order` n times; no other work.

    It answers on RendezvousService/EngineReports too, so kvpush's own
    client can stream to it (bench/engine_stream_cost.py).
    """
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})

    async def answer_each(requests, context) -> None:
        async for _ in requests:
            await context.write(answer)

    async def stream_orders(request: bytes, context) -> None:
        for _ in range(int(request)):
            await context.write(order)

    async def serve() -> None:
        server = grpc.aio.server()
        handlers = {"AnswerEach": grpc.stream_stream_rpc_method_handler(answer_each),
                    "StreamOrders": grpc.unary_stream_rpc_method_handler(stream_orders)}
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(FLOOR_SERVICE, handlers),
                                         grpc.method_handlers_generic_handler(BrokerClient.SERVICE, {"EngineReports": handlers["AnswerEach"]})))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        port_out.put(port)
        await server.wait_for_termination()

    run_event_loop(serve())


async def _floor_phases(address: str, server_pid: int, count: int, request: bytes) -> dict:
    """Server CPU per answered message (one in flight, as an engine awaiting each answer; and 16) and per streamed message."""
    figures = {}
    async with grpc.aio.insecure_channel(address) as channel:
        answer_each = channel.stream_stream(f"/{FLOOR_SERVICE}/AnswerEach")
        stream_orders = channel.unary_stream(f"/{FLOOR_SERVICE}/StreamOrders")
        for window in (1, 16):
            call = answer_each(timeout=BARRIER_TIMEOUT_S)
            in_flight = asyncio.Semaphore(window)

            async def read_answers(call=call, in_flight=in_flight) -> int:
                answers = 0
                for _ in range(count):
                    if await call.read() is grpc.aio.EOF:
                        break
                    answers += 1
                    in_flight.release()
                return answers

            cpu = cpu_seconds(server_pid)
            reader = asyncio.create_task(read_answers())
            for _ in range(count):
                await in_flight.acquire()
                await call.write(request)
            if await reader != count:
                raise RuntimeError("the bare server answered fewer messages than it was sent")
            figures[f"answered_message_us_{window}_in_flight"] = (cpu_seconds(server_pid) - cpu) / count * 1e6
            await call.done_writing()
        cpu = cpu_seconds(server_pid)
        streamed = 0
        async for _ in stream_orders(str(count).encode(), timeout=BARRIER_TIMEOUT_S):
            streamed += 1
        if streamed != count:
            raise RuntimeError("the bare server streamed fewer messages than asked")
        figures["streamed_message_us"] = (cpu_seconds(server_pid) - cpu) / count * 1e6
    return figures


def transport_floor(count: int, pin: bool) -> dict:
    """What grpc.aio alone costs the server per rendezvous: a bare server, the same messages, no broker work.

    A rendezvous over the engines' streams is at least two answered stream
    messages (the registration, the prefill-done) and one streamed order;
    with one item per message (the benchmark's rates, a few items per step
    and engine) that is the transport's floor per rendezvous, however fast
    the broker's own code gets. Best case: 16 messages in flight.
    """
    registration = rv_pb.EngineReportsRequest(engine_id="decode-0", registrations=[sample.destination_request("f-1", num_tokens=TOKENS)])
    answer = rv_pb.EngineReportsResponse()
    answer.registrations.add(key=registration.registrations[0].key).response.state = tr_pb.TRANSFER_STATE_WAITING_FOR_PREFILL
    order = rv_pb.StreamWriteOrdersResponse(order=tr_pb.WriteOrder(key=registration.registrations[0].key,
                                                                   destination=registration.registrations[0].destination))
    context = multiprocessing.get_context("spawn")
    port_out = context.Queue()
    server = context.Process(target=_floor_server, args=(port_out, SERVER_CPU if pin else None, answer.SerializeToString(), order.SerializeToString()),
                             daemon=True)
    server.start()
    try:
        port = port_out.get(timeout=START_TIMEOUT_S)
        figures = run_event_loop(_floor_phases(f"127.0.0.1:{port}", server.pid, count, registration.SerializeToString()))
    finally:
        server.kill()
        server.join(10)
    best = min(figures["answered_message_us_1_in_flight"], figures["answered_message_us_16_in_flight"])
    figures["rendezvous_us"] = 2 * best + figures["streamed_message_us"]
    figures["rendezvous_per_s"] = 1e6 / figures["rendezvous_us"] if figures["rendezvous_us"] else float("inf")  # below the clock's tick
    return {"phase": "transport floor (bare grpc.aio)", **figures}


class StreamSender:
    """One engine's messages on its EngineReports stream through the connector's ReportStream; send() awaits the item's answer.

    With step_s > 0 the items wait for the engine's next step and leave
    together, as a decode engine sends the registrations of one scheduler
    step (and a prefill engine the prefill-dones of one forward) in one
    message; on_sent is called when the item leaves.
    """

    def __init__(self, address: str, engine_id: str, token: str, step_s: float):
        self.client = BrokerClient(ClientConfig(target=address, token=token, default_timeout_s=CALL_TIMEOUT_S))
        self.closed = False
        self.stream = ReportStream(self.client, engine_id, asyncio.get_running_loop(), CALL_TIMEOUT_S, lambda: self.closed)
        self.step_s = step_s
        self.pending: list[Report] = []
        self.tasks = [asyncio.create_task(self.stream.run())]
        if step_s > 0:
            self.tasks.append(asyncio.create_task(self._steps()))

    async def send(self, kind: str, message, on_sent: Callable[[], None] | None = None) -> None:
        answered = asyncio.get_running_loop().create_future()

        def on_answer(answer, error) -> None:
            if not answered.done():
                answered.set_result(error)

        report = Report(kind, message, on_answer, prepare=on_sent)
        if self.step_s > 0:
            self.pending.append(report)
        else:
            self.stream.send(report)
        error = await answered
        if error is not None:
            raise error

    async def _steps(self) -> None:
        while True:
            await asyncio.sleep(self.step_s)
            if self.pending:
                self.stream.send_many(self.pending)
                self.pending = []

    async def close(self) -> None:
        self.closed = True
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.client.close(0.1)


def _failure_name(exc: Exception) -> str:
    """How a failed rendezvous is counted: its gRPC status, kvpush's error code, or the order that did not come."""
    if isinstance(exc, grpc.aio.AioRpcError):
        return exc.code().name
    if isinstance(exc, KvpushError):
        return exc.code
    return "order not delivered in time"


class Shard:
    """One broker member as the load generator sees it: its unary stub and, with --transport streams, each engine's stream to it."""

    def __init__(self, member_id: str, address: str, channel: grpc.aio.Channel):
        self.member_id = member_id
        self.address = address
        self.stub = rv_grpc.RendezvousServiceStub(channel)
        self.senders: dict[str, StreamSender] = {}  # engine id -> its EngineReports stream to this member


class Bench:
    """One load process: its engine pairs, the rendezvous it starts and the orders its prefill engines receive."""

    def __init__(self, registrar: grpc.aio.Channel, shards: list[Shard], tokens: dict[str, str], pairs: list[tuple[str, str]], part: int):
        self.registrar = reg_grpc.RegistrarServiceStub(registrar)
        self.shards = shards
        self.tokens = tokens  # engine id -> its token
        self.pairs = pairs  # (prefill engine id, decode engine id), one per simulated P/D pair
        self.part = part  # this load process's index: transfer ids stay unique across processes
        self.metadata = {engine_id: (("authorization", f"Bearer {tokens[engine_id]}"),) for pair in pairs for engine_id in pair}
        self.leases: dict[str, str] = {}  # engine id -> lease id
        self.sent_second: dict[str, float] = {}  # transfer id -> perf_counter when the second message left
        self.order_awaited: dict[str, asyncio.Future] = {}  # transfer id -> done when its order arrives (closed loop)
        self.latencies: list[float] = []
        self.delivered = 0
        self.errors: collections.Counter[str] = collections.Counter()
        self.sequence = 0
        self.streams = False  # --transport streams
        self.answer_orders = False  # --answer-orders
        self.transfer_timeout_s = TRANSFER_TIMEOUT_S  # --transfer-timeout
        self.answering: set[asyncio.Task] = set()

    def owner(self, transfer_id: str) -> Shard:
        """The shard that owns transfer_id (the only one, unsharded)."""
        if len(self.shards) == 1:
            return self.shards[0]
        member = owner(transfer_id, [shard.member_id for shard in self.shards])
        return next(shard for shard in self.shards if shard.member_id == member)

    async def register_engines(self) -> None:
        for pair in self.pairs:
            for engine_id, role in zip(pair, (sample.PREFILL, sample.DECODE), strict=True):
                request = sample.rank_request(engine_id, role, num_blocks=100_000, lease_ttl_s=30)
                response = await self.registrar.RegisterEngineRank(request, metadata=self.metadata[engine_id], timeout=CALL_TIMEOUT_S)
                self.leases[engine_id] = response.lease_id

    async def keep_alive(self, engine_id: str) -> None:
        """Renews one engine's lease on its own stream (a stream acts for one engine)."""
        call = self.registrar.KeepAlive(metadata=self.metadata[engine_id], timeout=3600)
        while True:
            await call.write(reg_pb.KeepAliveRequest(lease_ids=[self.leases[engine_id]]))
            response = await call.read()
            if response is grpc.aio.EOF or response.unknown_lease_ids:
                raise RuntimeError(f"the lease of {engine_id} was lost")
            await asyncio.sleep(3.0)

    async def consume_orders(self, shard: Shard, engine_id: str, ready: asyncio.Event) -> None:
        request = rv_pb.StreamWriteOrdersRequest(engine_id=engine_id, incarnation="inc-1", early_orders=False)
        call = shard.stub.StreamWriteOrders(request, metadata=self.metadata[engine_id], timeout=3600)
        await call.initial_metadata()
        ready.set()
        sent = self.sent_second
        async for message in call:
            if message.WhichOneof("message") != "order":
                continue
            arrived = time.perf_counter()
            transfer_id = message.order.key.transfer_id
            started = sent.pop(transfer_id, None)
            if started is not None:
                self.latencies.append(arrived - started)
                self.delivered += 1
            awaited = self.order_awaited.get(transfer_id)
            if awaited is not None and not awaited.done():
                awaited.set_result(None)
            if self.answer_orders:
                task = asyncio.create_task(self.answer(shard, engine_id, message.order.key))
                self.answering.add(task)
                task.add_done_callback(self.answering.discard)

    async def answer(self, shard: Shard, engine_id: str, key: tr_pb.TransferKey) -> None:
        """The producer's write result for an order, as the connector reports a posted WRITE: the broker settles the attempt."""
        request = sample.write_result_request(key.transfer_id, key.attempt, engine_id=engine_id)
        try:
            if self.streams:
                await shard.senders[engine_id].send("write_results", request)
            else:
                await shard.stub.ReportWriteResult(request, metadata=self.metadata[engine_id], timeout=CALL_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            self.errors[f"write result {exc.code().name}"] += 1
        except KvpushError as exc:
            self.errors[f"write result {exc.code}"] += 1

    def requests(self) -> tuple[str, rv_pb.RegisterDestinationRequest, rv_pb.ReportPrefillDoneRequest, tuple[str, str]]:
        self.sequence += 1
        pair = self.pairs[self.sequence % len(self.pairs)]
        transfer_id = f"b{self.part}-{self.sequence}"
        first_block = (self.sequence * 16) % 99_000
        engines = {"prefill_engine_id": pair[0], "decode_engine_id": pair[1]}
        destination = sample.destination_request(transfer_id, num_tokens=TOKENS, first_block=first_block, timeout_s=self.transfer_timeout_s, **engines)
        prefill_done = sample.prefill_done_request(transfer_id, num_tokens=TOKENS, first_block=first_block, timeout_s=self.transfer_timeout_s, **engines)
        return transfer_id, destination, prefill_done, pair

    async def send(self, engine_id: str, kind: str, request, on_sent: Callable[[], None] | None) -> None:
        shard = self.owner(request.key.transfer_id)
        if self.streams:
            await shard.senders[engine_id].send(kind, request, on_sent)
            return
        if on_sent is not None:
            on_sent()
        call = shard.stub.RegisterDestination if kind == "registrations" else shard.stub.ReportPrefillDone
        await call(request, metadata=self.metadata[engine_id], timeout=CALL_TIMEOUT_S)

    async def rendezvous(self, until_ordered: bool = False) -> None:
        """Sends one rendezvous's two messages; with until_ordered also waits (bounded) for its order to reach the prefill engine."""
        transfer_id, destination, prefill_done, (prefill_id, decode_id) = self.requests()

        def second_sent() -> None:
            self.sent_second[transfer_id] = time.perf_counter()

        calls = [(prefill_id, "prefill_done", prefill_done), (decode_id, "registrations", destination)]
        if self.sequence % 2:
            calls.reverse()
        if until_ordered:
            ordered = self.order_awaited[transfer_id] = asyncio.get_running_loop().create_future()
        try:
            await self.send(*calls[0], None)
            await self.send(*calls[1], second_sent)
            if until_ordered:
                async with asyncio.timeout(CALL_TIMEOUT_S):
                    await ordered
        except (grpc.aio.AioRpcError, KvpushError, TimeoutError) as exc:
            self.errors[_failure_name(exc)] += 1
            self.sent_second.pop(transfer_id, None)
        finally:
            self.order_awaited.pop(transfer_id, None)

    def reset(self) -> None:
        self.latencies = []
        self.delivered = 0
        self.errors = collections.Counter()

    async def drain(self, timeout: float = 5.0) -> None:
        """Waits until every sent rendezvous had its order delivered and every order its answer (--answer-orders), bounded.

        An answer still in flight at a phase's end would be the next phase's
        server work, and its error that phase's.
        """
        deadline = time.perf_counter() + timeout
        while self.sent_second and time.perf_counter() < deadline:
            await asyncio.sleep(0.01)
        if self.answering:
            await asyncio.wait(set(self.answering), timeout=max(0.0, deadline - time.perf_counter()))

    async def open_loop(self, rate: float, duration: float) -> int:
        """Starts `rate` rendezvous per second on schedule, whatever the latency (an offered load); returns how many it started."""
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
        return launched

    async def closed_loop(self, concurrency: int, duration: float) -> int:
        """`concurrency` callers each run rendezvous back to back: the maximum throughput.

        A caller's rendezvous ends when its order arrives, not when its two
        messages are answered: past capacity the broker answers messages
        faster than it streams orders, so callers that only waited for the
        answers would grow the order stream's backlog without bound and
        measure that queue instead of the broker's rate.
        """
        stop_at = time.perf_counter() + duration
        launched = 0

        async def caller() -> None:
            nonlocal launched
            while time.perf_counter() < stop_at:
                launched += 1
                await self.rendezvous(until_ordered=True)

        await asyncio.gather(*(caller() for _ in range(concurrency)))
        await self.drain()
        return launched


@dataclasses.dataclass
class Phase:
    name: str
    rate: float  # offered rendezvous per second over all load processes; 0: closed loop
    duration: float
    reported: bool = True


def phases(args: argparse.Namespace) -> list[Phase]:
    return [
        Phase("warm-up", 500, min(2.0, args.duration), reported=False),
        *(Phase(f"offered {rate:,.0f}/s", rate, args.duration) for rate in args.rates),
        Phase(f"max ({args.concurrency} callers)", 0, args.duration),
    ]


async def drive(args: argparse.Namespace, part: int, registrar: str, members: dict[str, str], tokens: dict[str, str],
                barrier: multiprocessing.synchronize.Barrier) -> list[dict]:
    """One load process: its share of the engine pairs, rate and callers, phase by phase in step with the others (barrier)."""
    pairs = [(f"prefill-{i}", f"decode-{i}") for i in range(part, args.engines, args.load_processes)]
    options = [("grpc.max_receive_message_length", 16 * 1024 * 1024)]
    channels = [grpc.aio.insecure_channel(address, options=options) for address in (registrar, *members.values())]
    loop = asyncio.get_running_loop()

    async def together() -> None:
        await loop.run_in_executor(None, barrier.wait, BARRIER_TIMEOUT_S)

    try:
        shards = [Shard(member_id, address, channel) for (member_id, address), channel in zip(members.items(), channels[1:], strict=True)]
        bench = Bench(channels[0], shards, tokens, pairs, part)
        await bench.register_engines()
        bench.answer_orders, bench.transfer_timeout_s = args.answer_orders, args.transfer_timeout
        if args.transport == "streams":
            bench.streams = True
            for shard in shards:
                shard.senders = {e: StreamSender(shard.address, e, tokens[e], args.step_ms / 1000) for pair in pairs for e in pair}
        readies = [(shard, prefill_id, asyncio.Event()) for shard in shards for prefill_id, _ in pairs]
        background = [
            *(asyncio.create_task(bench.keep_alive(engine_id)) for pair in pairs for engine_id in pair),
            *(asyncio.create_task(bench.consume_orders(shard, prefill_id, ready)) for shard, prefill_id, ready in readies),
        ]
        results = []
        try:
            async with asyncio.timeout(START_TIMEOUT_S):
                await asyncio.gather(*(ready.wait() for _, _, ready in readies))
            share = 1 / args.load_processes
            for phase in phases(args):
                bench.reset()
                await together()
                cpu_at_start = cpu_seconds(os.getpid())
                if phase.rate:
                    launched = await bench.open_loop(phase.rate * share, phase.duration)
                else:
                    launched = await bench.closed_loop(max(1, round(args.concurrency * share)), phase.duration)
                results.append({"launched": launched, "delivered": bench.delivered, "errors": dict(bench.errors),
                                "latencies": bench.latencies, "client_cpu_s": cpu_seconds(os.getpid()) - cpu_at_start})
                await together()
            for task in background:
                if task.done() and not task.cancelled() and task.exception() is not None:
                    raise RuntimeError("a keep-alive or an order stream failed during the run") from task.exception()
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


def load_process(args: argparse.Namespace, part: int, registrar: str, members: dict[str, str], tokens: dict[str, str],
                 barrier: multiprocessing.synchronize.Barrier, out: multiprocessing.Queue) -> None:
    if args.pin:
        os.sched_setaffinity(0, os.sched_getaffinity(0) - {SERVER_CPU} or {SERVER_CPU})
    try:
        out.put((part, run_event_loop(drive(args, part, registrar, members, tokens, barrier))))
    except BaseException as exc:
        barrier.abort()  # the others and the main process stop waiting
        out.put((part, f"{type(exc).__name__}: {exc}"))
        raise


def run(args: argparse.Namespace, registrar: str, members: dict[str, str], tokens: dict[str, str], server_pids: list[int]) -> list[dict]:
    """members: broker member id -> address ({"": address} unsharded). Starts the load processes and measures the server between their phases."""
    if args.pin:
        pin_threads(server_pids, {SERVER_CPU})
    context = multiprocessing.get_context("spawn")  # no gRPC state inherited
    barrier = context.Barrier(args.load_processes + 1)
    out = context.Queue()
    workers = [context.Process(target=load_process, args=(args, part, registrar, members, tokens, barrier, out), daemon=True)
               for part in range(args.load_processes)]
    for worker in workers:
        worker.start()
    spans = []
    try:
        for _ in phases(args):
            barrier.wait(BARRIER_TIMEOUT_S + START_TIMEOUT_S)
            started, cpu = time.perf_counter(), sum(cpu_seconds(pid) for pid in server_pids)
            barrier.wait(BARRIER_TIMEOUT_S)
            spans.append((time.perf_counter() - started, sum(cpu_seconds(pid) for pid in server_pids) - cpu))
        parts = dict(out.get(timeout=BARRIER_TIMEOUT_S) for _ in workers)
    except threading.BrokenBarrierError:
        parts = {}
        while not out.empty():
            part, result = out.get()
            parts[part] = result
        raise RuntimeError(f"a load process failed: {parts}") from None
    finally:
        for worker in workers:
            worker.join(10)
            if worker.is_alive():
                worker.kill()
    failed = {part: result for part, result in parts.items() if isinstance(result, str)}
    if failed:
        raise RuntimeError(f"load processes failed: {failed}")
    results = []
    for index, (phase, (elapsed, server_cpu)) in enumerate(zip(phases(args), spans, strict=True)):
        if phase.reported:
            results.append(summary(phase.name, elapsed, server_cpu, [parts[part][index] for part in sorted(parts)]))
    return results


def summary(name: str, elapsed: float, server_cpu: float, parts: list[dict]) -> dict:
    latencies = sorted(latency for part in parts for latency in part["latencies"])
    delivered = sum(part["delivered"] for part in parts)
    errors: collections.Counter[str] = collections.Counter()
    for part in parts:
        errors.update(part["errors"])
    per = 1e6 / max(1, delivered)

    def ms_at(p: float) -> float:
        return percentile(latencies, p * 100) * 1e3 if latencies else float("nan")

    return {
        "phase": name,
        "launched": sum(part["launched"] for part in parts),
        "delivered": delivered,
        "errors": dict(errors),
        "rendezvous_per_s": delivered / elapsed,
        "p50_ms": ms_at(0.50),
        "p99_ms": ms_at(0.99),
        "mean_ms": statistics.fmean(latencies) * 1e3 if latencies else float("nan"),
        # CPU per rendezvous bounds capacity on an idle core whatever else the machine runs.
        "server_cpu_us_per_rendezvous": server_cpu * per,
        "client_cpu_us_per_rendezvous": sum(part["client_cpu_s"] for part in parts) * per,
    }


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
