# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""deploy/observability, offline: the collector's pipelines, Tempo, Prometheus, compose and the Grafana dashboard.

The dashboard's queries must name spans kvpush really emits (read from the
connector, broker and router sources) and metrics its processes really
serve; the collector must wire every pipeline to defined components. The
dashboard's top rows read kvpush's own metrics only, so an operator with
Prometheus and no collector gets the TTFT breakdown; span metrics stay in
the trace drill-down row. tests/deploy/test_prometheus_live.py runs the top
rows' queries against a live Prometheus scraping a real local stack.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvpush.report.breakdown import DETAILS, SEGMENTS
from kvpush.services.broker.metrics import BrokerMetrics
from kvpush.services.common.rpc_metrics import RpcMetricsInterceptor
from kvpush.services.registrar.metrics import register_registrar_metrics
from kvpush.services.router.app import REQUEST_SPAN
from kvpush.services.router.core import Endpoint, EnginePool
from kvpush.services.router.legs import LEG_SPANS
from kvpush.services.router.metrics import RouterMetrics
from kvpush.telemetry.segments import DECODE_SEGMENTS, PREFILL_SEGMENTS, ROUTER_SEGMENTS, SEGMENT_METRIC

ROOT = Path(__file__).resolve().parents[2]
OBSERVABILITY = ROOT / "deploy" / "observability"
COLLECTOR = yaml.safe_load((OBSERVABILITY / "otel-collector.yaml").read_text())
DASHBOARD = json.loads((OBSERVABILITY / "grafana" / "dashboards" / "kvpush-ttft.json").read_text())
PROMETHEUS = yaml.safe_load((OBSERVABILITY / "prometheus.yml").read_text())
DRILL_DOWN_ROW = "Trace drill-down (needs the OpenTelemetry Collector's spanmetrics)"
STACKED_PANEL = "TTFT p50 by critical-path segment (stacked, ms)"
P90_PANEL = "Critical-path segments p90 (ms)"
SPANMETRICS_PREFIX = "traces_span_metrics_"
# Served by the engines on their own /metrics (connector.segment_stats.KvpushPromMetrics), not by the services.
ENGINE_METRICS = {f"{SEGMENT_METRIC}_bucket", "kvpush_decode_kv_wait_seconds_bucket", "kvpush_transfers_total", "kvpush_transfer_bytes_total"}
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def emitted_span_names() -> set[str]:
    """Span names kvpush emits: the connector's emit() calls and the broker's spans (read from the sources), and the router's.

    The broker's spans are started wherever its package does it (broker.rendezvous lives in tracing.py, not core.py).
    """
    names = set()
    for path in (ROOT / "connector").glob("*.py"):
        names |= set(re.findall(r'emit\(\s*"([a-z]+\.[a-z_]+)"', path.read_text()))
    for path in (ROOT / "services" / "broker").glob("*.py"):
        names |= set(re.findall(r'start_span\(\s*"(broker\.[a-z_]+)"', path.read_text()))
    return names | {REQUEST_SPAN, *LEG_SPANS.values()}


def panels_with_rows() -> list[tuple[str, dict]]:
    """Every panel that has queries, with the title of the row it sits under (a collapsed row holds its panels)."""
    found, row = [], ""
    for panel in DASHBOARD["panels"]:
        if panel["type"] == "row":
            row = panel["title"]
            found += [(row, inner) for inner in panel.get("panels", [])]
        else:
            found.append((row, panel))
    return found


def all_panels() -> list[dict]:
    """Rows and panels alike."""
    return [panel for panel in DASHBOARD["panels"] if panel["type"] == "row"] + [panel for _, panel in panels_with_rows()]


def queries() -> list[str]:
    return [target["expr"] for _, panel in panels_with_rows() for target in panel["targets"]]


def metric_names(expr: str) -> set[str]:
    return set(re.findall(r"\b((?:kvpush|traces|grpc_server)_[a-z_]+)\b", expr))


