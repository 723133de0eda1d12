# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""bench/engine_stream_cost.py: every message is answered each way (grpc.aio alone, kvpush's ReportStream, gRPC's sync API), and its cost is counted per message."""

from __future__ import annotations

from bench.engine_stream_cost import LOOP_THREAD, _messages, bare, bare_server, kvpush, sync
from kvpush.client import LoopThread
from kvpush.rendezvous.v1 import rendezvous_service_pb2 as rv_pb


def test_every_message_is_answered_each_way_and_its_cost_is_counted_per_message():
    registration, answer = _messages()
    request = rv_pb.EngineReportsRequest(engine_id="decode-0", registrations=[registration]).SerializeToString()
    with bare_server(answer.SerializeToString()) as address:
        loop = LoopThread(LOOP_THREAD)
        try:
            # Each raises unless every message got its answer (kvpush's through ReportStream's answer handler).
            for figures in (bare(loop, address, request, 500, 0.0), kvpush(loop, address, registration, 500, 0.0),
                            sync(address, request, 500, 0.0)):
                assert figures["context_switches"] > 0, figures  # read from /proc for every thread
                assert 0 < figures["process_us"] < 100_000, figures
                parts = figures["loop_thread_us"] + figures["grpc_threads_us"] + figures["sender_thread_us"]
                assert abs(parts - figures["process_us"]) < 1e-6, figures  # every thread falls in one column
        finally:
            loop.stop()
