# SPDX-License-Identifier: Apache-2.0
"""One engine's EngineReports stream: per-request messages go to the broker in batches, answers come back on it.

Every per-request message an engine (or a rank of it) sends the broker,
registrations, prefill-done reports, write results and cancellations, goes
on this one long-lived stream instead of a unary call each: items queued
from any thread meanwhile leave together in one message, the broker
authorizes the stream once, and it answers each batch, item by item, on the
same stream and in order.

After a stream fails, the items it left unanswered go out again first on
the next one while they are younger than the RPC timeout: the broker keys
every item on its attempt, so a repeat is idempotent, as a retried unary
call is. An item with no answer within the RPC timeout (the stream stalled,
or the broker stayed unreachable) is answered with DeadlineExceeded, as a
unary call's deadline would: whether the broker applied it is unknown.

With a sharded broker an engine keeps one such stream per broker member
(ReportRouter, report_routing.py, sends each item to its transfer's owner);
an item a member refuses as not its own (NOT_SHARD_OWNER), or refuses while
it is not serving (BROKER_SHARD_LOST: unsure of its membership lease, it
applied nothing), or answers UNAVAILABLE (it has not caught up with the
engine or the attempt yet), goes back to the router through `reroute`
instead of to its sender.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvpush import errors, status
from kvpush.client import BrokerClient
from kvpush.client.backoff import Backoff
from kvpush.rendezvous.v1 import rendezvous_service_pb2 as rv_pb

logger = logging.getLogger(__name__)

KINDS = ("registrations", "prefill_done", "write_results", "cancels")
# Refusals that say the member applied nothing because of the shard map: the item may go again.
SHARD_REFUSALS = frozenset((errors.Reason.NOT_SHARD_OWNER, errors.Reason.BROKER_SHARD_LOST))
# How long a stream waits at a time for its member's channel to connect before expiring what is due.
CONNECT_WAIT_S = 0.25
# Items per message: keeps a batch far below gRPC's 4 MiB message limit.
MAX_BATCH_ITEMS = 256

# answer: the item's RegistrationAnswer / ReportAnswer / CancelAnswer, or None with the error.
OnAnswer = Callable[[Any, "errors.KvpushError | None"], None]


@dataclass
class Report:
    """One item for the broker."""

    kind: str  # one of KINDS
    message: Any  # the unary call's request message
    on_answer: OnAnswer | None = None  # called on the control loop with (answer, None) or (None, error)
    prepare: Callable[[], None] | None = None  # runs on the control loop right before the item is first sent
    sent_ns: int = 0  # wall clock, when first sent
    expires: float = 0.0  # control-loop time after which it is answered DeadlineExceeded
    on_route: Callable[[str], None] | None = None  # sharded broker: called on the control loop with each member it is queued for
    to: str | None = None  # the member it must go to while that member has a stream (None: its transfer's owner)
    member: str = ""  # the broker member whose stream it is queued on
    sent: bool = False  # it left on that member's stream (the member may have applied it)
    redirects: int = 0  # NOT_SHARD_OWNER answers it followed
    retries: int = 0  # BROKER_SHARD_LOST refusals it was sent again after


class ReportStream:
    """Batches an engine's reports onto its EngineReports stream; lives on a ControlSession's loop."""

    def __init__(self, broker: BrokerClient, engine_id: str, loop: asyncio.AbstractEventLoop, timeout_s: float,
                 closed: Callable[[], bool], *, reroute: Callable[[Report, errors.KvpushError], bool] | None = None):
        """reroute(report, error), on a shard refusal (the member applied nothing), returns True when it took the item over (its sender hears nothing yet)."""
        self._broker = broker
        self._reroute = reroute
        self._engine_id = engine_id
        self._loop = loop
        self._timeout_s = timeout_s
        self._closed = closed
        self._queue: deque[Report] = deque()
        self._wakeup = asyncio.Event()  # created on any thread; only used on the loop (Python >= 3.10)

    def send(self, report: Report) -> None:
        """Queues one item (any thread)."""
        self.send_many([report])

    def send_many(self, reports: list[Report]) -> None:
        """Queues items to leave together (any thread): one wake-up of the control loop for all of them."""
        if reports and not self._closed():
            self._loop.call_soon_threadsafe(self._enqueue, reports)

    def _enqueue(self, reports: list[Report]) -> None:
        expires = self._loop.time() + self._timeout_s
        for report in reports:
            report.expires = expires
        self._queue.extend(reports)
        self._wakeup.set()

    def put(self, reports: list[Report]) -> None:
        """Queues items whose expiry is already set (control loop only).

        Items moved from another member's stream keep their own, earlier,
        expiry: the queue is kept in expiry order, so each is answered at it.
        """
        late = bool(self._queue) and min(r.expires for r in reports) < self._queue[-1].expires
        self._queue.extend(reports)
        if late:
            self._queue = deque(sorted(self._queue, key=lambda r: r.expires))
        self._wakeup.set()

    def take_pending(self) -> list[Report]:
        """Takes every item not answered yet, once run() has ended (control loop only)."""
        pending, self._queue = list(self._queue), deque()
        return pending

    async def run(self) -> None:
        """Keeps the stream open, sending what is queued and dispatching answers, until the session closes."""
        backoff = Backoff()
        while not self._closed():
            try:
                await self._broker.wait_ready(CONNECT_WAIT_S)
            except errors.Unavailable:
                # Nothing goes out while the member cannot be reached: its items stay unsent, so if it leaves the map they
                # go to their new owner (ReportRouter.remove_member) instead of failing as perhaps applied.
                self._expire(self._queue)
                continue
            except Exception as exc:  # the channel itself failed: try again, as after a failed stream
                logger.warning("kvpush: EngineReports stream cannot wait for its channel (%s); again in %.2fs", exc, backoff.delay_s)
                await backoff.sleep()
                continue
            call = self._broker.engine_reports(self._engine_id)
            inflight: deque[list[Report]] = deque()
            reader = asyncio.ensure_future(self._read(call, inflight))
            try:
                while not reader.done():
                    self._expire(self._queue)
                    if self._queue:
                        await self._write(call, inflight)
                        backoff.reset()
                        continue
                    oldest = inflight[0][0].expires if inflight else None
                    try:
                        async with asyncio.timeout(None if oldest is None else max(oldest - self._loop.time(), 0.0)):
                            await self._wakeup.wait()
                    except TimeoutError:
                        # Answers do not wake this loop (that would cost a
                        # wake-up per batch): the batch this wait was timed
                        # for may have been answered since, and the stream
                        # is only stalled if its oldest unanswered item is due.
                        if inflight and inflight[0][0].expires <= self._loop.time():
                            logger.warning("kvpush: EngineReports stream: no answer within %gs; reopening", self._timeout_s)
                            break
                        continue
                    self._wakeup.clear()
                if reader.done():
                    reader.result()  # the stream's error, if it failed
                    if not self._closed():
                        logger.warning("kvpush: EngineReports stream ended; reopening")
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # any failure: open another stream
                logger.warning("kvpush: EngineReports stream failed (%s); reopening in %.2fs", exc, backoff.delay_s)
            finally:
                reader.cancel()
                call.cancel()
                for batch in reversed(inflight):  # unanswered: first out on the next stream
                    self._queue.extendleft(reversed(batch))
            self._expire(self._queue)
            await backoff.sleep()

    async def _write(self, call, inflight: deque[list[Report]]) -> None:
        batch = [self._queue.popleft() for _ in range(min(len(self._queue), MAX_BATCH_ITEMS))]
        request = rv_pb.EngineReportsRequest(engine_id=self._engine_id)
        now_ns = time.time_ns()
        for report in batch:
            if report.prepare is not None:
                report.prepare()
                report.prepare = None
            report.sent_ns = report.sent_ns or now_ns
            report.sent = True
            getattr(request, report.kind).append(report.message)
        inflight.append(batch)
        await call.write(request)

    async def _read(self, call, inflight: deque[list[Report]]) -> None:
        try:
            async for response in call:
                if not inflight:
                    raise errors.Internal("the broker answered a batch that was not sent", reason=errors.Reason.INTERNAL)
                batch = inflight.popleft()
                for kind in KINDS:
                    items = [r for r in batch if r.kind == kind]
                    answers = getattr(response, kind)
                    if len(answers) != len(items):
                        raise errors.Internal(f"the broker answered {len(answers)} {kind} of {len(items)}", reason=errors.Reason.INTERNAL)
                    for report, answer in zip(items, answers):
                        if answer.WhichOneof("result") == "error":
                            error = status.from_item_error(answer.error)
                            # A member that applied nothing and asks for a retry (UNAVAILABLE: not serving, or not caught up
                            # with an engine or attempt yet) gets the item again, like a shard refusal.
                            retry = error.reason in SHARD_REFUSALS or error.code == "UNAVAILABLE"
                            if retry and self._reroute is not None and self._reroute(report, error):
                                continue
                            deliver(report, None, error)
                        else:
                            deliver(report, answer, None)
        finally:
            self._wakeup.set()

    def _expire(self, queue: deque[Report]) -> None:
        now = self._loop.time()
        while queue and queue[0].expires <= now:
            report = queue.popleft()
            deliver(report, None, errors.DeadlineExceeded(f"no answer from the broker within {self._timeout_s:g}s",
                                                          reason=errors.Reason.UNAVAILABLE))


def deliver(report: Report, answer: Any, error: errors.KvpushError | None) -> None:
    """Hands an item its answer or error (on the control loop)."""
    if report.on_answer is None:
        if error is not None:
            logger.warning("kvpush: %s %s/%s failed: %s", report.kind, report.message.key.transfer_id, report.message.key.attempt, error)
        return
    try:
        report.on_answer(answer, error)
    except Exception:  # a handler's bug must not end the stream for every other request
        logger.exception("kvpush: answer handler for %s failed", report.kind)
