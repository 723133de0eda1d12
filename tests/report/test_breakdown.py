# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""The TTFT breakdown's arithmetic on synthetic trace files whose segments are known exactly."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from kvpush.cli import main as kvpush_main
from kvpush.report import SEGMENTS, breakdown, percentile
from kvpush.report.render import text_table
from kvpush.telemetry import read_spans
from tests.report.synthetic import EXPECTED_DETAILS, EXPECTED_SEGMENTS, routed_request, span, write_trace_file

TRACE_A = "0af7651916cd43dd8448eb211c80319c"
TRACE_B = "1bf7651916cd43dd8448eb211c80319c"
TRACE_C = "2cf7651916cd43dd8448eb211c80319c"


def approx(values: dict) -> dict:
    return {key: pytest.approx(value, abs=1e-6) for key, value in values.items()}


@pytest.mark.parametrize("collector_style", [False, True], ids=["kvpush-file", "collector-file"])
def test_segments_of_one_request_are_exact_and_add_up_to_ttft(tmp_path, collector_style):
    path = write_trace_file(tmp_path / "traces.jsonl", routed_request(TRACE_A, "t1"), collector_style=collector_style)
    result = breakdown(read_spans(path))
    (request,) = result.requests
    assert request.segments == approx(EXPECTED_SEGMENTS)
    assert request.details == approx(EXPECTED_DETAILS)
    assert request.ttft_ms == pytest.approx(50.0)
    assert sum(request.segments.values()) == pytest.approx(request.ttft_ms)
    assert request.handoff_overhead_ms == pytest.approx(50.0 - 17.0 - 10.0)
    owned = ("handoff", "write_transfer", "d_wait_tail")  # prefill end → D's first step starts
    assert request.owned_handoff_ms == pytest.approx(sum(EXPECTED_SEGMENTS[name] for name in owned))
    assert (request.transfer_id, request.attempt, request.client_request_id, request.clamped) == ("t1", 1, "client-t1", False)
    assert request.complete


def test_percentiles_interpolate_between_ranks():
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == pytest.approx(2.5)
    assert percentile([1.0, 2.0, 3.0, 4.0], 90) == pytest.approx(3.7)
    assert percentile([7.0], 90) == 7.0
    with pytest.raises(ValueError):
        percentile([], 50)


def test_percentiles_are_numpys_linear_ones():
    """The one definition every report and benchmark uses (kvpush.report.percentiles): numpy's default."""
    rng = random.Random(7)
    for n in (1, 2, 5, 64, 999):
        values = [rng.expovariate(1.0) for _ in range(n)]
        for q in (0, 10, 50, 90, 99, 99.9, 100):
            assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), rel=1e-12, abs=1e-15)


def test_rows_give_p50_p90_over_requests(tmp_path):
    spans = routed_request(TRACE_A, "t1") + routed_request(TRACE_B, "t2", offset_ms=100, scale=2.0) + routed_request(TRACE_C, "t3", offset_ms=300, scale=3.0)
    result = breakdown(read_spans(write_trace_file(tmp_path / "traces.jsonl", spans)))
    assert [r.transfer_id for r in result.requests] == ["t1", "t2", "t3"]
    rows = {row.name: row for row in result.rows()}
    for segment in SEGMENTS:
        base = EXPECTED_SEGMENTS[segment.name]
        # Values base, 2*base, 3*base: median 2*base, p90 at rank 1.8 = 2.8*base.
        assert (rows[segment.name].p50, rows[segment.name].p90, rows[segment.name].count) == (pytest.approx(2 * base), pytest.approx(2.8 * base), 3)
    assert rows["ttft"].p50 == pytest.approx(100.0) and rows["ttft"].mean == pytest.approx(100.0)
    assert rows["handoff_overhead"].p90 == pytest.approx(2.8 * 23.0)


def test_spans_are_joined_by_transfer_id_and_only_the_final_attempt_counts(tmp_path):
    final = routed_request(TRACE_A, "t9", attempt=2)
    # The engines lost the router's context: their spans sit in traces of their own.
    for index, item in enumerate(final):
        if item["span"]["name"].startswith(("p.", "d.")):
            item["span"]["traceId"] = f"{index:032x}"
            item["span"]["parentSpanId"] = ""
    # Attempt 1's spans, in the request's own trace, describe work the answer did not use.
    stale = [item for item in routed_request(TRACE_A, "t9", attempt=1, offset_ms=-500) if item["span"]["name"].startswith("p.")]
    for index, item in enumerate(stale):
        item["span"]["spanId"] = f"{0xdead00 + index:016x}"
    result = breakdown(read_spans(write_trace_file(tmp_path / "traces.jsonl", final + stale)))
    (request,) = result.requests
    assert request.attempt == 2
    assert request.segments == approx(EXPECTED_SEGMENTS)