def service_registry() -> CollectorRegistry:
    """The router's and the control plane's (registrar, broker, RPC interceptor) metrics, as each process starts."""
    pools = (EnginePool("prefill", [Endpoint("http://p:1", "p")], "round_robin"), EnginePool("decode", [Endpoint("http://d:1", "d")], "round_robin"))
    registry = CollectorRegistry()
    RouterMetrics(pools, registry)
    BrokerMetrics(registry)
    register_registrar_metrics(registry, SimpleNamespace(engine_count=0, lease_count=0, watch_count=0))
    RpcMetricsInterceptor(registry)
    return registry


def service_metric_names() -> set[str]:
    return {family.name + suffix for family in service_registry().collect() for suffix in SUFFIXES[family.type]}


def spanmetrics_names() -> set[str]:
    """The collector's Prometheus exporter names span metrics <namespace>_duration_<unit>_bucket."""
    connector = COLLECTOR["connectors"]["spanmetrics"]
    assert connector["histogram"]["unit"] == "ms"
    return {f"{connector['namespace'].replace('.', '_')}_duration_milliseconds_bucket"}


def test_collector_pipelines_use_only_defined_components():
    defined = {section: set(COLLECTOR.get(section) or {}) for section in ("receivers", "processors", "exporters", "connectors")}
    pipelines = COLLECTOR["service"]["pipelines"]
    for name, pipeline in pipelines.items():
        assert set(pipeline["receivers"]) <= defined["receivers"] | defined["connectors"], name
        assert set(pipeline.get("processors", [])) <= defined["processors"], name
        assert set(pipeline["exporters"]) <= defined["exporters"] | defined["connectors"], name
    used = {c for p in pipelines.values() for c in p["receivers"] + p["exporters"]} | {c for p in pipelines.values() for c in p.get("processors", [])}
    assert defined["receivers"] | defined["exporters"] | defined["connectors"] | defined["processors"] <= used, "a component is defined but unused"
    assert set(COLLECTOR["service"]["extensions"]) <= set(COLLECTOR["extensions"])


def test_spanmetrics_turns_traces_into_prometheus_metrics_and_traces_reach_tempo_and_a_file():
    pipelines = COLLECTOR["service"]["pipelines"]
    traces = [p for name, p in pipelines.items() if name.split("/")[0] == "traces"]
    metrics = [p for name, p in pipelines.items() if name.split("/")[0] == "metrics"]
    assert any("otlp" in p["receivers"] and {"spanmetrics", "otlp/tempo", "file/traces"} <= set(p["exporters"]) for p in traces)
    assert any(p["receivers"] == ["spanmetrics"] and "prometheus" in p["exporters"] for p in metrics)
    assert COLLECTOR["exporters"]["file/traces"]["format"] == "json"  # what kvpush.telemetry.read_spans reads
    assert COLLECTOR["receivers"]["otlp"]["protocols"]["http"]["endpoint"].endswith(":4318")


def test_tempo_receives_what_the_collector_sends():
    tempo = yaml.safe_load((OBSERVABILITY / "tempo.yaml").read_text())
    grpc_endpoint = tempo["distributor"]["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"]
    assert COLLECTOR["exporters"]["otlp/tempo"]["endpoint"] == "tempo:" + grpc_endpoint.rsplit(":", 1)[1]


def test_dashboard_queries_name_spans_kvpush_emits_and_cover_the_critical_path():
    emitted = emitted_span_names()
    assert {"p.queue", "p.prefill", "p.write_transfer", "d.wait_for_kv", "d.first_decode_step", "broker.rendezvous", "router.request"} <= emitted
    referenced = set()
    for expr in queries():
        for pattern in re.findall(r'span_name=~"([^"]+)"', expr):
            referenced |= {name.replace("\\\\.", ".") for name in pattern.split("|")}
    assert referenced, "no span_name selectors"
    assert referenced <= emitted, referenced - emitted
    critical = {"p.queue", "p.prefill", "p.write_post", "p.write_transfer", "d.wait_for_kv", "d.first_decode_step"} | {span for _, _, span in DETAILS}
    assert critical <= referenced, critical - referenced


