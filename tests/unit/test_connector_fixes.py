# SPDX-License-Identifier: Apache-2.0
"""Connector defects of the fencing issue that live outside the protocol: device ids, wake-ups."""

from __future__ import annotations

import threading

import numpy as np

from kvpush.clock import ManualClock, duration, timestamp
from kvpush.connector.consumer import Consumer, ConsumerCore
from kvpush.connector.handoff import SourceReady
from kvpush.connector.nixl_agent import NixlWrite
from kvpush.connector.producer import ProducerCore
from kvpush.connector.producer_thread import Producer
from kvpush.connector.write_plans import LocalLayout, WritePlan
from kvpush.dev.sim.deployment import NoSpans
from kvpush.engine.v1 import engine_pb2
from kvpush.layout.plan import Plan
from kvpush.registrar.v1 import registrar_service_pb2 as reg_pb
from kvpush.rendezvous.v1 import rendezvous_service_pb2 as rv_pb
from kvpush.rendezvous.v1 import transfer_pb2 as tr_pb


class RecordingTransport:
    """Records the WRITEs made and posted; each completes at once (no NIXL here: the calls' arguments are under test)."""

    def __init__(self):
        self.posts: list[dict] = []

    def add_peer(self, metadata: bytes) -> str:
        return metadata.decode()

    def remove_peer(self, name: str) -> None:
        pass

    def warm_up(self, peer: str) -> None:
        pass

    def send_notif(self, peer: str, message: bytes) -> None:
        pass

    def make_write(self, peer, src, dst, lengths, src_device, dst_device, notif):
        return NixlWrite({"peer": peer, "src_device": src_device, "dst_device": dst_device}, peer, 1, 1)

    def start(self, write) -> None:
        self.posts.append(write.handle)

    def poll(self, write) -> str:
        return "DONE"

    def release(self, write) -> None:
        pass

    def notifications(self) -> dict:
        return {}


def _decode_engine(device_id: int) -> reg_pb.WatchEnginesResponse:
    layout = engine_pb2.KvLayout(total_kv_heads=1, num_local_heads=1, regions=[engine_pb2.KvRegion(device_id=device_id)])
    rank = reg_pb.RegisteredRank(rank=engine_pb2.EngineRank(engine_id="decode-0", tp_rank=0), nixl=engine_pb2.NixlAgent(agent_metadata=b"d0"), layout=layout)
    return reg_pb.WatchEnginesResponse(type=reg_pb.ENGINE_EVENT_TYPE_UPSERTED, engine=reg_pb.Engine(engine_id="decode-0", incarnation="d1", ranks=[rank]))


def producer_with_early_order(transport, d_device: int, **kwargs) -> ProducerCore:
    """A producer core that knows decode-0 (its KV on d_device) and holds an early order for transfer t, attempt 1."""
    clock = ManualClock()
    empty = Plan(*(np.zeros(0, dtype=np.int64),) * 3, 0)
    core = ProducerCore(transport, LocalLayout(engine_pb2.KvLayout(total_kv_heads=1), 0, 1, device=0), "prefill-0", lambda r: None,
                        NoSpans(), clock, plan_writes=lambda source, order, peer: [WritePlan(0, empty, 1)], **kwargs)
    core.engine_event(_decode_engine(device_id=d_device))
    core.stream_opened(1)
    order = tr_pb.WriteOrder(key=tr_pb.TransferKey(transfer_id="t", attempt=1), decode_tp_ranks=[0], write_budget=duration(10), write_timeout=duration(1))
    order.destination.engine_id, order.destination.incarnation, order.destination.num_tokens = "decode-0", "d1", 4
    core.stream_message(1, rv_pb.StreamWriteOrdersResponse(order=order, send_time=timestamp(clock.wall()), stream_lease=duration(3)))
    return core


def test_destination_descriptors_use_the_decode_ranks_device_not_ours():
    """Defect 11: P built D's descriptors with its own device id, so P on GPU 0 and D on GPU 1 failed."""
    transport = RecordingTransport()
    core = producer_with_early_order(transport, d_device=1)
    core.source_ready(SourceReady("r", "t", 1, "r", "decode-0", ((0,),), 4, 10.0, "", 0, 0))
    assert transport.posts == [{"peer": "d0", "src_device": 0, "dst_device": 1}]


