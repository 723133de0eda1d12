# SPDX-License-Identifier: Apache-2.0
"""Whether engines still reach this broker member, and when it should step out of the shard map because none does.

A member cut off from the engines but not from etcd keeps its shard lease,
so nothing else would move its transfers: every transfer hashed to it would
fail until the partition heals. Every engine keeps streams to every member
in the map (producer ranks' write orders, decode engines' events), so a
member that has had none for `silence_s` while another member reports
engines attached is the one cut off: it steps out of the map (revoking its
lease, so every client drops it at once) and its transfers move to members
engines can reach.

Comparing with the other members is what keeps a fleet-wide engine outage
(every engine restarting) from emptying the map: then no member is reached
and none steps down. A member reports itself unattached after half the
silence, so when all engines go at once every member's report has dropped
before any member's own silence bound passes.

After stepping down, a member waits a hold-off before joining again,
doubling while it keeps being cut off (up to HOLD_OFF_MAX_S): joining back
while still cut off costs its transfers for one silence bound each time.
"""

from __future__ import annotations

# Hold-offs before joining again after a step-down: HOLD_OFF_FIRST_S, doubling up to HOLD_OFF_MAX_S.
HOLD_OFF_FIRST_S = 2.0
HOLD_OFF_MAX_S = 30.0


class EngineReach:
    """One member's record of its engine streams, and the step-down decision (times from one monotonic clock)."""

    def __init__(self, silence_s: float, now: float):
        if silence_s <= 0:
            raise ValueError("the engine silence bound must be positive")
        self.silence_s = silence_s
        self._last_stream = float("-inf")  # the last time an engine stream was attached
        self._serving_since: float | None = None
        self._hold_off_s = HOLD_OFF_FIRST_S
        self.step_downs = 0

    def observe(self, *, streams: int, serving: bool, now: float) -> None:
        """Records how many engine streams are attached and whether the member serves, at now."""
        if streams:
            self._last_stream = now
            if self._serving_since is not None:
                self._hold_off_s = HOLD_OFF_FIRST_S  # reached while in the map: the partition healed
        if not serving:
            self._serving_since = None
        elif self._serving_since is None:
            # Engines open their streams once they see the member in the map: they get the bound from here.
            self._serving_since = now

    def attached(self, now: float) -> bool:
        """What this member reports to the others: reached by an engine within half the silence bound.

        Only a stream counts: a member that just joined and has none yet must not make the others step down.
        """
        return now - self._last_stream < self.silence_s / 2

    def cut_off(self, *, now: float, peers_attached: bool) -> bool:
        """Whether to step down now: serving, no engine stream for the silence bound, and another member is reached."""
        if self._serving_since is None or not peers_attached:
            return False
        return now - max(self._last_stream, self._serving_since) >= self.silence_s

    def next_hold_off(self) -> float:
        """The hold-off for a step-down happening now (the next one, unless reached again meanwhile, is twice as long)."""
        hold_off = self._hold_off_s
        self._hold_off_s = min(hold_off * 2, HOLD_OFF_MAX_S)
        self._serving_since = None
        self.step_downs += 1
        return hold_off
