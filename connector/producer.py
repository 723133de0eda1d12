# SPDX-License-Identifier: Apache-2.0
"""The prefill worker's transfer thread.

It owns the worker's NIXL agent. The engine thread hands it finished
prefills (sources); the control loop hands it write orders, revocations,
closures and decode engines seen by the registrar. When a source and an order
for the same (transfer_id, attempt) meet, the thread builds the merged
segment plan, posts one NIXL WRITE per destination rank (each with its
completion notification), polls them to completion and reports the result.
The engine loop never waits on any of this.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from kvpush.connector.metadata import SourceReady
from kvpush.connector.nixl_agent import KvAgent, PostedWrite
from kvpush.connector.spans import Spans
from kvpush.engine.v1 import engine_pb2
from kvpush.layout import heads
from kvpush.layout.geometry import dtype_bytes, planes_from_layout
from kvpush.layout.plan import Plan, Side, build_plan
from kvpush.registrar.v1 import registrar_service_pb2 as reg_pb
from kvpush.rendezvous.v1 import rendezvous_service_pb2 as rv_pb
from kvpush.rendezvous.v1 import transfer_pb2

logger = logging.getLogger(__name__)

NOTIF_PREFIX = "kvpush1"
# A WRITE must be posted this long before the order's budget runs out, so it
# completes before the decode side may give its blocks away.
WRITE_SAFETY_S = 0.5
OUTCOME_MEMORY = 10_000

Key = tuple[str, int]


def notification(transfer_id: str, attempt: int, producer_rank: int, expected: int) -> bytes:
    """The completion notification a WRITE carries (transfer ids never contain '|')."""
    return f"{NOTIF_PREFIX}|{transfer_id}|{attempt}|{producer_rank}|{expected}".encode()


@dataclass(frozen=True)
class LocalLayout:
    """This worker's KV cache as the plan builder needs it."""

    layout: engine_pb2.KvLayout
    tp_rank: int
    tp_size: int
    device: int

    def side(self, group: int, block_ids, first_token: int) -> Side:
        return _side(self.layout, group, block_ids, first_token)


def _side(layout: engine_pb2.KvLayout, group: int, block_ids, first_token: int) -> Side:
    block_size = next(g.block_size for g in layout.groups if g.group_index == group)
    return Side(planes_from_layout(layout, group), dtype_bytes(layout), layout.head_size, block_size, layout.first_head,
                np.asarray(block_ids, dtype=np.int64), first_token, layout.num_local_heads)


@dataclass
class PeerRank:
    agent: str
    layout: engine_pb2.KvLayout


@dataclass
class Peer:
    incarnation: str
    ranks: dict[int, PeerRank]


@dataclass
class Source:
    ready: SourceReady
    hold_until: float
    ready_ns: int
    ready_event: object = None  # CUDA event to wait on before reading the blocks


@dataclass
class Order:
    order: transfer_pb2.WriteOrder
    write_by: float
    received_ns: int
    sent_ns: int


@dataclass
class Job:
    key: Key
    source: Source
    order: Order
    writes: list[PostedWrite] = field(default_factory=list)
    post_ns: int = 0
    prep_ns: int = 0
    failed: str = ""


