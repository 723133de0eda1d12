# SPDX-License-Identifier: Apache-2.0
"""The broker benchmark's phases, run by its spawned load processes in step, and each phase's summary.

A warm-up, one open-loop phase per offered rate and a closed loop at
maximum throughput. The load processes (`drive`, one `Bench` each) share
the engines, the rate and the callers, and wait for each other at a
barrier before and after every phase, where the main process reads the
server's CPU time (`run`).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import multiprocessing
import multiprocessing.synchronize
import os
import statistics
import threading
import time

import grpc

from bench.broker_capacity_constants import BARRIER_TIMEOUT_S, SERVER_CPU, START_TIMEOUT_S
from bench.broker_capacity_load import Bench, Shard, StreamSender
from kvpush.processes import cpu_seconds, pin_threads
from kvpush.report.percentiles import percentile
from kvpush.services.common.server import run_event_loop


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
