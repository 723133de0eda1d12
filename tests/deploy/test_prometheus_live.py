# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""The Grafana dashboard's queries against a live Prometheus scraping a real local stack (control plane, P, D, router).

Prometheus runs with deploy/observability/prometheus.yml's jobs, their
static targets pointed at this stack's ports and a 1 s scrape interval; its
Kubernetes job (no cluster here) and the collector's job are left out. The
trace drill-down row's panels read the collector's span metrics, so they
are not run here: tests/deploy/test_observability.py checks them offline
against the collector's configuration.

After 5 streamed completions through the router to warm the engines up
and 100 more, every query of every other panel must return data: at least
one series with a finite value (a histogram_quantile over no observations
is NaN, which is no data; one series of several may be NaN, as a gRPC
method called only before the run). A failure rate of 0 is data: every
failure series exists from the start at 0, so a panel that shows none is a
broken query, not a quiet system. Then, over the 100 requests alone, every
request must be in every segment once, the segments' means must add up to
the router's mean TTFT within 5 % and their p50s, stacked as the dashboard
shows them, to its TTFT p50 within 10 % (P50_TOLERANCE says what is
missing), and every engine must end with no request left and all its KV
blocks free. Run with -s to see the per-segment table.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import math
import re
import shutil
import time
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urlencode

import pytest
import yaml

from kvpush.dev.localstack.completions import completions, stream_completions
from kvpush.dev.localstack.metrics import free_kv_blocks, metric_value, num_kv_blocks
from kvpush.dev.localstack.process import GroupProcess, free_fixed_port
from kvpush.dev.localstack.prompts import prompt_token_ids
from kvpush.dev.localstack.stack import Stack, StackSpec
from kvpush.dev.tinymodel import build_tiny_model, default_model_dir
from kvpush.report.breakdown import SEGMENTS
from tests.waiting import wait_for

PROMETHEUS = shutil.which("prometheus")

pytestmark = [
    pytest.mark.engine,
    pytest.mark.slow,
    pytest.mark.skipif(PROMETHEUS is None, reason="needs the prometheus binary on PATH (scripts/setup-env.sh --with-prometheus)"),
]

ROOT = Path(__file__).resolve().parents[2]
OBSERVABILITY = ROOT / "deploy" / "observability"
DRILL_DOWN_ROW = "Trace drill-down (needs the OpenTelemetry Collector's spanmetrics)"
COLLECTOR_JOB = "otel-collector-spanmetrics"
SCRAPE_INTERVAL_S = 1.0
WARMUP_REQUESTS = 5
REQUESTS = 100
MAX_TOKENS = 4
PROMPT_TOKENS = 300
# How far the segments' p50s, summed, may be from the router's TTFT p50 (the issue's bound). They fall short of it
# for two reasons measured on this machine (TTFT p50 ~31 ms): a sum of medians is less than the median of the sum
# (~4 % on per-request traces of the same requests), and ~0.5 ms per request is in no segment (D's answer on its
# way from its API server to the router). Over three runs of 100 requests the sum came 5.2-5.8 % under.
P50_TOLERANCE = 0.10
# Means do add exactly, so the mean TTFT minus the segments' means is the time no segment covers (1.6-1.9 % here).
MEAN_TOLERANCE = 0.05
PROMETHEUS_START_S = 30.0
TARGETS_UP_S = 30.0
METRICS_LINE = re.compile(r"kvpush control-plane metrics on http://[^:]+:(\d+)/metrics")


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    work = tmp_path_factory.mktemp("prometheus-live")
    model_dir = build_tiny_model(default_model_dir())
    # P and D pinned one per core: unpinned, their OpenMP threads fight and latencies swing by seconds.
    spec = StackSpec(mode="kvpush", prefill_cpus="0", decode_cpus="1", control_plane_args=("--metrics-port", "0"))
    with Stack(spec, model_dir, work / "stack") as running:
        running.start()
        yield running


def control_plane_metrics_port(stack: Stack) -> int:
    """The port the control plane announced for /metrics (it prints it before it writes its port file)."""
    assert stack.control_plane is not None
    match = METRICS_LINE.search(stack.control_plane.process.log_path.read_text(errors="replace"))
    assert match, f"no metrics port in {stack.control_plane.process.log_path}"
    return int(match.group(1))


