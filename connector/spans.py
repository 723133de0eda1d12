# SPDX-License-Identifier: Apache-2.0
"""The connector's critical-path spans.

Segments are measured where they happen (scheduler, engine thread, transfer
thread) as bare timestamps; a daemon thread turns them into spans later, so
the hot path pays one append per segment, not a span's construction. Each
span is a child of the router's span named by the request's traceparent, so
one trace covers router, P, broker and D.

Sampling follows the standard OTEL_TRACES_SAMPLER, decided on the hot path
from the request's traceparent where the sampler allows it: with a
parent-based sampler (the SDK's default) a segment whose request the router
did not sample, with `traceidratio` one whose trace id the ratio leaves
out, is dropped at once, before anything is recorded.
"""

from __future__ import annotations

import atexit
import collections
import threading
import time
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

from kvpush.connector.segment_recorder import SegmentRecorder
from kvpush.processes import name_os_thread
from kvpush.telemetry import extract_context, span_attributes, trace_id_ratio_sampled

TRACER_NAME = "kvpush.connector"
# How long the builder thread gathers recorded segments before it turns them into spans (the exporter
# batches again after it); an engine with nothing recorded never wakes it.
BUILD_INTERVAL_S = 0.5
# Recorded segments kept while the builder lags; the oldest go first (telemetry never grows without bound).
MAX_PENDING = 100_000
# How long close() lets the exporters write what is recorded (an engine's shutdown waits at most this).
CLOSE_EXPORT_TIMEOUT_S = 2.0


def parent_sampled(traceparent: str) -> bool:
    """The sampled flag of a W3C traceparent ("00-<trace>-<span>-<flags>"); True when it cannot be read."""
    try:
        return bool(int(traceparent[53:55], 16) & 1)
    except ValueError:
        return True


class Spans:
    """Records one engine's segments and emits them as spans off the hot path; a no-op when tracing is not configured."""

    def __init__(self, engine_id: str, role: str, provider: Any = None):
        """provider: the tracer provider (the global one by default)."""
        self.engine_id = engine_id
        self.role = role
        # The Prometheus side of the same segments: every request, whatever the sampling (segment_stats).
        self.segments = SegmentRecorder()
        provider = provider or trace.get_tracer_provider()
        self._provider = provider
        # Without a configured SDK every span is a no-op: skip the work of recording one.
        self.enabled = isinstance(provider, TracerProvider)
        sampler = provider.sampler if self.enabled else None
        self._follow_parent = isinstance(sampler, ParentBased)
        self._trace_id_ratio = sampler.rate if isinstance(sampler, TraceIdRatioBased) else None
        self._tracer = provider.get_tracer(TRACER_NAME)
        self._pending: collections.deque = collections.deque(maxlen=MAX_PENDING)
        self._lock = threading.Lock()  # one builder at a time (the thread, or flush at exit)
        self._recorded = threading.Event()  # set by the first segment recorded since the last build
        self._thread: threading.Thread | None = None

    def emit(self, name: str, start_ns: int, end_ns: int, request: Any, links: tuple[str, ...] = (), **attributes: Any) -> None:
        """Records a segment. request: anything with transfer_id, attempt, traceparent and optionally
        client_request_id; links: traceparents of related spans outside the request's own ancestry."""
        if not self.enabled:
            return
        traceparent = request.traceparent
        if traceparent:
            if self._follow_parent and not parent_sampled(traceparent):
                return
            if self._trace_id_ratio is not None and not trace_id_ratio_sampled(traceparent[3:35], self._trace_id_ratio):
                return
        self._pending.append((name, start_ns, end_ns, request.transfer_id, request.attempt, getattr(request, "client_request_id", ""),
                              traceparent, links, attributes))
        if not self._recorded.is_set():
            self._recorded.set()
            if self._thread is None:
                self._start()

    def flush(self) -> None:
        """Turns every recorded segment into a span now."""
        with self._lock:
            while self._pending:
                self._build(*self._pending.popleft())

    def close(self) -> None:
        """Builds every recorded segment and has the exporters write it, bounded by CLOSE_EXPORT_TIMEOUT_S.

        The connector's shutdown calls this: vLLM forks its engine and worker
        processes, and a forked multiprocessing child ends with os._exit, so
        neither the atexit flush below nor the SDK's own exit-time flush runs
        there; without it an engine stopped within a build interval plus the
        exporter's delay of its last request loses that request's spans.
        """
        if not self.enabled:
            return
        self.flush()
        self._provider.force_flush(int(CLOSE_EXPORT_TIMEOUT_S * 1000))

    def _start(self) -> None:
        with self._lock:
            if self._thread is not None:
                return
            self._thread = threading.Thread(target=self._run, name=f"kvpush-spans-{self.role}", daemon=True)
            self._thread.start()
        atexit.register(self.flush)  # runs before the provider's own exit-time flush (registered earlier)

    def _run(self) -> None:
        name_os_thread(f"kvpush-spans-{self.role}")
        while True:
            self._recorded.wait()
            time.sleep(BUILD_INTERVAL_S)
            self._recorded.clear()  # before building: a segment recorded meanwhile sets it again
            self.flush()

    def _build(self, name: str, start_ns: int, end_ns: int, transfer_id: str, attempt: int, client_request_id: str,
               traceparent: str, links: tuple[str, ...], attributes: dict[str, Any]) -> None:
        parent = extract_context({"traceparent": traceparent}) if traceparent else None
        attrs = span_attributes(transfer_id, attempt, engine_id=self.engine_id, client_request_id=client_request_id)
        attrs["kvpush.role"] = self.role
        attrs.update({f"kvpush.{k}": v for k, v in attributes.items() if v is not None and v != ""})
        span_links = [trace.Link(trace.get_current_span(extract_context({"traceparent": tp})).get_span_context()) for tp in links if tp]
        span = self._tracer.start_span(name, context=parent, start_time=start_ns, attributes=attrs, links=span_links)
        span.end(end_time=max(end_ns, start_ns))
