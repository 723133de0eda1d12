# SPDX-License-Identifier: Apache-2.0
"""A prefill rank's WRITE posting: when a job starts, the self-fencing checks before every post, and the parts of a layer-progressive push.

Self-fencing (docs/design.md, "Fencing"): a rank posts a WRITE for an order
only while (1) the order's budget, measured from the broker's send time,
has not run out; (2) the order's stream is still its broker member's current one and its
stream lease (renewed by every message, heartbeats included) holds; (3) no
WRITE for that (transfer_id, attempt) was posted before; (4) its source
holds every token the destination needs. The checks run again right before
the post, after the CUDA sync and the plan build. A WRITE may be made (its
plan built, its NIXL request created) while the source's forward still
runs; it is posted through the same checks, or freed unposted. A later part of a
layer-progressive WRITE passes (1) and (2) again, or the job stops and ends
FAILED once its parts in flight are done.

Posting is a part of ProducerCore (producer.py), which keeps the records
(_sources, _orders, _computing, _jobs, _peers, the streams) and answers the
broker (_answer, _finish); split out so the fencing reads on its own.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvpush.clock import Clock
from kvpush.connector.handoff import SourceReady, prompt_digest
from kvpush.connector.notification import notification, posted_notification
from kvpush.connector.producer_records import FAILED, REVOKED, Computing, Job, Key, MadeWrites, Order, Source
from kvpush.connector.write_plans import Peer, WritePlan, build_write_plans, device_of
from kvpush.rendezvous.v1 import transfer_pb2

if TYPE_CHECKING:
    from kvpush.connector.nixl_agent import NixlWrite
    from kvpush.connector.producer import Transport
    from kvpush.connector.write_plans import LocalLayout

logger = logging.getLogger(__name__)


class Posting:
    """ProducerCore's posting of WRITEs, fenced (a mixin: the state it reads and writes is the core's)."""

    if TYPE_CHECKING:  # ProducerCore's, declared for the type checker only
        transport: Transport
        local: LocalLayout
        spans: Any
        clock: Clock
        _plan_writes: Callable[..., list[WritePlan]]
        _sources: dict[Key, Source]
        _computing: dict[Key, Computing]
        _orders: dict[Key, Order]
        _jobs: dict[Key, Job]
        _peers: dict[str, Peer]
        _local_prepared: object | None
        _streams: dict[int, float]

        def _answer(self, key: Key, outcome: transfer_pb2.WriteOutcome, reason: transfer_pb2.EndReason, message: str, *, nbytes: int = 0, descriptors: int = 0,
                    job: Job | None = None, done_ns: int = 0) -> None: ...
        def _release(self, source: Source, written_ns: int = 0) -> None: ...
        def _wall_ns(self) -> int: ...

    def _try_start(self, key: Key) -> None:
        source, order = self._sources.get(key), self._orders.get(key)
        computing = self._computing.get(key) if source is None else None
        if order is None:
            return
        if source is None:
            if computing is not None and computing.whole:
                self._make_ahead(computing, order)
            if computing is None or not self._progressive_layers(key, None):
                return
        destination = order.order.destination
        peer = self._peers.get(destination.engine_id)
        if peer is None or peer.incarnation != destination.incarnation or any(r not in peer.ranks for r in order.order.decode_tp_ranks):
            return  # the registrar's view of the decode engine hasn't arrived yet
        del self._orders[key]
        if source is not None:
            ready = source.ready
        else:
            assert computing is not None, "without a source, a computing one was required above"
            ready = computing.ready
        reason, mismatch = self._mismatch(ready, destination)
        if mismatch:
            # An early order bypasses the broker's token check, and only this rank holds the
            # prompt: D must not decode on KV it never got or on another prompt's KV.
            self._answer(key, REVOKED, reason, mismatch)
            if source is not None:
                del self._sources[key]
                self._release(source)
            return  # a computing source is released when it is ready: this key has its answer
        if not self._may_post(order):
            return
        if source is None:
            job = Job(key, Source(ready, self.clock.now() + ready.hold_s, self._wall_ns()), order, more_parts=True)
        else:
            job = Job(key, source, order)
        self._post_parts(key, job, final=source is not None)

    @staticmethod
    def _mismatch(ready: SourceReady, destination: transfer_pb2.Destination) -> tuple[transfer_pb2.EndReason, str]:
        """Why this source cannot fill the destination (end reason, message), or (0, "")."""
        needed = destination.first_token + destination.num_tokens
        if ready.num_tokens < needed:
            return transfer_pb2.END_REASON_TOKEN_COUNT_MISMATCH, f"this prefill computed {ready.num_tokens} tokens; the destination needs {needed}"
        if destination.prompt_digest and ready.prompt and prompt_digest(ready.prompt, needed) != destination.prompt_digest:
            return transfer_pb2.END_REASON_PROMPT_MISMATCH, f"the destination needs the KV of another prompt than this prefill's first {needed} tokens"
        return transfer_pb2.END_REASON_UNSPECIFIED, ""

    def _may_post(self, order: Order) -> bool:
        """The self-fencing checks, run right before a post."""
        now = self.clock.now()
        if now >= self._streams.get(order.stream, float("-inf")):
            return False  # its stream is gone or quiet: the broker resends it on the next one if still wanted
        if now >= order.post_by:
            key = (order.order.key.transfer_id, order.order.key.attempt)
            logger.warning("kvpush producer: order %s is past its write budget; not writing", key)
            self._answer(key, REVOKED, transfer_pb2.END_REASON_UNSPECIFIED, "the order's write budget ran out before the WRITE could be posted")
            return False
        return True

    def _may_post_more(self, order: Order) -> bool:
        """The self-fencing checks before a later part: as _may_post, but this rank has posted already, so it answers FAILED later."""
        now = self.clock.now()
        return now < self._streams.get(order.stream, float("-inf")) and now < order.post_by

    def _progressive_layers(self, key: Key, job: Job | None) -> frozenset[int]:
        """Computed layers not yet posted, less the last layer: it goes with the source, in the part that ends the transfer."""
        computing = self._computing.get(key)
        if computing is None or not self.local.layers:
            return frozenset()
        posted = job.posted_layers if job is not None else frozenset()
        return frozenset(computing.done - posted - {max(self.local.layers)})

    def _post_parts(self, key: Key, job: Job, *, final: bool) -> None:
        """Posts one part (every layer not yet posted when final, else the computed ones), fenced like any WRITE."""
        order, ready = job.order, job.source.ready
        if job.failed:
            return  # stopped: nothing more is posted
        layers = self._progressive_layers(key, job) if not final else (self.local.layers - job.posted_layers if job.parts else None)
        if not final and not layers:
            return
        destination = order.order.destination
        peer = self._peers.get(destination.engine_id)
        if peer is None or peer.incarnation != destination.incarnation:
            self._stop_parts(job, "the decode engine went away while the parts of its WRITE were being posted")
            return
        made = self._take_made(key, job, peer) if final and not job.parts else None
        t0 = self._wall_ns()
        try:
            if final and job.source.ready_event is not None:
                job.source.ready_event.synchronize()  # the forward that wrote these blocks has finished
            elif not final and (layers_event := self._computing[key].event) is not None:
                layers_event.synchronize()  # the layers' forward has finished
            if made is not None:
                plans = made.plans
            else:
                plans = self._plan_writes(job.source, order, peer) if layers is None else self._plan_writes(job.source, order, peer, layers=layers)
        except Exception as exc:  # a plan that cannot be built fails the attempt, loudly
            logger.exception("kvpush producer: WRITE plan for %s could not be built", key)
            self._discard_writes(made.writes if made is not None else [])
            if job.parts:
                self._stop_parts(job, f"the WRITE plan could not be built: {exc}")
            else:
                self._answer(key, FAILED, transfer_pb2.END_REASON_UNSPECIFIED, f"the WRITE plan could not be built: {exc}")
            return
        prep_ns = self._wall_ns()
        if final:
            self.spans.emit("p.descriptor_prep", t0, prep_ns, ready, descriptors=sum(p.descriptors for p in plans), made_ahead=made is not None)
        if not job.parts:
            if not self._may_post(job.order):
                self._discard_writes(made.writes if made is not None else [])
                return  # the plan build or the CUDA sync outlasted the budget or the stream
            self._jobs[key] = job
        elif not self._may_post_more(order):
            self._stop_parts(job, "the order's stream or write budget ran out while the parts of its WRITE were being posted")
            return
        part = job.parts + 1
        writes: list[NixlWrite | None] = made.writes if made is not None else [None] * len(plans)
        try:
            for i, p in enumerate(plans):
                write = writes[i] or self._make_write(p, peer, ready, destination, part, final)
                writes[i] = None
                self.transport.start(write)  # a refused post frees its WRITE
                job.writes.append(write)
        except Exception as exc:  # a WRITE that cannot be posted fails the attempt, loudly
            logger.exception("kvpush producer: WRITE for %s could not be posted", key)
            job.failed = str(exc)
            self._discard_writes(writes)
        job.parts = part
        job.posted_layers |= layers if layers is not None else self.local.layers
        job.more_parts = not final and not job.failed
        # Each part may land up to write_timeout after its own post (A2): none is aborted before that.
        job.abort_at = self.clock.now() + order.order.write_timeout.ToTimedelta().total_seconds()
        post_ns = self._wall_ns()
        if final:
            self.spans.emit("p.write_post", prep_ns, post_ns, ready, writes=len(job.writes), parts=part)
            self.spans.segments.segment("handoff", job.source.ready_ns, post_ns)
            self._tell_posted(key, peer, {p.d_rank for p in plans}, post_ns)
        if part == 1:
            job.post_ns = post_ns
            # Emitted after the post, off the hand-off's critical path. A P-side segment belongs
            # under P's request; the broker's context (D's registration for an early order) is a link.
            self.spans.emit("p.order_delivery", order.sent_ns, order.received_ns, ready,
                            links=(order.order.trace_context.get("traceparent", ""),), early=not order.order.HasField("source"))

    def _tell_posted(self, key: Key, peer: Peer, d_ranks: set[int], post_ns: int) -> None:
        """Tells the decode ranks when the WRITE's last part went out: the WRITE segment of TTFT runs from here to their
        last notification, which only they see."""
        message = posted_notification(key[0], key[1], self.local.producer, post_ns)
        for d_rank in d_ranks:
            rank = peer.ranks.get(d_rank)
            if rank is None:
                continue
            try:
                self.transport.send_notif(rank.agent, message)
            except Exception as exc:  # telemetry: the WRITE does not depend on it
                logger.debug("kvpush producer: posted notification of %s to %s not sent: %s", key, rank.agent, exc)

    def _stop_parts(self, job: Job, why: str) -> None:
        """No more parts for this job: it ends FAILED once the parts in flight are done (they may have landed)."""
        job.failed = job.failed or why
        job.more_parts = False

    def _make_write(self, plan: WritePlan, peer: Peer, ready: SourceReady, destination: transfer_pb2.Destination, part: int, final: bool):
        """Makes (does not post) one part's WRITE to one decode rank, with its notification."""
        rank = peer.ranks[plan.d_rank]
        notif = notification(ready.transfer_id, ready.attempt, self.local.producer, plan.expected, destination.first_token,
                             destination.num_tokens, part, part if final else 0)
        if plan.pages is not None:
            return self.transport.make_pages(rank.agent, self._local_prepared, plan.pages.local, rank.prepared, plan.pages.remote,
                                             plan.pages.bytes, notif)
        assert plan.plan is not None, "a WritePlan holds pages or byte segments"
        return self.transport.make_write(rank.agent, plan.plan.src, plan.plan.dst, plan.plan.lengths, self.local.device,
                                         device_of(rank.layout), notif)

    def _make_ahead(self, computing: Computing, order: Order) -> None:
        """While a source's forward runs and its order is here: plan and make its WRITEs, so its end only posts them.

        Nothing is posted here: the fencing checks run at the post as for any
        WRITE, and the made WRITEs are used only if the order and the decode
        engine are still the same objects then (else freed, and made again).
        """
        if computing.made is not None:
            if computing.made.order is order:
                return
            self._discard_made(computing)
        destination = order.order.destination
        peer = self._peers.get(destination.engine_id)
        if (peer is None or peer.incarnation != destination.incarnation or any(r not in peer.ranks for r in order.order.decode_tp_ranks)
                or self._mismatch(computing.ready, destination)[1]):
            return  # decided when the source is ready
        writes: list[NixlWrite | None] = []
        try:
            plans = self._plan_writes(Source(computing.ready, float("inf"), 0), order, peer)
            for p in plans:
                writes.append(self._make_write(p, peer, computing.ready, destination, 1, True))
        except Exception:  # made again, or failed loudly, at the forward's end
            logger.exception("kvpush producer: making the WRITE of %s ahead failed", (computing.ready.transfer_id, computing.ready.attempt))
            self._discard_writes(writes)
            return
        computing.made = MadeWrites(order, peer, plans, writes)

    def _take_made(self, key: Key, job: Job, peer: Peer) -> MadeWrites | None:
        """The WRITEs made ahead for this job, if made for its very order, decode engine and source."""
        computing = self._computing.get(key)
        if computing is None or computing.made is None:
            return None
        made, computing.made = computing.made, None
        if made.order is job.order and made.peer is peer and computing.ready == job.source.ready:
            return made
        self._discard_writes(made.writes)
        return None

    def _discard_made(self, computing: Computing) -> None:
        """Frees the WRITEs made ahead for computing (callers check it has them)."""
        made, computing.made = computing.made, None
        assert made is not None, "called only for a computing source with WRITEs made ahead"
        self._discard_writes(made.writes)

    def _discard_writes(self, writes: list) -> None:
        """Frees made WRITEs that were never posted (None entries were posted or freed already)."""
        for write in writes:
            if write is not None:
                self.transport.release(write)

    def _build_plans(self, source: Source, order: Order, peer: Peer, layers: frozenset[int] | None = None) -> list[WritePlan]:
        return build_write_plans(self.local, source.ready, order.order, peer, layers)