def test_dashboard_metrics_exist_in_kvpush_processes_or_spanmetrics():
    used = set().union(*map(metric_names, queries()))
    known = service_metric_names() | ENGINE_METRICS | spanmetrics_names()
    assert used <= known, used - known
    assert {"kvpush_router_time_to_first_token_seconds_bucket", "grpc_server_handled_total", "grpc_server_handling_seconds_bucket"} | ENGINE_METRICS <= used
    # The router observes its own segments into the same family the engines serve.
    assert f"{SEGMENT_METRIC}_bucket" in service_metric_names()


def test_failure_series_the_dashboard_reads_exist_before_any_failure():
    """A counter series born at its first failure would lose that failure to rate(), and its panel could not tell no
    failures from a broken query."""
    samples = {sample.name for family in service_registry().collect() for sample in family.samples}
    failures = {name for name in set().union(*map(metric_names, queries())) if "fail" in name and not name.startswith(SPANMETRICS_PREFIX)}
    assert {"kvpush_router_failed_requests_total", "kvpush_router_leg_failures_total", "kvpush_broker_failures_total"} <= failures
    assert failures - ENGINE_METRICS <= samples, failures - ENGINE_METRICS - samples


def test_engine_metrics_the_dashboard_reads_are_the_engines():
    """ENGINE_METRICS against the engine's own Prometheus metrics (it needs vLLM: the fast tier skips this test)."""
    from kvpush.connector.segment_stats import KvpushPromMetrics

    families = []
    for role in ("prefill", "decode"):  # each engine serves its own registry
        registry = CollectorRegistry()
        types = {cls: functools.partial(cls, registry=registry) for cls in (Gauge, Counter, Histogram)}
        KvpushPromMetrics(SimpleNamespace(kv_transfer_config=None), types, ["model_name", "engine"], {0: ["tiny", "0"]}, role, f"{role}-0")
        families += registry.collect()
    served = {family.name + suffix for family in families for suffix in SUFFIXES[family.type]}
    assert ENGINE_METRICS <= served, ENGINE_METRICS - served
    # The series the failure panel reads exist from the engine's start (a counter born at its first
    # failure would lose that failure to rate()), and every segment the engines observe has its series.
    samples = [sample for family in families for sample in family.samples]
    assert {s.labels["segment"] for s in samples if s.name == f"{SEGMENT_METRIC}_bucket"} == set(PREFILL_SEGMENTS) | set(DECODE_SEGMENTS)
    assert {("prefill", "failed"), ("decode", "failed")} <= {(s.labels["role"], s.labels["outcome"]) for s in samples if s.name == "kvpush_transfers_total"}
    assert all({"model_name", "engine", "role", "engine_id"} <= s.labels.keys() for s in samples)


def test_every_segment_has_exactly_one_observer():
    observers = [*ROUTER_SEGMENTS, *PREFILL_SEGMENTS, *DECODE_SEGMENTS]
    assert sorted(observers) == sorted(s.name for s in SEGMENTS)


def test_top_rows_read_kvpush_metrics_only_and_span_metrics_stay_in_the_drill_down_row():
    rows = [panel for panel in DASHBOARD["panels"] if panel["type"] == "row"]
    assert rows[-1]["title"] == DRILL_DOWN_ROW and rows[-1]["collapsed"], "the drill-down row comes last, collapsed"
    for row, panel in panels_with_rows():
        for target in panel["targets"]:
            spanmetrics = any(name.startswith(SPANMETRICS_PREFIX) for name in metric_names(target["expr"]))
            assert spanmetrics == (row == DRILL_DOWN_ROW), (row, panel["title"], target["expr"])