def local_config(stack: Stack) -> tuple[dict, int]:
    """prometheus.yml with its static targets pointed at this stack; also how many targets that makes."""
    config = yaml.safe_load((OBSERVABILITY / "prometheus.yml").read_text())
    assert stack.router is not None
    # job -> the static config's role label (None: none) -> this stack's targets.
    local = {
        "kvpush-control-plane": {None: [f"127.0.0.1:{control_plane_metrics_port(stack)}"]},
        "kvpush-router": {None: [f"127.0.0.1:{stack.router.port}"]},
        "vllm": {role: [f"127.0.0.1:{server.port}" for server in servers] for role, servers in stack.engines.items()},
    }
    jobs, count = [], 0
    for job in config["scrape_configs"]:
        # No cluster here (and Debian's prometheus is built without Kubernetes discovery); the collector's span
        # metrics feed only the drill-down row, which test_observability.py checks against the collector's config.
        if "kubernetes_sd_configs" in job or job["job_name"] == COLLECTOR_JOB:
            continue
        assert job["job_name"] in local, f"prometheus.yml has a job this test does not know: {job['job_name']}"
        for static in job["static_configs"]:
            static["targets"] = local[job["job_name"]][static.get("labels", {}).get("role")]
            count += len(static["targets"])
        jobs.append(job)
    config["global"] = {**config.get("global", {}), "scrape_interval": f"{SCRAPE_INTERVAL_S:g}s", "scrape_timeout": f"{SCRAPE_INTERVAL_S:g}s",
                        "evaluation_interval": f"{SCRAPE_INTERVAL_S:g}s"}
    config["scrape_configs"] = jobs
    return config, count


class Prometheus:
    """A prometheus process on 127.0.0.1 and the few HTTP API calls the test makes."""

    def __init__(self, work: Path, config: dict):
        work.mkdir(parents=True, exist_ok=True)
        (work / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.url = f"http://127.0.0.1:{free_fixed_port()}"
        self.process = GroupProcess("prometheus", [
            PROMETHEUS, f"--config.file={work / 'prometheus.yml'}", f"--storage.tsdb.path={work / 'data'}",
            f"--web.listen-address={self.url.removeprefix('http://')}",
        ], work / "prometheus.log")

    def get(self, path: str, **params: object) -> object:
        url = f"{self.url}{path}" + (f"?{urlencode(params)}" if params else "")
        try:
            with urllib.request.urlopen(url, timeout=10.0) as answer:
                body = json.load(answer)
        except urllib.error.HTTPError as exc:
            raise AssertionError(f"{path} {params}: HTTP {exc.code} {exc.read()[:2000]!r}") from None
        assert body["status"] == "success", body
        return body["data"]

    def ready(self) -> bool:
        assert self.process.alive(), f"prometheus exited with {self.process.returncode}:\n{self.process.tail()}"
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2.0) as answer:
                return answer.status == 200
        except OSError:
            return False

    def targets(self) -> list[dict]:
        return self.get("/api/v1/targets", state="active")["activeTargets"]

    def query(self, expr: str, at: float) -> list[dict]:
        data = self.get("/api/v1/query", query=expr, time=f"{at:.3f}")
        assert data["resultType"] == "vector", (expr, data)
        return data["result"]

    def scraped_twice_since(self, instant: float) -> bool:
        """Whether every target is up and was scraped at least twice since `instant` (wall clock): a scrape 1.5 intervals
        after it is at least the second."""
        return all(scrape_time(t["lastScrape"]) >= instant + 1.5 * SCRAPE_INTERVAL_S and t["health"] == "up" for t in self.targets())

    def stop(self) -> None:
        self.process.stop(10.0)


def scrape_time(rfc3339: str) -> float:
    """Seconds since the epoch of a Prometheus lastScrape (RFC 3339 with nanoseconds: cut to the microseconds datetime takes)."""
    return datetime.datetime.fromisoformat(re.sub(r"(\.\d{6})\d+", r"\1", rfc3339)).timestamp()


def dashboard_targets() -> list[tuple[str, str, str]]:
    """(panel title, legend, expr) of every query outside the trace drill-down row (a collapsed row holds its panels)."""
    dashboard = json.loads((OBSERVABILITY / "grafana" / "dashboards" / "kvpush-ttft.json").read_text())
    found, row = [], ""
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            row = panel["title"]
            panels = panel.get("panels", [])
        else:
            panels = [panel]
        if row != DRILL_DOWN_ROW:
            found += [(p["title"], t["legendFormat"], t["expr"]) for p in panels for t in p["targets"]]
    return found


