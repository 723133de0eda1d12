# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""deploy/observability, offline: the collector's pipelines, Tempo, Prometheus, compose and the Grafana dashboard.

The dashboard's queries must name spans kvpush really emits (read from the
connector, broker and router sources) and metrics its registries really
define; the collector must wire every pipeline to defined components.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry

from kvpush.report.breakdown import DETAILS
from kvpush.services.broker.metrics import BrokerMetrics
from kvpush.services.common.rpc_metrics import RpcMetricsInterceptor
from kvpush.services.router.app import REQUEST_SPAN
from kvpush.services.router.core import Endpoint, EnginePool
from kvpush.services.router.legs import LEG_SPANS
from kvpush.services.router.metrics import RouterMetrics

ROOT = Path(__file__).resolve().parents[2]
OBSERVABILITY = ROOT / "deploy" / "observability"
COLLECTOR = yaml.safe_load((OBSERVABILITY / "otel-collector.yaml").read_text())
DASHBOARD = json.loads((OBSERVABILITY / "grafana" / "dashboards" / "kvpush-ttft.json").read_text())
PROMETHEUS = yaml.safe_load((OBSERVABILITY / "prometheus.yml").read_text())


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


def queries() -> list[str]:
    return [target["expr"] for panel in DASHBOARD["panels"] for target in panel["targets"]]


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


def test_dashboard_metrics_exist_in_kvpush_registries_or_spanmetrics():
    pools = (EnginePool("prefill", [Endpoint("http://p:1", "p")], "round_robin"), EnginePool("decode", [Endpoint("http://d:1", "d")], "round_robin"))
    registry = CollectorRegistry()
    RouterMetrics(pools, registry)
    BrokerMetrics(registry)
    RpcMetricsInterceptor(registry)
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    known = {family.name + suffix for family in registry.collect() for suffix in suffixes[family.type]}
    # The collector's Prometheus exporter names span metrics <namespace>_duration_<unit>_bucket.
    connector = COLLECTOR["connectors"]["spanmetrics"]
    known.add(f"{connector['namespace'].replace('.', '_')}_duration_milliseconds_bucket")
    assert connector["histogram"]["unit"] == "ms"
    used = set()
    for expr in queries():
        used |= set(re.findall(r"\b((?:kvpush|traces|grpc_server)_[a-z_]+)\b", expr))
    assert used and used <= known, used - known
    assert {"kvpush_router_time_to_first_token_seconds_bucket", "grpc_server_handled_total", "grpc_server_handling_seconds_bucket"} <= used


def test_dashboard_panels_are_well_formed():
    ids = [panel["id"] for panel in DASHBOARD["panels"]]
    assert len(ids) == len(set(ids))
    assert DASHBOARD["uid"] and DASHBOARD["title"]
    variables = {v["name"] for v in DASHBOARD["templating"]["list"]}
    for panel in DASHBOARD["panels"]:
        assert panel["datasource"]["uid"].strip("${}") in variables
        assert all(target["refId"] and target["expr"] for target in panel["targets"])
        assert {"h", "w", "x", "y"} <= panel["gridPos"].keys() and panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24


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
