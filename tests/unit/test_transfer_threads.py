# SPDX-License-Identifier: Apache-2.0
"""ProducerCore and ConsumerCore over real NIXL (two UCX agents in this process, host memory), without vLLM.

The cores are driven directly on a ManualClock: the test hands them stream
messages, sources and engine events as the worker's control loop would, and
steps both (stepping is what makes UCX progress). A producer (P rank) and a
consumer (D rank) each own a real NIXL agent over CPU-backend-shaped KV
tensors of different block sizes; the consumer must see exactly P's bytes
and the producer must report what it did, truthfully. A few tests run the
same cores inside their transfer threads (Producer, Consumer).
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Sequence

import numpy as np
import pytest
import torch

from kvpush.connector.consumer import EARLY_NOTIFICATION_TTL_S, Consumer, ConsumerCore
from kvpush.connector.handoff import DestinationReady, SourceReady, packed_prompt, prompt_digest
from kvpush.connector.kv_layout import GroupSpec, LayerTensor, build_layout
from kvpush.connector.nixl_agent import HELLO, KvAgent, PostedWrite
from kvpush.connector.notification import Notification, notification, parse_notification
from kvpush.connector.producer import Producer, ProducerCore
from kvpush.connector.spans import Spans
from kvpush.connector.write_plans import LocalLayout, build_write_plans
from kvpush.engine.v1 import engine_pb2
from kvpush.layout.geometry import planes_from_layout
from kvpush.registrar.v1 import registrar_service_pb2 as reg_pb
from kvpush.rendezvous.v1 import rendezvous_service_pb2 as rv_pb
from kvpush.rendezvous.v1 import transfer_pb2
from kvpush.services.common import validation
from kvpush.services.common.clock import ManualClock, SystemClock, timestamp

LAYERS, HEADS, HEAD_SIZE, NUM_BLOCKS = 2, 2, 16, 12
P_BLOCK, D_BLOCK = 32, 64
TOKEN_BYTES = LAYERS * 2 * HEADS * HEAD_SIZE * 4  # keys and values of every layer and head, float32
POLL, IDLE = 0.0005, 0.01
LEASE_S, BUDGET_S, WRITE_TIMEOUT_S = 2.75, 30.0, 3.0
STREAM = 1  # the order stream generation the fixture opens

WRITTEN, FAILED, REVOKED = transfer_pb2.WRITE_OUTCOME_WRITTEN, transfer_pb2.WRITE_OUTCOME_FAILED, transfer_pb2.WRITE_OUTCOME_REVOKED


class StalledWriteAgent(KvAgent):
    """A real KvAgent whose WRITEs never report completion (poll() always says "PROC").

    The only stand-in in this file: NIXL over UCX loopback completes a WRITE
    at once and cannot be made to stall, yet the write-timeout abort and the
    deferred unload of a peer's agent are only observable while a WRITE is
    in flight. Posting, releasing and unloading stay the real agent's; the
    calls are recorded so the test can check their order.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls: list[str] = []

    def poll(self, write: PostedWrite) -> str:
        self.calls.append("poll")
        return "PROC"

    def release(self, write: PostedWrite) -> None:
        self.calls.append("release")
        super().release(write)

    def remove_peer(self, name: str) -> None:
        self.calls.append(f"remove_peer {name}")
        super().remove_peer(name)

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
        agent_type = StalledWriteAgent if stalled else KvAgent
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
        message.stream_lease.CopyFrom(validation.duration(lease_s))
        return message

    def send(self, kind: str, transfer_id: str = "t1", *, stream: int = STREAM, **kwargs) -> None:
        self.producer.stream_message(stream, self.message(kind, transfer_id, **kwargs))

    def source(self, transfer_id: str = "t1", req_id: str = "p-req", blocks=(7, 2, 9, 4), num_tokens: int = 110, hold_s: float = 30.0,
               prompt: Sequence[int] | None = None, *, computing: bool = False) -> SourceReady:
        """The source is ready (the forward ended); computing: its forward only starts (layer-progressive push)."""
        packed = packed_prompt(prompt) if prompt is not None else b""
        ready = SourceReady(req_id, transfer_id, 1, req_id, "decode-t", (tuple(blocks),), num_tokens, hold_s, "", 0, 0, packed)
        if computing:
            self.producer.computing(ready)
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
    order.write_budget.CopyFrom(validation.duration(budget_s))
    order.write_timeout.CopyFrom(validation.duration(write_timeout_s))
    if source:
        order.source.engine_id, order.source.incarnation, order.source.num_tokens = "prefill-t", "inc-1", first_token + num_tokens
    return order


