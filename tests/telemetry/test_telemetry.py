# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""kvpush.telemetry with the real SDK: env configuration, the OTLP/JSON file exporter, read_spans, OTLP/HTTP."""

from __future__ import annotations

import asyncio
import base64
import gzip
import json
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from aiohttp import web
from google.protobuf import json_format
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvpush.telemetry import (
    OtlpJsonLinesFileExporter,
    encode_json_line,
    extract_context,
    inject_traceparent,
    read_spans,
    setup_tracing,
    span_attributes,
)
from kvpush.telemetry.file_exporter import EXPORT_THREAD_NAME

OTEL_ENV = ("OTEL_TRACES_EXPORTER", "OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES", "OTEL_TRACES_SAMPLER", "OTEL_SDK_DISABLED", "KVPUSH_TRACES_FILE")


@pytest.fixture(autouse=True)
def clean_otel_env(monkeypatch):
    for name in OTEL_ENV:
        monkeypatch.delenv(name, raising=False)


def _record_spans() -> list:
    """Returns finished SDK spans: a root with attributes and an event, a CLIENT child linking to it."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("kvpush.test")
    with tracer.start_as_current_span("router.request", attributes=span_attributes("t-1", 2, engine_id="decode-0", client_request_id="req-9")) as root:
        root.add_event("dispatched", {"kvpush.legs": 2})
        with tracer.start_as_current_span(
            "kvpush.rpc/RegisterDestination",
            kind=trace.SpanKind.CLIENT,
            links=[trace.Link(root.get_span_context(), {"kvpush.first_arrival": "DECODE"})],
            attributes={"ratio": 0.5, "ok": True, "ranks": [0, 1], "names": ["a", "b"]},
        ):
            pass
    provider.shutdown()
    return list(exporter.get_finished_spans())


def test_json_line_is_the_otlp_json_of_the_export_request():
    spans = _record_spans()
    line = encode_json_line(spans)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    document = json.loads(line)
    span = document["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
    assert span["traceId"] == f"{spans[0].context.trace_id:032x}"  # hex, not base64
    assert span["spanId"] == f"{spans[0].context.span_id:016x}"
    assert span["kind"] == 3  # enums as integers
    assert isinstance(span["startTimeUnixNano"], str)  # 64-bit integers as strings
    # Back to protobuf JSON (base64 ids), the document parses into exactly the request encode_spans builds.
    for item in document["resourceSpans"][0]["scopeSpans"][0]["spans"]:
        for key in ("traceId", "spanId", "parentSpanId"):
            if key in item:
                item[key] = base64.b64encode(bytes.fromhex(item[key])).decode()
        for link in item.get("links", []):
            link["traceId"] = base64.b64encode(bytes.fromhex(link["traceId"])).decode()
            link["spanId"] = base64.b64encode(bytes.fromhex(link["spanId"])).decode()
    assert json_format.ParseDict(document, ExportTraceServiceRequest()) == encode_spans(spans)


def _protobuf_otlp_json(spans) -> dict:
    """The oracle: the SDK's protobuf request in protobuf's JSON mapping, ids turned to OTLP/JSON's hex."""

    def hex_ids(node):
        if isinstance(node, dict):
            return {k: base64.b64decode(v).hex() if k in ("traceId", "spanId", "parentSpanId") else hex_ids(v) for k, v in node.items()}
        return [hex_ids(item) for item in node] if isinstance(node, list) else node

    return hex_ids(json_format.MessageToDict(encode_spans(spans), use_integers_for_enums=True))


def _varied_spans() -> list:
    """Spans of two resources and three scopes, with every attribute type, events, links, statuses, trace state and drops."""
    exporter = InMemorySpanExporter()
    limits = SpanLimits(max_span_attributes=12, max_events=2, max_links=1)
    spans = []
    for resource in (Resource({"service.name": "p", "host.id": 7}), Resource({}, schema_url="https://example.com/schema")):
        provider = TracerProvider(resource=resource, span_limits=limits)
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        for tracer in (provider.get_tracer("kvpush.a"), provider.get_tracer("kvpush.b", "1.2", "https://example.com/s", {"scope.k": True})):
            remote = trace.SpanContext(0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331, is_remote=True,
                                       trace_flags=trace.TraceFlags(1), trace_state=trace.TraceState([("vendor", "v1"), ("other", "x")]))
            with tracer.start_as_current_span("root", context=trace.set_span_in_context(trace.NonRecordingSpan(remote)),
                                              kind=trace.SpanKind.SERVER,
                                              attributes={"dropped": "the oldest, over the limit", "s": "text ✓", "i": -3, "big": 2**62, "f": 0.25, "whole": 2.0, "b": False,
                                                          "strs": ["a", ""], "ints": [0, 1], "floats": [1.5], "bools": [True], "empty": [],
                                                          "zero": 0}) as root:
                root.add_event("e0", {"n": 0}, timestamp=1)
                root.add_event("e1")
                root.add_event("e2 dropped")
                root.set_status(trace.Status(trace.StatusCode.ERROR, "went wrong"))
                with tracer.start_as_current_span("child", kind=trace.SpanKind.CONSUMER,
                                                  links=[trace.Link(remote, {"why": "order"}), trace.Link(root.get_span_context())]) as child:
                    child.set_status(trace.StatusCode.OK)
            tracer.start_span("internal, no parent", attributes={"nan": float("nan"), "inf": float("-inf")}).end()
            spans.extend(exporter.get_finished_spans())
            exporter.clear()
    return spans


