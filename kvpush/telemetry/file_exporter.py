# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""A span exporter appending OTLP/JSON lines, as the OpenTelemetry Collector's file exporter writes them."""

from __future__ import annotations

import base64
import fcntl
import json
import logging
import os
import threading
from collections.abc import Sequence

from google.protobuf import json_format
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from kvpush.processes import name_os_thread

logger = logging.getLogger(__name__)

# OTLP/JSON writes these bytes fields as lowercase hex, where protobuf's own
# JSON mapping would write base64.
_HEX_ID_KEYS = frozenset({"traceId", "spanId", "parentSpanId"})
# The Python name the SDK gives its batch processor's worker thread, and the kernel name this exporter gives it,
# so per-thread CPU (/proc/<pid>/task/<tid>/comm, the sweep's thread table) shows what exporting spans costs.
_SDK_BATCH_THREAD_PREFIX = "OtelBatch"
EXPORT_THREAD_NAME = "kvpush-otel-exp"


def _hex_ids(node):
    if isinstance(node, dict):
        return {
            key: (base64.b64decode(value).hex() if key in _HEX_ID_KEYS and isinstance(value, str) else _hex_ids(value))
            for key, value in node.items()
        }
    if isinstance(node, list):
        return [_hex_ids(item) for item in node]
    return node


def encode_json_line(spans: Sequence[ReadableSpan]) -> bytes:
    """Encodes spans as one ExportTraceServiceRequest in OTLP/JSON, newline-terminated.

    Keys are lowerCamelCase, enums integers, 64-bit integers decimal strings
    and ids lowercase hex: the OTLP/JSON encoding of the OTLP spec.
    """
    document = json_format.MessageToDict(encode_spans(spans), use_integers_for_enums=True)
    return (json.dumps(_hex_ids(document), separators=(",", ":"), ensure_ascii=False) + "\n").encode("utf-8")


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
