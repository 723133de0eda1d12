# SPDX-License-Identifier: Apache-2.0
"""A ProducerCore and a ConsumerCore over real NIXL (two UCX agents in this process, host memory), without vLLM.

The cores are driven directly on a ManualClock: the test hands them stream
messages, sources and engine events as the worker's control loop would, and
steps both (stepping is what makes UCX progress). A producer (P rank) and a
consumer (D rank) each own a real NIXL agent over CPU-backend-shaped KV
tensors of different block sizes; the consumer must see exactly P's bytes
and the producer must report what it did, truthfully. A few tests run the
same cores inside their transfer threads (Producer, Consumer).
"""

from __future__ import annotations

import contextlib
import ctypes
import time
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from kvpush.clock import ManualClock, SystemClock, duration, timestamp
from kvpush.connector.consumer import Consumer, ConsumerCore
from kvpush.connector.handoff import DestinationReady, SourceReady, packed_prompt, prompt_digest
from kvpush.connector.kv_layout import GroupSpec, LayerTensor, build_layout
from kvpush.connector.nixl_agent import KvAgent, NixlWrite
from kvpush.connector.producer import ProducerCore
from kvpush.connector.producer_thread import Producer
from kvpush.connector.spans import Spans
from kvpush.connector.write_plans import LocalLayout, build_write_plans
from kvpush.engine.v1 import engine_pb2
from kvpush.layout.geometry import planes_from_layout
from kvpush.registrar.v1 import registrar_service_pb2 as reg_pb
from kvpush.rendezvous.v1 import rendezvous_service_pb2 as rv_pb
from kvpush.rendezvous.v1 import transfer_pb2

LAYERS, HEADS, HEAD_SIZE, NUM_BLOCKS = 2, 2, 16, 12
P_BLOCK, D_BLOCK = 32, 64
TOKEN_BYTES = LAYERS * 2 * HEADS * HEAD_SIZE * 4  # keys and values of every layer and head, float32
POLL, IDLE = 0.0005, 0.01
LEASE_S, BUDGET_S, WRITE_TIMEOUT_S = 2.75, 30.0, 3.0
STREAM = 1  # the order stream generation the fixture opens

WRITTEN, FAILED, REVOKED = transfer_pb2.WRITE_OUTCOME_WRITTEN, transfer_pb2.WRITE_OUTCOME_FAILED, transfer_pb2.WRITE_OUTCOME_REVOKED