def at_window(expr: str, window: str) -> str:
    """A Grafana query with its range variables set to a window covering the run."""
    return expr.replace("$__rate_interval", window).replace("$__range", window)


def finite(series: dict) -> bool:
    return math.isfinite(float(series["value"][1]))


def by_label(result: list[dict], label: str) -> dict[str, float]:
    return {series["metric"][label]: float(series["value"][1]) for series in result}


def scalar(result: list[dict]) -> float:
    (series,) = result
    return float(series["value"][1])


def test_every_dashboard_query_has_data_and_the_segments_add_up_to_ttft(stack, tmp_path):
    config, expected_targets = local_config(stack)
    prometheus = Prometheus(tmp_path / "prometheus", config)
    try:
        started = time.time()
        wait_for(prometheus.ready, PROMETHEUS_START_S, interval=0.2, what="prometheus ready")
        wait_for(lambda: len(prometheus.targets()) == expected_targets and all(t["health"] == "up" for t in prometheus.targets()),
                 TARGETS_UP_S, interval=0.5, what=f"{expected_targets} targets up")

        # A fresh engine's first requests are slow (its first decode step takes seconds here): they are not what a
        # dashboard of a serving fleet shows, so the measured window starts after them.
        send_requests(stack, range(WARMUP_REQUESTS))
        warmed = time.time()
        wait_for(lambda: prometheus.scraped_twice_since(warmed), 10.0, interval=0.2, what="two scrapes after the warm-up")
        warm = time.time()
        sent = time.monotonic()
        send_requests(stack, range(WARMUP_REQUESTS, WARMUP_REQUESTS + REQUESTS))
        sent_s = time.monotonic() - sent
        last = time.time()
        wait_for(lambda: prometheus.scraped_twice_since(last), 10.0, interval=0.2, what="two scrapes of every target after the last request")
        now = time.time()
        window = f"{math.ceil(now - started) + 5}s"

        assert_every_query_has_data(prometheus, window, now)

        # The run alone: each series' value now less its value at the window's start (no extrapolation, unlike increase()).
        def run_only(selector: str, by: str) -> str:
            return f"(sum by ({by}) ({selector}) - sum by ({by}) ({selector} offset {round(1000 * (now - warm))}ms))"

        p50s = by_label(prometheus.query(f"histogram_quantile(0.5, {run_only('kvpush_ttft_segment_seconds_bucket', 'le, segment')})", now), "segment")
        ttft_p50 = scalar(prometheus.query(f"histogram_quantile(0.5, {run_only('kvpush_router_time_to_first_token_seconds_bucket', 'le')})", now))
        counts = by_label(prometheus.query(run_only("kvpush_ttft_segment_seconds_count", "segment"), now), "segment")
        means = {name: total / counts[name] for name, total in by_label(prometheus.query(run_only("kvpush_ttft_segment_seconds_sum", "segment"), now),
                                                                        "segment").items() if counts.get(name)}
        ttft_count = scalar(prometheus.query(run_only("kvpush_router_time_to_first_token_seconds_count", ""), now))
        ttft_mean = scalar(prometheus.query(run_only("kvpush_router_time_to_first_token_seconds_sum", ""), now)) / ttft_count

        print(f"\n{REQUESTS} streamed requests in {sent_s:.1f} s after {WARMUP_REQUESTS} to warm up; per segment (Prometheus):")
        print(f"  {'segment':<22} {'p50 ms':>8} {'mean ms':>9} {'count':>6}")
        for segment in SEGMENTS:
            name = segment.name
            print(f"  {name:<22} {1000 * p50s.get(name, math.nan):8.2f} {1000 * means.get(name, math.nan):9.2f} {counts.get(name, 0):6.0f}")
        p50_sum = sum(p50s.get(s.name, math.nan) for s in SEGMENTS)
        mean_sum = sum(means.get(s.name, math.nan) for s in SEGMENTS)
        print(f"  {'sum of the segments':<22} {1000 * p50_sum:8.2f} {1000 * mean_sum:9.2f}")
        print(f"  {'router TTFT':<22} {1000 * ttft_p50:8.2f} {1000 * ttft_mean:9.2f} {ttft_count:6.0f}")
        print(f"  sum / TTFT: p50s {p50_sum / ttft_p50 - 1:+.1%}, means {mean_sum / ttft_mean - 1:+.1%} "
              f"(means add exactly: {1000 * (ttft_mean - mean_sum):.2f} ms per request is in no segment)")

        assert [s.name for s in SEGMENTS if not math.isfinite(p50s.get(s.name, math.nan))] == []
        assert abs(p50_sum - ttft_p50) <= P50_TOLERANCE * ttft_p50, (p50_sum, ttft_p50)
        assert abs(mean_sum - ttft_mean) <= MEAN_TOLERANCE * ttft_mean, (mean_sum, ttft_mean)
        # Every request is in every segment once: none lost on its way from a process's stats to its /metrics.
        assert ttft_count == REQUESTS
        assert {s.name: counts.get(s.name) for s in SEGMENTS} == {s.name: REQUESTS for s in SEGMENTS}
        # The engines' own role label is kept (prometheus.yml's honor_labels), not renamed beside the target's.
        assert prometheus.query('{exported_role!=""}', now) == []
        # One unsharded broker serving, and a lease for each engine's one rank.
        for expr, value in (("kvpush_broker_shard_members", 1), ("kvpush_broker_shard_serving", 1), ("kvpush_registrar_leased_ranks", 2)):
            assert [float(series["value"][1]) for series in prometheus.query(expr, now)] == [value], expr
    finally:
        prometheus.stop()
    assert_engines_idle(stack)


