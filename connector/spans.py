# SPDX-License-Identifier: Apache-2.0
"""The connector's critical-path spans.

Segments are measured where they happen (scheduler, engine thread, transfer
thread) and emitted afterwards with explicit start and end times, each a
child of the router's span named by the request's traceparent, so one trace
covers router, P, broker and D.
"""

from __future__ import annotations

from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from kvpush.telemetry import extract_context, span_attributes

TRACER_NAME = "kvpush.connector"


class Spans:
    """Emits spans for one engine; a no-op when tracing is not configured."""

    def __init__(self, engine_id: str, role: str):
        self.engine_id = engine_id
        self.role = role
        self._tracer = trace.get_tracer(TRACER_NAME)
        # Without a configured SDK every span is a no-op: skip the work of building one.
        self.enabled = isinstance(trace.get_tracer_provider(), TracerProvider)

    def emit(self, name: str, start_ns: int, end_ns: int, request: Any, links: tuple[str, ...] = (), **attributes: Any) -> None:
        """request: anything with transfer_id, attempt, traceparent and optionally client_request_id;
        links: traceparents of related spans outside the request's own ancestry."""
        if not self.enabled:
            return
        parent = extract_context({"traceparent": request.traceparent}) if request.traceparent else None
        attrs = span_attributes(
            request.transfer_id,
            request.attempt,
            engine_id=self.engine_id,
            client_request_id=getattr(request, "client_request_id", ""),
        )
        attrs["kvpush.role"] = self.role
        attrs.update({f"kvpush.{k}": v for k, v in attributes.items() if v is not None and v != ""})
        span_links = [trace.Link(trace.get_current_span(extract_context({"traceparent": tp})).get_span_context()) for tp in links if tp]
        span = self._tracer.start_span(name, context=parent, start_time=start_ns, attributes=attrs, links=span_links)
        span.end(end_time=max(end_ns, start_ns))
