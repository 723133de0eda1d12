# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""Per-request critical-path segments of TTFT, computed from flat spans (`kvpush.telemetry.read_spans`).

A request is one `router.request` span. Its P, D and broker spans are the
spans of the same trace, plus spans elsewhere that carry its
`kvpush.transfer_id`; only those of the request's final attempt count.

The critical path is a chain of instants, each read from a span:

    request           router.request start
    p_arrival         p.queue start (vLLM's arrival time of the prefill leg)
    p_scheduled       p.queue end
    p_computed        p.prefill end (the forward that completed the prompt)
    write_posted      p.write_post end (latest producer rank)
    kv_received       d.wait_for_kv end (latest decode rank: last notification)
    d_scheduled       d.first_decode_step start
    d_step_done       d.first_decode_step end
    d_output_read     router.decode_leg's first_output event (the router read D's first output)
    first_token       router.request's first_token event

and each segment is the time between two consecutive instants, so the
segments add up to TTFT. Instants are taken in chain order and clamped to
be non-decreasing and inside [request, first_token]: segments are never
negative even across hosts with skewed clocks (on one host clamping never
changes anything; `clamped` tells when it did). A segment one of whose
instants is missing (for example every P/D segment under upstream
connectors, which emit no such spans) is None.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

from kvpush.report.percentiles import percentile
from kvpush.telemetry import ATTR_ATTEMPT, ATTR_TRANSFER_ID, FIRST_OUTPUT_EVENT, FIRST_TOKEN_EVENT

ROUTER_SPAN = "router.request"

INSTANTS = ("request", "p_arrival", "p_scheduled", "p_computed", "write_posted", "kv_received", "d_scheduled", "d_step_done", "d_output_read", "first_token")


@dataclasses.dataclass(frozen=True)
class Segment:
    """One critical-path segment: from instant `start` to instant `end`."""

    name: str
    label: str
    start: str
    end: str


SEGMENTS: tuple[Segment, ...] = (
    Segment("router_to_p", "router → P dispatch", "request", "p_arrival"),
    Segment("p_queue", "P queue", "p_arrival", "p_scheduled"),
    Segment("p_prefill", "P prefill compute", "p_scheduled", "p_computed"),
    Segment("handoff", "hand-off (prefill end → WRITE posted)", "p_computed", "write_posted"),
    Segment("write_transfer", "WRITE transfer (posted → last notification at D)", "write_posted", "kv_received"),
    Segment("d_wait_tail", "D wait tail (KV in → D scheduled)", "kv_received", "d_scheduled"),
    Segment("d_first_decode_step", "D first decode step", "d_scheduled", "d_step_done"),
    Segment("d_output", "D output → router (D's engine core + API server)", "d_step_done", "d_output_read"),
    Segment("router_overhead", "router → client (the router's relay)", "d_output_read", "first_token"),
)

# Measured spans shown beside the chain (not summed): what the hand-off and
# the transfer are made of, and what ran off the critical path.
DETAILS: tuple[tuple[str, str, str], ...] = (
    ("descriptor_prep", "of hand-off: descriptor prep", "p.descriptor_prep"),
    ("write_post", "of hand-off: WRITE post", "p.write_post"),
    ("p_write_transfer", "p.write_transfer (posted → P saw completion)", "p.write_transfer"),
    ("d_register", "D RegisterDestination call (off path)", "d.register_rpc"),
    ("broker_rendezvous", "broker rendezvous wait (off path)", "broker.rendezvous"),
)


@dataclasses.dataclass
class RequestBreakdown:
    """One routed request: its instants (ns, after clamping), segments and details (ms)."""

    trace_id: str
    transfer_id: str
    attempt: int
    client_request_id: str
    status: int
    start_ns: int
    instants: dict[str, int | None]
    segments: dict[str, float | None]
    details: dict[str, float | None]
    clamped: bool

    @property
    def ttft_ms(self) -> float | None:
        first = self.instants["first_token"]
        return None if first is None else (first - self.start_ns) / 1e6

    @property
    def handoff_overhead_ms(self) -> float | None:
        """TTFT minus the two computations it cannot avoid: P's prefill and D's first decode step."""
        ttft, prefill, step = self.ttft_ms, self.segments["p_prefill"], self.segments["d_first_decode_step"]
        return None if ttft is None or prefill is None or step is None else ttft - prefill - step

    @property
    def owned_handoff_ms(self) -> float | None:
        """The hand-off kvpush owns: P's prefill end → D's first decode step starts (hand-off, WRITE transfer, D wait tail)."""
        start, end = self.instants["p_computed"], self.instants["d_scheduled"]
        return None if start is None or end is None else (end - start) / 1e6

    @property
    def complete(self) -> bool:
        return all(value is not None for value in self.segments.values())


@dataclasses.dataclass(frozen=True)
class Row:
    """Percentiles of one quantity over the requests that have it."""

    name: str
    label: str
    p50: float | None
    p90: float | None
    mean: float | None
    count: int


@dataclasses.dataclass
class Breakdown:
    """The requests of a trace file and the percentiles of their segments."""

    requests: list[RequestBreakdown]
    excluded: dict[str, int]  # reason -> number of router.request spans left out

    def rows(self) -> list[Row]:
        """One row per segment, then TTFT, the hand-off overhead and the hand-off kvpush owns (all in ms)."""
        rows = [_row(s.name, s.label, [r.segments[s.name] for r in self.requests]) for s in SEGMENTS]
        rows.append(_row("ttft", "TTFT", [r.ttft_ms for r in self.requests]))
        rows.append(_row("handoff_overhead", "hand-off overhead (TTFT − P prefill − D first step)", [r.handoff_overhead_ms for r in self.requests]))
        rows.append(_row("owned_handoff", "kvpush's hand-off (prefill end → D's first step starts)", [r.owned_handoff_ms for r in self.requests]))
        return rows

    def detail_rows(self) -> list[Row]:
        return [_row(name, label, [r.details[name] for r in self.requests]) for name, label, _ in DETAILS]