@pytest.fixture
def pair():
    started = Pair().start()
    yield started
    started.close()


@pytest.fixture
def stalled():
    started = Pair(stalled=True).start()
    yield started
    started.close()


# ----- writes -----


def test_early_order_then_source_writes_exactly_the_tokens(pair: Pair):
    pair.expect("t1", num_tokens=110)
    pair.send("order", "t1", blocks=(5, 1), num_tokens=110)  # early: no source in it
    pair.source("t1", blocks=(7, 2, 9, 4), num_tokens=110)
    finished, failed = pair.pump(pair.results)
    assert (finished, failed) == ({"d-req"}, set())
    [report] = pair.reports
    assert (report.key.transfer_id, report.outcome, report.bytes_written) == ("t1", WRITTEN, 110 * TOKEN_BYTES)
    assert report.HasField("post_time") and report.descriptor_count > 0
    released, written = pair.producer.take_released()
    assert released == {"p-req"} and written["p-req"][0] > 0  # released after its WRITE completed
    pair.check_bytes((7, 2, 9, 4), (5, 1), 0, 110)
    assert not pair.producer.busy and not pair.producer.holds_sources


def test_source_then_late_order_with_a_locally_cached_prefix(pair: Pair):
    p_blocks, d_blocks, tokens, first = (3, 6, 8, 10, 11), (0, 2), 150, 64  # D already holds its first 64-token block
    pair.source("t2", blocks=p_blocks, num_tokens=tokens)
    pair.expect("t2", first_token=first, num_tokens=tokens - first)
    pair.send("order", "t2", blocks=d_blocks, first_token=first, num_tokens=tokens - first, source=True)
    assert pair.pump(pair.results) == ({"d-req"}, set())
    assert pair.answers() == [("t2", WRITTEN, 0)]
    pair.check_bytes(p_blocks, d_blocks, first, tokens - first)
    assert pair.d_block_is_zero(1)  # nothing outside the destination blocks


def test_a_source_with_too_few_tokens_refuses_the_order_and_writes_nothing(pair: Pair):
    pair.send("order", "t1", blocks=(4, 6), num_tokens=110)
    pair.source("t1", blocks=(1, 2, 3), num_tokens=96)  # a tokenizer drift: P computed fewer tokens than D wants
    [report] = pair.reports
    assert (report.outcome, report.reason) == (REVOKED, transfer_pb2.END_REASON_TOKEN_COUNT_MISMATCH)
    assert "96" in report.error_message and "110" in report.error_message
    assert pair.released() == {"p-req"}  # never written: the source goes back at once
    pair.settle()
    assert pair.d_block_is_zero(4) and pair.d_block_is_zero(6)
    pair.send("revocation", "t1")  # the broker's revocation gets the same answer again
    assert [(r.outcome, r.reason) for r in pair.reports[1:]] == [(REVOKED, transfer_pb2.END_REASON_TOKEN_COUNT_MISMATCH)]


def test_a_source_with_another_prompt_refuses_the_order_and_writes_nothing(pair: Pair):
    """A colliding transfer id (or a template drift): the destination needs the KV of other tokens than this prefill's."""
    mine = list(range(1000, 1110))
    pair.send("order", "t1", blocks=(4, 6), num_tokens=40, prompt=[7] + mine[1:40])
    pair.source("t1", blocks=(1, 2, 3, 5), num_tokens=110, prompt=mine)
    [report] = pair.reports
    assert (report.outcome, report.reason) == (REVOKED, transfer_pb2.END_REASON_PROMPT_MISMATCH)
    assert pair.released() == {"p-req"}
    pair.settle()
    assert pair.d_block_is_zero(4) and pair.d_block_is_zero(6)


