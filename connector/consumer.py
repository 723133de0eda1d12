# SPDX-License-Identifier: Apache-2.0
"""Completion counting on a decode worker.

Every producer rank that writes to this rank sends one NIXL notification
per transfer attempt, and each says how many producer ranks to expect. When
all have arrived, the KV is in place and the request is reported received.

Who polls NIXL: the engine thread, once per engine step (a cheap call, and
the scheduler can act on a completion only at a step boundary anyway), and,
when a step has nothing to compute, in a short loop instead of stepping
again. A background thread keeps the agent progressing (connection setup
with producers, stray notifications) only while the engine thread has not
polled for a while, so during busy decoding no second thread competes for
the GIL.
"""

from __future__ import annotations

import logging
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
# The background thread polls only when the engine thread has not for this long.
ENGINE_POLL_WINDOW_S = 0.05

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
        # One lock over the agent (not thread-safe without NIXL's progress
        # thread) and the tables below.
        self._lock = threading.Lock()
        self._finished: set[str] = set()
        self._failed: set[str] = set()
        self._pending: dict[Key, Receive] = {}
        self._by_request: dict[str, Key] = {}
        self._early: dict[Key, Early] = {}
        self._engine_polled = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvpush-consumer", daemon=True)
        self._thread.start()

    # ---- from the engine thread -----------------------------------------------------

    def expect(self, recv: RecvExpected) -> None:
        key = (recv.transfer_id, recv.attempt)
        with self._lock:
            receive = Receive(recv)
            self._pending[key] = receive
            self._by_request[recv.req_id] = key
            early = self._early.pop(key, None)
            if early is not None:
                receive.producers, receive.needed = early.producers, early.needed
                self._check(key, receive, time.time_ns())

    def fail(self, req_id: str, reason: str) -> None:
        with self._lock:
            key = self._by_request.pop(req_id, None)
            if key is not None and self._pending.pop(key, None) is not None:
                logger.warning("kvpush consumer: request %s failed: %s", req_id, reason)
                self._failed.add(req_id)

    def take_results(self, wait_s: float = 0.0) -> tuple[set[str], set[str]]:
        """(finished, failed), every failed id also finished, as vLLM expects.

        Polls NIXL first. With wait_s > 0 (an engine step with nothing to
        compute) and receives pending, it keeps polling for up to wait_s until
        something finishes, instead of letting the engine step again.
        """
        deadline = time.monotonic() + wait_s
        while True:
            with self._lock:
                self._engine_polled = time.monotonic()
                self._poll()
                if self._finished or self._failed or not self._pending or self._engine_polled >= deadline:
                    finished, failed = self._finished | self._failed, self._failed
                    self._finished, self._failed = set(), set()
                    return finished, failed
            time.sleep(self.poll_interval_s)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    # ---- background progress ---------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.wait(self.idle_poll_s):
            try:
                with self._lock:
                    if time.monotonic() - self._engine_polled > ENGINE_POLL_WINDOW_S:
                        self._poll()
                    self._expire_early()
            except Exception:
                logger.exception("kvpush consumer: unexpected error")

    def _poll(self) -> None:
        """Fetches notifications and counts them (lock held)."""
        now_ns = time.time_ns()
        for sender, messages in self.agent.notifications().items():
            for message in messages:
                self._on_notification(sender, message, now_ns)

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
            self._finished.add(receive.expected.req_id)

    def _expire_early(self) -> None:
        if not self._early:
            return
        cutoff = time.monotonic() - EARLY_NOTIFICATION_TTL_S
        for key in [k for k, e in self._early.items() if e.first_seen < cutoff]:
            del self._early[key]
