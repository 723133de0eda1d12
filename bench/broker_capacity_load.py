# SPDX-License-Identifier: Apache-2.0
"""One load process of the broker benchmark: its fake engine pairs, the rendezvous it starts and the orders its prefill engines receive.

`Bench` registers its engine pairs and keeps their leases, consumes each
prefill rank's write orders (one stream per broker shard), and starts
rendezvous on schedule (open loop) or back to back (closed loop), measuring
each order's latency from the second message leaving. With `--transport
streams` each engine sends on its EngineReports stream to each shard
through the connector's own ReportStream (`StreamSender`).
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable

import grpc

from bench.broker_capacity_constants import CALL_TIMEOUT_S, TOKENS, TRANSFER_TIMEOUT_S
from kvpush.client import BrokerClient, ClientConfig
from kvpush.connector.report_stream import Report, ReportStream
from kvpush.dev import sample_engines as sample
from kvpush.errors import KvpushError
from kvpush.registrar.v1 import registrar_service_pb2 as reg_pb
from kvpush.registrar.v1 import registrar_service_pb2_grpc as reg_grpc
from kvpush.rendezvous.v1 import rendezvous_service_pb2 as rv_pb
from kvpush.rendezvous.v1 import rendezvous_service_pb2_grpc as rv_grpc
from kvpush.rendezvous.v1 import transfer_pb2 as tr_pb
from kvpush.shards import owner


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
