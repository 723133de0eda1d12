# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""A run's figures: percentiles, whether it kept up with its arrivals, and its outputs against the single-engine references."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

from bench.sweep.grid import Point, Workload
from bench.sweep.load import RequestRecord
from kvpush.dev.localstack.completions import Completion, max_logprob_diff
from kvpush.report.percentiles import percentile

LOGPROB_ATOL = 1e-3

# A point keeps up with its offered load when its requests finish at ≥ this
# share of the rate they arrived at (see `sustained`).
SUSTAINED_SHARE = 0.9


def stats(values: Iterable[float | None]) -> dict[str, float | None]:
    present = [v for v in values if v is not None and not math.isnan(v)]
    if not present:
        return {"p50": None, "p90": None, "p99": None, "mean": None, "n": 0}
    return {"p50": percentile(present, 50), "p90": percentile(present, 90), "p99": percentile(present, 99), "mean": sum(present) / len(present),
            "n": len(present)}


def sustained(records: Sequence[RequestRecord], workload: Workload) -> tuple[bool, float]:
    """Whether the run kept up with its arrivals, and the share it kept up at.

    Arrival rate: requests / (last arrival + one mean gap). Completion
    rate: requests / (last completion − first send). A stack that keeps up
    finishes about one request latency after the last arrival (share near
    1); a saturated one builds a backlog that finishes late. Every request
    must also have succeeded.
    """
    if not records or not all(r.ok for r in records):
        return False, 0.0
    n = len(records)
    arrival_window = workload.offsets_s[-1] + 1.0 / workload.point.qps
    completion_window = max(r.sent_s + r.e2e_ms / 1000 for r in records) - min(r.sent_s for r in records)
    share = (n / completion_window) / (n / arrival_window) if completion_window > 0 else 0.0
    return share >= SUSTAINED_SHARE, share


def check_correctness(records: Sequence[RequestRecord], workload: Workload, references: dict[tuple[Point, int], Completion]) -> dict[str, Any]:
    """Compares the checked requests with the single-engine references."""
    outcomes = []
    for index in workload.checked:
        record = records[index]
        if not record.ok:
            outcomes.append({"index": index, "ok": False, "why": record.error or "no output"})
            continue
        reference = references[(workload.point, index)]
        diff = max_logprob_diff(reference, Completion(record.token_ids, record.logprobs))
        outcomes.append({"index": index, "ok": diff <= LOGPROB_ATOL, "tokens_equal": record.token_ids == reference.token_ids,
                         "max_logprob_diff": None if math.isinf(diff) else diff})
    return {"checked": len(outcomes), "passed": sum(o["ok"] for o in outcomes), "ok": all(o["ok"] for o in outcomes), "outcomes": outcomes}


def summarize(records: Sequence[RequestRecord], wall_s: float, workload: Workload) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    keeps_up, share = sustained(records, workload)
    output_tokens = sum(len(r.token_ids) for r in ok)
    span = (max(r.sent_s + r.e2e_ms / 1000 for r in ok) - min(r.sent_s for r in ok)) if ok else 0.0
    quarter = max(1, len(records) // 4)
    return {
        "requests": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "errors": sorted({r.error for r in records if r.error})[:5],
        "ttft_ms": stats(r.ttft_ms for r in ok),
        "tpot_ms": stats(r.tpot_ms for r in ok),
        "itl_ms": stats(x for r in ok for x in r.itl_ms),
        "e2e_ms": stats(r.e2e_ms for r in ok),
        # A saturated run's TTFT grows from the first arrivals to the last.
        "ttft_first_quarter_p50_ms": stats(r.ttft_ms for r in records[:quarter] if r.ok)["p50"],
        "ttft_last_quarter_p50_ms": stats(r.ttft_ms for r in records[-quarter:] if r.ok)["p50"],
        "max_send_lag_ms": max((r.sent_s - r.scheduled_s) * 1000 for r in records if not math.isnan(r.sent_s)) if records else None,
        "request_throughput_per_s": len(ok) / span if span > 0 else None,
        "output_throughput_tok_per_s": output_tokens / span if span > 0 else None,
        "offered_qps": workload.point.qps,
        "sustained": keeps_up,
        "sustained_share": share,
        "wall_s": wall_s,
    }
