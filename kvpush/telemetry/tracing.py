# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""Configures the OpenTelemetry SDK's tracing from the standard OTEL_* environment variables."""

from __future__ import annotations

import os

from opentelemetry import trace
from opentelemetry.sdk.resources import SERVICE_NAME, OTELResourceDetector, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF

from kvpush.telemetry.file_exporter import OtlpJsonLinesFileExporter

TRACES_FILE_ENV = "KVPUSH_TRACES_FILE"
EXPORTERS = ("otlp", "console", "kvpush_file", "none")

# The SDK's default of 5 s loses the last spans of a process killed without
# atexit and makes a trace show up late; 200 ms keeps batches small and
# fresh at a negligible cost.
DEFAULT_SCHEDULE_DELAY_MS = 200.0


def _resource(service_name: str) -> Resource:
    # OTEL_SERVICE_NAME (or service.name in OTEL_RESOURCE_ATTRIBUTES) wins over
    # the caller's default, so one deployment can rename a service.
    if SERVICE_NAME in OTELResourceDetector().detect().attributes:
        return Resource.create()
    return Resource.create({SERVICE_NAME: service_name})


def _otlp_exporter() -> SpanExporter:
    protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "http/protobuf"
    if protocol != "http/protobuf":
        raise ValueError(f"OTLP protocol {protocol!r} is not supported; kvpush exports OTLP over http/protobuf")
    # Imported here: it pulls in requests, which only OTLP users pay for.
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter()  # endpoint, headers, TLS, timeout, compression: OTEL_EXPORTER_OTLP_*


def _file_exporter() -> SpanExporter:
    path = os.environ.get(TRACES_FILE_ENV, "")
    if not path:
        raise ValueError(f"OTEL_TRACES_EXPORTER=kvpush_file needs {TRACES_FILE_ENV} to name the output file")
    return OtlpJsonLinesFileExporter(path)


def exporter_names() -> list[str]:
    """Returns the exporters OTEL_TRACES_EXPORTER selects.

    Unset, it selects kvpush_file when KVPUSH_TRACES_FILE is set and none
    otherwise: unlike the SDK's default (otlp), kvpush never sends spans to a
    collector nobody configured.
    """
    value = os.environ.get("OTEL_TRACES_EXPORTER", "").strip()
    if not value:
        return ["kvpush_file"] if os.environ.get(TRACES_FILE_ENV) else []
    names = [name.strip().lower() for name in value.split(",") if name.strip()]
    unknown = [name for name in names if name not in EXPORTERS]
    if unknown:
        raise ValueError(f"OTEL_TRACES_EXPORTER names unsupported exporters {unknown}; supported: {', '.join(EXPORTERS)}")
    return [name for name in names if name != "none"]


_EXPORTER_FACTORIES = {
    "otlp": _otlp_exporter,
    "console": ConsoleSpanExporter,
    "kvpush_file": _file_exporter,
}


def setup_tracing(service_name: str, *, set_global: bool = True) -> TracerProvider:
    """Builds a TracerProvider configured from the OTEL_* environment variables.

    Reads OTEL_TRACES_EXPORTER (otlp = OTLP http/protobuf, console, none,
    kvpush_file; comma-separated for several), KVPUSH_TRACES_FILE,
    OTEL_EXPORTER_OTLP_* (through the OTLP exporter), OTEL_SERVICE_NAME and
    OTEL_RESOURCE_ATTRIBUTES (service_name is the default name),
    OTEL_TRACES_SAMPLER(_ARG), OTEL_BSP_* and OTEL_SDK_DISABLED. Each exporter
    gets a BatchSpanProcessor; the provider flushes and shuts them down at
    interpreter exit (the SDK registers that with atexit).

    Args:
        service_name: the service.name resource attribute unless the
            environment sets one.
        set_global: install the provider as OpenTelemetry's global one
            (OpenTelemetry takes only the first per process; tests pass
            False to leave the global untouched).

    Raises:
        ValueError: the environment names an unsupported exporter or protocol,
            or kvpush_file without KVPUSH_TRACES_FILE.
    """
    resource = _resource(service_name)
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        provider = TracerProvider(resource=resource, sampler=ALWAYS_OFF)
    else:
        exporters = [_EXPORTER_FACTORIES[name]() for name in exporter_names()]
        provider = TracerProvider(resource=resource)  # the sampler comes from OTEL_TRACES_SAMPLER
        schedule_delay_ms = None if "OTEL_BSP_SCHEDULE_DELAY" in os.environ else DEFAULT_SCHEDULE_DELAY_MS
        for exporter in exporters:
            provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=schedule_delay_ms))
    if set_global:
        trace.set_tracer_provider(provider)
    return provider


def configure_tracing(service_name: str) -> bool:
    """Installs the SDK as the global provider only when the environment selects an exporter.

    Without one, spans stay no-ops: recording spans nobody exports costs
    about as much as a control-plane RPC. Trace context still propagates.
    Returns whether tracing was installed; a second call in the same process
    leaves the first provider in place.
    """
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true" or not exporter_names():
        return False
    if isinstance(trace.get_tracer_provider(), TracerProvider):
        return True
    setup_tracing(service_name)
    return True