def test_a_destination_that_needs_a_prefix_of_this_prompt_is_written(pair: Pair):
    mine = list(range(1000, 1110))
    pair.expect("t1", num_tokens=40)
    pair.send("order", "t1", blocks=(4, 6), num_tokens=40, prompt=mine[:40])
    pair.source("t1", blocks=(1, 2, 3, 5), num_tokens=110, prompt=mine)
    assert pair.pump(pair.results) == ({"d-req"}, set())
    assert pair.answers() == [("t1", WRITTEN, 0)]


def test_the_prompt_digest_covers_exactly_the_tokens_it_names():
    tokens = [1, 2, 3, 70_000, 2**32 - 1]
    packed = packed_prompt(tokens)
    assert len(packed) == 4 * len(tokens) and packed[12:16] == (70_000).to_bytes(4, "little")
    assert prompt_digest(packed, 3) == prompt_digest(packed_prompt(tokens[:3]), 3) != prompt_digest(packed, 4)
    assert len(prompt_digest(packed, 5)) == 16


# ----- stream generations and the stream lease -----


def test_a_replaced_streams_late_message_is_ignored(pair: Pair):
    pair.producer.stream_opened(STREAM + 1)
    pair.send("order", "t1", stream=STREAM)  # sent on the stream that was replaced
    pair.source("t1")
    pair.settle()
    assert pair.reports == [] and pair.d_block_is_zero(5)
    pair.producer.stream_lost(STREAM)  # the old stream's end does not touch the new one
    pair.send("order", "t1", stream=STREAM + 1)
    pair.pump(lambda: pair.reports)
    assert pair.answers() == [("t1", WRITTEN, 0)]


@pytest.mark.parametrize("how", ["stream lost", "stream replaced"])
def test_unposted_orders_are_dropped_when_their_stream_goes(pair: Pair, how: str):
    pair.send("order", "t1")
    if how == "stream lost":
        pair.producer.stream_lost(STREAM)
    else:
        pair.producer.stream_opened(STREAM + 1)
    pair.source("t1")
    pair.settle()
    assert pair.reports == [] and not pair.producer.busy  # the broker resends it on the next stream if still wanted
    assert pair.released() == set()  # the source waits for that order, its closure or its hold deadline
    pair.producer.stream_opened(STREAM + 2)
    pair.send("order", "t1", stream=STREAM + 2)
    pair.pump(lambda: pair.reports)
    assert pair.answers() == [("t1", WRITTEN, 0)]


def test_unposted_orders_are_dropped_once_the_stream_lease_runs_out(pair: Pair):
    pair.send("order", "t1", lease_s=LEASE_S)
    pair.clock.advance(LEASE_S - 0.25)
    assert pair.producer.step() == pair.clock.now() + 0.25  # the lease end is when it must look again
    pair.clock.advance(0.25)
    pair.step()
    pair.source("t1")
    pair.settle()
    assert pair.reports == [] and pair.d_block_is_zero(5)


def test_any_message_renews_the_stream_lease_heartbeats_included(pair: Pair):
    pair.send("order", "t1")
    pair.clock.advance(2.0)
    pair.send("heartbeat", "")
    pair.clock.advance(2.0)  # past the order's own message's lease, within the heartbeat's
    pair.step()
    pair.source("t1")
    pair.pump(lambda: pair.reports)
    assert pair.answers() == [("t1", WRITTEN, 0)]


def test_the_stream_lease_counts_from_send_time_by_this_hosts_wall_clock(pair: Pair):
    # The broker's clock runs 2 s behind (or the message spent 2 s in flight): 0.75 s of the lease is left.
    pair.send("order", "t1", sent_ahead_s=-2.0)
    pair.clock.advance(0.75)
    pair.source("t1")
    pair.settle()
    assert pair.reports == []


# ----- the write budget -----


@pytest.mark.parametrize("sent_ahead_s, still_posts_after_s", [(0.0, 1.9), (1.0, 2.9), (-1.0, 0.9)], ids=["same clock", "broker ahead", "broker behind"])
def test_the_write_budget_runs_from_send_time_by_this_hosts_wall_clock(pair: Pair, sent_ahead_s: float, still_posts_after_s: float):
    pair.send("order", "t1", budget_s=2.0, lease_s=10.0, sent_ahead_s=sent_ahead_s)
    pair.clock.advance(still_posts_after_s)
    pair.step()
    pair.source("t1")
    pair.pump(lambda: pair.reports)
    assert pair.answers() == [("t1", WRITTEN, 0)]


