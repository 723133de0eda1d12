# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""What one answered EngineReports message costs an engine's process, at the pace an engine sends them.

kvpush's own threads cost each engine a few ms of CPU per request (the
sweep's per-thread table), most of it on the control loop and gRPC's
threads, for the two or three stream messages a transfer takes per engine.
This measures that per message, apart from the engines and the broker: a
bare grpc.aio server in another process (on CPU 0) answers every message on
`RendezvousService/EngineReports` at once with an answer-sized message
(bench/broker_capacity.py's transport-floor server), and
this process (on CPU 1) sends one registration per message, one in flight,

* bare: grpc.aio's write and read of each message on the engine's control
  loop (kvpush's LoopThread), nothing else;
* kvpush: the connector's ReportStream through BrokerClient, the item
  handed over from another thread and its answer delivered, as D's
  scheduler sends its registrations,
* sync: gRPC's synchronous API instead of grpc.aio, the sending thread
  blocking on the answer (no control loop, no poller thread in between),

back to back and paced (`--gaps-ms`: an engine at QPS 4 sends about one
message every 250 ms per kind). Printed per answered message: the CPU of
the whole process, of the control loop's thread, and of gRPC's own threads.

    python -m bench.engine_stream_cost --gaps-ms 0,40,250 --seconds 20
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import queue
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc

from bench.broker_capacity_ceilings import _floor_server
from bench.broker_capacity_constants import SERVER_CPU
from kvpush.client import BrokerClient, ClientConfig, LoopThread
from kvpush.connector.report_stream import Report, ReportStream
from kvpush.dev import sample_engines as sample
from kvpush.processes import name_os_thread, thread_cpu_seconds, thread_ids
from kvpush.rendezvous.v1 import rendezvous_service_pb2 as rv_pb
from kvpush.rendezvous.v1 import transfer_pb2 as tr_pb

LOOP_THREAD = "kvpush-control"
SWITCHES = "context switches"
START_TIMEOUT_S = 20.0
CALL_TIMEOUT_S = 5.0
WARM_UP = 50
TOKENS = 256


def _messages() -> tuple[rv_pb.RegisterDestinationRequest, rv_pb.EngineReportsResponse]:
    registration = sample.destination_request("e-1", num_tokens=TOKENS)
    answer = rv_pb.EngineReportsResponse()
    answer.registrations.add(key=registration.key).response.state = tr_pb.TRANSFER_STATE_WAITING_FOR_PREFILL
    return registration, answer


def _thread_cpu() -> dict[str, float]:
    """This process's CPU seconds per kernel thread name (kvpush.processes.thread_cpu_seconds), and its threads' context switches under SWITCHES."""
    totals = {key.partition("/")[2]: seconds for key, seconds in thread_cpu_seconds([os.getpid()]).items()}
    totals[SWITCHES] = 0.0
    for tid in thread_ids([os.getpid()]):
        try:
            with open(f"/proc/self/task/{tid}/status") as status:
                totals[SWITCHES] += sum(int(line.split()[1]) for line in status if "ctxt_switches:" in line)
        except OSError:
            continue  # the thread ended
    return totals


def _per_message(before: dict[str, float], after: dict[str, float], count: int) -> dict[str, float]:
    used = {name: after[name] - before.get(name, 0.0) for name in after}
    switches = used.pop(SWITCHES)
    # The grpc.aio poller thread is started from the control loop and so carries its kernel name: both count as the loop's.
    main_name = Path(f"/proc/self/task/{threading.main_thread().native_id}/comm").read_text().strip()
    grpc_threads = sum(v for name, v in used.items() if name not in (LOOP_THREAD, main_name))
    return {"process_us": sum(used.values()) / count * 1e6, "loop_thread_us": used.get(LOOP_THREAD, 0.0) / count * 1e6,
            "grpc_threads_us": grpc_threads / count * 1e6, "sender_thread_us": used.get(main_name, 0.0) / count * 1e6,
            "context_switches": switches / count}


def bare(loop: LoopThread, address: str, request: bytes, count: int, gap_s: float) -> dict[str, float]:
    """grpc.aio alone: write one message, read its answer, wait gap_s; on the control loop."""

    async def run() -> dict[str, float]:
        async with grpc.aio.insecure_channel(address, options=ClientConfig(target=address).channel_options("rendezvous")) as channel:
            call = channel.stream_stream(f"/{BrokerClient.SERVICE}/EngineReports")(timeout=count * (gap_s + 1) + 60)
            for i in range(WARM_UP + count):
                if i == WARM_UP:
                    before = _thread_cpu()
                await call.write(request)
                if await call.read() is grpc.aio.EOF:
                    raise RuntimeError("the server ended the stream")
                await asyncio.sleep(gap_s)
            figures = _per_message(before, _thread_cpu(), count)
            call.cancel()
            return figures

    return loop.call(run(), timeout_s=count * (gap_s + 1) + 120)


def sync(address: str, request: bytes, count: int, gap_s: float) -> dict[str, float]:
    """gRPC's synchronous API: the message queued for gRPC's request iterator, its answer read by this thread blocking on the call."""
    outbox: queue.SimpleQueue = queue.SimpleQueue()

    def requests() -> Iterator[bytes]:
        while (item := outbox.get()) is not None:
            yield item

    with grpc.insecure_channel(address, options=ClientConfig(target=address).channel_options("rendezvous")) as channel:
        answers = channel.stream_stream(f"/{BrokerClient.SERVICE}/EngineReports")(requests(), timeout=count * (gap_s + 1) + 60)
        try:
            for i in range(WARM_UP + count):
                if i == WARM_UP:
                    before = _thread_cpu()
                outbox.put(request)
                next(answers)  # StopIteration (the server ended the stream) or RpcError end the run
                time.sleep(gap_s)
            return _per_message(before, _thread_cpu(), count)
        finally:
            outbox.put(None)
            answers.cancel()


def kvpush(loop: LoopThread, address: str, registration: rv_pb.RegisterDestinationRequest, count: int, gap_s: float) -> dict[str, float]:
    """kvpush's ReportStream: each registration handed over from this thread, its answer awaited here, then gap_s."""
    broker = BrokerClient(ClientConfig(target=address, default_timeout_s=CALL_TIMEOUT_S))
    closed = False
    stream = ReportStream(broker, "decode-0", loop.loop, CALL_TIMEOUT_S, lambda: closed)
    running = loop.submit(stream.run())
    answered = threading.Event()
    errors: list[Exception] = []

    def on_answer(answer, error) -> None:
        if error is not None:
            errors.append(error)
        answered.set()

    try:
        for i in range(WARM_UP + count):
            if i == WARM_UP:
                before = _thread_cpu()
            answered.clear()
            stream.send(Report("registrations", registration, on_answer))
            if not answered.wait(CALL_TIMEOUT_S * 2) or errors:
                raise RuntimeError(f"no answer from the bare server: {errors}")
            time.sleep(gap_s)
        return _per_message(before, _thread_cpu(), count)
    finally:
        closed = True
        running.cancel()
        loop.call(broker.close(0.1), timeout_s=5.0)


@contextlib.contextmanager
def bare_server(answer: bytes) -> Iterator[str]:
    """The bare server in its own process, for as long as the block runs: yields its address."""
    context = multiprocessing.get_context("spawn")  # no gRPC state inherited
    port_out = context.Queue()
    server = context.Process(target=_floor_server, args=(port_out, SERVER_CPU, answer, b""), daemon=True)
    server.start()
    try:
        yield f"127.0.0.1:{port_out.get(timeout=START_TIMEOUT_S)}"
    finally:
        server.kill()
        server.join(10)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gaps-ms", default="0,40,250", help="pauses after each answer, ms (0: back to back)")
    parser.add_argument("--seconds", type=float, default=20.0, help="how long each paced phase runs (back to back: 2,000 messages)")
    parser.add_argument("--repeats", type=int, default=2, help="rounds, the three ways in turn in each")
    args = parser.parse_args()
    try:
        gaps = [float(g) / 1000 for g in args.gaps_ms.split(",")]
    except ValueError:
        parser.error(f"--gaps-ms: comma-separated milliseconds, not {args.gaps_ms!r}")
    if any(g < 0 for g in gaps) or args.seconds <= 0 or args.repeats < 1:
        parser.error("--gaps-ms must be >= 0, --seconds > 0, --repeats >= 1")
    if len(os.sched_getaffinity(0)) < 2:
        parser.error("needs two CPUs: the server on CPU 0, this process on CPU 1")

    registration, answer = _messages()
    request = rv_pb.EngineReportsRequest(engine_id="decode-0", registrations=[registration]).SerializeToString()
    with bare_server(answer.SerializeToString()) as address:
        os.sched_setaffinity(0, {1})
        name_os_thread("stream-cost")
        loop = LoopThread(LOOP_THREAD)
        try:
            results = _measure(loop, address, registration, request, gaps, args.seconds, args.repeats)
        finally:
            loop.stop()
    print(json.dumps({"benchmark": "engine_stream_cost", "cpus": os.cpu_count(), "grpc_experiments": os.environ.get("GRPC_EXPERIMENTS", ""),
                      "results": results}))
    return 0


def _measure(loop: LoopThread, address: str, registration: rv_pb.RegisterDestinationRequest, request: bytes, gaps: list[float],
             seconds: float, repeats: int) -> list[dict]:
    """Each way at each pause in turn, `repeats` rounds; prints a line per phase."""
    results = []
    print(f"GRPC_EXPERIMENTS={os.environ.get('GRPC_EXPERIMENTS', '')!r}; per answered message: CPU (us) of this process, of the control loop "
          "(with grpc.aio's poller), of gRPC's other threads (event_engine, timers), of the sending thread (the harness's waits too; for sync also its blocking read of the answer); "
          "context switches of all its threads")
    print(f"{'way':<7}{'gap ms':>8}{'messages':>10}{'process us':>12}{'loop':>8}{'gRPC':>8}{'sender':>8}{'switches':>10}")
    for repeat in range(1, repeats + 1):
        for gap in gaps:
            count = 2000 if gap == 0 else max(20, int(seconds / gap))
            for way in ("bare", "kvpush", "sync"):
                if way == "bare":
                    figures = bare(loop, address, request, count, gap)
                elif way == "kvpush":
                    figures = kvpush(loop, address, registration, count, gap)
                else:
                    figures = sync(address, request, count, gap)
                results.append({"way": way, "gap_ms": gap * 1000, "messages": count, "repeat": repeat, **figures})
                print(f"{way:<7}{gap * 1000:>8g}{count:>10}{figures['process_us']:>12.0f}{figures['loop_thread_us']:>8.0f}"
                      f"{figures['grpc_threads_us']:>8.0f}{figures['sender_thread_us']:>8.0f}{figures['context_switches']:>10.1f}", flush=True)
    return results


if __name__ == "__main__":
    raise SystemExit(main())