class RecordingAgent(KvAgent):
    """A real KvAgent that records which WRITE calls were made, and in what order (each still does its real work)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls: list[str] = []

    def make_write(self, *args) -> NixlWrite:
        self.calls.append("make")
        return super().make_write(*args)

    def make_pages(self, *args) -> NixlWrite:
        self.calls.append("make")
        return super().make_pages(*args)

    def start(self, write: NixlWrite) -> None:
        self.calls.append("start")
        super().start(write)

    def release(self, write: NixlWrite) -> None:
        self.calls.append("release")
        super().release(write)

    def remove_peer(self, name: str) -> None:
        self.calls.append(f"remove_peer {name}")
        super().remove_peer(name)


class StalledWriteAgent(RecordingAgent):
    """A real KvAgent whose WRITEs never report completion (poll() always says "PROC").

    The only stand-in in this file: NIXL over UCX loopback completes a WRITE
    at once and cannot be made to stall, yet the write-timeout abort and the
    deferred unload of a peer's agent are only observable while a WRITE is
    in flight. Posting, releasing and unloading stay the real agent's; the
    calls are recorded so the test can check their order.
    """

    def poll(self, write: NixlWrite) -> str:
        self.calls.append("poll")
        return "PROC"

    def notifications(self) -> dict[str, list[bytes]]:
        self.calls.append("notifications")
        return super().notifications()


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


class Pair:
    """A producer core and a consumer core on one ManualClock, each with its own real NIXL agent."""

    def __init__(self, stalled: bool = False, clock=None, plan_time_s: float = 0.0, p_block: int = P_BLOCK, d_block: int = D_BLOCK):
        self.clock = clock or ManualClock()
        self.p_block, self.d_block = p_block, d_block
        self.p_layers, self.d_layers = kv_tensors(p_block, True), kv_tensors(d_block, False)
        self.p_layout, p_ranges, _ = layout_of(self.p_layers, p_block)
        self.d_layout, d_ranges, _ = layout_of(self.d_layers, d_block)
        agent_type = StalledWriteAgent if stalled else RecordingAgent
        self.p_agent, self.d_agent = agent_type("test-p", ["UCX"], "DRAM"), KvAgent("test-d", ["UCX"], "DRAM")
        self.p_agent.register(p_ranges)
        self.d_agent.register(d_ranges)
        self.reports: list[rv_pb.ReportWriteResultRequest] = []
        local = LocalLayout(self.p_layout, 0, 1, 0)

        def plan_writes(source, order, peer, layers=None):
            """The real plan build, taking plan_time_s of (manual) time, as a CUDA sync or a large plan may."""
            if plan_time_s:
                self.clock.advance(plan_time_s)
            return build_write_plans(local, source.ready, order.order, peer, layers)

        self.producer = ProducerCore(self.p_agent, local, "prefill-t", self.reports.append, Spans("prefill-t", "prefill"), self.clock, plan_writes=plan_writes)
        self.consumer = ConsumerCore(self.d_agent, Spans("decode-t", "decode"), self.clock)
        self.engine = reg_pb.Engine(engine_id="decode-t", incarnation="inc-1", role=engine_pb2.ENGINE_ROLE_DECODE, tp_size=1, pp_size=1)
        self.engine.ranks.add(rank=engine_pb2.EngineRank(engine_id="decode-t", incarnation="inc-1", tp_rank=0, tp_size=1, pp_size=1),
                              nixl=engine_pb2.NixlAgent(agent_name="test-d", agent_metadata=self.d_agent.metadata()), layout=self.d_layout)

    def start(self) -> Pair:
        """The registrar's view of the decode engine arrives, and the first order stream opens."""
        self.producer.engine_event(reg_pb.WatchEnginesResponse(type=reg_pb.ENGINE_EVENT_TYPE_UPSERTED, engine=self.engine))
        self.producer.stream_opened(STREAM)
        return self

    def close(self) -> None:
        self.p_agent.close()
        self.d_agent.close()

    # ---- inputs ----

    def message(self, kind: str, transfer_id: str, *, sent_ahead_s: float = 0.0, lease_s: float = LEASE_S, attempt: int = 1, **order) -> rv_pb.StreamWriteOrdersResponse:
        """A broker message stamped now on the broker's wall clock, which runs sent_ahead_s ahead of this host's."""
        if kind == "order":
            message = rv_pb.StreamWriteOrdersResponse(order=order_body(transfer_id, attempt, **order))
        elif kind == "heartbeat":
            message = rv_pb.StreamWriteOrdersResponse(heartbeat=rv_pb.StreamHeartbeat())
        else:
            message = rv_pb.StreamWriteOrdersResponse()
            getattr(message, kind).key.transfer_id = transfer_id
            getattr(message, kind).key.attempt = attempt
        message.send_time.CopyFrom(timestamp(self.clock.wall() + sent_ahead_s))
        message.stream_lease.CopyFrom(duration(lease_s))
        return message

    def send(self, kind: str, transfer_id: str = "t1", *, stream: int = STREAM, **kwargs) -> None:
        self.producer.stream_message(stream, self.message(kind, transfer_id, **kwargs))

    def source(self, transfer_id: str = "t1", req_id: str = "p-req", blocks=(7, 2, 9, 4), num_tokens: int = 110, hold_s: float = 30.0,
               prompt: Sequence[int] | None = None, *, computing: bool = False, whole: bool = False,
               announce_at: float | None = None) -> SourceReady:
        """The source is ready (the forward ended); computing: its forward only starts (whole: its KV is written at the end; D is told it is due at announce_at)."""
        packed = packed_prompt(prompt) if prompt is not None else b""
        ready = SourceReady(req_id, transfer_id, 1, req_id, "decode-t", (tuple(blocks),), num_tokens, hold_s, "", 0, 0, packed)
        if computing:
            self.producer.computing(ready, whole, announce_at)
        else:
            self.producer.source_ready(ready)
        return ready

    def expect(self, transfer_id: str = "t1", req_id: str = "d-req", first_token: int = 0, num_tokens: int = 110) -> None:
        self.consumer.expect(DestinationReady(req_id, transfer_id, 1, first_token, num_tokens, 0, ""))

    # ---- progress ----

    def step(self) -> None:
        self.producer.step()
        self.consumer.step()

    def pump(self, predicate, timeout: float = 10.0):
        """Steps both cores (real time passes, the ManualClock does not) until predicate() is truthy."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.step()
            value = predicate()
            if value:
                return value
            time.sleep(0.001)
        raise AssertionError("timed out")

    def settle(self, seconds: float = 0.2) -> None:
        """Steps both cores for a while (to show that nothing happens)."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self.step()
            time.sleep(0.002)

    def answers(self) -> list[tuple[str, int, int]]:
        """(transfer_id, outcome, reason) of every ReportWriteResult so far, taken."""
        out = [(r.key.transfer_id, r.outcome, r.reason) for r in self.reports]
        self.reports.clear()
        return out

    def released(self) -> set[str]:
        return self.producer.take_released()[0]

    def received(self) -> tuple[set[str], set[str]]:
        return self.consumer.take_results()

    def results(self) -> tuple[set[str], set[str]] | None:
        """The consumer's (finished, failed) once something finished, else None (for pump)."""
        finished, failed = self.consumer.take_results()
        return (finished, failed) if finished else None

    def d_block_is_zero(self, block: int) -> bool:
        return not any(layer.tensor[block].any() for layer in self.d_layers)

    def check_bytes(self, p_blocks, d_blocks, first_token: int, num_tokens: int) -> None:
        tokens = range(first_token, first_token + num_tokens)
        sent = cells(self.p_layout, list(p_blocks), self.p_block, 0, tokens)
        np.testing.assert_array_equal(cells(self.d_layout, list(d_blocks), self.d_block, first_token, tokens), sent)
        assert np.any(sent != 0)


