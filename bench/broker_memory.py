# SPDX-License-Identifier: Apache-2.0
"""Bytes a BrokerCore holds per transfer attempt, live and retained, measured with tracemalloc.

A real BrokerCore over an in-process RegistrarCore on a ManualClock (as
tests/unit/broker_harness builds it): one prefill engine of `producer_ranks`
ranks (every rank subscribed to orders) and one decode engine. It creates
`attempts` attempts of `tokens` tokens each (RegisterDestination +
ReportPrefillDone: matched, orders sent, waiting for the ranks' write
results) and measures what the process allocated and still holds per
attempt ("live"); then every rank reports its write, the attempts settle,
and it measures again ("retained": ended attempts remembered for
retention_s to answer repeats and refuse late messages). The orders queued
for the ranks' streams are drained first: a connected stream sends them at
once, so they are not state the broker keeps. Requests are built inside the
measured region and dropped, so what stays allocated is what the broker
keeps of them.

    python -m bench.broker_memory [--attempts 2000] [--producer-ranks 8] [--tokens 1024]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import tracemalloc

from kvpush.clock import ManualClock
from kvpush.dev import sample_engines as sample
from kvpush.rendezvous.v1 import rendezvous_service_pb2 as rv_pb
from kvpush.services.broker.config import BrokerConfig
from kvpush.services.broker.core import BrokerCore
from kvpush.services.registrar.config import RegistrarConfig
from kvpush.services.registrar.core import RegistrarCore

PREFILL, DECODE = "prefill-0", "decode-0"
BLOCK_SIZE = 16
TIMEOUT_S = 300.0  # no attempt may expire while it is measured


@dataclasses.dataclass(frozen=True)
class AttemptBytes:
    """Bytes held per attempt: live (matched, awaiting write results) and retained (settled, remembered)."""

    live: int
    retained: int


def _held_bytes() -> int:
    gc.collect()
    return tracemalloc.get_traced_memory()[0]


def measure(attempts: int = 2000, producer_ranks: int = 8, tokens: int = 1024) -> AttemptBytes:
    """Runs the measurement described in the module docstring; tracemalloc is on only inside it."""
    clock = ManualClock()
    registrar = RegistrarCore(RegistrarConfig(default_lease_ttl_s=60.0), clock)
    blocks = attempts * -(-tokens // BLOCK_SIZE)
    for engine_id, role, ranks in ((PREFILL, sample.PREFILL, producer_ranks), (DECODE, sample.DECODE, 1)):
        for request in sample.engine_requests(engine_id, role, tp_size=ranks, total_kv_heads=producer_ranks, num_blocks=blocks):
            registrar.register(request)
    config = BrokerConfig(max_unsettled_attempts=attempts + 1, max_retained_attempts=attempts + 1, retention_s=3600.0)
    broker = BrokerCore(registrar, config, clock)
    clock.advance(config.startup_grace_s)  # past the grace a new broker gives a predecessor's orders
    orders = [
        broker.subscribe_producer(rv_pb.StreamWriteOrdersRequest(engine_id=PREFILL, incarnation="inc-1", tp_rank=rank), PREFILL)
        for rank in range(producer_ranks)
    ]
    events = broker.subscribe_decode(rv_pb.StreamTransferEventsRequest(engine_id=DECODE, incarnation="inc-1"), DECODE)
    tracemalloc.start()
    try:
        before = _held_bytes()
        for i in range(attempts):
            first_block = i * -(-tokens // BLOCK_SIZE)
            broker.register_destination(
                sample.destination_request(f"m{i:08d}", num_tokens=tokens, first_block=first_block, timeout_s=TIMEOUT_S), DECODE
            )
            broker.report_prefill_done(
                sample.prefill_done_request(f"m{i:08d}", num_tokens=tokens, first_block=first_block, timeout_s=TIMEOUT_S), PREFILL
            )
        for subscription in orders:
            subscription.outbox.drain()
        live = _held_bytes() - before
        if broker.live_attempts != attempts:
            raise RuntimeError(f"{broker.live_attempts} of {attempts} attempts are live: the live figure would be wrong")
        for i in range(attempts):
            for rank in range(producer_ranks):
                broker.report_write_result(sample.write_result_request(f"m{i:08d}", tp_rank=rank), PREFILL)
        clock.advance(config.max_clock_skew_s + config.fence_margin_s)
        broker.tick()
        events.outbox.drain()
        retained = _held_bytes() - before
    finally:
        tracemalloc.stop()
    if broker.unsettled_attempts:
        raise RuntimeError(f"{broker.unsettled_attempts} attempts did not settle: the retained figure would mix live and settled ones")
    return AttemptBytes(live=round(live / attempts), retained=round(retained / attempts))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--attempts", type=int, default=2000, help="attempts held at once (default 2000)")
    parser.add_argument("--producer-ranks", type=int, default=8, help="prefill engine ranks, each with an order and a write result per attempt")
    parser.add_argument("--tokens", type=int, default=1024, help="tokens per transfer (its block lists grow with it)")
    args = parser.parse_args(argv)
    result = measure(args.attempts, args.producer_ranks, args.tokens)
    print(json.dumps(dataclasses.asdict(result)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
