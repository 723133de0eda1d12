# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""bench/broker_capacity.py's closed loop: a caller's rendezvous ends when its write order reached the prefill engine, not at the answers."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc

from bench.broker_capacity_load import Bench, Shard
from kvpush.dev.localstack.control_plane import start_control_plane

PAIRS = [("prefill-0", "decode-0"), ("prefill-1", "decode-1")]
RENDEZVOUS = 30
WAIT_S = 10.0


async def _closed_loop_callers(address: str, tokens: dict[str, str]) -> Bench:
    async with grpc.aio.insecure_channel(address) as channel:
        bench = Bench(channel, [Shard("", address, channel)], tokens, PAIRS, part=0)
        await bench.register_engines()
        readies = [asyncio.Event() for _ in PAIRS]
        orders = [asyncio.create_task(bench.consume_orders(bench.shards[0], prefill_id, ready)) for (prefill_id, _), ready in zip(PAIRS, readies, strict=True)]
        try:
            async with asyncio.timeout(WAIT_S):
                await asyncio.gather(*(ready.wait() for ready in readies))
            for done in range(1, RENDEZVOUS + 1):
                async with asyncio.timeout(WAIT_S):
                    await bench.rendezvous(until_ordered=True)
                # Its order was counted before the call returned: the next call cannot add to a backlog.
                assert (bench.delivered, dict(bench.errors), bench.sent_second, bench.order_awaited) == (done, {}, {}, {})
        finally:
            for task in orders:
                task.cancel()
            await asyncio.gather(*orders, return_exceptions=True)
    return bench


def test_a_closed_loop_caller_waits_for_its_order(tmp_path: Path):
    engine_ids = [engine_id for pair in PAIRS for engine_id in pair]
    plane = start_control_plane(tmp_path, engine_ids=engine_ids, env={"OTEL_TRACES_EXPORTER": None})
    try:
        tokens = {engine_id: plane.token_file_of(engine_id).read_text().strip() for engine_id in engine_ids}
        bench = asyncio.run(_closed_loop_callers(plane.address, tokens))
    finally:
        plane.stop()
    assert len(bench.latencies) == RENDEZVOUS and all(latency > 0 for latency in bench.latencies)