def test_prefill_done_goes_with_the_early_orders_write_result():
    """Nothing control-plane-bound sits between the end of prefill and the WRITE post, and an early order's
    prefill-done leaves with its WRITE's result (one stream message), just before it; without an order it leaves at once."""
    transport = RecordingTransport()
    events: list[str] = []
    transport.start = lambda write: events.append("post")
    states = iter(["PROC", "DONE"])
    transport.poll = lambda write: next(states)
    core = producer_with_early_order(transport, d_device=0, prefill_done=lambda ready: events.append(f"prefill-done {ready.transfer_id}"))
    core.report = lambda result: events.append(f"result {result.key.transfer_id} {tr_pb.WriteOutcome.Name(result.outcome)}")
    core.source_ready(SourceReady("r", "t", 1, "r", "decode-0", ((0,),), 4, 10.0, "", 0, 0))
    core.source_ready(SourceReady("r2", "u", 1, "r2", "decode-0", ((1,),), 4, 10.0, "", 0, 0))  # no order yet: the broker matches it
    assert events == ["post", "prefill-done u"]
    core.step()  # the WRITE is still in flight
    assert events == ["post", "prefill-done u"]
    core.step()
    assert events == ["post", "prefill-done u", "prefill-done t", "result t WRITE_OUTCOME_WRITTEN"]


def test_prefill_done_goes_with_a_failed_write_result_too():
    transport = RecordingTransport()
    events: list[str] = []
    transport.poll = lambda write: "ERR"
    core = producer_with_early_order(transport, d_device=0, prefill_done=lambda ready: events.append(f"prefill-done {ready.transfer_id}"))
    core.report = lambda result: events.append(f"result {tr_pb.WriteOutcome.Name(result.outcome)}")
    core.source_ready(SourceReady("r", "t", 1, "r", "decode-0", ((0,),), 4, 10.0, "", 0, 0))
    core.step()
    assert events == ["prefill-done t", "result WRITE_OUTCOME_FAILED"]
    assert core._prefill_done_with_result == {}


def test_a_release_racing_with_take_finished_is_not_lost():
    """A source released between taking the released set and clearing `ready` left the engine asleep on it."""
    core = ProducerCore(RecordingTransport(), LocalLayout(engine_pb2.KvLayout(total_kv_heads=1), 0, 1, 0), "prefill-0", lambda r: None,
                        NoSpans(), ManualClock())
    producer = Producer.__new__(Producer)  # the wrapper's own logic, without starting its thread
    producer.core, producer.ready = core, threading.Event()
    core.on_release = producer.ready.set
    taken = core.take_released

    def take_while_another_release_lands():
        result = taken()
        core._release(core_source("late"))  # the transfer thread releases another source right now
        return result

    core.take_released = take_while_another_release_lands
    producer.take_finished()
    assert producer.ready.is_set()  # the engine thread will look again


def test_a_result_racing_with_take_results_is_not_lost():
    core = ConsumerCore(RecordingTransport(), NoSpans(), ManualClock())
    consumer = Consumer.__new__(Consumer)
    consumer.core, consumer.ready, consumer._pending, consumer._count_lock = core, threading.Event(), 0, threading.Lock()
    core.on_result = consumer.ready.set
    taken = core.take_results

    def take_while_a_result_lands():
        result = taken()
        core.fail("late", "deadline")
        return result

    core.take_results = take_while_a_result_lands
    consumer.take_results()
    assert consumer.ready.is_set()


def core_source(req_id: str):
    from kvpush.connector.producer_records import Source

    return Source(SourceReady(req_id, "t", 1, req_id, "d", ((0,),), 4, 1.0, "", 0, 0), 0.0, 0)


class PagesTransport(RecordingTransport):
    """Records which device each prepared page table names (no NIXL: the arguments are under test)."""

    def __init__(self):
        super().__init__()
        self.prepared: dict[str | None, set[int]] = {}

    def prepare_pages(self, peer, rows):
        self.prepared[peer] = {int(d) for d in rows[:, 2]}
        return peer or "local"


def test_prepared_page_tables_name_each_sides_own_device():
    """Defect 11 for prepared lists: P on device 0 prepares D's pages with D's device (1), its own with 0."""
    import torch

    from kvpush.connector.kv_layout import GroupSpec, LayerTensor, build_layout

    def layout(device_id: int) -> engine_pb2.KvLayout:
        layers = [LayerTensor(i, f"model.layers.{i}.self_attn.attn", 0, torch.zeros(4, 1, 16, 16)) for i in range(2)]
        built, _, _ = build_layout("FLASH_ATTN", layers, [GroupSpec(16, 4)], dtype="torch.float32", head_size=8, total_kv_heads=1,
                                   num_local_heads=1)
        for region in built.regions:
            region.device_id = device_id
        return built

    transport = PagesTransport()
    core = ProducerCore(transport, LocalLayout(layout(0), 0, 1, device=0), "prefill-0", lambda r: None, NoSpans(), ManualClock())
    event = _decode_engine(device_id=1)
    event.engine.ranks[0].layout.CopyFrom(layout(1))
    core.engine_event(event)
    assert transport.prepared == {None: {0}, "d0": {1}}