@pytest.mark.parametrize("sent_ahead_s, dropped_after_s", [(0.0, 2.0), (1.0, 3.0), (-1.0, 1.0)], ids=["same clock", "broker ahead", "broker behind"])
def test_an_order_whose_budget_ran_out_is_never_written(pair: Pair, sent_ahead_s: float, dropped_after_s: float):
    pair.send("order", "t1", budget_s=2.0, lease_s=10.0, sent_ahead_s=sent_ahead_s)
    pair.clock.advance(dropped_after_s)
    pair.source("t1")  # the checks run again right before the post
    pair.settle()
    assert pair.d_block_is_zero(5) and not pair.producer.busy
    [report] = pair.reports
    assert report.outcome == REVOKED and "budget" in report.error_message  # refused by the check right before the post
    pair.reports.clear()
    pair.send("revocation", "t1")  # the broker revokes it and hears the truth: nothing was posted
    assert [(t, o) for t, o, _ in pair.answers()] == [("t1", REVOKED)]


@pytest.mark.parametrize("runs_out", ["budget", "stream lease"])
def test_the_checks_run_again_right_before_the_post(runs_out: str):
    slow = Pair(plan_time_s=1.0).start()  # building the plan takes 1 s
    try:
        if runs_out == "budget":
            slow.send("order", "t1", budget_s=1.5, lease_s=10.0)
        else:
            slow.send("order", "t1", budget_s=30.0, lease_s=1.5)
        slow.clock.advance(0.75)
        slow.source("t1")  # passes the checks, then the plan build outlasts what was left
        slow.settle()
        assert not slow.producer.busy and slow.d_block_is_zero(5)
        if runs_out == "budget":
            [report] = slow.reports
            assert report.outcome == REVOKED and "budget" in report.error_message
        else:
            assert slow.reports == []  # void with its stream's lease: the broker resends it if still wanted
    finally:
        slow.close()


def test_a_source_held_past_its_hold_deadline_is_released_without_a_write(pair: Pair):
    pair.source("t4", blocks=(2,), num_tokens=20, hold_s=0.3)
    assert pair.producer.step() == pair.clock.now() + 0.3
    pair.clock.advance(0.3)
    pair.step()
    assert pair.released() == {"p-req"} and pair.reports == []


# ----- at most one WRITE per key, truthful answers -----


def test_at_most_one_write_per_key_and_a_repeated_order_gets_the_recorded_answer(pair: Pair):
    pair.expect("t1")
    pair.source("t1")
    pair.send("order", "t1")  # posted at once
    assert pair.producer.busy
    pair.send("order", "t1")  # a resync's copy while the WRITE is in flight: the job answers
    pair.pump(pair.results)
    pair.settle()
    assert pair.answers() == [("t1", WRITTEN, 0)]
    pair.send("order", "t1")  # a copy after the answer: the same answer, no second WRITE
    assert [(r.outcome, r.bytes_written) for r in pair.reports] == [(WRITTEN, 0)]
    assert not pair.producer.busy
    pair.producer.stream_opened(STREAM + 1)
    pair.send("order", "t1", stream=STREAM + 1)  # and on a new stream too
    assert [r.outcome for r in pair.reports] == [WRITTEN, WRITTEN] and not pair.producer.busy


def test_a_revocation_before_any_post_is_answered_revoked_and_the_source_goes_back(pair: Pair):
    pair.send("order", "t3", blocks=(4,), num_tokens=20)
    pair.send("revocation", "t3")
    assert pair.answers() == [("t3", REVOKED, 0)]
    pair.source("t3", blocks=(1,), num_tokens=20)
    assert pair.released() == {"p-req"}  # this rank answered for the key: it will never write it
    pair.send("order", "t3", blocks=(4,), num_tokens=20)  # a stale copy of the revoked order
    assert pair.answers() == [("t3", REVOKED, 0)]
    pair.settle()
    assert pair.d_block_is_zero(4) and not pair.producer.busy
    pair.send("revocation", "t9")  # a revocation of an order never seen: nothing was posted
    assert pair.answers() == [("t9", REVOKED, 0)]