def test_failed_requests_are_left_out_and_unstreamed_ones_have_no_ttft(tmp_path):
    spans = routed_request(TRACE_A, "t1") + routed_request(TRACE_B, "t2", status=502) + routed_request(TRACE_C, "t3", streamed=False)
    result = breakdown(read_spans(write_trace_file(tmp_path / "traces.jsonl", spans)))
    assert result.excluded == {"HTTP 502": 1}
    unstreamed = next(r for r in result.requests if r.transfer_id == "t3")
    assert unstreamed.ttft_ms is None and unstreamed.handoff_overhead_ms is None
    assert unstreamed.segments["router_overhead"] is None and not unstreamed.complete
    assert unstreamed.segments["d_first_decode_step"] == pytest.approx(10.0)
    rows = {row.name: row for row in result.rows()}
    assert (rows["ttft"].count, rows["p_prefill"].count) == (1, 2)


def test_requests_without_engine_spans_have_only_ttft(tmp_path):
    root = span("router.request", TRACE_A, "1" * 16, 0, 40, kind=2, events={"first_token": 30},
                attributes={"kvpush.transfer_id": "t1", "kvpush.attempt": 1, "http.response.status_code": 200})
    (request,) = breakdown(read_spans(write_trace_file(tmp_path / "traces.jsonl", [root]))).requests
    assert request.ttft_ms == pytest.approx(30.0)
    assert all(value is None for value in request.segments.values())


def test_skewed_clocks_are_clamped_so_segments_stay_non_negative_and_sum_to_ttft(tmp_path):
    spans = routed_request(TRACE_A, "t1")
    for item in spans:
        if item["span"]["name"] == "p.queue":  # P's clock runs 5 ms behind the router's
            item["span"]["startTimeUnixNano"] = str(int(item["span"]["startTimeUnixNano"]) - 5_000_000)
        if item["span"]["name"] == "d.first_decode_step":  # D's clock 20 ms ahead
            item["span"]["endTimeUnixNano"] = str(int(item["span"]["endTimeUnixNano"]) + 20_000_000)
    (request,) = breakdown(read_spans(write_trace_file(tmp_path / "traces.jsonl", spans))).requests
    assert request.clamped
    assert request.segments["router_to_p"] == 0.0
    assert request.segments["d_first_decode_step"] == pytest.approx(50.0 - 31.0)
    assert request.segments["router_overhead"] == 0.0
    assert all(value >= 0 for value in request.segments.values())
    assert sum(request.segments.values()) == pytest.approx(request.ttft_ms)


def test_text_table_lists_every_segment_with_its_percentiles(tmp_path):
    result = breakdown(read_spans(write_trace_file(tmp_path / "traces.jsonl", routed_request(TRACE_A, "t1"))))
    table = text_table(result)
    for segment in SEGMENTS:
        line = next(line for line in table.splitlines() if line.startswith(segment.label))
        value = f"{EXPECTED_SEGMENTS[segment.name]:.2f}"
        assert line.split()[-4:] == [value, value, value, "1"]
    assert next(line for line in table.splitlines() if line.startswith("TTFT ")).split()[-4:] == ["50.00", "50.00", "50.00", "1"]


def test_cli_writes_table_html_png_and_json(tmp_path, capsys):
    traces = write_trace_file(tmp_path / "traces.jsonl", routed_request(TRACE_A, "t1") + routed_request(TRACE_B, "t2", offset_ms=100))
    html, png, data = tmp_path / "report.html", tmp_path / "breakdown.png", tmp_path / "requests.json"
    assert kvpush_main(["ttft-report", str(traces), "--html", str(html), "--png", str(png), "--json", str(data)]) == 0
    assert "P prefill compute" in capsys.readouterr().out
    assert html.read_text().startswith("<!DOCTYPE html>")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    records = json.loads(data.read_text())["requests"]
    assert [r["segments"]["p_prefill"] for r in records] == [pytest.approx(17.0)] * 2


def test_cli_without_router_spans_explains_itself(tmp_path, capsys):
    traces = write_trace_file(tmp_path / "traces.jsonl", [span("p.prefill", TRACE_A, "1" * 16, 0, 1)])
    assert kvpush_main(["ttft-report", str(traces)]) == 1
    assert "no served router.request spans" in capsys.readouterr().err


def test_request_id_prefix_selects_requests(tmp_path):
    spans = routed_request(TRACE_A, "t1") + routed_request(TRACE_B, "t2", offset_ms=100)
    for item in spans:
        if item["span"]["name"] == "router.request" and item["span"]["traceId"] == TRACE_B:
            item["span"]["attributes"].append({"key": "kvpush.client_request_id", "value": {"stringValue": "warmup-0"}})
            item["span"]["attributes"] = [a for a in item["span"]["attributes"] if a["key"] != "kvpush.client_request_id" or a["value"]["stringValue"] == "warmup-0"]
    result = breakdown(read_spans(write_trace_file(tmp_path / "traces.jsonl", spans)), request_id_prefix="client-")
    assert [r.transfer_id for r in result.requests] == ["t1"] and result.excluded == {}
