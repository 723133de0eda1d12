# SPDX-License-Identifier: Apache-2.0
"""The producer and consumer transfer threads over real NIXL (UCX, host memory), without vLLM.

A producer (P rank) and a consumer (D rank) each own a real NIXL agent over
CPU-backend-shaped KV tensors of different block sizes; orders, revocations
and closures arrive as the broker would send them. The consumer must see
exactly P's bytes, and the producer must report what it did.
"""

from __future__ import annotations

import ctypes
import time

import numpy as np
import pytest
import torch
from google.protobuf import duration_pb2

from kvpush.connector.consumer import Consumer, parse_notification
from kvpush.connector.kv_layout import GroupSpec, LayerTensor, build_layout
from kvpush.connector.metadata import RecvExpected, SourceReady
from kvpush.connector.nixl_agent import KvAgent
from kvpush.connector.producer import LocalLayout, Producer, notification
from kvpush.connector.spans import Spans
from kvpush.engine.v1 import engine_pb2
from kvpush.layout.geometry import planes_from_layout
from kvpush.registrar.v1 import registrar_service_pb2 as reg_pb
from kvpush.rendezvous.v1 import rendezvous_service_pb2 as rv_pb
from kvpush.rendezvous.v1 import transfer_pb2

LAYERS, HEADS, HEAD_SIZE, NUM_BLOCKS = 2, 2, 16, 12
P_BLOCK, D_BLOCK = 32, 64
POLL, IDLE = 0.0005, 0.01


def kv_tensors(block_size: int, fill: bool) -> list[LayerTensor]:
    generator = torch.Generator().manual_seed(block_size)
    layers = []
    for index in range(LAYERS):
        shape = (NUM_BLOCKS, HEADS, block_size, 2 * HEAD_SIZE)
        tensor = torch.randn(shape, generator=generator) if fill else torch.zeros(shape)
        layers.append(LayerTensor(index, f"model.layers.{index}.self_attn.attn", 0, tensor))
    return layers


def layout_of(layers, block_size):
    return build_layout("CPU_ATTN", layers, [GroupSpec(block_size, NUM_BLOCKS)], dtype="torch.float32",
                        head_size=HEAD_SIZE, total_kv_heads=HEADS, num_local_heads=HEADS)