def test_json_line_equals_the_sdk_protobuf_encoding_for_every_field_kind():
    spans = _varied_spans()
    assert len(spans) == 12 and {s.dropped_attributes for s in spans} >= {1} and {s.dropped_links for s in spans} >= {1}
    assert json.loads(encode_json_line(spans)) == _protobuf_otlp_json(spans)
    assert json.loads(encode_json_line(spans[:1])) == _protobuf_otlp_json(spans[:1])


def test_read_spans_round_trip(tmp_path):
    spans = _record_spans()
    path = tmp_path / "traces.jsonl"
    assert OtlpJsonLinesFileExporter(path).export(spans).name == "SUCCESS"
    child, root = read_spans(path)
    assert root["name"] == "router.request"
    assert root["parent_span_id"] == ""
    assert root["kind"] == "INTERNAL"
    assert root["attributes"] == {"kvpush.transfer_id": "t-1", "kvpush.attempt": 2, "kvpush.engine_id": "decode-0", "kvpush.client_request_id": "req-9"}
    assert root["events"][0]["name"] == "dispatched" and root["events"][0]["attributes"] == {"kvpush.legs": 2}
    assert child["kind"] == "CLIENT"
    assert child["parent_span_id"] == root["span_id"] == f"{spans[1].context.span_id:016x}"
    assert child["trace_id"] == root["trace_id"] == f"{spans[1].context.trace_id:032x}"
    assert child["attributes"] == {"ratio": 0.5, "ok": True, "ranks": [0, 1], "names": ["a", "b"]}
    assert child["links"] == [{"trace_id": root["trace_id"], "span_id": root["span_id"], "attributes": {"kvpush.first_arrival": "DECODE"}}]
    assert (child["start_ns"], child["end_ns"]) == (spans[0].start_time, spans[0].end_time)
    assert child["service_name"] == root["resource"]["service.name"]
    assert child["scope"] == "kvpush.test"


def test_read_spans_reads_collector_files_and_skips_other_signals(tmp_path):
    collector_line = {
        "resourceSpans": [
            {
                "resource": {"attributes": [{"key": "service.name", "value": {"stringValue": "broker"}}]},
                "scopeSpans": [
                    {
                        "scope": {"name": "kvpush.services"},
                        "spans": [
                            {
                                "traceId": "5B8EFFF798038103D269B633813FC60C",
                                "spanId": "EEE19B7EC3C1B174",
                                "parentSpanId": "",
                                "name": "broker.rendezvous",
                                "kind": "SPAN_KIND_SERVER",
                                "startTimeUnixNano": 1544712660000000000,
                                "endTimeUnixNano": "1544712661000000000",
                                "attributes": [{"key": "kvpush.attempt", "value": {"intValue": "3"}}],
                                "status": {"code": 2, "message": "deadline"},
                            }
                        ],
                    }
                ],
            }
        ]
    }
    base64_line = {  # protobuf's generic JSON mapping: base64 ids
        "resourceSpans": [{"scopeSpans": [{"spans": [{"traceId": base64.b64encode(bytes(range(16))).decode(), "spanId": base64.b64encode(bytes(range(8))).decode(), "name": "p.prefill"}]}]}]
    }
    metrics_line = {"resourceMetrics": [{"scopeMetrics": []}]}
    path = tmp_path / "collector.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in (collector_line, metrics_line, base64_line)) + "\n\n")
    rendezvous, prefill = read_spans(path)
    assert rendezvous["trace_id"] == "5b8efff798038103d269b633813fc60c"
    assert rendezvous["kind"] == "SERVER"
    assert rendezvous["status_code"] == "ERROR" and rendezvous["status_message"] == "deadline"
    assert rendezvous["start_ns"] == 1544712660000000000 and rendezvous["end_ns"] == 1544712661000000000
    assert rendezvous["attributes"] == {"kvpush.attempt": 3}
    assert rendezvous["service_name"] == "broker"
    assert prefill["trace_id"] == bytes(range(16)).hex() and prefill["span_id"] == bytes(range(8)).hex()