class Producer:
    """Matches sources with orders and writes them; one per prefill worker."""

    def __init__(
        self,
        agent: KvAgent,
        local: LocalLayout,
        engine_id: str,
        report: Callable[[rv_pb.ReportWriteResultRequest], None],
        spans: Spans,
        poll_interval_s: float,
        idle_poll_s: float,
    ):
        self.agent = agent
        self.local = local
        self.engine_id = engine_id
        self.report = report
        self.spans = spans
        self.poll_interval_s = poll_interval_s
        self.idle_poll_s = idle_poll_s
        self.ready = threading.Event()  # set when a source was released
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._finished: set[str] = set()
        self._written: dict[str, tuple[int, SourceReady]] = {}  # released after a WRITE: its completion time
        self._finished_lock = threading.Lock()
        self._sources: dict[Key, Source] = {}
        self._orders: dict[Key, Order] = {}
        self._jobs: dict[Key, Job] = {}
        self._closed: set[Key] = set()
        self._outcomes: OrderedDict[Key, int] = OrderedDict()  # answered keys, to answer revocations truthfully
        self._peers: dict[str, Peer] = {}
        self._producers = heads.even_split(local.layout.total_kv_heads, local.tp_size)
        self._stop = False
        self._thread = threading.Thread(target=self._run, name=f"kvpush-producer-{local.tp_rank}", daemon=True)
        self._thread.start()

    # ---- handed over from other threads -------------------------------------------

    def source_ready(self, ready: SourceReady, ready_event=None) -> None:
        """ready_event: a CUDA event recorded after the forward that computed the KV (None on CPU)."""
        self._inbox.put(("source", ready, time.time_ns(), ready_event))

    def on_order_stream(self, message: rv_pb.StreamWriteOrdersResponse) -> None:
        kind = message.WhichOneof("message")
        self._inbox.put((kind, getattr(message, kind), message.send_time.ToNanoseconds(), time.time_ns()))

    def on_engine_event(self, event: reg_pb.WatchEnginesResponse) -> None:
        self._inbox.put(("engine", event))

    def take_finished(self) -> set[str]:
        """Released sources; the `p.completion` span runs from the WRITE's completion to this hand-back."""
        with self._finished_lock:
            done, self._finished = self._finished, set()
            written, self._written = self._written, {}
        self.ready.clear()
        now_ns = time.time_ns()
        for written_ns, ready in written.values():
            self.spans.emit("p.completion", written_ns, now_ns, ready)
        return done

    def has_work(self) -> bool:
        return bool(self._sources)

    def stop(self) -> None:
        self._stop = True
        self._inbox.put(("stop",))
        self._thread.join(timeout=5)

    # ---- the thread ---------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop:
            try:
                self._step()
            except Exception:  # never let one bad message kill the transfer thread
                logger.exception("kvpush producer: unexpected error")

    def _step(self) -> None:
        timeout = self.poll_interval_s if self._jobs else self._idle_timeout()
        try:
            item = self._inbox.get(timeout=timeout)
        except queue.Empty:
            item = None
        while item is not None:
            self._handle(item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                item = None
        self._poll_jobs()
        self._expire()
        if not self._jobs:
            self.agent.notifications()  # progress connection setup with decode agents

    def _idle_timeout(self) -> float:
        now = time.monotonic()
        deadlines = [s.hold_until for s in self._sources.values()] + [o.write_by for o in self._orders.values()]
        if not deadlines:
            return self.idle_poll_s
        return max(0.0, min(self.idle_poll_s, min(deadlines) - now))

    def _handle(self, item: tuple) -> None:
        kind = item[0]
        if kind == "source":
            ready: SourceReady = item[1]
            key = (ready.transfer_id, ready.attempt)
            source = Source(ready, time.monotonic() + ready.hold_s, item[2], item[3])
            if key in self._closed:
                self._release(source)
                return
            self._sources[key] = source
            self._try_start(key)
        elif kind == "order":
            order: transfer_pb2.WriteOrder = item[1]
            key = (order.key.transfer_id, order.key.attempt)
            if key in self._closed or key in self._jobs or key in self._outcomes:
                return  # at most one write per (transfer, attempt) on this rank
            budget = order.write_budget.ToTimedelta().total_seconds()
            self._orders[key] = Order(order, time.monotonic() + budget - WRITE_SAFETY_S, item[3], item[2])
            self._try_start(key)
        elif kind == "revocation":
            key = (item[1].key.transfer_id, item[1].key.attempt)
            self._orders.pop(key, None)
            if key not in self._jobs:  # a job in flight answers when it completes
                self._answer(key, self._outcomes.get(key, transfer_pb2.WRITE_OUTCOME_REVOKED), Job(key, None, None))  # type: ignore[arg-type]
        elif kind == "closed":
            key = (item[1].key.transfer_id, item[1].key.attempt)
            self._orders.pop(key, None)
            self._closed.add(key)
            if len(self._closed) > OUTCOME_MEMORY:
                self._closed.pop()
            source = self._sources.get(key)
            if source is not None and key not in self._jobs:
                del self._sources[key]
                self._release(source)
        elif kind == "engine":
            self._on_engine(item[1])

    def _on_engine(self, event: reg_pb.WatchEnginesResponse) -> None:
        engine = event.engine
        if event.type == reg_pb.ENGINE_EVENT_TYPE_REMOVED:
            peer = self._peers.pop(engine.engine_id, None)
            if peer is not None:
                for rank in peer.ranks.values():
                    self.agent.remove_peer(rank.agent)
            return
        peer = self._peers.get(engine.engine_id)
        if peer is not None and peer.incarnation != engine.incarnation:
            for rank in peer.ranks.values():
                self.agent.remove_peer(rank.agent)
            peer = None
        if peer is None:
            peer = self._peers[engine.engine_id] = Peer(engine.incarnation, {})
        for registered in engine.ranks:
            tp = registered.rank.tp_rank
            if tp in peer.ranks:
                continue
            name = self.agent.add_peer(registered.nixl.agent_metadata)
            self.agent.warm_up(name)
            peer.ranks[tp] = PeerRank(name, registered.layout)
        for key in list(self._orders):
            self._try_start(key)

    def _try_start(self, key: Key) -> None:
        source, order = self._sources.get(key), self._orders.get(key)
        if source is None or order is None:
            return
        destination = order.order.destination
        peer = self._peers.get(destination.engine_id)
        if peer is None or peer.incarnation != destination.incarnation or any(r not in peer.ranks for r in order.order.decode_tp_ranks):
            return  # the registrar's view of the decode engine hasn't arrived yet
        del self._orders[key]
        job = Job(key, source, order)
        if time.monotonic() > order.write_by:
            logger.warning("kvpush producer: order %s arrived too late to write; dropping", key)
            self._answer(key, transfer_pb2.WRITE_OUTCOME_REVOKED, job)
        else:
            self._jobs[key] = job
            try:
                self._post(job, peer)
            except Exception as exc:  # a WRITE that cannot be posted fails the attempt, loudly
                logger.exception("kvpush producer: WRITE for %s could not be posted", key)
                job.failed = str(exc)
        # Emitted after the post, off the hand-off's critical path. A P-side segment belongs
        # under P's request; the broker's context (D's registration for an early order) is a link.
        self.spans.emit("p.order_delivery", order.sent_ns, order.received_ns, source.ready,
                        links=(order.order.trace_context.get("traceparent", ""),), early=not order.order.HasField("source"))

    def _post(self, job: Job, peer: Peer) -> None:
        ready, order = job.source.ready, job.order.order
        destination = order.destination
        t0 = time.time_ns()
        if job.source.ready_event is not None:
            job.source.ready_event.synchronize()  # the forward that wrote these blocks has finished
        consumers = [heads.RankHeads(tp, r.layout.first_head, r.layout.num_local_heads) for tp, r in sorted(peer.ranks.items())]
        routes = heads.routes(self._producers, consumers)
        first_token = destination.first_token
        token_range = (first_token, min(first_token + destination.num_tokens, ready.num_tokens))
        dst_blocks = {b.group_index: b.block_ids for b in destination.blocks}
        plans: list[tuple[int, Plan, int]] = []
        for d_rank in order.decode_tp_ranks:
            mine = [r for r in routes if r.producer == self.local.tp_rank and r.consumer == d_rank]
            expected = heads.expected_notifications(d_rank, routes)
            layout = peer.ranks[d_rank].layout
            parts = []
            for group, src_ids in enumerate(ready.blocks):
                src = self.local.side(group, src_ids, 0)
                dst = _side(layout, group, dst_blocks[group], first_token)
                parts += [build_plan(src, dst, token_range, (r.first_head, r.stop)) for r in mine]
            plans.append((d_rank, _concat(parts), expected))
        job.prep_ns = time.time_ns()
        self.spans.emit("p.descriptor_prep", t0, job.prep_ns, ready, descriptors=sum(len(p) for _, p, _ in plans))
        for d_rank, plan, expected in plans:
            notif = notification(ready.transfer_id, ready.attempt, self.local.tp_rank, expected)
            job.writes.append(self.agent.post_write(peer.ranks[d_rank].agent, plan.src, plan.dst, plan.lengths, self.local.device, notif))
        job.post_ns = time.time_ns()
        self.spans.emit("p.write_post", job.prep_ns, job.post_ns, ready, writes=len(job.writes))

    def _poll_jobs(self) -> None:
        for key, job in list(self._jobs.items()):
            states = [self.agent.poll(w) for w in job.writes] if not job.failed else []
            if any(s == "PROC" for s in states):
                continue
            done_ns = time.time_ns()
            for w in job.writes:
                self.agent.release(w)
            if "ERR" in states:
                job.failed = "a NIXL WRITE completed with an error"
            del self._jobs[key]
            outcome = transfer_pb2.WRITE_OUTCOME_FAILED if job.failed else transfer_pb2.WRITE_OUTCOME_WRITTEN
            nbytes = sum(w.bytes for w in job.writes)
            descriptors = sum(w.descriptors for w in job.writes)
            ready = job.source.ready
            seconds = max(done_ns - job.post_ns, 1) / 1e9
            self.spans.emit("p.write_transfer", job.post_ns, done_ns, ready, bytes=nbytes, descriptors=descriptors,
                            gbps=nbytes / seconds / 1e9, error=job.failed)
            self._answer(key, outcome, job, nbytes=nbytes, descriptors=descriptors, done_ns=done_ns)
            source = self._sources.pop(key, None)
            if source is not None:
                self._release(source, done_ns)

    def _answer(self, key: Key, outcome: int, job: Job, *, nbytes: int = 0, descriptors: int = 0, done_ns: int = 0) -> None:
        self._outcomes[key] = outcome
        while len(self._outcomes) > OUTCOME_MEMORY:
            self._outcomes.popitem(last=False)
        request = rv_pb.ReportWriteResultRequest(
            engine_id=self.engine_id,
            tp_rank=self.local.tp_rank,
            outcome=outcome,
            bytes_written=nbytes,
            descriptor_count=descriptors,
            error_message=job.failed,
        )
        request.key.transfer_id, request.key.attempt = key
        if job.post_ns:
            request.post_time.FromNanoseconds(job.post_ns)
            request.transfer_duration.FromNanoseconds(max(done_ns - job.post_ns, 0))
        self.report(request)

    def _expire(self) -> None:
        now = time.monotonic()
        for key, order in list(self._orders.items()):
            if now > order.write_by:
                del self._orders[key]  # the broker revokes it at its deadline; we answer then
        for key, source in list(self._sources.items()):
            if now > source.hold_until and key not in self._jobs:
                logger.warning("kvpush producer: releasing %s after its hold deadline without a write", key)
                del self._sources[key]
                self._release(source)

    def _release(self, source: Source, written_ns: int = 0) -> None:
        with self._finished_lock:
            self._finished.add(source.ready.req_id)
            if written_ns:
                self._written[source.ready.req_id] = (written_ns, source.ready)
        self.ready.set()


def _concat(plans: list[Plan]) -> Plan:
    if len(plans) == 1:
        return plans[0]
    return Plan(
        np.concatenate([p.src for p in plans]),
        np.concatenate([p.dst for p in plans]),
        np.concatenate([p.lengths for p in plans]),
        sum(p.unmerged_count for p in plans),
    )