def send_requests(stack: Stack, seeds: range) -> None:
    """Streamed completions through the router, one at a time; a few unary control-plane calls among them."""
    assert stack.router is not None
    for seed in seeds:
        # One length (the p50s compare best when P's prefill does not vary), all different (no prefix is shared).
        answer = stream_completions(stack.router.url, prompt_token_ids(PROMPT_TOKENS, seed=seed), MAX_TOKENS, timeout=60.0)
        assert len(answer.token_ids) == MAX_TOKENS
        if seed % 10 == 0:
            assert list_engines(stack) == ["decode-0", "prefill-0"]


def assert_every_query_has_data(prometheus: Prometheus, window: str, now: float) -> None:
    """Every target of every panel above the drill-down row returns a series with a finite value."""
    no_data = []
    for title, legend, expr in dashboard_targets():
        query = at_window(expr, window)
        result = prometheus.query(query, now)
        if not any(map(finite, result)):
            no_data.append((title, legend, query, [series["value"][1] for series in result]))
    assert not no_data, f"queries with no series or no finite value: {no_data}"


def list_engines(stack: Stack) -> list[str]:
    """The registrar's engines, by a unary ListEngines call as an operator's tooling makes it.

    Requests travel on streams (engine reports, write orders), and unary RPCs are the control operations
    (registration, lookups, cancellations): without these calls the unary handling-time panel would
    have no call inside the run to show.
    """
    from kvpush.client import ClientConfig, RegistrarClient
    from kvpush.registrar.v1 import registrar_service_pb2 as pb

    assert stack.control_plane is not None

    async def call() -> list[str]:
        async with RegistrarClient(ClientConfig(target=stack.control_plane.address, token=stack.control_plane.token)) as registrar:
            return [engine.engine_id for engine in (await registrar.list_engines(pb.ListEnginesRequest(), timeout_s=10.0)).engines]

    return asyncio.run(call())


def assert_engines_idle(stack: Stack) -> None:
    """Every engine ends with no request running or waiting and all its KV blocks free."""
    for server in [s for servers in stack.engines.values() for s in servers]:
        total = num_kv_blocks(server.url)

        def idle(server=server, total=total):
            # vLLM publishes these gauges from engine steps: a one-token local request makes the engine step.
            completions(server.url, prompt_token_ids(4, seed=7), 1)
            running = metric_value(server.url, "vllm:num_requests_running") + metric_value(server.url, "vllm:num_requests_waiting")
            return running == 0 and free_kv_blocks(server.url) == total - 1  # the null block is never free

        wait_for(idle, 20.0, interval=0.5, what=f"{server.name}: no request left and every KV block free")