def test_a_closure_releases_a_source_no_order_came_for(pair: Pair):
    pair.source("t5", blocks=(1,), num_tokens=20)
    pair.settle()
    assert pair.released() == set()  # held for an order
    pair.send("closed", "t5")
    assert pair.released() == {"p-req"} and pair.reports == []


def test_a_revocation_of_a_posted_write_is_answered_by_the_write(pair: Pair):
    pair.expect("t1")
    pair.source("t1")
    pair.send("order", "t1")
    pair.send("revocation", "t1")  # too late: the WRITE is in flight
    assert pair.reports == []
    pair.pump(pair.results)
    pair.settle()
    assert pair.answers() == [("t1", WRITTEN, 0)]
    pair.send("revocation", "t1")  # again after completion: the same truth
    assert pair.answers() == [("t1", WRITTEN, 0)]


def test_a_closure_before_the_order_refuses_the_late_order(pair: Pair):
    pair.send("closed", "t1")
    pair.send("order", "t1")
    assert pair.answers() == [("t1", REVOKED, 0)]
    pair.source("t1")
    assert pair.released() == {"p-req"}  # the attempt ended: its source goes back at once


def test_a_second_source_with_a_key_another_request_holds_is_released_at_once(pair: Pair):
    pair.source("t1", req_id="p-first")
    pair.source("t1", req_id="p-second")
    assert pair.released() == {"p-second"}
    pair.expect("t1")
    pair.send("order", "t1")
    pair.pump(pair.results)
    pair.settle()
    assert pair.released() == {"p-first"} and pair.answers() == [("t1", WRITTEN, 0)]
    pair.check_bytes((7, 2, 9, 4), (5, 1), 0, 110)


# ----- writes that never complete (StalledWriteAgent) -----


def test_a_write_still_in_flight_at_its_write_timeout_is_aborted_and_reported_failed(stalled: Pair):
    stalled.send("order", "t1", write_timeout_s=WRITE_TIMEOUT_S)
    stalled.source("t1")
    assert stalled.producer.busy and stalled.reports == []
    posted = stalled.clock.now()
    assert stalled.producer.step() == posted + WRITE_TIMEOUT_S
    stalled.clock.advance(WRITE_TIMEOUT_S - 0.01)
    stalled.step()
    assert stalled.producer.busy and stalled.reports == []
    stalled.clock.advance(0.01)
    stalled.p_agent.calls.clear()
    stalled.producer.step()
    # Released before any call that makes progress: an aborted WRITE can no longer land.
    assert stalled.p_agent.calls[0] == "release"
    [report] = stalled.reports
    assert report.outcome == FAILED and "aborted" in report.error_message
    assert stalled.released() == {"p-req"} and not stalled.producer.busy


def test_a_removed_decode_engines_agent_is_unloaded_only_once_no_write_to_it_is_in_flight(stalled: Pair):
    stalled.send("order", "t1")
    stalled.source("t1")
    assert stalled.producer.busy
    removed = reg_pb.WatchEnginesResponse(type=reg_pb.ENGINE_EVENT_TYPE_REMOVED, engine=stalled.engine)
    stalled.producer.engine_event(removed)
    stalled.clock.advance(1.0)
    stalled.producer.step()
    assert not [c for c in stalled.p_agent.calls if c.startswith("remove_peer")]  # a WRITE to it is in flight
    stalled.clock.advance(WRITE_TIMEOUT_S)
    stalled.producer.step()
    assert [c for c in stalled.p_agent.calls if c.startswith("remove_peer")] == ["remove_peer test-d"]
    assert stalled.p_agent.calls.index("release") < stalled.p_agent.calls.index("remove_peer test-d")
    assert [r.outcome for r in stalled.reports] == [FAILED]


def test_an_idle_removed_engines_agent_is_unloaded_at_the_next_step(stalled: Pair):
    stalled.producer.engine_event(reg_pb.WatchEnginesResponse(type=reg_pb.ENGINE_EVENT_TYPE_REMOVED, engine=stalled.engine))
    stalled.producer.step()
    assert "remove_peer test-d" in stalled.p_agent.calls
    # An order for it now waits for the engine to come back (the broker fails it meanwhile).
    stalled.send("order", "t1")
    stalled.source("t1")
    assert not stalled.producer.busy and stalled.reports == []


