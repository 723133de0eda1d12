# SPDX-License-Identifier: Apache-2.0
"""The broker benchmark's two ceilings beside its load: the broker core alone (no gRPC) and gRPC alone (no broker work).

`core_only` drives BrokerCore in this process; `transport_floor` starts a
bare grpc.aio server on the control plane's event loop and counts its CPU
per answered and per streamed message, the least any rendezvous over the
engines' streams costs the server.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import time

import grpc

from bench.broker_capacity_constants import BARRIER_TIMEOUT_S, SERVER_CPU, START_TIMEOUT_S, TOKENS, TRANSFER_TIMEOUT_S
from kvpush.client import BrokerClient
from kvpush.clock import SystemClock
from kvpush.dev import sample_engines as sample
from kvpush.processes import cpu_seconds
from kvpush.rendezvous.v1 import rendezvous_service_pb2 as rv_pb
from kvpush.rendezvous.v1 import transfer_pb2 as tr_pb
from kvpush.services.broker.config import BrokerConfig
from kvpush.services.broker.core import BrokerCore
from kvpush.services.common.server import run_event_loop
from kvpush.services.registrar.config import RegistrarConfig
from kvpush.services.registrar.core import RegistrarCore

FLOOR_SERVICE = "kvpush.bench.Floor"  # the bare server of transport_floor


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
