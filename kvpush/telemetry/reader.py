# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""Reads OTLP/JSON-lines trace files (kvpush's or the Collector's file exporter) into flat span dicts."""

from __future__ import annotations

import base64
import fcntl
import json
import os
from typing import Any

_SPAN_KINDS = {0: "UNSPECIFIED", 1: "INTERNAL", 2: "SERVER", 3: "CLIENT", 4: "PRODUCER", 5: "CONSUMER"}
_STATUS_CODES = {0: "UNSET", 1: "OK", 2: "ERROR"}


def _id(value: str | None, size: int) -> str:
    # OTLP/JSON writes ids as hex; protobuf's generic JSON mapping as base64.
    # The lengths differ (32/16 hex digits vs 24/12 base64 characters).
    if not value:
        return ""
    if len(value) == 2 * size:
        return value.lower()
    return base64.b64decode(value).hex()


def _enum_name(value: int | str | None, names: dict[int, str], prefix: str) -> str:
    if isinstance(value, str) and not value.isdigit():
        return value.removeprefix(prefix)
    return names.get(int(value or 0), str(value))


def _any_value(value: dict[str, Any]) -> Any:
    if "stringValue" in value:
        return value["stringValue"]
    if "intValue" in value:
        return int(value["intValue"])
    if "doubleValue" in value:
        return float(value["doubleValue"])
    if "boolValue" in value:
        return bool(value["boolValue"])
    if "arrayValue" in value:
        return [_any_value(item) for item in value["arrayValue"].get("values", [])]
    if "kvlistValue" in value:
        return _attributes(value["kvlistValue"].get("values", []))
    if "bytesValue" in value:
        return base64.b64decode(value["bytesValue"])
    return None


def _attributes(key_values: list[dict[str, Any]]) -> dict[str, Any]:
    return {kv["key"]: _any_value(kv.get("value", {})) for kv in key_values}


def _flat_span(span: dict[str, Any], resource: dict[str, Any], scope: str) -> dict[str, Any]:
    status = span.get("status", {})
    return {
        "trace_id": _id(span.get("traceId"), 16),
        "span_id": _id(span.get("spanId"), 8),
        "parent_span_id": _id(span.get("parentSpanId"), 8),
        "name": span.get("name", ""),
        "kind": _enum_name(span.get("kind"), _SPAN_KINDS, "SPAN_KIND_"),
        "start_ns": int(span.get("startTimeUnixNano", 0)),
        "end_ns": int(span.get("endTimeUnixNano", 0)),
        "attributes": _attributes(span.get("attributes", [])),
        "events": [
            {"name": event.get("name", ""), "time_ns": int(event.get("timeUnixNano", 0)), "attributes": _attributes(event.get("attributes", []))}
            for event in span.get("events", [])
        ],
        "links": [
            {"trace_id": _id(link.get("traceId"), 16), "span_id": _id(link.get("spanId"), 8), "attributes": _attributes(link.get("attributes", []))}
            for link in span.get("links", [])
        ],
        "status_code": _enum_name(status.get("code"), _STATUS_CODES, "STATUS_CODE_"),
        "status_message": status.get("message", ""),
        "service_name": resource.get("service.name", ""),
        "resource": resource,
        "scope": scope,
    }


def read_spans(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Returns every span of an OTLP/JSON-lines file, in file order.

    Each span is a dict with trace_id, span_id, parent_span_id ("" for a
    root; ids as lowercase hex), name, kind ("CLIENT", ...), start_ns, end_ns,
    attributes, events, links (trace_id, span_id, attributes), status_code
    ("UNSET", "OK", "ERROR"), status_message, service_name, resource
    (attributes) and scope (instrumentation scope name). Lines of other
    signals (metrics, logs) are skipped.

    Raises:
        ValueError: a line is not JSON; the message names path and line.
    """
    spans: list[dict[str, Any]] = []
    with open(path, encoding="utf-8") as file:
        # Writers append under an exclusive flock; a shared one here keeps a
        # half-written line from being read.
        fcntl.flock(file.fileno(), fcntl.LOCK_SH)
        lines = file.readlines()
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            document = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{os.fspath(path)}:{number}: not an OTLP/JSON line: {exc}") from exc
        for resource_spans in document.get("resourceSpans", []):
            resource = _attributes(resource_spans.get("resource", {}).get("attributes", []))
            for scope_spans in resource_spans.get("scopeSpans", []):
                scope = scope_spans.get("scope", {}).get("name", "")
                spans.extend(_flat_span(span, resource, scope) for span in scope_spans.get("spans", []))
    return spans