# ----- layer-progressive push -----


@pytest.mark.parametrize("block_sizes", [(P_BLOCK, D_BLOCK), (P_BLOCK, P_BLOCK)], ids=["segments", "prepared-pages"])
def test_layers_leave_as_they_are_computed_and_the_request_is_received_only_after_the_last_part(block_sizes):
    pair = Pair(p_block=block_sizes[0], d_block=block_sizes[1]).start()
    try:
        blocks = (5, 1) if block_sizes[1] == D_BLOCK else (5, 1, 8, 3)
        pair.expect("t1", num_tokens=110)
        pair.send("order", "t1", blocks=blocks, num_tokens=110)  # early: D registered while P computes
        pair.source("t1", blocks=(7, 2, 9, 4), num_tokens=110, computing=True)
        pair.producer.layer_done((("t1", 1),), 0)
        assert pair.producer.busy  # layer 0 is on its way; the last layer waits for the source
        pair.settle()
        assert pair.received() == (set(), set())  # a part landed, but its notification names no count
        layer0 = [cells(pair.d_layout, list(blocks), pair.d_block, 0, range(110))]
        assert np.any(layer0[0] != 0) and not pair.reports
        pair.source("t1", blocks=(7, 2, 9, 4), num_tokens=110)
        assert pair.pump(pair.results) == ({"d-req"}, set())
        pair.settle()
        [report] = pair.reports
        assert (report.outcome, report.reason) == (WRITTEN, 0)
        assert report.bytes_written >= 110 * TOKEN_BYTES  # whole pages when prepared, exact rows otherwise
        pair.check_bytes((7, 2, 9, 4), blocks, 0, 110)
        assert pair.released() == {"p-req"} and not pair.producer.busy
    finally:
        pair.close()


def test_prepared_pages_are_used_when_both_sides_lay_blocks_out_alike():
    pair = Pair(p_block=P_BLOCK, d_block=P_BLOCK).start()
    try:
        peer = pair.producer._peers["decode-t"]
        assert peer.ranks[0].prepared is not None
        order = order_body("t1", blocks=(5, 1, 8, 3), num_tokens=110)
        ready = SourceReady("r", "t1", 1, "r", "decode-t", ((7, 2, 9, 4),), 110, 30.0, "", 0, 0)
        [plan] = build_write_plans(pair.producer.local, ready, order, peer)
        assert plan.plan is None and len(plan.pages) == LAYERS * 4  # a page per (layer, block): NIXL merges neighbours
        [layer1] = build_write_plans(pair.producer.local, ready, order, peer, frozenset({1}))
        assert len(layer1.pages) == 4
    finally:
        pair.close()
    mixed = Pair().start()  # P and D blocks of different sizes: byte segments, built per request
    try:
        [plan] = build_write_plans(mixed.producer.local, ready, order_body("t1", blocks=(5, 1)), mixed.producer._peers["decode-t"])
        assert plan.pages is None and len(plan.plan) > 0
    finally:
        mixed.close()


def test_a_revocation_between_parts_stops_the_parts_and_is_answered_failed(pair: Pair):
    pair.expect("t1")
    pair.send("order", "t1")
    pair.source("t1", computing=True)
    pair.producer.layer_done((("t1", 1),), 0)
    pair.send("revocation", "t1")  # a part is posted: REVOKED would be a lie
    pair.source("t1")  # the forward ends: no last part
    pair.pump(lambda: pair.reports)
    assert pair.answers() == [("t1", FAILED, 0)]
    assert pair.released() == {"p-req"}
    pair.settle()
    assert pair.received() == (set(), set())  # never complete: D's deadline fails it, after the broker's word
    pair.send("revocation", "t1")
    assert pair.answers() == [("t1", FAILED, 0)]


