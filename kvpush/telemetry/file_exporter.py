# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""A span exporter appending OTLP/JSON lines, as the OpenTelemetry Collector's file exporter writes them."""

from __future__ import annotations

import base64
import fcntl
import json
import logging
import math
import os
import threading
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanKind

from kvpush.processes import name_os_thread

logger = logging.getLogger(__name__)

# The Python name the SDK gives its batch processor's worker thread, and the kernel name this exporter gives it,
# so per-thread CPU (/proc/<pid>/task/<tid>/comm, the sweep's thread table) shows what exporting spans costs.
_SDK_BATCH_THREAD_PREFIX = "OtelBatch"
EXPORT_THREAD_NAME = "kvpush-otel-exp"
# OTLP's span kinds (opentelemetry.proto.trace.v1.Span.SpanKind) by the SDK's.
_SPAN_KINDS = {SpanKind.INTERNAL: 1, SpanKind.SERVER: 2, SpanKind.CLIENT: 3, SpanKind.PRODUCER: 4, SpanKind.CONSUMER: 5}
# Span.flags: the W3C trace flags' upper bits say whether the parent (or a link's context) is known to be remote.
_FLAGS_HAS_IS_REMOTE, _FLAGS_IS_REMOTE = 0x100, 0x200


def encode_json_line(spans: Sequence[ReadableSpan]) -> bytes:
    """Encodes spans as one ExportTraceServiceRequest in OTLP/JSON, newline-terminated.

    Keys are lowerCamelCase, enums integers, 64-bit integers decimal strings,
    ids lowercase hex and fields at their default value left out: the OTLP/JSON
    encoding of the OTLP spec, the same document as the SDK's protobuf
    encoder turned into JSON (tests/telemetry checks the two agree), built
    directly from the spans because the protobuf round trip cost an engine
    ~80 µs of its exporter thread per span.
    """
    # Grouped by the resource object: a Resource hashes by serializing its attributes, once per span in the SDK's encoder.
    resources: dict[int, Resource] = {}
    by_resource: dict[int, dict[Any, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for span in spans:
        resources.setdefault(id(span.resource), span.resource)
        by_resource[id(span.resource)][span.instrumentation_scope or None].append(_span(span))
    document = {"resourceSpans": [_omit_defaults({
        "resource": _omit_defaults({"attributes": _key_values(resource.attributes)}),
        "scopeSpans": [_omit_defaults({"scope": _scope(scope), "spans": encoded, "schemaUrl": scope.schema_url if scope else None})
                       for scope, encoded in scopes.items()],
        "schemaUrl": resource.schema_url,
    }) for resource, scopes in ((resources[key], scopes) for key, scopes in by_resource.items())]}
    return (json.dumps(document, separators=(",", ":"), ensure_ascii=False) + "\n").encode("utf-8")


def _omit_defaults(fields: dict[str, Any]) -> dict[str, Any]:
    # proto3 JSON leaves out a scalar or repeated field at its default (a set sub-message, even empty, stays).
    return {key: value for key, value in fields.items() if value not in (None, "", 0, [])}


def _span(span: ReadableSpan) -> dict[str, Any]:
    context = span.get_span_context()
    assert context is not None, "the SDK makes every span with its context"
    trace_state = ",".join(f"{key}={value}" for key, value in context.trace_state.items()) if context.trace_state is not None else ""
    status = span.status
    return _omit_defaults({
        "traceId": f"{context.trace_id:032x}",
        "spanId": f"{context.span_id:016x}",
        "traceState": trace_state,
        "parentSpanId": f"{span.parent.span_id:016x}" if span.parent else None,
        "flags": _flags(span.parent),
        "name": span.name,
        "kind": _SPAN_KINDS[span.kind],
        "startTimeUnixNano": str(span.start_time) if span.start_time else None,
        "endTimeUnixNano": str(span.end_time) if span.end_time else None,
        "attributes": _key_values(span.attributes),
        "droppedAttributesCount": span.dropped_attributes,
        "events": [_omit_defaults({"timeUnixNano": str(event.timestamp) if event.timestamp else None, "name": event.name,
                                   "attributes": _key_values(event.attributes), "droppedAttributesCount": event.dropped_attributes})
                   for event in span.events],
        "droppedEventsCount": span.dropped_events,
        "links": [_omit_defaults({"traceId": f"{link.context.trace_id:032x}", "spanId": f"{link.context.span_id:016x}",
                                  "attributes": _key_values(link.attributes), "droppedAttributesCount": link.dropped_attributes,
                                  "flags": _flags(link.context)})
                  for link in span.links],
        "droppedLinksCount": span.dropped_links,
        "status": None if status is None else _omit_defaults({"message": status.description, "code": status.status_code.value}),
    })


def _flags(context: Any) -> int:
    return _FLAGS_HAS_IS_REMOTE | (_FLAGS_IS_REMOTE if context is not None and context.is_remote else 0)


def _scope(scope: InstrumentationScope | None) -> dict[str, Any]:
    if scope is None:
        return {}
    return _omit_defaults({"name": scope.name, "version": scope.version, "attributes": _key_values(scope.attributes)})


def _key_values(attributes: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    encoded = []
    for key, value in (attributes or {}).items():
        try:
            encoded.append({"key": key, "value": _any_value(value)})
        except TypeError:
            logger.exception("cannot encode attribute %s", key)  # the SDK's encoder drops it likewise
    return encoded


def _any_value(value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if isinstance(value, bool):
        return {"boolValue": value}
    if isinstance(value, str):
        return {"stringValue": value}
    if isinstance(value, int):
        return {"intValue": str(value)}
    if isinstance(value, float):
        return {"doubleValue": value if math.isfinite(value) else "NaN" if math.isnan(value) else "Infinity" if value > 0 else "-Infinity"}
    if isinstance(value, bytes):
        return {"bytesValue": base64.b64encode(value).decode("ascii")}
    if isinstance(value, Sequence):
        return {"arrayValue": _omit_defaults({"values": [_any_value(item) for item in value]})}
    if isinstance(value, Mapping):
        return {"kvlistValue": _omit_defaults({"values": [{"key": str(k), "value": _any_value(v)} for k, v in value.items()]})}
    raise TypeError(f"an attribute value of type {type(value).__name__}")


def append_locked(path: str, data: bytes) -> None:
    """Appends data to path under an exclusive flock, so lines of several processes never interleave.

    O_APPEND alone makes one write() atomic only up to PIPE_BUF on some file
    systems, and a batch of spans is often larger; the lock covers the rest.
    """
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)  # closing releases the lock


class OtlpJsonLinesFileExporter(SpanExporter):
    """Appends each exported batch to a file as one OTLP/JSON ExportTraceServiceRequest line.

    The file is opened per batch, so it may be removed or rotated between
    batches and the exporter survives fork().
    """

    def __init__(self, path: str | os.PathLike[str]):
        self.path = os.fspath(path)
        parent = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(parent, exist_ok=True)
        self._shut_down = False
        self._named_threads: set[tuple[int, int | None]] = set()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if self._shut_down:
            return SpanExportResult.FAILURE
        if not spans:
            return SpanExportResult.SUCCESS
        thread = threading.current_thread()
        key = (os.getpid(), thread.ident)  # the worker is re-created after a fork (vLLM forks its engines)
        if key not in self._named_threads and thread.name.startswith(_SDK_BATCH_THREAD_PREFIX):
            name_os_thread(EXPORT_THREAD_NAME)
            self._named_threads.add(key)
        try:
            append_locked(self.path, encode_json_line(spans))
        except OSError:
            logger.exception("cannot append %d spans to %s", len(spans), self.path)
            return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        self._shut_down = True

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True  # every export is written before it returns
