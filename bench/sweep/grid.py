# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""The sweep's grid of points and each point's workload: prompts and Poisson arrivals, the same for every mode."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence

from kvpush.dev.localstack.prompts import prompt_token_ids


@dataclasses.dataclass(frozen=True)
class Point:
    """One grid point of one iteration; every mode runs it with the same prompts and arrival times."""

    input_len: int
    qps: float
    output_len: int
    iteration: int

    @property
    def qps_label(self) -> str:
        return f"{self.qps:g}"

    def run_name(self, mode: str) -> str:
        """The seed study's file stem: <mode>_qps<q>_in<in>_out<out>_iter<i>."""
        return f"{mode}_qps{self.qps_label}_in{self.input_len}_out{self.output_len}_iter{self.iteration}"

    def request_id(self, mode: str, index: int) -> str:
        return f"{self.run_name(mode)}-r{index:04d}"

    def seed(self, base: int) -> int:
        # Stable across processes (unlike hash()): prompts and arrivals are reproducible.
        return base * 1_000_003 + self.input_len * 7919 + round(self.qps * 1000) * 31 + self.output_len * 17 + self.iteration


@dataclasses.dataclass
class Workload:
    """A point's prompts, Poisson arrival offsets (s from the run's start) and the requests checked for correctness."""

    point: Point
    prompts: list[list[int]]
    offsets_s: list[float]
    checked: list[int]


def shared_prefix_len(input_len: int, shared_prefix: float) -> int:
    """Tokens every prompt of a point shares, for a shared fraction of the prompt."""
    return round(input_len * shared_prefix)


def make_workload(point: Point, num_requests: int, num_checked: int, seed: int, shared_prefix: float = 0.0) -> Workload:
    """Deterministic prompts and arrivals; the checked requests are spread over the run (first to last).

    With `shared_prefix` every prompt of the point starts with the same
    tokens (that fraction of the prompt, its own prefix per point and
    iteration), as requests sharing a system prompt or a document do.
    """
    rng = random.Random(point.seed(seed))
    offsets, now = [], 0.0
    for _ in range(num_requests):
        offsets.append(now)
        now += rng.expovariate(point.qps)
    shared = shared_prefix_len(point.input_len, shared_prefix)
    prefix = prompt_token_ids(shared, seed=point.seed(seed) * 10_007 - 1) if shared else []
    prompts = [prefix + prompt_token_ids(point.input_len - shared, seed=point.seed(seed) * 10_007 + i) for i in range(num_requests)]
    count = min(num_checked, num_requests)
    checked = sorted({round(i * (num_requests - 1) / max(count - 1, 1)) for i in range(count)}) if count else []
    return Workload(point, prompts, offsets, checked)


def requests_for(qps: float, duration_s: float, min_requests: int) -> int:
    """Requests per run: `duration_s` of arrivals at `qps`, at least `min_requests`."""
    return max(min_requests, round(qps * duration_s))


def build_grid(input_lens: Sequence[int], qps_list: Sequence[float], output_lens: Sequence[int], iterations: int) -> list[Point]:
    """Iterations outermost, so a sweep cut short still covers every point once."""
    return [Point(i, q, o, it) for it in range(1, iterations + 1) for o in output_lens for i in input_lens for q in qps_list]
