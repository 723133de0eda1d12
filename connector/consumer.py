# SPDX-License-Identifier: Apache-2.0
"""The decode worker's receive logic: count completion notifications until a request's KV is in place.

Every producer rank that writes to this rank sends one notification per
WRITE, naming the tokens it wrote and how many producer ranks to expect; a
layer-progressive transfer is several WRITEs (parts) per rank, the last of
which names how many parts there were. When every part of every producer
rank has arrived and each named exactly the tokens the request registered,
the request is reported received. ConsumerCore is
deterministic (time from its Clock, NIXL through a transport), so the
protocol simulation drives the same code; Consumer wraps it in the worker's
transfer thread.

Who polls NIXL, and how often. vLLM acts on a landed KV only when the
engine thread next asks (get_finished, at the end of a step), so the engine
thread polls then itself (about a microsecond): while the engine computes,
nothing needs to poll for it, and a poll from another thread would wake a
thread on the core the decode forward runs on. In a step with nothing to
compute, the engine thread polls every poll_interval while a WRITE to this
rank is due, else every waiting_poll, until a result or the step's idle
wait ends. The transfer thread takes the scheduler's items and polls every
waiting_poll while receives wait (every poll_interval when waiting_poll is
None: KV in GPU memory), rarely (idle_poll) otherwise, to let producers
connect; it never polls faster for a WRITE that is due. A WRITE is
due once P said so (a due notification, sent near the predicted end of the
forward that computes it), once a part of it landed (layer-progressive
push), and for fresh_poll after a receive is expected (P may be done
already: its WRITE then follows D's registration). A missed or lost hint
costs at most waiting_poll of latency, never a receive.

Failing a request is the decode scheduler's decision (it knows when the
blocks are safe to reuse): fail(req_id) always reports it, once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from kvpush.clock import Clock
from kvpush.connector.handoff import DestinationReady, Key
from kvpush.connector.nixl_agent import HELLO
from kvpush.connector.notification import Notification, parse_due, parse_notification, parse_posted
from kvpush.connector.transfer_thread import TransferThread

logger = logging.getLogger(__name__)

# Notifications for transfers this rank has not been told about yet (they can
# overtake the scheduler's metadata) are kept this long.
EARLY_NOTIFICATION_TTL_S = 60.0

REPORTED_MEMORY = 10_000
# Complete receives kept for a posted notification that comes after their WRITE's own (the WRITE segment's start).
AWAITING_POSTED_MEMORY = 1_000


@dataclass
class Receive:
    expected: DestinationReady
    parts_seen: dict[int, int] = field(default_factory=dict)  # producer rank -> parts landed
    parts_total: dict[int, int] = field(default_factory=dict)  # producer rank -> its part count, once its last part said
    needed: int = 0  # producer ranks to hear from; 0 until the first notification says

    def complete_producers(self) -> int:
        return sum(1 for rank, total in self.parts_total.items() if self.parts_seen.get(rank, 0) >= total)


@dataclass
class UnclaimedNotifications:
    """Notifications that arrived before the scheduler said which request waits for them."""

    notes: list[Notification]
    first_seen: float


class ConsumerCore:
    """One decode rank's notification counting (single-threaded)."""

    def __init__(self, transport, spans, clock: Clock, *, waiting_poll_s: float | None = None, fresh_poll_s: float = 0.0):
        """waiting_poll_s: how often to poll while receives wait and no WRITE is due (None: as often as when one is due)."""
        self.transport = transport
        self.spans = spans
        self.clock = clock
        self.waiting_poll_s = waiting_poll_s
        self.fresh_poll_s = fresh_poll_s
        self._lock = threading.Lock()
        self._finished: set[str] = set()
        self._failed: set[str] = set()
        self._received_ns: dict[str, int] = {}
        # Recently published req_ids: a fail() racing with a success (the scheduler's deadline) is a no-op.
        self._reported: OrderedDict[str, None] = OrderedDict()
        self._pending: dict[Key, Receive] = {}
        self._by_request: dict[str, Key] = {}
        self._unclaimed: dict[Key, UnclaimedNotifications] = {}
        self._due: set[Key] = set()  # pending receives a WRITE is due for
        self._early_due: dict[Key, float] = {}  # due notifications ahead of the scheduler's metadata: when seen
        self._posted: dict[Key, tuple[int, float]] = {}  # posted notifications of receives not complete: (latest post ns, when seen)
        self._awaiting_posted: OrderedDict[Key, int] = OrderedDict()  # complete receives whose posted notification is still to come
        self._fresh_until = float("-inf")  # the newest receive's fresh_poll window ends
        self.on_result = lambda: None

    # ---- inputs -------------------------------------------------------------------------

    def handle(self, item: tuple) -> None:
        if item[0] == "expect":
            self.expect(item[1])
        elif item[0] == "fail":
            self.fail(item[1], item[2])

    @property
    def busy(self) -> bool:
        """True while a WRITE to this rank is due: poll at the fast interval."""
        return bool(self._pending) and (self.waiting_poll_s is None or bool(self._due) or self.clock.now() < self._fresh_until)

    def expect(self, recv: DestinationReady) -> None:
        key = (recv.transfer_id, recv.attempt)
        held = self._pending.get(key)
        if held is not None:
            # The scheduler never lets two requests share a key; if it happens, neither may take the other's KV.
            logger.error("kvpush consumer: request %s reuses transfer key %s of request %s", recv.req_id, key, held.expected.req_id)
            return
        receive = self._pending[key] = Receive(recv)
        self._by_request[recv.req_id] = key
        self._fresh_until = self.clock.now() + self.fresh_poll_s
        if self._early_due.pop(key, None) is not None:
            self._due.add(key)
        unclaimed = self._unclaimed.pop(key, None)
        for note in unclaimed.notes if unclaimed is not None else ():
            self._count(receive, note)
        self._check(key, receive)

    def fail(self, req_id: str, reason: str) -> None:
        key = self._by_request.pop(req_id, None)
        if key is not None and self._pending.get(key) is not None and self._pending[key].expected.req_id == req_id:
            del self._pending[key]
            self._due.discard(key)
        if req_id not in self._reported:
            logger.warning("kvpush consumer: request %s failed: %s", req_id, reason)
            self._publish(req_id, failed=True)

    def take_results(self) -> tuple[set[str], set[str]]:
        """(finished, failed): every failed id is also finished, as vLLM expects."""
        with self._lock:
            finished, failed = self._finished | self._failed, self._failed
            self._finished, self._failed = set(), set()
        return finished, failed

    def take_received_times(self) -> dict[str, int]:
        """When each receive published since the last call got its last notification (wall ns), for the scheduler's
        d_wait_tail; published with its result, so never later than it."""
        with self._lock:
            received, self._received_ns = self._received_ns, {}
        return received

    # ---- progress -------------------------------------------------------------------------

    def step(self) -> float | None:
        """Takes new notifications; returns when to poll next at the latest while receives wait (None: the thread's intervals rule).

        Returned while a WRITE is due too: the fresh window may end before
        the thread next looks at `busy`, and must not leave it waiting for
        idle_poll then.
        """
        for sender, messages in self.transport.notifications().items():
            for message in messages:
                self._on_notification(sender, message)
        now = self.clock.now()
        if self._unclaimed or self._early_due or self._posted:
            cutoff = now - EARLY_NOTIFICATION_TTL_S
            for key in [k for k, u in self._unclaimed.items() if u.first_seen < cutoff]:
                del self._unclaimed[key]
            for key in [k for k, seen in self._early_due.items() if seen < cutoff]:
                del self._early_due[key]
            for key in [k for k, (_, seen) in self._posted.items() if seen < cutoff]:
                del self._posted[key]
        return now + self.waiting_poll_s if self._pending and self.waiting_poll_s is not None else None

    def _on_notification(self, sender: str, message: bytes) -> None:
        if message == HELLO:
            return
        posted = parse_posted(message)
        if posted is not None:
            self._on_posted(*posted)
            return
        due = parse_due(message)
        if due is not None:
            if due in self._pending:
                self._due.add(due)
            else:
                self._early_due[due] = self.clock.now()
            return
        note = parse_notification(message)
        if note is None:
            logger.warning("kvpush consumer: ignoring notification %r from %s", message[:64], sender)
            return
        receive = self._pending.get(note.key)
        if receive is None:
            unclaimed = self._unclaimed.setdefault(note.key, UnclaimedNotifications([], self.clock.now()))
            unclaimed.notes.append(note)
            return
        self._count(receive, note)
        self._check(note.key, receive)

    def _on_posted(self, key: Key, post_ns: int) -> None:
        """A producer rank posted its WRITE to this attempt at post_ns: the WRITE segment runs from the latest rank's post
        to the last notification, whichever comes first here."""
        received_ns = self._awaiting_posted.pop(key, None)
        if received_ns is not None:
            self.spans.segments.segment("write_transfer", post_ns, received_ns)
        else:
            self._posted[key] = (max(post_ns, self._posted.get(key, (0, 0.0))[0]), self.clock.now())

    def _count(self, receive: Receive, note: Notification) -> None:
        expected = receive.expected
        if (note.first_token, note.num_tokens) != (expected.first_token, expected.num_tokens):
            # Never report KV received that does not cover the registered tokens; the deadline fails it.
            logger.error("kvpush consumer: %s from producer rank %d wrote tokens [%d, +%d); request %s registered [%d, +%d)",
                         note.key, note.producer, note.first_token, note.num_tokens, expected.req_id, expected.first_token, expected.num_tokens)
            return
        receive.parts_seen[note.producer] = receive.parts_seen.get(note.producer, 0) + 1
        self._due.add((receive.expected.transfer_id, receive.expected.attempt))  # more parts or ranks may follow at once
        if note.parts:
            receive.parts_total[note.producer] = note.parts
        receive.needed = note.needed

    def _check(self, key: Key, receive: Receive) -> None:
        if receive.needed and receive.complete_producers() >= receive.needed:
            del self._pending[key]
            self._due.discard(key)
            self._by_request.pop(receive.expected.req_id, None)
            now_ns = int(self.clock.wall() * 1e9)
            self.spans.emit("d.wait_for_kv", receive.expected.alloc_ns, now_ns, receive.expected, producers=receive.needed, parts=sum(receive.parts_seen.values()))
            self.spans.segments.kv_wait(receive.expected.alloc_ns, now_ns)
            posted = self._posted.pop(key, None)
            if posted is not None:
                self.spans.segments.segment("write_transfer", posted[0], now_ns)
            else:  # the WRITE's notification overtook its posted notification
                self._awaiting_posted[key] = now_ns
                if len(self._awaiting_posted) > AWAITING_POSTED_MEMORY:
                    self._awaiting_posted.popitem(last=False)
            self._publish(receive.expected.req_id, failed=False, received_ns=now_ns)

    def _publish(self, req_id: str, *, failed: bool, received_ns: int = 0) -> None:
        self._reported[req_id] = None
        if len(self._reported) > REPORTED_MEMORY:
            self._reported.popitem(last=False)
        self.spans.segments.outcome("failed" if failed else "received")
        with self._lock:
            (self._failed if failed else self._finished).add(req_id)
            if received_ns:
                self._received_ns[req_id] = received_ns
                if len(self._received_ns) > REPORTED_MEMORY:  # a vLLM that never asks for them (take_received_times)
                    del self._received_ns[next(iter(self._received_ns))]
        self.on_result()