def test_read_spans_names_a_broken_line(tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text('{"resourceSpans": []}\n{"resourceSp\n')
    with pytest.raises(ValueError, match=r"broken.jsonl:2"):
        read_spans(path)


def _env_without_otel() -> dict[str, str]:
    return {name: value for name, value in os.environ.items() if not name.startswith(("OTEL_", "KVPUSH_"))}


WRITER = textwrap.dedent(
    """
    import sys
    from opentelemetry import trace
    from kvpush.telemetry import setup_tracing

    setup_tracing(sys.argv[1])
    tracer = trace.get_tracer("writer")
    for index in range(int(sys.argv[2])):
        with tracer.start_as_current_span(f"{sys.argv[1]}-{index}", attributes={"padding": "x" * 6000}):
            pass
    # No shutdown here: the provider's atexit hook must flush the batch processor.
    """
)


def test_two_processes_append_whole_lines_to_one_file(tmp_path):
    path = tmp_path / "shared" / "traces.jsonl"
    env = {
        **_env_without_otel(),
        "OTEL_TRACES_EXPORTER": "kvpush_file",
        "KVPUSH_TRACES_FILE": str(path),
        "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "3",  # many lines, each well over PIPE_BUF
        "OTEL_BSP_SCHEDULE_DELAY": "1",
    }
    spans_each = 40
    writers = [subprocess.Popen([sys.executable, "-c", WRITER, name, str(spans_each)], env=env) for name in ("prefill", "decode")]
    assert [writer.wait(timeout=60) for writer in writers] == [0, 0]

    lines = path.read_bytes().splitlines()
    assert len(lines) >= 2 * spans_each // 3
    assert all(len(line) > 4096 for line in lines)
    for line in lines:
        json.loads(line)  # every line whole
    spans = read_spans(path)
    by_service = {name: sorted(s["name"] for s in spans if s["service_name"] == name) for name in ("prefill", "decode")}
    assert by_service == {name: sorted(f"{name}-{i}" for i in range(spans_each)) for name in ("prefill", "decode")}


async def test_otlp_exporter_posts_protobuf_to_the_configured_endpoint(monkeypatch):
    received: list[ExportTraceServiceRequest] = []

    async def traces(request: web.Request) -> web.Response:
        body = await request.read()
        if request.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        assert request.headers["Content-Type"] == "application/x-protobuf"
        received.append(ExportTraceServiceRequest.FromString(body))
        return web.Response(body=b"", content_type="application/x-protobuf")

    app = web.Application()
    app.router.add_post("/v1/traces", traces)
    runner = web.AppRunner(app)
    await runner.setup()
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    await web.SockSite(runner, listener).start()
    try:
        monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{port}")
        monkeypatch.setenv("NO_PROXY", "127.0.0.1")
        provider = setup_tracing("router", set_global=False)
        with provider.get_tracer("test").start_as_current_span("router.request", attributes=span_attributes("t-7", 1)):
            pass
        # The exporter posts from the processor's thread with blocking I/O;
        # this loop must stay free to answer it.
        assert await asyncio.wait_for(asyncio.to_thread(provider.force_flush, 10_000), 15)
        await asyncio.to_thread(provider.shutdown)
    finally:
        await runner.cleanup()
    (request,) = received
    resource_spans = request.resource_spans[0]
    assert {kv.key: kv.value.string_value for kv in resource_spans.resource.attributes}["service.name"] == "router"
    (span,) = resource_spans.scope_spans[0].spans
    assert span.name == "router.request"
    assert {kv.key for kv in span.attributes} == {"kvpush.transfer_id", "kvpush.attempt"}


def test_env_names_the_service_and_adds_resource_attributes(monkeypatch):
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=ci,service.name=from-attributes")
    assert setup_tracing("default", set_global=False).resource.attributes["service.name"] == "from-attributes"
    monkeypatch.setenv("OTEL_SERVICE_NAME", "decode-7")
    resource = setup_tracing("default", set_global=False).resource
    assert resource.attributes["service.name"] == "decode-7"
    assert resource.attributes["deployment.environment"] == "ci"
    monkeypatch.delenv("OTEL_SERVICE_NAME")
    monkeypatch.delenv("OTEL_RESOURCE_ATTRIBUTES")
    assert setup_tracing("default", set_global=False).resource.attributes["service.name"] == "default"


def test_sampler_and_sdk_switch_come_from_env(monkeypatch, tmp_path):
    monkeypatch.setenv("KVPUSH_TRACES_FILE", str(tmp_path / "t.jsonl"))
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_off")
    with setup_tracing("p", set_global=False).get_tracer("t").start_as_current_span("dropped") as span:
        assert not span.is_recording()
    monkeypatch.delenv("OTEL_TRACES_SAMPLER")
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    with setup_tracing("p", set_global=False).get_tracer("t").start_as_current_span("dropped") as span:
        assert not span.is_recording()
    assert not (tmp_path / "t.jsonl").exists()


def test_unset_exporter_writes_the_file_only_when_one_is_named(monkeypatch, tmp_path):
    provider = setup_tracing("p", set_global=False)
    provider.get_tracer("t").start_span("nowhere").end()
    provider.shutdown()
    path = tmp_path / "t.jsonl"
    monkeypatch.setenv("KVPUSH_TRACES_FILE", str(path))
    provider = setup_tracing("p", set_global=False)
    provider.get_tracer("t").start_span("in-file").end()
    provider.shutdown()
    assert [span["name"] for span in read_spans(path)] == ["in-file"]


def test_console_and_file_exporters_together(tmp_path):
    path = tmp_path / "t.jsonl"
    env = {**_env_without_otel(), "OTEL_TRACES_EXPORTER": "console, kvpush_file", "KVPUSH_TRACES_FILE": str(path)}
    script = "from kvpush.telemetry import setup_tracing; setup_tracing('p').get_tracer('t').start_span('both').end()"
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60, check=True)
    assert json.loads(result.stdout)["name"] == "both"
    assert [span["name"] for span in read_spans(path)] == ["both"]