@contextlib.contextmanager
def transfer_threads(idle: float = IDLE, waiting_poll: float | None = None) -> Iterator[tuple[Pair, Producer, Consumer]]:
    """A Pair on the system clock with a Producer and a Consumer thread over it (POLL, idle; the consumer's waiting_poll), the producer knowing the pair's engine; stopped on the way out."""
    pair = Pair(clock=SystemClock())
    pair.consumer.waiting_poll_s = waiting_poll
    producer = Producer(pair.producer, POLL, idle)
    consumer = Consumer(pair.consumer, POLL, idle)
    producer.on_engine_event(reg_pb.WatchEnginesResponse(type=reg_pb.ENGINE_EVENT_TYPE_UPSERTED, engine=pair.engine))
    try:
        yield pair, producer, consumer
    finally:
        producer.stop()
        consumer.stop()
        pair.close()


def order_body(transfer_id: str, attempt: int = 1, *, blocks=(5, 1), first_token: int = 0, num_tokens: int = 110, budget_s: float = BUDGET_S,
               write_timeout_s: float = WRITE_TIMEOUT_S, source: bool = False, prompt: Sequence[int] | None = None) -> transfer_pb2.WriteOrder:
    order = transfer_pb2.WriteOrder()
    order.key.transfer_id, order.key.attempt = transfer_id, attempt
    order.destination.engine_id, order.destination.incarnation = "decode-t", "inc-1"
    order.destination.first_token, order.destination.num_tokens = first_token, num_tokens
    order.destination.blocks.add(group_index=0, block_ids=list(blocks))
    if prompt is not None:  # the decode side's prompt, as its digest
        order.destination.prompt_digest = prompt_digest(packed_prompt(prompt), first_token + num_tokens)
    order.decode_tp_ranks.append(0)
    order.write_budget.CopyFrom(duration(budget_s))
    order.write_timeout.CopyFrom(duration(write_timeout_s))
    if source:
        order.source.engine_id, order.source.incarnation, order.source.num_tokens = "prefill-t", "inc-1", first_token + num_tokens
    return order
