# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""Steady mixed load: client threads sending requests through the router back to back."""

from __future__ import annotations

import random
import threading
import time

from bench.chaos.client import send
from bench.chaos.log import Log
from bench.chaos.outcomes import Outcome, classify
from bench.chaos.settings import HANG_SLACK_S, MAX_TOKENS_CHOICES, STREAM_SHARE, Settings
from bench.chaos.stack import Stack
from kvpush.dev.localstack.completions import completion_body


class Load:
    """Client threads sending mixed requests through the router back to back; outcomes are kept per phase."""

    def __init__(self, stack: Stack, settings: Settings, log: Log, started: float):
        self.stack = stack
        self.settings = settings
        self.log = log
        self.started = started
        self.outcomes: list[Outcome] = []
        self.phase = ""
        self.disconnect_share = 0.0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._sequence = 0
        self.last_ok_at = 0.0  # time.monotonic() of the last ok answer

    def start(self, phase: str) -> None:
        self.phase = phase
        self._stop.clear()
        self._threads = [threading.Thread(target=self._client, args=(i,), name=f"chaos-client-{i}", daemon=True) for i in range(self.settings.clients)]
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        """Lets every client finish its request (each is bounded by its deadline + HANG_SLACK_S)."""
        self._stop.set()
        bound = time.monotonic() + self.settings.deadline_s + HANG_SLACK_S + 10.0
        for thread in self._threads:
            thread.join(timeout=max(0.1, bound - time.monotonic()))
        stuck = [t.name for t in self._threads if t.is_alive()]
        if stuck:
            self.log(f"client threads still running after their bound: {stuck}")
        self._threads = []

    def _client(self, index: int) -> None:
        rng = random.Random(self.settings.seed * 1000 + index + len(self.outcomes))
        while not self._stop.is_set():
            self.one(rng)
            self._stop.wait(rng.uniform(0, 2 * self.settings.think_s))

    def one(self, rng: random.Random) -> Outcome:
        stack = self.stack
        index = rng.randrange(len(stack.prompts))
        max_tokens = rng.choice(MAX_TOKENS_CHOICES)
        stream = rng.random() < STREAM_SHARE
        with self._lock:
            self._sequence += 1
            request_id = f"chaos-{self.phase}-{self._sequence}"
        disconnect = rng.uniform(0.005, 0.4) if rng.random() < self.disconnect_share else None
        body = completion_body(stack.prompts[index], max_tokens, stream=stream)
        phase = self.phase
        start_s = time.monotonic() - self.started
        deadline_s = self.settings.deadline_s
        reply = send(stack.router_url, "/v1/completions", body, hang_after_s=deadline_s + HANG_SLACK_S, disconnect_after_s=disconnect,
                     headers={"X-Request-Id": request_id})
        result, reason, detail = classify(reply, stack.reference[index].token_ids, max_tokens)
        outcome = Outcome(phase, "router", request_id, len(stack.prompts[index]), max_tokens, stream, round(start_s, 3), round(reply.elapsed_s, 3),
                          deadline_s, reply.status, result, reason, detail)
        with self._lock:
            self.outcomes.append(outcome)
            if result == "ok":
                self.last_ok_at = time.monotonic()
        if result in ("wrong", "hung"):
            self.log(f"{result.upper()}: {request_id} prompt {len(stack.prompts[index])} tok, max_tokens {max_tokens}, stream {stream}: {detail}")
        return outcome

    def record(self, outcome: Outcome) -> None:
        with self._lock:
            self.outcomes.append(outcome)