def test_stacked_segment_panel_stacks_every_segment_in_chain_order_and_p90_covers_them_by_label():
    by_title = {panel["title"]: panel for _, panel in panels_with_rows()}
    stacked = by_title[STACKED_PANEL]
    assert stacked["fieldConfig"]["defaults"]["custom"]["stacking"]["mode"] == "normal"
    # One target per segment: Grafana stacks series in target order, so the stack reads in chain order from the bottom.
    segment_targets, (ttft,) = stacked["targets"][: len(SEGMENTS)], stacked["targets"][len(SEGMENTS):]
    for segment, target in zip(SEGMENTS, segment_targets):
        assert target["expr"] == (
            f'histogram_quantile(0.5, sum by (le, segment) (rate({SEGMENT_METRIC}_bucket{{segment="{segment.name}"}}[$__rate_interval]))) * 1000'
        )
    # The router's TTFT p50 is drawn over the stack, not in it.
    assert "kvpush_router_time_to_first_token_seconds_bucket" in ttft["expr"]
    (override,) = [o for o in stacked["fieldConfig"]["overrides"] if o["matcher"]["options"] == ttft["legendFormat"]]
    assert {"id": "custom.stacking", "value": {"mode": "none", "group": "A"}} in override["properties"]
    p90 = by_title[P90_PANEL]
    assert [t["expr"] for t in p90["targets"]] == [f"histogram_quantile(0.9, sum by (le, segment) (rate({SEGMENT_METRIC}_bucket[$__rate_interval]))) * 1000"]
    assert "stacking" not in p90["fieldConfig"]["defaults"].get("custom", {})


def test_dashboard_panels_are_well_formed():
    assert DASHBOARD["uid"] and DASHBOARD["title"]
    ids = [panel["id"] for panel in all_panels()]
    assert len(ids) == len(set(ids))
    variables = {v["name"] for v in DASHBOARD["templating"]["list"]}
    for panel in all_panels():
        grid = panel["gridPos"]
        assert {"h", "w", "x", "y"} <= grid.keys() and grid["x"] >= 0 and grid["w"] > 0 and grid["x"] + grid["w"] <= 24, panel["title"]
        if panel["type"] == "row":
            assert (grid["x"], grid["w"], grid["h"]) == (0, 24, 1) and "targets" not in panel, panel["title"]
            continue
        assert panel["datasource"]["uid"].strip("${}") in variables
        assert panel["targets"] and all(target["refId"] and target["expr"] for target in panel["targets"])
        assert len({target["refId"] for target in panel["targets"]}) == len(panel["targets"]), panel["title"]
        assert all(target["datasource"] == panel["datasource"] for target in panel["targets"])


def test_dashboard_panels_do_not_overlap():
    cells: set[tuple[int, int]] = set()
    for panel in all_panels():
        grid = panel["gridPos"]
        cell = {(x, y) for x in range(grid["x"], grid["x"] + grid["w"]) for y in range(grid["y"], grid["y"] + grid["h"])}
        assert not cells & cell, panel["title"]
        cells |= cell


@pytest.mark.parametrize(("job", "port"), [("otel-collector-spanmetrics", 8889), ("kvpush-control-plane", 9400), ("kvpush-router", 8000), ("vllm", 8100)])
def test_prometheus_scrapes_every_component(job, port):
    (config,) = [c for c in PROMETHEUS["scrape_configs"] if c["job_name"] == job]
    ports = {int(t.rsplit(":", 1)[1]) for s in config["static_configs"] for t in s["targets"]}
    assert port in ports
    if job == "otel-collector-spanmetrics":
        assert COLLECTOR["exporters"]["prometheus"]["endpoint"].endswith(f":{port}")
    if job == "kvpush-control-plane":
        k8s = yaml.safe_load_all((ROOT / "deploy" / "k8s" / "10-control-plane.yaml").read_text())
        assert next(d for d in k8s if d["kind"] == "ConfigMap")["data"]["KVPUSH_METRICS_PORT"] == str(port)


def test_compose_mounts_files_that_exist_and_grafana_provisions_the_dashboard():
    compose = yaml.safe_load((OBSERVABILITY / "compose.yaml").read_text())
    for service in compose["services"].values():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (OBSERVABILITY / source).exists(), source
    provider = yaml.safe_load((OBSERVABILITY / "grafana" / "provisioning" / "dashboards" / "kvpush.yaml").read_text())["providers"][0]
    grafana_volumes = dict(v.split(":")[:2] for v in compose["services"]["grafana"]["volumes"])
    assert grafana_volumes["./grafana/dashboards"] == provider["options"]["path"]
    datasources = yaml.safe_load((OBSERVABILITY / "grafana" / "provisioning" / "datasources" / "kvpush.yaml").read_text())["datasources"]
    assert {d["type"] for d in datasources} == {"prometheus", "tempo"}
