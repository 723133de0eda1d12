# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""How each request ended (ok, failed, hung, wrong, disconnected) and the counts of a phase."""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence
from typing import Any

from bench.chaos.client import Reply
from bench.chaos.settings import FAILURE_SLACK_S


@dataclasses.dataclass
class Outcome:
    """One request and how it ended."""

    phase: str
    source: str  # "router", or "direct-d"/"direct-p" for requests sent straight to an engine
    request_id: str
    prompt_tokens: int
    max_tokens: int
    stream: bool
    start_s: float  # since the run started
    elapsed_s: float
    deadline_s: float
    status: int
    result: str  # ok, failed, hung, wrong, disconnected
    reason: str = ""  # failed: the router's "reason" ("" when the answer had none)
    detail: str = ""


def classify(reply: Reply, expected: Sequence[int] | None, max_tokens: int) -> tuple[str, str, str]:
    """(result, reason, detail) of a reply; expected is the reference's tokens (None: any 200 is ok)."""
    if reply.disconnected:
        return "disconnected", "", ""
    if reply.hung:
        return "hung", "", f"no answer after {reply.elapsed_s:.1f} s; status {reply.status}"
    if reply.status == 200 and reply.error is None and reply.done:
        if expected is None:
            return "ok", "", ""
        want = list(expected[:max_tokens])
        if reply.token_ids != want:
            return "wrong", "", f"got {reply.token_ids[:16]} want {want[:16]}"
        return "ok", "", ""
    if reply.error is not None:
        reason = str(reply.error.get("reason") or "")
        return "failed", reason, str(reply.error.get("message", ""))[:300]
    if reply.status == 200:
        return "failed", "", f"the answer ended early ({reply.exception or 'no [DONE]'}) after {len(reply.token_ids)} tokens"
    return "failed", "", reply.exception or reply.raw


def summarize(outcomes: Sequence[Outcome]) -> dict[str, Any]:
    """Counts by result, failures by reason and status, and the latest failure relative to its deadline."""
    counts = collections.Counter(o.result for o in outcomes)
    by_reason = collections.Counter(f"{o.reason or 'NO_REASON'} ({o.status or 'no answer'})" for o in outcomes if o.result == "failed")
    failures = [o for o in outcomes if o.result == "failed"]
    over = [o.elapsed_s - o.deadline_s for o in failures]
    late = [o for o in failures if o.elapsed_s > o.deadline_s + FAILURE_SLACK_S]
    no_reason = [o for o in failures if not o.reason]
    return {
        "requests": len(outcomes),
        "ok": counts["ok"],
        "failed": counts["failed"],
        "hung": counts["hung"],
        "wrong": counts["wrong"],
        "disconnected": counts["disconnected"],
        "failures_by_reason": dict(sorted(by_reason.items())),
        "max_failure_minus_deadline_s": round(max(over), 3) if over else None,
        "late_failures": len(late),
        "failures_without_reason": len(no_reason),
        "examples": {
            "late": [dataclasses.asdict(o) for o in late[:5]],
            "without_reason": [dataclasses.asdict(o) for o in no_reason[:5]],
            "wrong": [dataclasses.asdict(o) for o in outcomes if o.result == "wrong"][:5],
            "hung": [dataclasses.asdict(o) for o in outcomes if o.result == "hung"][:5],
        },
    }
