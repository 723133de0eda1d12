# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""Builds OTLP/JSON-lines trace files from span tuples, in kvpush's flavour or protobuf-JSON's (base64 ids, enum names)."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

MS = 1_000_000
BASE_NS = 1_700_000_000_000_000_000


def _value(value: Any) -> dict[str, Any]:
    if isinstance(value, bool):
        return {"boolValue": value}
    if isinstance(value, int):
        return {"intValue": str(value)}
    if isinstance(value, float):
        return {"doubleValue": value}
    return {"stringValue": str(value)}


def span(name: str, trace_id: str, span_id: str, start_ms: float, end_ms: float, *, parent: str = "", service: str = "svc",
         attributes: dict | None = None, events: dict[str, float] | None = None, kind: int = 1) -> dict[str, Any]:
    """One span; times in ms after BASE_NS, ids as hex."""
    return {
        "service": service,
        "span": {
            "traceId": trace_id, "spanId": span_id, "parentSpanId": parent, "name": name, "kind": kind,
            "startTimeUnixNano": str(BASE_NS + int(start_ms * MS)), "endTimeUnixNano": str(BASE_NS + int(end_ms * MS)),
            "attributes": [{"key": k, "value": _value(v)} for k, v in (attributes or {}).items()],
            "events": [{"name": n, "timeUnixNano": str(BASE_NS + int(t * MS))} for n, t in (events or {}).items()],
            "status": {},
        },
    }


def _protobuf_json(record: dict[str, Any]) -> dict[str, Any]:
    converted = dict(record)
    for key in ("traceId", "spanId", "parentSpanId"):
        if converted.get(key):
            converted[key] = base64.b64encode(bytes.fromhex(converted[key])).decode()
    converted["kind"] = {1: "SPAN_KIND_INTERNAL", 2: "SPAN_KIND_SERVER", 3: "SPAN_KIND_CLIENT"}[record["kind"]]
    return converted


def write_trace_file(path: Path, spans: list[dict[str, Any]], *, collector_style: bool = False) -> Path:
    """One line per service, as each process (or a Collector's file exporter) writes them."""
    by_service: dict[str, list[dict[str, Any]]] = {}
    for item in spans:
        by_service.setdefault(item["service"], []).append(_protobuf_json(item["span"]) if collector_style else item["span"])
    with path.open("w", encoding="utf-8") as handle:
        for service, records in by_service.items():
            document = {
                "resourceSpans": [
                    {"resource": {"attributes": [{"key": "service.name", "value": {"stringValue": service}}]},
                     "scopeSpans": [{"scope": {"name": "test"}, "spans": records}]}
                ]
            }
            handle.write(json.dumps(document) + "\n")
    return path


def routed_request(trace_id: str, transfer_id: str, *, offset_ms: float = 0.0, attempt: int = 1, status: int = 200, streamed: bool = True,
                   scale: float = 1.0) -> list[dict[str, Any]]:
    """A push-mode request whose segments are known exactly (see EXPECTED_SEGMENTS, times `scale`d).

    Router span [0, 60] with its first token at 50; P queue [2, 3], prefill [3, 20], descriptor prep [21, 22],
    WRITE post [22, 23], transfer at P [23, 30]; D waits [1, 28] and runs its first step [31, 41]; the router reads D's
    first output at 48.
    """
    def at(ms: float) -> float:
        return offset_ms + ms * scale

    key = {"kvpush.transfer_id": transfer_id, "kvpush.attempt": attempt}
    root_id = trace_id[:16]
    router_attributes = {**key, "kvpush.client_request_id": f"client-{transfer_id}", "http.response.status_code": status}
    spans = [
        span("router.request", trace_id, root_id, at(0), at(60), service="kvpush-router", kind=2, attributes=router_attributes,
             events={"first_token": at(50)} if streamed else None),
        span("router.prefill_leg", trace_id, "a" * 16, at(0), at(22), parent=root_id, service="kvpush-router", kind=3, attributes=key),
        span("router.decode_leg", trace_id, "b" * 16, at(0), at(60), parent=root_id, service="kvpush-router", kind=3, attributes=key,
             events={"first_output": at(48)} if streamed else None),
    ]
    for name, start, end in (("p.queue", 2, 3), ("p.prefill", 3, 20), ("p.descriptor_prep", 21, 22), ("p.write_post", 22, 23), ("p.write_transfer", 23, 30)):
        spans.append(span(name, trace_id, f"{len(spans):016x}", at(start), at(end), parent="a" * 16, service="kvpush-prefill", attributes=key))
    for name, start, end in (("d.register_rpc", 1, 2), ("d.wait_for_kv", 1, 28), ("d.first_decode_step", 31, 41)):
        spans.append(span(name, trace_id, f"{len(spans):016x}", at(start), at(end), parent="b" * 16, service="kvpush-decode", attributes=key))
    spans.append(span("broker.rendezvous", trace_id, f"{len(spans):016x}", at(1.5), at(20.5), service="kvpush-control-plane", attributes=key))
    return spans


EXPECTED_SEGMENTS = {
    "router_to_p": 2.0, "p_queue": 1.0, "p_prefill": 17.0, "handoff": 3.0, "write_transfer": 5.0,
    "d_wait_tail": 3.0, "d_first_decode_step": 10.0, "d_output": 7.0, "router_overhead": 2.0,
}
EXPECTED_DETAILS = {"descriptor_prep": 1.0, "write_post": 1.0, "p_write_transfer": 7.0, "d_register": 1.0, "broker_rendezvous": 19.0}
