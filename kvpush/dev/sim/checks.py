# SPDX-License-Identifier: Apache-2.0
"""The invariants the simulation checks, and the record of their violations.

Checked as things happen (after every event):
* write-after-free: no WRITE lands on a decode block its request no longer owns;
* short-receive: a decode request is reported received only when every
  producer rank's WRITE for its key landed covering exactly its tokens, with
  the KV of its own prompt (not a colliding request's);
* double-write: a producer rank posts at most one WRITE per attempt;
* agent-unloaded-in-flight: no peer agent is unloaded with WRITEs to it in flight.

Checked against each request's deadline:
* late-end: every client request is answered by its deadline + 1 s, and
  every decode request's blocks are released by its deadline + hold margin
  + 1 s (the fencing bound);

Checked once the schedule has quiesced:
* leak: nothing is left allocated or remembered beyond its retention: no
  decode block owned, no source held, no order, job or wait pending, no
  unsettled attempt at the broker, no unanswered client.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Violation:
    kind: str
    detail: str
    time: float


@dataclass
class Violations:
    """Everything that went wrong in one schedule (empty: the schedule passed)."""

    items: list[Violation] = field(default_factory=list)
    clock: object = None  # the World, for timestamps

    def add(self, kind: str, detail: str) -> None:
        self.items.append(Violation(kind, detail, getattr(self.clock, "time", 0.0)))

    def __bool__(self) -> bool:
        return bool(self.items)

    @property
    def kinds(self) -> list[str]:
        return sorted({v.kind for v in self.items})
