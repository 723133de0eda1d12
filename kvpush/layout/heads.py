# SPDX-License-Identifier: Apache-2.0
"""Which producer rank writes which KV heads to which consumer rank.

P and D may use different tensor-parallel sizes. Each rank holds a
contiguous range of global KV heads (ranges repeat when TP exceeds the head
count, i.e. heads are replicated; an MLA latent is one head every rank
holds). Every head a consumer rank needs is written by exactly one producer
rank: of the producers holding it, the one at the consumer's rank modulo
their count. Replicas so spread the WRITEs over the producer ranks (with MLA
and equal TP sizes rank i writes rank i) instead of one rank writing them
all. A consumer rank expects one notification per distinct producer rank
that writes to it (one with MLA).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RankHeads:
    """The global KV heads one tensor-parallel rank holds."""

    tp_rank: int
    first_head: int
    num_heads: int

    @property
    def stop(self) -> int:
        return self.first_head + self.num_heads


@dataclass(frozen=True)
class HeadRoute:
    """Producer `producer` writes global heads [first_head, stop) to `consumer`."""

    producer: int
    consumer: int
    first_head: int
    stop: int


def even_split(total_heads: int, tp_size: int) -> list[RankHeads]:
    """The head ranges vLLM gives each rank for `total_heads` KV heads."""
    if total_heads <= 0 or tp_size <= 0:
        raise ValueError("total_heads and tp_size must be positive")
    if tp_size >= total_heads:
        if tp_size % total_heads:
            raise ValueError(f"tp_size {tp_size} is not a multiple of {total_heads} heads")
        per_head = tp_size // total_heads
        return [RankHeads(r, r // per_head, 1) for r in range(tp_size)]
    if total_heads % tp_size:
        raise ValueError(f"{total_heads} heads do not split evenly over tp_size {tp_size}")
    n = total_heads // tp_size
    return [RankHeads(r, r * n, n) for r in range(tp_size)]


def routes(producers: list[RankHeads], consumers: list[RankHeads]) -> list[HeadRoute]:
    """Every (producer, consumer, head range) write, ordered by producer then consumer."""
    holders: dict[int, list[int]] = {}
    for p in sorted(producers, key=lambda r: r.tp_rank):
        for h in range(p.first_head, p.stop):
            holders.setdefault(h, []).append(p.tp_rank)
    out: list[HeadRoute] = []
    for c in consumers:
        missing = [h for h in range(c.first_head, c.stop) if h not in holders]
        if missing:
            raise ValueError(f"no producer rank holds heads {missing} needed by consumer rank {c.tp_rank}")
        owner = {h: holders[h][c.tp_rank % len(holders[h])] for h in range(c.first_head, c.stop)}
        start = c.first_head
        for h in range(c.first_head + 1, c.stop + 1):
            if h == c.stop or owner[h] != owner[start]:
                out.append(HeadRoute(owner[start], c.tp_rank, start, h))
                start = h
    out.sort(key=lambda r: (r.producer, r.consumer, r.first_head))
    return out


def consumers_of(producer: int, all_routes: list[HeadRoute]) -> list[int]:
    """Consumer ranks that `producer` writes to, ascending."""
    return sorted({r.consumer for r in all_routes if r.producer == producer})


def expected_notifications(consumer: int, all_routes: list[HeadRoute]) -> int:
    """How many distinct producer ranks write to `consumer`."""
    return len({r.producer for r in all_routes if r.consumer == consumer})