def cells(layout, blocks, block_size, first_token, tokens):
    """Every (layer, plane, token, head, channel) value of a layout's memory, in a fixed order."""
    out = []
    for plane in planes_from_layout(layout):
        for t in tokens:
            block = blocks[(t - first_token) // block_size]
            for h in range(HEADS):
                for c in range(HEAD_SIZE):
                    address = plane.address(block, h, t % block_size, c)
                    out.append(np.frombuffer(ctypes.string_at(address, 4), np.float32)[0])
    return np.array(out)


@pytest.fixture
def pair():
    p_layers, d_layers = kv_tensors(P_BLOCK, True), kv_tensors(D_BLOCK, False)
    p_layout, p_ranges, _ = layout_of(p_layers, P_BLOCK)
    d_layout, d_ranges, _ = layout_of(d_layers, D_BLOCK)
    p_agent, d_agent = KvAgent("test-p", ["UCX"], "DRAM"), KvAgent("test-d", ["UCX"], "DRAM")
    p_agent.register(p_ranges)
    d_agent.register(d_ranges)
    reports: list[rv_pb.ReportWriteResultRequest] = []
    producer = Producer(p_agent, LocalLayout(p_layout, 0, 1, 0), "prefill-t", reports.append, Spans("prefill-t", "prefill"), POLL, IDLE)
    consumer = Consumer(d_agent, Spans("decode-t", "decode"), POLL, IDLE)
    engine = reg_pb.Engine(engine_id="decode-t", incarnation="inc-1", role=engine_pb2.ENGINE_ROLE_DECODE, tp_size=1, pp_size=1)
    engine.ranks.add(rank=engine_pb2.EngineRank(engine_id="decode-t", incarnation="inc-1", tp_rank=0, tp_size=1, pp_size=1),
                     nixl=engine_pb2.NixlAgent(agent_name="test-d", agent_metadata=d_agent.metadata()), layout=d_layout)
    producer.on_engine_event(reg_pb.WatchEnginesResponse(type=reg_pb.ENGINE_EVENT_TYPE_UPSERTED, engine=engine))
    yield {"producer": producer, "consumer": consumer, "reports": reports, "p_layout": p_layout, "d_layout": d_layout,
           "tensors": (p_layers, d_layers)}
    producer.stop()
    consumer.stop()
    p_agent.close()
    d_agent.close()


def order(transfer_id: str, blocks: list[int], first_token: int, num_tokens: int, budget_s: float = 30.0) -> rv_pb.StreamWriteOrdersResponse:
    message = rv_pb.StreamWriteOrdersResponse()
    o = message.order
    o.key.transfer_id, o.key.attempt = transfer_id, 1
    o.destination.engine_id, o.destination.incarnation = "decode-t", "inc-1"
    o.destination.first_token, o.destination.num_tokens = first_token, num_tokens
    o.destination.blocks.add(group_index=0, block_ids=blocks)
    o.decode_tp_ranks.append(0)
    o.write_budget.CopyFrom(duration_pb2.Duration(seconds=int(budget_s), nanos=int((budget_s % 1) * 1e9)))
    message.send_time.GetCurrentTime()
    return message


def source(transfer_id: str, req_id: str, blocks: list[int], num_tokens: int, hold_s: float = 30.0) -> SourceReady:
    return SourceReady(req_id, transfer_id, 1, req_id, "decode-t", (tuple(blocks),), num_tokens, hold_s, "", time.time_ns(), time.time_ns())


def control(kind: str, transfer_id: str) -> rv_pb.StreamWriteOrdersResponse:
    message = rv_pb.StreamWriteOrdersResponse()
    getattr(message, kind).key.transfer_id = transfer_id
    getattr(message, kind).key.attempt = 1
    return message


def wait(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.005)
    raise AssertionError("timed out")


def test_early_order_then_source_writes_exactly_the_tokens(pair):
    producer, consumer = pair["producer"], pair["consumer"]
    p_blocks, d_blocks, tokens, first = [7, 2, 9, 4], [5, 1], 110, 0
    consumer.expect(RecvExpected("d-req", "t1", 1, time.time_ns(), ""))
    producer.on_order_stream(order("t1", d_blocks, first, tokens))
    producer.source_ready(source("t1", "p-req", p_blocks, tokens))
    finished, failed = wait(lambda: consumer.take_results() or None if consumer.ready.wait(0.05) else None)
    assert finished == {"d-req"} and failed == set()
    assert wait(producer.take_finished) == {"p-req"}
    report = wait(lambda: pair["reports"][0] if pair["reports"] else None)
    assert report.outcome == transfer_pb2.WRITE_OUTCOME_WRITTEN
    assert report.bytes_written == tokens * LAYERS * 2 * HEADS * HEAD_SIZE * 4
    sent = cells(pair["p_layout"], p_blocks, P_BLOCK, 0, range(first, tokens))
    received = cells(pair["d_layout"], d_blocks, D_BLOCK, first, range(first, tokens))
    np.testing.assert_array_equal(received, sent)
    assert np.any(sent != 0)


def test_source_then_late_order_with_a_locally_cached_prefix(pair):
    producer, consumer = pair["producer"], pair["consumer"]
    p_blocks, d_blocks, tokens, first = [3, 6, 8, 10, 11], [0, 2], 150, 64  # D already holds its first 64-token block
    producer.source_ready(source("t2", "p-req2", p_blocks, tokens))
    consumer.expect(RecvExpected("d-req2", "t2", 1, time.time_ns(), ""))
    producer.on_order_stream(order("t2", d_blocks, first, tokens - first))
    assert wait(lambda: consumer.take_results()[0] if consumer.ready.wait(0.05) else None) == {"d-req2"}
    sent = cells(pair["p_layout"], p_blocks, P_BLOCK, 0, range(first, tokens))
    np.testing.assert_array_equal(cells(pair["d_layout"], d_blocks, D_BLOCK, first, range(first, tokens)), sent)


def test_revoked_order_is_never_written_and_closure_releases_the_source(pair):
    producer, reports = pair["producer"], pair["reports"]
    producer.on_order_stream(order("t3", [4], 0, 20))
    producer.on_order_stream(control("revocation", "t3"))
    report = wait(lambda: reports[0] if reports else None)
    assert report.outcome == transfer_pb2.WRITE_OUTCOME_REVOKED and report.bytes_written == 0
    producer.source_ready(source("t3", "p-req3", [1], 20))
    time.sleep(0.1)
    assert producer.take_finished() == set()  # held until the broker closes the transfer
    assert len(reports) == 1
    producer.on_order_stream(control("closed", "t3"))
    assert wait(producer.take_finished) == {"p-req3"}
    assert not np.any(pair["tensors"][1][0].tensor[4].numpy())  # D's block untouched


def test_order_past_its_budget_is_dropped_and_the_source_released_at_its_hold_deadline(pair):
    producer, reports = pair["producer"], pair["reports"]
    producer.on_order_stream(order("t4", [3], 0, 20, budget_s=0.1))  # budget shorter than the safety margin
    producer.source_ready(source("t4", "p-req4", [2], 20, hold_s=0.3))
    assert wait(producer.take_finished, timeout=5) == {"p-req4"}
    assert all(r.outcome != transfer_pb2.WRITE_OUTCOME_WRITTEN for r in reports)
    assert not np.any(pair["tensors"][1][0].tensor[3].numpy())


def test_consumer_fails_on_instruction_and_ignores_strangers(pair):
    consumer = pair["consumer"]
    consumer.expect(RecvExpected("d-req5", "t5", 1, time.time_ns(), ""))
    consumer.fail("d-req5", "broker ended it")
    consumer.fail("unknown-req", "never expected")
    finished, failed = wait(lambda: consumer.take_results() if consumer.ready.wait(0.05) else None)
    assert finished == {"d-req5"} and failed == {"d-req5"}
    assert not consumer.has_work()


def test_notification_format_round_trips():
    assert parse_notification(notification("xfer-1", 3, 1, 2)) == (("xfer-1", 3), 1, 2)
    assert parse_notification(b"garbage") is None and parse_notification(b"other|a|1|2|3") is None
