# SPDX-License-Identifier: Apache-2.0
"""The decode worker's receive thread.

It owns the worker's NIXL agent and counts completion notifications: every
producer rank that writes to this rank sends one per transfer attempt, and
each says how many producer ranks to expect. When all have arrived, the KV is
in place and the request is reported as received. The thread polls NIXL only
while a receive is pending (and rarely otherwise, to let producers connect);
the engine thread sleeps on `ready` instead of stepping.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from kvpush.connector.metadata import RecvExpected
from kvpush.connector.nixl_agent import HELLO, KvAgent
from kvpush.connector.producer import NOTIF_PREFIX
from kvpush.connector.spans import Spans

logger = logging.getLogger(__name__)

# Notifications for transfers this rank has not been told about yet (they can
# overtake the scheduler's metadata) are kept this long.
EARLY_NOTIFICATION_TTL_S = 60.0

Key = tuple[str, int]


@dataclass
class Receive:
    expected: RecvExpected
    producers: set[int] = field(default_factory=set)
    needed: int = 0  # producer ranks to hear from; 0 until the first notification says


@dataclass
class Early:
    producers: set[int]
    needed: int
    first_seen: float


def parse_notification(message: bytes) -> tuple[Key, int, int] | None:
    """(transfer key, producer rank, producers expected), or None if not a kvpush completion."""
    try:
        prefix, transfer_id, attempt, rank, expected = message.decode().split("|")
        if prefix != NOTIF_PREFIX:
            return None
        return (transfer_id, int(attempt)), int(rank), int(expected)
    except ValueError:
        return None


class Consumer:
    """Counts notifications per transfer; one per decode worker."""

    def __init__(self, agent: KvAgent, spans: Spans, poll_interval_s: float, idle_poll_s: float):
        self.agent = agent
        self.spans = spans
        self.poll_interval_s = poll_interval_s
        self.idle_poll_s = idle_poll_s
        self.ready = threading.Event()  # set when a result is waiting
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._finished: set[str] = set()
        self._failed: set[str] = set()
        self._pending: dict[Key, Receive] = {}
        self._by_request: dict[str, Key] = {}
        self._early: dict[Key, Early] = {}
        self._pending_count = 0
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="kvpush-consumer", daemon=True)
        self._thread.start()

    # ---- from the engine thread -----------------------------------------------------

    def expect(self, recv: RecvExpected) -> None:
        with self._lock:
            self._pending_count += 1
        self._inbox.put(("expect", recv))

    def fail(self, req_id: str, reason: str) -> None:
        self._inbox.put(("fail", req_id, reason))

    def take_results(self) -> tuple[set[str], set[str]]:
        """(finished, failed): every failed id is also finished, as vLLM expects."""
        with self._lock:
            finished, failed = self._finished | self._failed, self._failed
            self._finished, self._failed = set(), set()
        self.ready.clear()
        return finished, failed

    def has_work(self) -> bool:
        return self._pending_count > 0

    def stop(self) -> None:
        self._stop = True
        self._inbox.put(("stop",))
        self._thread.join(timeout=5)

    # ---- the thread ---------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop:
            try:
                self._step()
            except Exception:
                logger.exception("kvpush consumer: unexpected error")

    def _step(self) -> None:
        try:
            item = self._inbox.get(timeout=self.poll_interval_s if self._pending else self.idle_poll_s)
        except queue.Empty:
            item = None
        while item is not None:
            self._handle(item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                item = None
        now_ns = time.time_ns()
        for sender, messages in self.agent.notifications().items():
            for message in messages:
                self._on_notification(sender, message, now_ns)
        self._expire_early()

    def _handle(self, item: tuple) -> None:
        if item[0] == "expect":
            recv: RecvExpected = item[1]
            key = (recv.transfer_id, recv.attempt)
            receive = Receive(recv)
            self._pending[key] = receive
            self._by_request[recv.req_id] = key
            early = self._early.pop(key, None)
            if early is not None:
                receive.producers, receive.needed = early.producers, early.needed
                self._check(key, receive, time.time_ns())
        elif item[0] == "fail":
            key = self._by_request.pop(item[1], None)
            if key is not None and self._pending.pop(key, None) is not None:
                logger.warning("kvpush consumer: request %s failed: %s", item[1], item[2])
                self._publish(item[1], failed=True)

    def _on_notification(self, sender: str, message: bytes, now_ns: int) -> None:
        if message == HELLO:
            return
        parsed = parse_notification(message)
        if parsed is None:
            logger.warning("kvpush consumer: ignoring notification %r from %s", message[:64], sender)
            return
        key, producer, needed = parsed
        receive = self._pending.get(key)
        if receive is None:
            early = self._early.setdefault(key, Early(set(), needed, time.monotonic()))
            early.producers.add(producer)
            return
        receive.producers.add(producer)
        receive.needed = needed
        self._check(key, receive, now_ns)

    def _check(self, key: Key, receive: Receive, now_ns: int) -> None:
        if receive.needed and len(receive.producers) >= receive.needed:
            del self._pending[key]
            self._by_request.pop(receive.expected.req_id, None)
            self.spans.emit("d.wait_for_kv", receive.expected.alloc_ns, now_ns, receive.expected, producers=len(receive.producers))
            self._publish(receive.expected.req_id, failed=False)

    def _publish(self, req_id: str, *, failed: bool) -> None:
        with self._lock:
            (self._failed if failed else self._finished).add(req_id)
            self._pending_count -= 1
        self.ready.set()

    def _expire_early(self) -> None:
        if not self._early:
            return
        cutoff = time.monotonic() - EARLY_NOTIFICATION_TTL_S
        for key in [k for k, e in self._early.items() if e.first_seen < cutoff]:
            del self._early[key]
