# SPDX-License-Identifier: Apache-2.0
"""Records the engine's TTFT segments and transfer outcomes as plain numbers, from any thread, for vLLM's stats (segment_stats).

Free of vLLM so that the transfer cores and their unit tests need none.
"""

from __future__ import annotations

import threading
from typing import Any

# Outcomes a rank counts: P's WRITEs, D's receives.
OUTCOMES = {"prefill": ("written", "failed", "revoked"), "decode": ("received", "failed")}

# The stats payload's keys (it crosses processes as plain dicts, lists and numbers).
SEGMENTS_KEY = "segments"  # segment -> [seconds]
KV_WAIT_KEY = "kv_wait"  # [seconds]: D's blocks allocated -> last notification (off the critical path)
OUTCOMES_KEY = "outcomes"  # outcome -> count
BYTES_KEY = "bytes"  # bytes written
FIRST_STEPS_KEY = "first_steps_done_ns"  # [wall ns]: D's first decode steps that ended, for d_output


def empty_observations() -> dict[str, Any]:
    return {SEGMENTS_KEY: {}, KV_WAIT_KEY: [], OUTCOMES_KEY: {}, BYTES_KEY: 0, FIRST_STEPS_KEY: []}


class SegmentRecorder:
    """One connector instance's observations since vLLM last took them; any thread records, the engine thread drains."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data = empty_observations()

    def segment(self, name: str, start_ns: int, end_ns: int) -> None:
        with self._lock:
            self._data[SEGMENTS_KEY].setdefault(name, []).append(max(end_ns - start_ns, 0) / 1e9)

    def kv_wait(self, start_ns: int, end_ns: int) -> None:
        with self._lock:
            self._data[KV_WAIT_KEY].append(max(end_ns - start_ns, 0) / 1e9)

    def outcome(self, outcome: str, nbytes: int = 0) -> None:
        with self._lock:
            outcomes = self._data[OUTCOMES_KEY]
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
            self._data[BYTES_KEY] += nbytes

    def first_step_done(self, end_ns: int) -> None:
        with self._lock:
            self._data[FIRST_STEPS_KEY].append(end_ns)

    def drain(self) -> dict[str, Any] | None:
        """What was recorded since the last drain (None if nothing: vLLM then sends no stats for this connector)."""
        with self._lock:
            data, self._data = self._data, empty_observations()
        return None if is_empty(data) else data


def is_empty(data: dict[str, Any]) -> bool:
    """Whether an observations payload holds nothing to export."""
    return not (any(data[SEGMENTS_KEY].values()) or data[KV_WAIT_KEY] or data[OUTCOMES_KEY] or data[FIRST_STEPS_KEY])