def test_a_lost_stream_between_parts_posts_nothing_more(pair: Pair):
    pair.expect("t1")
    pair.send("order", "t1")
    pair.source("t1", computing=True)
    pair.producer.layer_done((("t1", 1),), 0)
    pair.producer.stream_lost(STREAM)
    pair.source("t1")
    pair.pump(lambda: pair.reports)
    assert [(r.outcome, "stream" in r.error_message) for r in pair.reports] == [(FAILED, True)]
    assert pair.released() == {"p-req"}


def test_a_computing_source_for_another_prompt_refuses_the_order_before_any_part(pair: Pair):
    pair.send("order", "t1", prompt=[1, 2, 3] * 40)
    pair.source("t1", prompt=[9, 2, 3] * 40, computing=True)
    pair.producer.layer_done((("t1", 1),), 0)
    assert pair.answers() == [("t1", REVOKED, transfer_pb2.END_REASON_PROMPT_MISMATCH)]
    assert not pair.producer.busy
    pair.source("t1", prompt=[9, 2, 3] * 40)
    assert pair.released() == {"p-req"}
    pair.settle()
    assert pair.d_block_is_zero(5) and pair.d_block_is_zero(1)


def test_an_order_after_the_source_is_one_write_as_without_progression(pair: Pair):
    pair.expect("t1")
    pair.source("t1", computing=True)
    pair.producer.layer_done((("t1", 1),), 0)  # no order yet: nothing to post
    assert not pair.producer.busy
    pair.source("t1")
    pair.send("order", "t1")
    assert pair.pump(pair.results) == ({"d-req"}, set())
    pair.check_bytes((7, 2, 9, 4), (5, 1), 0, 110)


def test_the_consumer_counts_every_part_whatever_order_their_notifications_come_in(pair: Pair):
    pair.expect("t1", num_tokens=110)
    last = notification("t1", 1, 0, 1, 0, 110, 3, 3)
    pair.consumer._on_notification("p", last)  # the last part's notification overtakes the others
    pair.consumer._on_notification("p", notification("t1", 1, 0, 1, 0, 110, 1, 0))
    assert pair.received() == (set(), set())
    pair.consumer._on_notification("p", notification("t1", 1, 0, 1, 0, 110, 2, 0))
    assert pair.received() == ({"d-req"}, set())


# ----- the consumer -----


def test_a_notification_for_other_tokens_than_the_request_registered_is_ignored(pair: Pair):
    pair.expect("t1", num_tokens=110)
    pair.send("order", "t1", num_tokens=100)  # the producer was told other tokens than this request waits for
    pair.source("t1")
    pair.pump(lambda: pair.reports)
    pair.settle()
    assert pair.received() == (set(), set())
    assert pair.consumer.busy  # it waits on: the scheduler's deadline fails it
    pair.consumer.fail("d-req", "deadline")
    assert pair.received() == ({"d-req"}, {"d-req"})
    assert not pair.consumer.busy


def test_a_notification_that_overtakes_the_schedulers_expectation_is_counted_when_it_comes(pair: Pair):
    pair.send("order", "t1")
    pair.source("t1")
    pair.pump(lambda: pair.reports)
    pair.settle()
    pair.expect("t1")
    assert pair.received() == ({"d-req"}, set())


def test_unclaimed_notifications_are_forgotten_after_their_ttl(pair: Pair):
    pair.send("order", "t1")
    pair.source("t1")
    pair.pump(lambda: pair.reports)
    pair.settle()
    pair.clock.advance(EARLY_NOTIFICATION_TTL_S + 1)
    pair.step()
    pair.expect("t1")
    assert pair.received() == (set(), set())


def test_fail_always_reports_once(pair: Pair):
    pair.expect("t5", req_id="d-req5")
    pair.consumer.fail("d-req5", "broker ended it")
    pair.consumer.fail("d-req5", "again")
    pair.consumer.fail("unknown-req", "never expected")  # reported too: the scheduler decides
    finished, failed = pair.received()
    assert finished == failed == {"d-req5", "unknown-req"}
    assert not pair.consumer.busy
    pair.consumer.fail("unknown-req", "again")
    assert pair.received() == (set(), set())


def test_fail_after_success_is_a_no_op(pair: Pair):
    pair.expect("t1")
    pair.send("order", "t1")
    pair.source("t1")
    assert pair.pump(pair.results) == ({"d-req"}, set())
    pair.consumer.fail("d-req", "the scheduler's deadline raced the success")
    assert pair.received() == (set(), set())


