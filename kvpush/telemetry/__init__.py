# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""OpenTelemetry for kvpush: SDK setup from OTEL_* env, the OTLP/JSON-lines file exporter, context helpers."""

from kvpush.telemetry.context import (
    ATTR_ATTEMPT,
    ATTR_CLIENT_REQUEST_ID,
    ATTR_ENGINE_ID,
    ATTR_TRANSFER_ID,
    FIRST_OUTPUT_EVENT,
    FIRST_TOKEN_EVENT,
    extract_context,
    inject_traceparent,
    span_attributes,
    trace_id_ratio_sampled,
)
from kvpush.telemetry.file_exporter import OtlpJsonLinesFileExporter, encode_json_line
from kvpush.telemetry.reader import read_spans
from kvpush.telemetry.tracing import TRACES_FILE_ENV, configure_tracing, setup_tracing

__all__ = [
    "ATTR_ATTEMPT",
    "ATTR_CLIENT_REQUEST_ID",
    "ATTR_ENGINE_ID",
    "ATTR_TRANSFER_ID",
    "FIRST_OUTPUT_EVENT",
    "FIRST_TOKEN_EVENT",
    "OtlpJsonLinesFileExporter",
    "TRACES_FILE_ENV",
    "encode_json_line",
    "extract_context",
    "inject_traceparent",
    "read_spans",
    "configure_tracing",
    "setup_tracing",
    "span_attributes",
    "trace_id_ratio_sampled",
]