def test_the_batch_processor_thread_carries_a_kernel_name_and_the_caller_keeps_its_own(tmp_path):
    # Per-thread CPU (the sweep's thread table) tells span export apart from the engine's own threads by this name.
    provider, earlier = TracerProvider(), set(threading.enumerate())  # other tests' processors may still run
    processor = BatchSpanProcessor(OtlpJsonLinesFileExporter(tmp_path / "t.jsonl"), schedule_delay_millis=10)
    provider.add_span_processor(processor)
    caller_comm = Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text()
    provider.get_tracer("t").start_span("exported-by-the-worker").end()
    deadline = time.monotonic() + 10
    while not (tmp_path / "t.jsonl").exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    (worker,) = (t for t in set(threading.enumerate()) - earlier if t.name.startswith("OtelBatch"))
    assert Path(f"/proc/self/task/{worker.native_id}/comm").read_text().strip() == EXPORT_THREAD_NAME
    provider.get_tracer("t").start_span("exported-by-the-caller").end()
    provider.force_flush()
    assert Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text() == caller_comm
    provider.shutdown()
    assert {s["name"] for s in read_spans(tmp_path / "t.jsonl")} == {"exported-by-the-worker", "exported-by-the-caller"}


@pytest.mark.parametrize(
    "env",
    [
        {"OTEL_TRACES_EXPORTER": "zipkin"},
        {"OTEL_TRACES_EXPORTER": "kvpush_file"},
        {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"},
    ],
    ids=["unknown-exporter", "file-without-path", "otlp-grpc"],
)
def test_misconfiguration_fails_at_setup(monkeypatch, env):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError):
        setup_tracing("p", set_global=False)


def test_traceparent_round_trip():
    tracer = TracerProvider().get_tracer("t")
    assert inject_traceparent() == {}
    with tracer.start_as_current_span("router.request") as span:
        carrier = inject_traceparent()
    context = span.get_span_context()
    assert carrier["traceparent"].split("-")[1:3] == [f"{context.trace_id:032x}", f"{context.span_id:016x}"]
    with tracer.start_as_current_span("d.register_rpc", context=extract_context(carrier)) as child:
        assert child.get_span_context().trace_id == context.trace_id
        assert child.parent.span_id == context.span_id


def test_span_attributes_leave_out_empty_values():
    assert span_attributes("t-1", 3) == {"kvpush.transfer_id": "t-1", "kvpush.attempt": 3}
    assert span_attributes("t-1", 3, engine_id="prefill-0", client_request_id="r") == {
        "kvpush.transfer_id": "t-1",
        "kvpush.attempt": 3,
        "kvpush.engine_id": "prefill-0",
        "kvpush.client_request_id": "r",
    }