def test_notification_format_round_trips():
    message = notification("xfer-1", 3, 1, 2, 64, 86)
    assert message == b"kvpush1|xfer-1|3|1|2|64|86|1|1"
    assert parse_notification(message) == Notification(("xfer-1", 3), 1, 2, 64, 86, 1, 1)
    # A part of a layer-progressive transfer: not the last (0), and the last, which names the count.
    assert parse_notification(notification("xfer-1", 3, 1, 2, 64, 86, 2, 0)) == Notification(("xfer-1", 3), 1, 2, 64, 86, 2, 0)
    assert parse_notification(notification("xfer-1", 3, 1, 2, 64, 86, 3, 3)).parts == 3
    assert parse_notification(b"kvpush1|xfer-1|3|1|2|64|86") == Notification(("xfer-1", 3), 1, 2, 64, 86, 1, 1)  # before parts
    assert parse_notification(b"garbage") is None
    assert parse_notification(b"other|a|1|2|3|0|1") is None  # another prefix
    assert parse_notification(b"kvpush1|a|1|2|3") is None  # the old five-field format
    assert parse_notification(b"kvpush1|a|x|2|3|0|1") is None
    assert parse_notification(HELLO) is None


# ----- the transfer threads -----


@pytest.fixture
def threads():
    pair = Pair(clock=SystemClock())
    producer = Producer(pair.producer, POLL, IDLE)
    consumer = Consumer(pair.consumer, POLL, IDLE)
    producer.on_engine_event(reg_pb.WatchEnginesResponse(type=reg_pb.ENGINE_EVENT_TYPE_UPSERTED, engine=pair.engine))
    yield pair, producer, consumer
    producer.stop()
    consumer.stop()
    pair.close()


def wait(predicate, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.005)
    raise AssertionError("timed out")


def test_the_threads_move_the_kv_and_hand_results_back(threads):
    pair, producer, consumer = threads
    deliver = producer.open_stream()
    consumer.expect(DestinationReady("d-req", "t1", 1, 0, 110, time.time_ns(), ""))
    assert consumer.has_work()
    deliver(pair.message("order", "t1"))
    producer.source_ready(SourceReady("p-req", "t1", 1, "p-req", "decode-t", ((7, 2, 9, 4),), 110, 30.0, "", 0, 0))
    assert wait(lambda: consumer.take_results() if consumer.ready.wait(0.05) else None) == ({"d-req"}, set())
    assert not consumer.has_work()
    assert wait(lambda: producer.take_finished() if producer.ready.wait(0.05) else None) == {"p-req"}
    assert [r.outcome for r in wait(lambda: list(pair.reports))] == [WRITTEN]
    pair.check_bytes((7, 2, 9, 4), (5, 1), 0, 110)
    assert not producer.has_work()


def test_the_producer_thread_ignores_a_lost_streams_orders_and_acts_on_the_next(threads):
    pair, producer, consumer = threads
    deliver = producer.open_stream()
    deliver(pair.message("order", "t1"))
    producer.stream_lost()
    producer.source_ready(SourceReady("p-req", "t1", 1, "p-req", "decode-t", ((7, 2, 9, 4),), 110, 30.0, "", 0, 0))
    late = deliver  # a message the lost stream still delivers
    late(pair.message("order", "t1"))
    time.sleep(0.2)
    assert pair.reports == [] and producer.has_work()
    producer.open_stream()(pair.message("order", "t1"))
    assert [r.outcome for r in wait(lambda: list(pair.reports))] == [WRITTEN]


def test_the_consumer_thread_reports_a_failure_once(threads):
    pair, producer, consumer = threads
    consumer.expect(DestinationReady("d-req", "t5", 1, 0, 20, time.time_ns(), ""))
    consumer.fail("d-req", "broker ended it")
    consumer.fail("d-req", "again")
    assert wait(lambda: consumer.take_results() if consumer.ready.wait(0.05) else None) == ({"d-req"}, {"d-req"})
    time.sleep(0.1)
    assert consumer.take_results() == (set(), set())
    assert not consumer.has_work()