def _row(name: str, label: str, values: Iterable[float | None]) -> Row:
    present = [v for v in values if v is not None]
    if not present:
        return Row(name, label, None, None, None, 0)
    return Row(name, label, percentile(present, 50), percentile(present, 90), sum(present) / len(present), len(present))


def _event_ns(spans: Iterable[dict[str, Any]], event: str) -> int | None:
    return min((e["time_ns"] for span in spans for e in span["events"] if e["name"] == event), default=None)


def _request_instants(root: dict[str, Any], related: list[dict[str, Any]]) -> dict[str, int | None]:
    by_name: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for span in related:
        by_name[span["name"]].append(span)

    def earliest_start(name: str) -> int | None:
        return min((s["start_ns"] for s in by_name[name]), default=None)

    def latest_end(name: str) -> int | None:
        return max((s["end_ns"] for s in by_name[name]), default=None)

    return {
        "request": root["start_ns"],
        "p_arrival": earliest_start("p.queue"),
        "p_scheduled": latest_end("p.queue") if by_name["p.queue"] else earliest_start("p.prefill"),
        "p_computed": latest_end("p.prefill"),
        "write_posted": latest_end("p.write_post"),
        "kv_received": latest_end("d.wait_for_kv"),
        "d_scheduled": earliest_start("d.first_decode_step"),
        "d_step_done": latest_end("d.first_decode_step"),
        "d_output_read": _event_ns(by_name["router.decode_leg"], FIRST_OUTPUT_EVENT),
        "first_token": _event_ns([root], FIRST_TOKEN_EVENT),
    }


def _between_ms(start: int | None, end: int | None) -> float | None:
    return None if start is None or end is None else (end - start) / 1e6


def _clamp(instants: dict[str, int | None]) -> tuple[dict[str, int | None], bool]:
    """Makes present instants non-decreasing in chain order and bounded by the request's start and first token."""
    low = instants["request"]
    assert low is not None, "the request's own span always gives its start"
    high = instants["first_token"]
    clamped = False
    result: dict[str, int | None] = {}
    for name in INSTANTS:
        value = instants[name]
        if value is not None:
            bounded = max(value, low)
            if high is not None:
                bounded = min(bounded, high)
            clamped |= bounded != value
            value = low = bounded
        result[name] = value
    return result, clamped


def _duration_ms(spans: list[dict[str, Any]]) -> float | None:
    # Several ranks each emit one: the longest is the one the request waited for.
    return max(((s["end_ns"] - s["start_ns"]) / 1e6 for s in spans), default=None)


def breakdown(spans: Iterable[dict[str, Any]], *, request_id_prefix: str = "") -> Breakdown:
    """Groups spans into routed requests and computes each request's segments.

    Only requests whose client request id (the X-Request-Id the router got)
    starts with request_id_prefix are taken, e.g. to leave warm-up requests
    out. Requests whose router span ended with an HTTP error status are left
    out too (counted in `excluded`), so the percentiles describe served
    requests.
    """
    spans = list(spans)
    by_trace: dict[str, list[dict[str, Any]]] = defaultdict(list)
    by_transfer: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for span in spans:
        by_trace[span["trace_id"]].append(span)
        transfer_id = span["attributes"].get(ATTR_TRANSFER_ID)
        if transfer_id:
            by_transfer[transfer_id].append(span)
    requests: list[RequestBreakdown] = []
    excluded: dict[str, int] = defaultdict(int)
    for root in (s for s in spans if s["name"] == ROUTER_SPAN):
        attributes = root["attributes"]
        if not str(attributes.get("kvpush.client_request_id", "")).startswith(request_id_prefix):
            continue
        status = int(attributes.get("http.response.status_code", 0))
        if status >= 400:
            excluded[f"HTTP {status}"] += 1
            continue
        transfer_id = attributes.get(ATTR_TRANSFER_ID, "")
        attempt = int(attributes.get(ATTR_ATTEMPT, 0))
        candidates = {s["span_id"]: s for s in by_trace[root["trace_id"]]}
        candidates.update({s["span_id"]: s for s in by_transfer.get(transfer_id, [])})
        # Spans of superseded attempts (a retried request) describe work the answer did not use.
        related = [
            s for s in candidates.values()
            if s is not root and s["attributes"].get(ATTR_TRANSFER_ID, transfer_id) == transfer_id and int(s["attributes"].get(ATTR_ATTEMPT, attempt)) == attempt
        ]
        instants, clamped = _clamp(_request_instants(root, related))
        segments = {s.name: _between_ms(instants[s.start], instants[s.end]) for s in SEGMENTS}
        details = {name: _duration_ms([s for s in related if s["name"] == span_name]) for name, _, span_name in DETAILS}
        requests.append(
            RequestBreakdown(
                trace_id=root["trace_id"],
                transfer_id=transfer_id,
                attempt=attempt,
                client_request_id=attributes.get("kvpush.client_request_id", ""),
                status=status,
                start_ns=root["start_ns"],
                instants=instants,
                segments=segments,
                details=details,
                clamped=clamped,
            )
        )
    requests.sort(key=lambda r: r.start_ns)
    return Breakdown(requests, dict(excluded))