class Consumer:
    """A decode worker's transfer thread around its ConsumerCore, and the engine thread's polls.

    The core is single-threaded: the transfer thread and the engine thread
    take turns on it under one lock, held for microseconds.
    """

    def __init__(self, core: ConsumerCore, poll_interval_s: float, idle_poll_s: float):
        self.core = core
        self.poll_interval_s = poll_interval_s
        self.ready = threading.Event()  # set when a result is waiting
        core.on_result = self.ready.set
        self._pending = 0
        self._count_lock = threading.Lock()
        self._core_lock = threading.Lock()
        # The thread polls at the waiting pace (fast when that is None: KV in GPU memory);
        # the engine thread polls at each step's end and fast in idle steps.
        background_s = core.waiting_poll_s if core.waiting_poll_s is not None else poll_interval_s
        self._thread = TransferThread("kvpush-consumer", _LockedCore(core, self._core_lock), background_s, idle_poll_s)

    def expect(self, recv: DestinationReady) -> None:
        with self._count_lock:
            self._pending += 1
        self._thread.put(("expect", recv))

    def fail(self, req_id: str, reason: str) -> None:
        self._thread.put(("fail", req_id, reason))

    def take_results(self) -> tuple[set[str], set[str]]:
        self.ready.clear()  # before taking: a result racing with us sets it again
        finished, failed = self.core.take_results()
        if finished:
            with self._count_lock:
                self._pending = max(0, self._pending - len(finished))
        return finished, failed

    def poll(self) -> tuple[set[str], set[str]]:
        """Engine thread: takes NIXL's new notifications now, then the results."""
        with self._core_lock:
            self.core.step()
        return self.take_results()

    def wait(self, wait_s: float) -> tuple[set[str], set[str]]:
        """Engine thread, in a step with nothing to compute: the first results within wait_s (none: empty sets).

        Polls every poll_interval while a WRITE is due, else every
        waiting_poll (a failure the transfer thread publishes ends a wait
        early).
        """
        deadline = time.monotonic() + wait_s
        while (left := deadline - time.monotonic()) > 0:
            if self.core.busy:
                time.sleep(min(self.poll_interval_s, left))
            else:
                self.ready.wait(min(left, self.core.waiting_poll_s or left))
            finished, failed = self.poll()
            if finished:
                return finished, failed
        return set(), set()

    def has_work(self) -> bool:
        return self._pending > 0

    def stop(self) -> None:
        self._thread.stop()


class _LockedCore:
    """The transfer thread's view of a core the engine thread also steps."""

    def __init__(self, core: ConsumerCore, lock: threading.Lock):
        self._core = core
        self._lock = lock

    def handle(self, item: tuple) -> None:
        with self._lock:
            self._core.handle(item)

    def step(self) -> float | None:
        with self._lock:
            return self._core.step()

    @property
    def busy(self) -> bool:
        return self._core.busy
