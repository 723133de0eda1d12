# SPDX-License-Identifier: Apache-2.0
"""The prefill worker's transfer logic: match finished prefills with write orders and WRITE them, fenced.

ProducerCore is deterministic: it reads time only from its Clock and talks
to NIXL only through a Transport, so the protocol simulation
(kvpush.dev.sim) drives the very same code the worker runs. Producer
(producer_thread.py) runs it on the worker's transfer thread.

The core is the state machine: it takes sources, orders, revocations,
closures and engine events, keeps one job per (transfer_id, attempt), and
answers for each. Its WRITEs are posted by Posting (posting.py, where the
self-fencing checks are); its decode peers' agents are loaded and unloaded
by DecodePeers (decode_peers.py). A posted WRITE still in flight write_timeout
later is aborted (its handle released before this thread's next progress
call) and reported FAILED: that it can land no later rests on assumption A2
(docs/design.md, "Fencing"). A rank's answer to a revocation is the truth:
REVOKED only when nothing was or will be posted.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol

from kvpush.clock import Clock
from kvpush.connector.decode_peers import DecodePeers
from kvpush.connector.handoff import SourceReady
from kvpush.connector.nixl_agent import NixlWrite
from kvpush.connector.notification import due_notification
from kvpush.connector.posting import Posting
from kvpush.connector.producer_records import FAILED, REVOKED, WRITTEN, Computing, Job, Key, Order, Source
from kvpush.connector.write_plans import LocalLayout, Peer, PeerRank, WritePlan
from kvpush.rendezvous.v1 import rendezvous_service_pb2 as rv_pb
from kvpush.rendezvous.v1 import transfer_pb2

logger = logging.getLogger(__name__)
# The outcome label each answer counts under (kvpush_transfers_total).
WRITE_OUTCOMES = {WRITTEN: "written", FAILED: "failed", REVOKED: "revoked"}

# Answered keys remembered, so a repeated order or revocation gets the same truthful answer.
OUTCOME_MEMORY = 100_000


class Transport(Protocol):
    """What the core needs of a NIXL agent (KvAgent; a simulated one in kvpush.dev.sim)."""

    def add_peer(self, metadata: bytes) -> str: ...
    def remove_peer(self, name: str) -> None: ...
    def warm_up(self, peer: str) -> None: ...
    def send_notif(self, peer: str, message: bytes) -> None: ...
    def make_write(self, peer: str, src, dst, lengths, src_device: int, dst_device: int, notif: bytes) -> NixlWrite: ...
    def prepare_pages(self, peer: str | None, rows) -> object: ...
    def forget_pages(self, prepared: object) -> None: ...
    def make_pages(self, peer: str, local, local_entries, remote, remote_entries, nbytes: int, notif: bytes) -> NixlWrite: ...
    def start(self, write: NixlWrite) -> None: ...
    def poll(self, write: NixlWrite) -> str: ...
    def release(self, write: NixlWrite) -> None: ...
    def notifications(self) -> dict[str, list[bytes]]: ...


class ProducerCore(Posting, DecodePeers):
    """One prefill rank's transfer state machine (single-threaded)."""

    def __init__(
        self,
        transport: Transport,
        local: LocalLayout,
        engine_id: str,
        report: Callable[[rv_pb.ReportWriteResultRequest], None],
        spans,
        clock: Clock,
        plan_writes: Callable[[Source, Order, Peer], list[WritePlan]] | None = None,
        prefill_done: Callable[[SourceReady], None] | None = None,
    ):
        """prefill_done: tells the broker a source is ready (one rank of an engine does): at once when no WRITE could be posted
        for it, else just before that WRITE's result (early orders need it only for the broker's record)."""
        self.transport = transport
        self.local = local
        self.engine_id = engine_id
        self.report = report
        self.spans = spans
        self.clock = clock
        self._plan_writes = plan_writes or self._build_plans
        self._prefill_done = prefill_done
        self._released: dict[str, tuple[int, SourceReady]] = {}  # req_id -> (WRITE completion ns or 0, source)
        self._released_lock = threading.Lock()
        self.on_release: Callable[[], None] = lambda: None
        self._sources: dict[Key, Source] = {}
        self._computing: dict[Key, Computing] = {}
        self._orders: dict[Key, Order] = {}
        self._jobs: dict[Key, Job] = {}
        self._closed: OrderedDict[Key, None] = OrderedDict()
        self._outcomes: OrderedDict[Key, tuple[transfer_pb2.WriteOutcome, transfer_pb2.EndReason, str]] = OrderedDict()  # answered keys: (outcome, reason, message)
        self._peers: dict[str, Peer] = {}
        self._retiring: list[PeerRank] = []  # peer ranks to unload once no WRITE to them is in flight
        self._local_prepared = None  # this rank's page table, prepared once a peer can use it
        # Live order streams, one per broker member (a sharded broker has several):
        # generation -> the end of its stream lease (monotonic), renewed by each of its messages.
        self._streams: dict[int, float] = {}
        self._member_streams: dict[str, int] = {}  # broker member -> its current stream generation
        self._stream_members: dict[int, str] = {}  # and back
        # Whose order (or revocation) each key's answer answers: the member that sent it holds the attempt,
        # and takes the answer even once the transfer moved to another member.
        self._answer_to: OrderedDict[Key, str] = OrderedDict()
        self._prefill_done_with_result: dict[Key, SourceReady] = {}  # prefill-done reports held for their WRITE's result

    # ---- inputs (from the transfer thread's inbox) ----------------------------------

    def handle(self, item: tuple) -> None:
        kind = item[0]
        if kind == "source":
            self.source_ready(*item[1:])
        elif kind == "computing":
            self.computing(*item[1:])
        elif kind == "layer":
            self.layer_done(item[1], item[2], item[3])
        elif kind == "stream":
            self.stream_message(item[1], item[2])
        elif kind == "stream_opened":
            self.stream_opened(*item[1:])
        elif kind == "stream_lost":
            self.stream_lost(item[1])
        elif kind == "engine":
            self.engine_event(item[1])

    @property
    def busy(self) -> bool:
        return bool(self._jobs)

    @property
    def holds_sources(self) -> bool:
        return bool(self._sources)

    def source_ready(self, ready: SourceReady, ready_event=None, computed_ns: int = 0) -> None:
        key = (ready.transfer_id, ready.attempt)
        # The hand-off starts where the prefill ended, not when this thread got to it.
        source = Source(ready, self.clock.now() + ready.hold_s, computed_ns or self._wall_ns(), ready_event)
        held = self._sources.get(key)
        if held is not None and held.ready.req_id != ready.req_id:
            logger.error("kvpush producer: request %s reuses transfer key %s of request %s; not transferring it", ready.req_id, key, held.ready.req_id)
            self._release(source)
        elif key in self._closed or key in self._outcomes:
            self._release(source)  # the attempt ended, or this rank already answered for it
        else:
            self._sources[key] = source
            job = self._jobs.get(key)
            if job is not None and job.more_parts:
                job.source = source
                self._post_parts(key, job, final=True)
            else:
                self._try_start(key)
        computing = self._computing.pop(key, None)
        if computing is not None and computing.made is not None:
            self._discard_made(computing)  # not posted: its order or peer changed, or the source failed its checks
        if self._prefill_done is not None:
            if key in self._jobs:
                # An early order's WRITE is on its way and the broker needs this report only to match: it goes with the
                # WRITE's result (_finish), in the same stream message, rather than as one more message (and one more
                # wake-up of the control loop) at the end of this forward.
                self._prefill_done_with_result[key] = ready
            else:
                self._prefill_done(ready)

    def computing(self, ready: SourceReady, whole: bool = False, announce_at: float | None = None) -> None:
        """This source's forward has started: its layers may be written as they are computed, or (whole) its WRITE made ahead.

        announce_at: when to tell its decode ranks the WRITE is due (None: at once).
        """
        key = (ready.transfer_id, ready.attempt)
        if key not in self._closed and key not in self._outcomes and key not in self._sources and key not in self._computing:
            self._computing[key] = Computing(ready, whole, announce_at=float("-inf") if announce_at is None else announce_at)
            self._announce(key)
            if whole:
                self._try_start(key)

    def layer_done(self, keys: tuple[Key, ...], layer: int, event=None) -> None:
        """A layer of these computing sources is in P's cache (after `event`, on GPU)."""
        for key in keys:
            computing = self._computing.get(key)
            if computing is None:
                continue
            computing.done.add(layer)
            computing.event = event
            job = self._jobs.get(key)
            if job is None:
                self._try_start(key)
            elif job.more_parts:
                self._post_parts(key, job, final=False)

    def stream_opened(self, stream: int, member: str = "") -> None:
        """A new order stream from a broker member replaces that member's old one: orders from the old one are void (the new one resyncs them).

        Streams of other members are untouched: each member orders only the
        transfers it owns, so losing one member's stream stops only its orders.
        """
        old = self._member_streams.get(member)
        if old is not None:
            self.stream_lost(old)
        self._member_streams[member] = stream
        self._stream_members[stream] = member
        self._streams[stream] = float("-inf")

    def stream_lost(self, stream: int) -> None:
        if self._streams.pop(stream, None) is not None:
            member = self._stream_members.pop(stream)
            if self._member_streams.get(member) == stream:
                del self._member_streams[member]
            self._drop_unposted(stream)

    def answer_member(self, key: Key) -> str | None:
        """The broker member whose order or revocation for key came last: the one its answer goes to."""
        return self._answer_to.get(key)

    def stream_message(self, stream: int, message: rv_pb.StreamWriteOrdersResponse) -> None:
        if stream not in self._streams:
            return  # a replaced or lost stream's late message
        now = self.clock.now()
        sent_ns = message.send_time.ToNanoseconds()
        # Time since the broker stamped it, by this host's wall clock; the
        # broker took the skew allowance off the budget and lease it sent.
        age = self.clock.wall() - sent_ns / 1e9
        lease_end = now + message.stream_lease.ToTimedelta().total_seconds() - age
        self._streams[stream] = max(self._streams[stream], lease_end)
        kind = message.WhichOneof("message")
        if kind in ("order", "revocation"):
            body = getattr(message, kind)
            self._remember(self._answer_to, (body.key.transfer_id, body.key.attempt), self._stream_members[stream])
        if kind == "order":
            self._on_order(message.order, stream, now + message.order.write_budget.ToTimedelta().total_seconds() - age, sent_ns)
        elif kind == "revocation":
            key = (message.revocation.key.transfer_id, message.revocation.key.attempt)
            self._orders.pop(key, None)
            if key not in self._jobs:  # a job in flight answers when it completes
                outcome = self._outcomes.get(key, (REVOKED, transfer_pb2.END_REASON_UNSPECIFIED, ""))
                self._answer(key, *outcome)
            elif self._jobs[key].more_parts:
                self._stop_parts(self._jobs[key], "the attempt was revoked while the parts of its WRITE were being posted")
        elif kind == "closed":
            key = (message.closed.key.transfer_id, message.closed.key.attempt)
            self._orders.pop(key, None)
            self._remember(self._closed, key, None)
            if key in self._jobs and self._jobs[key].more_parts:
                self._stop_parts(self._jobs[key], "the attempt was closed while the parts of its WRITE were being posted")
            source = self._sources.get(key)
            if source is not None and key not in self._jobs:
                del self._sources[key]
                self._release(source)

    def _on_order(self, order: transfer_pb2.WriteOrder, stream: int, post_by: float, sent_ns: int) -> None:
        key = (order.key.transfer_id, order.key.attempt)
        if key in self._jobs:
            return  # at most one WRITE per (transfer, attempt) on this rank; the job answers
        if key in self._outcomes:
            self._answer(key, *self._outcomes[key])  # a resent order: the same answer again
            return
        if key in self._closed:
            self._answer(key, REVOKED, transfer_pb2.END_REASON_UNSPECIFIED, "the attempt was closed before its order arrived")
            return
        self._orders[key] = Order(order, stream, post_by, self._wall_ns(), sent_ns)
        self._announce(key)
        self._try_start(key)

    def _announce(self, key: Key) -> None:
        """Tells the order's decode ranks that its WRITE is due: they poll NIXL fast until it lands.

        Once per attempt, to the decode ranks this rank writes to, once both
        the source's forward runs and its order is here, and not before the
        source's announce_at (near the forward's predicted end). A hint
        only: a decode rank that misses it finds the WRITE at its slower
        polling.
        """
        computing, order = self._computing.get(key), self._orders.get(key)
        if computing is None or order is None or computing.announced or self.clock.now() < computing.announce_at:
            return  # step() announces it when its time comes
        destination = order.order.destination
        peer = self._peers.get(destination.engine_id)
        if peer is None or peer.incarnation != destination.incarnation:
            return
        computing.announced = True
        message = due_notification(*key)
        for d_rank in order.order.decode_tp_ranks:
            rank = peer.ranks.get(d_rank)
            if rank is None:
                continue
            try:
                self.transport.send_notif(rank.agent, message)
            except Exception as exc:  # a hint: the WRITE itself does not depend on it
                logger.debug("kvpush producer: due notification of %s to %s not sent: %s", key, rank.agent, exc)

    def take_released(self) -> tuple[set[str], dict[str, tuple[int, SourceReady]]]:
        """Released sources by req_id, and of those the ones released after a WRITE (completion ns, source)."""
        with self._released_lock:
            released, self._released = self._released, {}
        return set(released), {req: info for req, info in released.items() if info[0]}

    # ---- progress ---------------------------------------------------------------------

    def step(self) -> float | None:
        """Aborts overdue WRITEs (before this thread's progress calls), expires orders and sources, polls WRITEs."""
        now = self.clock.now()
        self._abort_overdue(now)
        for stream, valid_until in self._streams.items():
            if now >= valid_until:
                self._drop_unposted(stream)
        for key, order in list(self._orders.items()):
            if now >= order.post_by:
                del self._orders[key]  # its budget ran out; the broker revokes it and gets REVOKED then
        for key, source in list(self._sources.items()):
            if now >= source.hold_until and key not in self._jobs:
                logger.warning("kvpush producer: releasing %s after its hold deadline without a write", key)
                del self._sources[key]
                self._release(source)
        for key, job in list(self._jobs.items()):
            states = [self.transport.poll(w) for w in job.writes]
            if "ERR" in states:
                self._stop_parts(job, "a NIXL WRITE completed with an error")
            if "PROC" not in states and not job.more_parts:
                self._finish(key, job, job.failed)
        self._unload_retired()
        if not self._jobs:
            self.transport.notifications()  # progresses connection setup with decode agents
        announcing = [k for k, c in self._computing.items() if not c.announced and k in self._orders]
        for key in announcing:
            self._announce(key)
        due = [s.hold_until for k, s in self._sources.items() if k not in self._jobs]
        due += [self._computing[k].announce_at for k in announcing if self._computing[k].announce_at > now]
        due += [o.post_by for o in self._orders.values()] + [j.abort_at for j in self._jobs.values()]
        due += [self._streams[s] for s in {o.stream for o in self._orders.values()} if s in self._streams]
        return min(due) if due else None

    def _abort_overdue(self, now: float) -> None:
        """Releases WRITEs still in flight past their write timeout (before this thread's calls that make progress)."""
        for key, job in list(self._jobs.items()):
            if now >= job.abort_at:
                timeout = job.order.order.write_timeout.ToTimedelta().total_seconds()
                self._finish(key, job, f"the WRITE was still in flight {timeout:g}s after its post; aborted")

    def _drop_unposted(self, stream: int) -> None:
        """A stream's orders not yet posted are void once it is gone or quiet: the broker resends what is still wanted."""
        for key in [k for k, o in self._orders.items() if o.stream == stream]:
            del self._orders[key]

    # ---- answers ---------------------------------------------------------------------

    def _finish(self, key: Key, job: Job, failure: str) -> None:
        done_ns = self._wall_ns()
        for w in job.writes:
            self.transport.release(w)  # aborts a WRITE still in flight
        del self._jobs[key]
        held = self._prefill_done_with_result.pop(key, None)
        if held is not None:
            assert self._prefill_done is not None, "a report is held for its result only when there is one to send"
            self._prefill_done(held)  # first: the broker then reads the report before the result, as when it came first
        nbytes = sum(w.bytes for w in job.writes)
        descriptors = sum(w.descriptors for w in job.writes)
        ready = job.source.ready
        if job.post_ns:
            seconds = max(done_ns - job.post_ns, 1) / 1e9
            self.spans.emit("p.write_transfer", job.post_ns, done_ns, ready, bytes=nbytes, descriptors=descriptors, gbps=nbytes / seconds / 1e9, error=failure)
        self._answer(key, FAILED if failure else WRITTEN, transfer_pb2.END_REASON_UNSPECIFIED, failure, nbytes=nbytes, descriptors=descriptors, job=job, done_ns=done_ns)
        source = self._sources.pop(key, None)
        if source is not None:
            self._release(source, done_ns)

    def _answer(self, key: Key, outcome: transfer_pb2.WriteOutcome, reason: transfer_pb2.EndReason, message: str, *, nbytes: int = 0, descriptors: int = 0, job: Job | None = None, done_ns: int = 0) -> None:
        self._remember(self._outcomes, key, (outcome, reason, message))
        self.spans.segments.outcome(WRITE_OUTCOMES.get(outcome, "failed"), nbytes if outcome == WRITTEN else 0)
        request = rv_pb.ReportWriteResultRequest(
            engine_id=self.engine_id, tp_rank=self.local.tp_rank, pp_rank=self.local.pp_rank, outcome=outcome, bytes_written=nbytes, descriptor_count=descriptors,
            error_message=message, reason=reason,
        )
        request.key.transfer_id, request.key.attempt = key
        if job is not None and job.post_ns:
            request.post_time.FromNanoseconds(job.post_ns)
            request.transfer_duration.FromNanoseconds(max(done_ns - job.post_ns, 0))
        self.report(request)

    @staticmethod
    def _remember(memory: OrderedDict, key: Key, value) -> None:
        memory[key] = value
        while len(memory) > OUTCOME_MEMORY:
            memory.popitem(last=False)

    def _release(self, source: Source, written_ns: int = 0) -> None:
        with self._released_lock:
            self._released[source.ready.req_id] = (written_ns, source.ready)
        self.on_release()

    def _wall_ns(self) -> int:
        return int(self.clock.wall() * 1e9)

