# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""The connector's span recorder: segments recorded on the hot path become spans later, and unsampled requests cost nothing."""

from __future__ import annotations

import multiprocessing
import os
import time
from dataclasses import dataclass

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBased, TraceIdRatioBased

from kvpush.connector.spans import Spans, parent_sampled
from kvpush.telemetry import read_spans, setup_tracing, trace_id_ratio_sampled

TRACE = "0af7651916cd43dd8448eb211c80319c"
SAMPLED = f"00-{TRACE}-b7ad6b7169203331-01"
NOT_SAMPLED = f"00-{TRACE}-b7ad6b7169203331-00"


@dataclass
class Request:
    transfer_id: str
    attempt: int
    traceparent: str
    client_request_id: str = "client-1"


def provider_with(sampler) -> tuple[TracerProvider, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=sampler)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


def test_traceparent_flags():
    assert parent_sampled(SAMPLED) and not parent_sampled(NOT_SAMPLED)
    assert parent_sampled("garbage")  # unreadable: let the SDK's sampler decide


def test_segments_become_child_spans_only_when_built():
    provider, exporter = provider_with(ParentBased(ALWAYS_ON))
    spans = Spans("prefill-1", "prefill", provider)
    spans.emit("p.write_post", 1_000, 3_000, Request("t1", 2, SAMPLED), writes=1, error="")
    assert exporter.get_finished_spans() == ()  # the hot path only recorded it
    spans.flush()
    (span,) = exporter.get_finished_spans()
    assert span.name == "p.write_post" and (span.start_time, span.end_time) == (1_000, 3_000)
    assert format(span.context.trace_id, "032x") == TRACE and format(span.parent.span_id, "016x") == "b7ad6b7169203331"
    assert span.attributes["kvpush.transfer_id"] == "t1" and span.attributes["kvpush.attempt"] == 2
    assert span.attributes["kvpush.writes"] == 1 and "kvpush.error" not in span.attributes
    assert span.attributes["kvpush.role"] == "prefill" and span.attributes["kvpush.engine_id"] == "prefill-1"


def test_unsampled_requests_are_dropped_before_recording():
    provider, exporter = provider_with(ParentBased(TraceIdRatioBased(0.0)))
    spans = Spans("decode-1", "decode", provider)
    spans.emit("d.wait_for_kv", 1, 2, Request("t1", 1, NOT_SAMPLED))
    assert not spans._pending
    spans.emit("d.wait_for_kv", 1, 2, Request("t2", 1, SAMPLED))  # the router sampled this one: D follows
    spans.flush()
    assert [s.attributes["kvpush.transfer_id"] for s in exporter.get_finished_spans()] == ["t2"]


def test_a_sampler_that_ignores_parents_decides_for_itself():
    provider, exporter = provider_with(ALWAYS_ON)
    spans = Spans("decode-1", "decode", provider)
    spans.emit("d.wait_for_kv", 1, 2, Request("t1", 1, NOT_SAMPLED))
    spans.flush()
    assert len(exporter.get_finished_spans()) == 1


def test_a_trace_id_ratio_sampler_drops_before_recording_what_the_sdk_would_not_sample():
    # traceidratio decides on the trace id's low 64 bits, so an engine keeps exactly the traces that every other
    # process at the same ratio keeps (a router at parentbased_traceidratio too), whatever the parent's flag says.
    provider, exporter = provider_with(TraceIdRatioBased(0.5))
    spans = Spans("decode-1", "decode", provider)
    kept, dropped = "0" * 16 + "7fffffffffffffff", "0" * 16 + "8000000000000000"
    spans.emit("d.wait_for_kv", 1, 2, Request("dropped", 1, f"00-{dropped}-b7ad6b7169203331-01"))
    assert not spans._pending
    spans.emit("d.wait_for_kv", 1, 2, Request("kept", 1, f"00-{kept}-b7ad6b7169203331-00"))
    spans.flush()
    assert [s.attributes["kvpush.transfer_id"] for s in exporter.get_finished_spans()] == ["kept"]
    assert trace_id_ratio_sampled(kept, 0.5) and not trace_id_ratio_sampled(dropped, 0.5)
    assert trace_id_ratio_sampled("garbage", 0.0)  # unreadable: let the SDK's sampler decide


def test_the_builder_thread_emits_without_a_flush():
    provider, exporter = provider_with(ParentBased(ALWAYS_ON))
    spans = Spans("prefill-1", "prefill", provider)
    spans.emit("p.queue", 1, 2, Request("t1", 1, SAMPLED))
    deadline = time.monotonic() + 5
    while not exporter.get_finished_spans() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [s.name for s in exporter.get_finished_spans()] == ["p.queue"]


def _engine_process(traces: str, close: bool) -> None:
    """A forked child like vLLM's engine process: tracing set up inside it, one segment recorded, then the child returns."""
    os.environ["KVPUSH_TRACES_FILE"] = traces
    spans = Spans("decode-1", "decode", setup_tracing("kvpush-decode", set_global=False))
    spans.emit("d.wait_for_kv", 1, 2, Request("t1", 1, SAMPLED), parts=2)
    if close:
        spans.close()  # what the connector's shutdown does


def test_close_exports_what_a_forked_engine_process_recorded(tmp_path):
    # A forked multiprocessing child ends with os._exit: atexit (the SDK's flush, and the builder's) never runs there.
    for close in (False, True):
        traces = tmp_path / f"close-{close}.jsonl"
        traces.touch()
        child = multiprocessing.get_context("fork").Process(target=_engine_process, args=(str(traces), close))
        child.start()
        child.join(timeout=30)
        assert child.exitcode == 0
        names = [s["name"] for s in read_spans(traces)]
        assert names == (["d.wait_for_kv"] if close else []), (close, names)
