# SPDX-License-Identifier: Apache-2.0
"""The push-vs-pull sweep on this machine: kvpush, upstream NixlPushConnector and upstream NixlConnector (pull).

Reproduces the study in /work/shared/seed (TTFT and TPOT against QPS, one
panel per input length) with three P/D stacks of the same tiny model and the
same engine flags (kvpush.localstack.engines; prefix caching off on P and D),
every P pinned to CPU 0 and every D to CPU 1:

* kvpush: `KvpushConnector` on both engines, the kvpush control plane and
  `kvpush router --mode push`;
* upstream-push: `NixlPushConnector`, `kvpush router --mode upstream-push`;
* pull: `NixlConnector`, `kvpush router --mode pull` (P leg, then D leg).

Upstream engines run with the NIXL progress thread's spin removed (a 1 ms
poll delay, bench/nixl_poll_delay) unless `--nixl-as-shipped`.

Load: per point (input length, QPS, output length, iteration) the same
prompts and the same Poisson arrival times for every mode, streamed
completions through the mode's router. Per request: TTFT (client send →
first streamed token), TPOT ((last − first token) / (n − 1)), inter-token
latencies, end-to-end latency. By default all stacks are up at once and the
modes alternate at every point, in an order that rotates from point to
point, so machine drift hits all of them; the CPU every stack used during
each run is recorded, so the idle stacks' interference shows (an idle
upstream engine still wakes ~1,000 times a second). With
`--one-stack-at-a-time` (forced by `--nixl-as-shipped`, whose idle engines
each burn a core) only one mode's stack runs: the modes alternate per pass
over the points instead, one stack start per mode and pass.

Every run is checked: a sample of its requests must give the greedy token
ids of a single ordinary engine (`kvpush.localstack.engines.reference_run`, computed up front)
with logprobs within 1e-3, and the KV must have moved: kvpush, the broker's
`bytes_written` per transfer equals the prompt's whole 128-token blocks ×
2,048 B/token (2 layers × K and V × 2 KV heads × 64 × 4 B); upstream, the
`vllm:nixl_bytes_transferred` histograms of P and D (sum and count deltas)
give one transfer and the prompt's bytes per request. For kvpush each run
also gets the per-segment TTFT breakdown from its spans (`kvpush.report`);
for every mode the router-side P leg and the engines' vLLM histograms
(queue, prefill, decode time) beside it.

One JSON per run: `<results-dir>/<mode>_qps<q>_in<in>_out<out>_iter<i>.json`
(every request's figures and the summary), plus `summary.json` (every run's
summary and the tables) and `points.json` (the tables' figures only). Then

    python -m bench.sweep --quick --results-dir runs/sweep-quick
    python -m bench.sweep --results-dir runs/sweep            # the full grid
    python -m bench.sweep --results-dir runs/sweep --report-only --markdown runs/sweep/report.md
    python bench/plot_sweep.py --results-dir runs/sweep --metric ttft --log-y
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import fcntl
import json
import math
import random
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from bench.sweep_report import report, write_json
from bench.upstream import poll_delay_env
from kvpush.localstack.completions import Completion, completion_body, max_logprob_diff
from kvpush.localstack.control_plane import ControlPlaneHandle
from kvpush.localstack.engines import ServerHandle, reference_run
from kvpush.localstack.metrics import scrape_metrics
from kvpush.localstack.process import interrupt_on_signals
from kvpush.localstack.prompts import prompt_token_ids
from kvpush.localstack.stack import MODES, Stack, StackSpec
from kvpush.processes import cpu_seconds, thread_cpu_seconds
from kvpush.report.breakdown import breakdown, percentile
from kvpush.sse import DONE, sse_payloads_async
from kvpush.telemetry import read_spans

PREFILL_CPUS, DECODE_CPUS = "0", "1"
NIXL_POLL_DELAY_US = 1000

# Tiny-model geometry (kvpush.tinymodel): 2 layers × K and V × 2 KV heads × 64
# channels × 4 bytes (float32) per token; vLLM CPU's block size.
KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 64 * 4
BLOCK_SIZE = 128
LOGPROB_ATOL = 1e-3

# A point keeps up with its offered load when its requests finish at ≥ this
# share of the rate they arrived at (see `sustained`).
SUSTAINED_SHARE = 0.9

# vLLM's per-engine histograms read around every run (sum and count deltas).
ENGINE_HISTOGRAMS = {
    "nixl_bytes": "vllm:nixl_bytes_transferred",
    "nixl_transfer_s": "vllm:nixl_xfer_time_seconds",
    "queue_s": "vllm:request_queue_time_seconds",
    "prefill_s": "vllm:request_prefill_time_seconds",
    "decode_s": "vllm:request_decode_time_seconds",
    "ttft_s": "vllm:time_to_first_token_seconds",
}
WARMUP_PREFIX = "warmup-"
METRICS_SETTLE_TIMEOUT_S = 5.0
SPANS_SETTLE_TIMEOUT_S = 10.0


# ---- the grid and its workloads ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Point:
    """One grid point of one iteration; every mode runs it with the same prompts and arrival times."""

    input_len: int
    qps: float
    output_len: int
    iteration: int

    @property
    def qps_label(self) -> str:
        return f"{self.qps:g}"

    def run_name(self, mode: str) -> str:
        """The seed study's file stem: <mode>_qps<q>_in<in>_out<out>_iter<i>."""
        return f"{mode}_qps{self.qps_label}_in{self.input_len}_out{self.output_len}_iter{self.iteration}"

    def request_id(self, mode: str, index: int) -> str:
        return f"{self.run_name(mode)}-r{index:04d}"

    def seed(self, base: int) -> int:
        # Stable across processes (unlike hash()): prompts and arrivals are reproducible.
        return base * 1_000_003 + self.input_len * 7919 + round(self.qps * 1000) * 31 + self.output_len * 17 + self.iteration


@dataclasses.dataclass
class Workload:
    """A point's prompts, Poisson arrival offsets (s from the run's start) and the requests checked for correctness."""

    point: Point
    prompts: list[list[int]]
    offsets_s: list[float]
    checked: list[int]


def make_workload(point: Point, num_requests: int, num_checked: int, seed: int) -> Workload:
    """Deterministic prompts and arrivals; the checked requests are spread over the run (first to last)."""
    rng = random.Random(point.seed(seed))
    offsets, now = [], 0.0
    for _ in range(num_requests):
        offsets.append(now)
        now += rng.expovariate(point.qps)
    prompts = [prompt_token_ids(point.input_len, seed=point.seed(seed) * 10_007 + i) for i in range(num_requests)]
    count = min(num_checked, num_requests)
    checked = sorted({round(i * (num_requests - 1) / max(count - 1, 1)) for i in range(count)}) if count else []
    return Workload(point, prompts, offsets, checked)


def requests_for(qps: float, duration_s: float, min_requests: int) -> int:
    """Requests per run: `duration_s` of arrivals at `qps`, at least `min_requests`."""
    return max(min_requests, round(qps * duration_s))


def build_grid(input_lens: Sequence[int], qps_list: Sequence[float], output_lens: Sequence[int], iterations: int) -> list[Point]:
    """Iterations outermost, so a sweep cut short still covers every point once."""
    return [Point(i, q, o, it) for it in range(1, iterations + 1) for o in output_lens for i in input_lens for q in qps_list]


# ---- processes ------------------------------------------------------------------------------------------------


class SpanTail:
    """Reads the spans appended to a shared OTLP/JSON-lines file since a byte offset."""

    def __init__(self, path: Path):
        self.path = path

    def offset(self) -> int:
        return self.path.stat().st_size if self.path.exists() else 0

    def read_since(self, offset: int) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        with self.path.open("rb") as file:
            # Writers append whole lines under an exclusive flock (kvpush.telemetry).
            fcntl.flock(file.fileno(), fcntl.LOCK_SH)
            file.seek(offset)
            chunk = file.read()
        # kvpush.telemetry.read_spans parses files: give it just the new lines.
        with tempfile.NamedTemporaryFile(suffix=".jsonl") as part:
            part.write(chunk)
            part.flush()
            return read_spans(part.name)


@dataclasses.dataclass
class ModeStack:
    """One mode's running stack (P, D, its router and, for kvpush, the control plane) and the spans it writes."""

    mode: str
    stack: Stack
    spans: SpanTail
    failure: str = ""  # set once the stack is found dead; its remaining runs are skipped

    @property
    def prefill(self) -> ServerHandle:
        return self.stack.prefill

    @property
    def decode(self) -> ServerHandle:
        return self.stack.decode

    @property
    def router_url(self) -> str:
        return self.stack.router.url

    @property
    def control_plane(self) -> ControlPlaneHandle | None:
        return self.stack.control_plane

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds used so far by each part (all processes of each engine's group)."""
        used = {"P": self.prefill.cpu_seconds(), "D": self.decode.cpu_seconds(), "router": cpu_seconds(self.stack.router.process.pid)}
        if self.control_plane is not None:
            used["control_plane"] = cpu_seconds(self.control_plane.process.pid)
        return used

    def stop(self) -> None:
        self.stack.stop()


def start_stack(mode: str, model_dir: Path, work: Path, nixl_as_shipped: bool, kvpush_engine_tracing: bool,
                kvpush_extra: dict[str, Any]) -> ModeStack:
    """Starts one mode's engines (P on PREFILL_CPUS, D on DECODE_CPUS, concurrently) and router.

    Every router exports its spans (router-side timings, kvpush transfer
    ids); kvpush's engines and control plane too unless
    `kvpush_engine_tracing` is off (to measure what tracing costs them).
    `kvpush_extra` goes into both kvpush engines' kv_connector_extra_config.
    Upstream engines get NIXL's poll delay unless `nixl_as_shipped`.
    """
    traces = work / "traces.jsonl"
    spec = StackSpec(
        mode=mode, prefill_cpus=PREFILL_CPUS, decode_cpus=DECODE_CPUS, traces_file=traces, trace_engines=kvpush_engine_tracing,
        engine_env={} if mode == "kvpush" else poll_delay_env(None if nixl_as_shipped else NIXL_POLL_DELAY_US), kvpush_extra=kvpush_extra,
        # Settled transfers stay queryable (GetTransfer) for the whole sweep; retention only bounds memory.
        control_plane_args=("--retention", "7200"), router_log_level="WARNING",
    )
    return ModeStack(mode, Stack(spec, model_dir, work).start(), SpanTail(traces))


# ---- the load ------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class RequestRecord:
    """What the client saw of one request (times in s from the run's start unless named _ms)."""

    index: int
    request_id: str
    scheduled_s: float
    sent_s: float = math.nan
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None
    itl_ms: list[float] = dataclasses.field(default_factory=list)
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and self.ttft_ms is not None

    def figures(self) -> dict[str, Any]:
        """The JSON form: no token ids or logprobs (the correctness verdict is stored instead)."""
        return {
            "index": self.index,
            "request_id": self.request_id,
            "scheduled_s": round(self.scheduled_s, 6),
            "send_lag_ms": None if math.isnan(self.sent_s) else round((self.sent_s - self.scheduled_s) * 1000, 3),
            "ttft_ms": self.ttft_ms,
            "tpot_ms": self.tpot_ms,
            "e2e_ms": self.e2e_ms,
            "output_tokens": len(self.token_ids),
            "itl_ms": [round(x, 3) for x in self.itl_ms],
            "error": self.error,
        }


async def stream_one(session: Any, url: str, body: dict[str, Any], record: RequestRecord, started: float, timeout_s: float) -> None:
    """Sends one streamed completion and fills `record` with its timings, tokens and logprobs (never raises)."""
    import aiohttp

    token_times: list[float] = []
    sent = time.monotonic()
    record.sent_s = sent - started
    try:
        async with session.post(url + "/v1/completions", json=body, headers={"X-Request-Id": record.request_id},
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:
            if response.status != 200:
                record.error = f"HTTP {response.status}: {(await response.text())[:300]}"
                return
            # An event that is not JSON raises MalformedEvent (a ValueError): the request's error.
            async for chunk in sse_payloads_async(response.content):
                if chunk == DONE:
                    break
                now = time.monotonic()
                if "error" in chunk:
                    record.error = f"stream error: {str(chunk['error'])[:300]}"
                    return
                for choice in chunk.get("choices", []):
                    ids = choice.get("token_ids") or []
                    record.token_ids += ids
                    token_times += [now] * len(ids)
                    record.logprobs += [float(x) for x in (choice.get("logprobs") or {}).get("token_logprobs") or []]
    except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"[:300] or type(exc).__name__
    finally:
        if token_times:
            record.ttft_ms = (token_times[0] - sent) * 1000
            record.e2e_ms = (token_times[-1] - sent) * 1000
            record.itl_ms = [(b - a) * 1000 for a, b in zip(token_times, token_times[1:])]
            if len(token_times) > 1:
                record.tpot_ms = (token_times[-1] - token_times[0]) * 1000 / (len(token_times) - 1)
        if not record.error and len(record.token_ids) != body["max_tokens"]:
            record.error = f"{len(record.token_ids)} of {body['max_tokens']} tokens"


async def run_load(url: str, workload: Workload, mode: str, timeout_s: float, on_done) -> tuple[list[RequestRecord], float]:
    """Sends the workload's requests at their arrival offsets; returns the records and the run's wall time (s).

    Every request is bounded by `timeout_s`, and the whole run by the last
    arrival plus `timeout_s` plus a margin, so a stuck engine cannot stall it.
    """
    import aiohttp

    point = workload.point
    records = [RequestRecord(i, point.request_id(mode, i), offset) for i, offset in enumerate(workload.offsets_s)]
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=connector, read_bufsize=4 * 1024 * 1024) as session:
        started = time.monotonic()

        async def one(record: RequestRecord, prompt: list[int]) -> None:
            await asyncio.sleep(max(0.0, started + record.scheduled_s - time.monotonic()))
            body = completion_body(prompt, point.output_len, stream=True)
            await stream_one(session, url, body, record, started, timeout_s)
            on_done()

        tasks = [asyncio.create_task(one(r, p)) for r, p in zip(records, workload.prompts)]
        limit = workload.offsets_s[-1] + timeout_s + 30.0
        done, pending = await asyncio.wait(tasks, timeout=limit)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for record in records:
            if record.ttft_ms is None and not record.error:
                record.error = f"not finished within the run's limit of {limit:.0f} s"
        wall = time.monotonic() - started
    return records, wall


async def warm_up(url: str, input_lens: Sequence[int], timeout_s: float) -> list[str]:
    """A few sequential requests per input length, then a concurrent burst: the first requests pay one-time costs."""
    import aiohttp

    errors = []
    async with aiohttp.ClientSession() as session:
        index = 0
        for input_len in input_lens:
            for _ in range(2):
                record = RequestRecord(index, f"{WARMUP_PREFIX}{index}", 0.0)
                body = completion_body(prompt_token_ids(input_len, seed=900_000 + index), 8, stream=True)
                await stream_one(session, url, body, record, time.monotonic(), timeout_s)
                errors += [record.error] if record.error else []
                index += 1
        burst = []
        for input_len in input_lens:
            for _ in range(2):
                record = RequestRecord(index, f"{WARMUP_PREFIX}{index}", 0.0)
                body = completion_body(prompt_token_ids(input_len, seed=900_000 + index), 8, stream=True)
                burst.append((record, body))
                index += 1
        await asyncio.gather(*(stream_one(session, url, body, record, time.monotonic(), timeout_s) for record, body in burst))
        errors += [record.error for record, _ in burst if record.error]
    return errors


# ---- measurements around a run ---------------------------------------------------------------------------


def histogram_totals(url: str) -> dict[str, dict[str, float]]:
    """Sum and count of each ENGINE_HISTOGRAMS entry on one engine (absent ones are 0)."""
    samples = scrape_metrics(url)
    totals = {}
    for key, name in ENGINE_HISTOGRAMS.items():
        totals[key] = {part: sum(v for _, v in samples.get(f"{name}_{part}", [])) for part in ("sum", "count")}
    return totals


def histogram_delta(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]) -> dict[str, dict[str, float | None]]:
    """Per histogram: sum and count over the run and their mean (ms for times, bytes for sizes)."""
    delta = {}
    for key in ENGINE_HISTOGRAMS:
        total = after[key]["sum"] - before[key]["sum"]
        count = after[key]["count"] - before[key]["count"]
        scale = 1.0 if key == "nixl_bytes" else 1000.0
        delta[key] = {"sum": total, "count": count, "mean": total / count * scale if count else None}
    return delta


def expected_kv_bytes(input_len: int) -> int:
    """The KV a request's transfer moves: the prompt's blocks, whole (kvpush writes a last partly filled block whole too)."""
    return -(-input_len // BLOCK_SIZE) * BLOCK_SIZE * KV_BYTES_PER_TOKEN


async def fetch_transfers(control_plane: ControlPlaneHandle, keys: Sequence[tuple[str, int]]) -> dict[tuple[str, int], Any]:
    """The broker's record of each (transfer_id, attempt); errors are returned in place of a record."""
    from kvpush.client import BrokerClient, ClientConfig
    from kvpush.rendezvous.v1 import rendezvous_service_pb2 as pb

    results: dict[tuple[str, int], Any] = {}
    async with BrokerClient(ClientConfig(target=control_plane.address, token=control_plane.token)) as broker:
        for transfer_id, attempt in keys:
            try:
                response = await broker.get_transfer(pb.GetTransferRequest(transfer_id=transfer_id, attempt=attempt))
                results[(transfer_id, attempt)] = response.transfer
            except Exception as exc:  # recorded per transfer; one failed query must not end the sweep
                results[(transfer_id, attempt)] = exc
    return results


def wait_for_spans(stack: ModeStack, offset: int, prefix: str, expected: int, need_engine_spans: bool) -> list[dict[str, Any]]:
    """The spans written since `offset` once `expected` router requests of `prefix` are there (engine spans too for kvpush); bounded."""
    deadline = time.monotonic() + SPANS_SETTLE_TIMEOUT_S
    while True:
        spans = stack.spans.read_since(offset)
        result = breakdown(spans, request_id_prefix=prefix)
        have = sum(r.complete for r in result.requests) if need_engine_spans else len(result.requests)
        if have >= expected or time.monotonic() > deadline:
            return spans
        time.sleep(0.3)


def router_segments(spans: list[dict[str, Any]], prefix: str) -> dict[str, dict[str, float | None]]:
    """Router-side timings per request of `prefix` (ms): P leg, router TTFT and what follows the P leg's answer."""
    by_trace: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for span in spans:
        by_trace[span["trace_id"]].append(span)
    per_request: dict[str, dict[str, float | None]] = {}
    for root in spans:
        if root["name"] != "router.request" or not str(root["attributes"].get("kvpush.client_request_id", "")).startswith(prefix):
            continue
        attempt = int(root["attributes"].get("kvpush.attempt", 0))
        legs = {s["name"]: s for s in by_trace[root["trace_id"]] if s["name"] in ("router.prefill_leg", "router.decode_leg")
                and int(s["attributes"].get("kvpush.attempt", attempt)) == attempt}
        first = [e["time_ns"] for e in root["events"] if e["name"] == "first_token"]
        prefill = legs.get("router.prefill_leg")
        decode = legs.get("router.decode_leg")
        ttft = (first[0] - root["start_ns"]) / 1e6 if first else None
        p_leg = (prefill["end_ns"] - root["start_ns"]) / 1e6 if prefill else None
        per_request[root["attributes"]["kvpush.client_request_id"]] = {
            "router_ttft_ms": ttft,
            "p_leg_ms": p_leg,
            "after_p_leg_ms": None if ttft is None or p_leg is None else ttft - p_leg,
            "d_leg_sent_ms": (decode["start_ns"] - root["start_ns"]) / 1e6 if decode else None,
            "attempt": attempt,
        }
    return per_request


# ---- statistics ------------------------------------------------------------------------------------------------


def stats(values: Iterable[float | None]) -> dict[str, float | None]:
    present = [v for v in values if v is not None and not math.isnan(v)]
    if not present:
        return {"p50": None, "p90": None, "p99": None, "mean": None, "n": 0}
    return {"p50": percentile(present, 50), "p90": percentile(present, 90), "p99": percentile(present, 99), "mean": sum(present) / len(present),
            "n": len(present)}


def sustained(records: Sequence[RequestRecord], workload: Workload) -> tuple[bool, float]:
    """Whether the run kept up with its arrivals, and the share it kept up at.

    Arrival rate: requests / (last arrival + one mean gap). Completion
    rate: requests / (last completion − first send). A stack that keeps up
    finishes about one request latency after the last arrival (share near
    1); a saturated one builds a backlog that finishes late. Every request
    must also have succeeded.
    """
    if not records or not all(r.ok for r in records):
        return False, 0.0
    n = len(records)
    arrival_window = workload.offsets_s[-1] + 1.0 / workload.point.qps
    completion_window = max(r.sent_s + r.e2e_ms / 1000 for r in records) - min(r.sent_s for r in records)
    share = (n / completion_window) / (n / arrival_window) if completion_window > 0 else 0.0
    return share >= SUSTAINED_SHARE, share


def check_correctness(records: Sequence[RequestRecord], workload: Workload, references: dict[tuple[Point, int], Completion]) -> dict[str, Any]:
    """Compares the checked requests with the single-engine references."""
    outcomes = []
    for index in workload.checked:
        record = records[index]
        if not record.ok:
            outcomes.append({"index": index, "ok": False, "why": record.error or "no output"})
            continue
        reference = references[(workload.point, index)]
        diff = max_logprob_diff(reference, Completion(record.token_ids, record.logprobs))
        outcomes.append({"index": index, "ok": diff <= LOGPROB_ATOL, "tokens_equal": record.token_ids == reference.token_ids,
                         "max_logprob_diff": None if math.isinf(diff) else diff})
    return {"checked": len(outcomes), "passed": sum(o["ok"] for o in outcomes), "ok": all(o["ok"] for o in outcomes), "outcomes": outcomes}


def summarize(records: Sequence[RequestRecord], wall_s: float, workload: Workload) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    keeps_up, share = sustained(records, workload)
    output_tokens = sum(len(r.token_ids) for r in ok)
    span = (max(r.sent_s + r.e2e_ms / 1000 for r in ok) - min(r.sent_s for r in ok)) if ok else 0.0
    quarter = max(1, len(records) // 4)
    return {
        "requests": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "errors": sorted({r.error for r in records if r.error})[:5],
        "ttft_ms": stats(r.ttft_ms for r in ok),
        "tpot_ms": stats(r.tpot_ms for r in ok),
        "itl_ms": stats(x for r in ok for x in r.itl_ms),
        "e2e_ms": stats(r.e2e_ms for r in ok),
        # A saturated run's TTFT grows from the first arrivals to the last.
        "ttft_first_quarter_p50_ms": stats(r.ttft_ms for r in records[:quarter] if r.ok)["p50"],
        "ttft_last_quarter_p50_ms": stats(r.ttft_ms for r in records[-quarter:] if r.ok)["p50"],
        "max_send_lag_ms": max((r.sent_s - r.scheduled_s) * 1000 for r in records if not math.isnan(r.sent_s)) if records else None,
        "request_throughput_per_s": len(ok) / span if span > 0 else None,
        "output_throughput_tok_per_s": output_tokens / span if span > 0 else None,
        "offered_qps": workload.point.qps,
        "sustained": keeps_up,
        "sustained_share": share,
        "wall_s": wall_s,
    }


# ---- one run ------------------------------------------------------------------------------------------------------


def run_point(stack: ModeStack, stacks: Sequence[ModeStack], workload: Workload, references: dict[tuple[Point, int], Completion],
              args: argparse.Namespace, progress) -> dict[str, Any]:
    """Runs one mode at one point and returns its full result (the JSON document)."""
    point, mode = workload.point, stack.mode
    prefix = point.run_name(mode) + "-"
    moved_threads = stack.stack.repin()
    before = {"P": histogram_totals(stack.prefill.url), "D": histogram_totals(stack.decode.url)}
    cpu_before = {s.mode: s.cpu_seconds() for s in stacks}
    threads_before = {"P": thread_cpu_seconds(stack.prefill.pids()), "D": thread_cpu_seconds(stack.decode.pids())}
    offset = stack.spans.offset()

    def done() -> None:
        progress.update(1)

    records, wall = asyncio.run(run_load(stack.router_url, workload, mode, args.request_timeout, done))
    cpu_after = {s.mode: s.cpu_seconds() for s in stacks}
    threads_after = {"P": thread_cpu_seconds(stack.prefill.pids()), "D": thread_cpu_seconds(stack.decode.pids())}
    # The engines publish their histograms with scheduler stats; the NIXL counts may trail the last response.
    expected_transfers = len([r for r in records if r.ok])
    deadline = time.monotonic() + METRICS_SETTLE_TIMEOUT_S
    while True:
        after = {"P": histogram_totals(stack.prefill.url), "D": histogram_totals(stack.decode.url)}
        nixl_count = sum(after[e]["nixl_bytes"]["count"] - before[e]["nixl_bytes"]["count"] for e in after)
        if mode == "kvpush" or nixl_count >= expected_transfers or time.monotonic() > deadline:
            break
        time.sleep(0.25)
    engines = {e: histogram_delta(before[e], after[e]) for e in before}
    engine_spans = mode == "kvpush" and args.kvpush_engine_tracing
    spans = wait_for_spans(stack, offset, prefix, len(records), need_engine_spans=engine_spans)
    summary = summarize(records, wall, workload)
    summary["correctness"] = check_correctness(records, workload, references)
    router_side = router_segments(spans, prefix)
    summary["router"] = {key: stats(r[key] for r in router_side.values()) for key in ("router_ttft_ms", "p_leg_ms", "after_p_leg_ms", "d_leg_sent_ms")}
    summary["router"]["retried"] = sum(1 for r in router_side.values() if (r["attempt"] or 1) > 1)
    summary["engines"] = {e: {k: v["mean"] for k, v in d.items()} | {"nixl_transfers": d["nixl_bytes"]["count"]} for e, d in engines.items()}
    summary["cores_used"] = {m: {part: (cpu_after[m][part] - cpu_before[m][part]) / wall for part in cpu_after[m]} for m in cpu_after}
    # Engine CPU per completed request: every process of this mode's P and D group (vLLM's own spin included).
    completed = max(summary["completed"], 1)
    summary["cpu_ms_per_request"] = {part: (cpu_after[mode][part] - cpu_before[mode][part]) * 1000 / completed for part in ("P", "D")}
    summary["thread_cpu_ms_per_request"] = {part: thread_breakdown(threads_before[part], threads_after[part], completed) for part in ("P", "D")}
    summary["threads_repinned"] = moved_threads
    if mode == "kvpush":
        summary["kv_bytes"] = kvpush_kv_check(stack, spans, prefix, point)
        if engine_spans:
            summary["breakdown"] = kvpush_breakdown(spans, prefix)
    else:
        summary["kv_bytes"] = upstream_kv_check(engines, len(records), point)
    return {
        "mode": mode,
        "point": dataclasses.asdict(point),
        "run": point.run_name(mode),
        "nixl_progress_thread": "as shipped (busy-polling)" if args.nixl_as_shipped else f"poll delay {NIXL_POLL_DELAY_US} us",
        "pinning": {"prefill_cpus": PREFILL_CPUS, "decode_cpus": DECODE_CPUS},
        "layout": "one stack at a time" if args.one_stack_at_a_time else "all stacks up, modes alternating per point",
        "kvpush_engine_tracing": args.kvpush_engine_tracing,
        "kvpush_extra_config": args.kvpush_extra_config,
        "summary": summary,
        "requests": [dict(r.figures(), router=router_side.get(r.request_id)) for r in records],
    }


def thread_breakdown(before: dict[str, float], after: dict[str, float], completed: int) -> dict[str, float]:
    """CPU ms per completed request of each "<process>/<thread>" name that used at least 0.5 ms per request."""
    used = {name: (seconds - before.get(name, 0.0)) * 1000 / completed for name, seconds in after.items()}
    return dict(sorted(((n, round(ms, 2)) for n, ms in used.items() if ms >= 0.5), key=lambda item: -item[1]))


def kvpush_breakdown(spans: list[dict[str, Any]], prefix: str) -> dict[str, Any]:
    """kvpush.report's per-segment breakdown of the run (p50/p90/mean per segment, ms)."""
    result = breakdown(spans, request_id_prefix=prefix)
    rows = {row.name: {"p50": row.p50, "p90": row.p90, "mean": row.mean, "n": row.count} for row in result.rows() + result.detail_rows()}
    return {"requests": len(result.requests), "complete": sum(r.complete for r in result.requests), "excluded": result.excluded,
            "clamped": sum(r.clamped for r in result.requests), "rows": rows}


def kvpush_kv_check(stack: ModeStack, spans: list[dict[str, Any]], prefix: str, point: Point) -> dict[str, Any]:
    """The broker's bytes_written of every transfer of the run against the prompt's whole blocks."""
    roots = [s for s in spans if s["name"] == "router.request" and str(s["attributes"].get("kvpush.client_request_id", "")).startswith(prefix)]
    keys = [(s["attributes"].get("kvpush.transfer_id", ""), int(s["attributes"].get("kvpush.attempt", 1))) for s in roots]
    transfers = asyncio.run(fetch_transfers(stack.control_plane, [k for k in keys if k[0]]))
    expected = expected_kv_bytes(point.input_len)
    written = [t.bytes_written for t in transfers.values() if not isinstance(t, Exception)]
    errors = [str(t)[:200] for t in transfers.values() if isinstance(t, Exception)]
    return {
        "source": "broker GetTransfer(...).bytes_written",
        "expected_per_request": expected,
        "transfers": len(transfers),
        "matching": sum(b == expected for b in written),
        "distinct_values": sorted(set(written)),
        "query_errors": errors[:3],
        "ok": bool(written) and all(b == expected for b in written) and not errors,
    }


def upstream_kv_check(engines: dict[str, dict[str, dict[str, float | None]]], requests: int, point: Point) -> dict[str, Any]:
    """NIXL bytes over the run (P and D `vllm:nixl_bytes_transferred`): one transfer of the prompt's blocks per request."""
    total = sum(d["nixl_bytes"]["sum"] for d in engines.values())
    count = sum(d["nixl_bytes"]["count"] for d in engines.values())
    expected = expected_kv_bytes(point.input_len)
    per_request = total / requests if requests else None
    return {
        "source": "vllm:nixl_bytes_transferred sum/count deltas on P and D",
        "expected_per_request": expected,
        "bytes_per_request": per_request,
        "transfers": count,
        "transfers_per_request": count / requests if requests else None,
        "ok": requests > 0 and count == requests and per_request == expected,
    }


# ---- the sweep -------------------------------------------------------------------------------------------------------


def compute_references(model_dir: Path, workloads: Sequence[Workload], log_dir: Path) -> dict[tuple[Point, int], Completion]:
    """Single-engine greedy outputs of every checked prompt, one reference server per output length."""
    references: dict[tuple[Point, int], Completion] = {}
    for output_len in sorted({w.point.output_len for w in workloads}):
        keys = [(w.point, i) for w in workloads if w.point.output_len == output_len for i in w.checked]
        prompts = [next(w for w in workloads if w.point == p).prompts[i] for p, i in keys]
        outputs = reference_run(model_dir, prompts, output_len, log_path=log_dir / f"reference-out{output_len}.log")
        references.update(zip(keys, outputs))
    return references


def skipped_result(mode: str, point: Point, reason: str, args: argparse.Namespace) -> dict[str, Any]:
    return {"mode": mode, "point": dataclasses.asdict(point), "run": point.run_name(mode), "skipped": reason,
            "nixl_progress_thread": "as shipped (busy-polling)" if args.nixl_as_shipped else f"poll delay {NIXL_POLL_DELAY_US} us"}


def describe(result: dict[str, Any]) -> str:
    s = result["summary"]
    correct = "ok" if s["correctness"]["ok"] else f"MISMATCH {s['correctness']['passed']}/{s['correctness']['checked']}"
    kv = "ok" if s["kv_bytes"]["ok"] else "BAD"
    ttft, tpot = s["ttft_ms"]["p50"], s["tpot_ms"]["p50"]
    return (f"{result['run']:<44} TTFT p50 {ttft if ttft is None else round(ttft, 1)!s:>7} ms  TPOT p50 "
            f"{tpot if tpot is None else round(tpot, 2)!s:>6} ms  done {s['completed']}/{s['requests']}  "
            f"kept up {s['sustained_share']:.2f}  correct {correct}  kv {kv}  CPU/req P {s['cpu_ms_per_request']['P']:.0f} "
            f"D {s['cpu_ms_per_request']['D']:.0f} ms")


def run_sweep(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from kvpush.tinymodel import build_tiny_model, default_model_dir

    results_dir: Path = args.results_dir
    results_dir.mkdir(parents=True, exist_ok=True)
    work = results_dir / "work"
    work.mkdir(exist_ok=True)
    grid = build_grid(args.input_lens, args.qps, args.output_lens, args.iterations)
    workloads = {p: make_workload(p, requests_for(p.qps, args.duration, args.min_requests), args.check_per_run, args.seed) for p in grid}
    total_requests = sum(len(w.prompts) for w in workloads.values()) * len(args.modes)
    print(f"{len(grid)} points x {len(args.modes)} modes, {total_requests} measured requests; results in {results_dir}", flush=True)
    model_dir = build_tiny_model(args.model or default_model_dir())
    started = time.monotonic()
    print("single-engine references for the checked requests ...", flush=True)
    references = compute_references(model_dir, list(workloads.values()), work)
    print(f"  {len(references)} references in {time.monotonic() - started:.0f} s", flush=True)
    stacks: dict[str, ModeStack] = {}
    failed_start: dict[str, str] = {}
    completed_runs: list[dict[str, Any]] = []

    def bring_up(mode: str) -> None:
        t0 = time.monotonic()
        try:
            stack = start_stack(mode, model_dir, work / mode, args.nixl_as_shipped, args.kvpush_engine_tracing, args.kvpush_extra_config)
        except Exception as exc:  # recorded; the other modes go on
            failed_start[mode] = f"stack did not start: {exc}"[:2000]
            tqdm.write(f"{mode}: {failed_start[mode]}")
            return
        errors = asyncio.run(warm_up(stack.router_url, args.input_lens, args.request_timeout))
        stack.stack.repin()
        stacks[mode] = stack
        idle = {m: s.prefill.idle_cores(2) + s.decode.idle_cores(2) for m, s in stacks.items()} if args.measure_idle else {}
        tqdm.write(f"{mode}: up in {time.monotonic() - t0:.0f} s; warm-up errors: {errors[:2] or 'none'}"
                   + (f"; idle cores P+D per stack: {', '.join(f'{m} {c:.3f}' for m, c in idle.items())}" if idle else ""))

    def run_one(mode: str, point: Point, progress) -> None:
        stack = stacks.get(mode)
        reason = failed_start.get(mode) or (stack.failure if stack else "stack not running")
        if stack is not None and not reason:
            dead = stack.stack.dead_parts()
            if dead:
                stack.failure = reason = f"stack died: {', '.join(dead)}; P log tail:\n{stack.prefill.process.tail(15)}\nD log tail:\n{stack.decode.process.tail(15)}"
        if reason:
            write_json(results_dir / f"{point.run_name(mode)}.json", skipped_result(mode, point, reason, args))
            progress.update(len(workloads[point].prompts))
            return
        progress.set_description(point.run_name(mode))
        result = run_point(stack, list(stacks.values()), workloads[point], references, args, progress)
        write_json(results_dir / f"{point.run_name(mode)}.json", result)
        completed_runs.append(result)
        tqdm.write(describe(result))
        time.sleep(args.settle)

    try:
        with interrupt_on_signals(), tqdm(total=total_requests, unit="req", dynamic_ncols=True, mininterval=1.0) as progress:
            if not args.one_stack_at_a_time:
                for mode in args.modes:
                    bring_up(mode)
                for k, point in enumerate(grid):
                    # The order rotates so no mode always follows the same other one.
                    for mode in args.modes[k % len(args.modes):] + args.modes[:k % len(args.modes)]:
                        run_one(mode, point, progress)
            else:
                for iteration in range(1, args.iterations + 1):
                    shift = (iteration - 1) % len(args.modes)
                    for mode in args.modes[shift:] + args.modes[:shift]:
                        bring_up(mode)
                        for point in (p for p in grid if p.iteration == iteration):
                            run_one(mode, point, progress)
                        if mode in stacks:
                            stacks.pop(mode).stop()
    except KeyboardInterrupt:
        print("\nsweep interrupted; stopping every stack", file=sys.stderr)
        return 130
    finally:
        for stack in stacks.values():
            stack.stop()
    print(f"sweep wall time {(time.monotonic() - started) / 60:.1f} min", flush=True)
    return report(results_dir, args.modes, args.markdown)


# ---- CLI --------------------------------------------------------------------------------------------------------------


def _numbers(kind):
    return lambda text: [kind(x) for x in text.split(",") if x.strip()]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results-dir", type=Path, required=True, help="where the per-run JSON files and summary.json go")
    parser.add_argument("--modes", type=lambda t: [m for m in t.split(",") if m], default=list(MODES), help=f"comma-separated, from {', '.join(MODES)}")
    parser.add_argument("--input-lens", type=_numbers(int), default=[256, 1024, 2048], help="prompt lengths in tokens, comma-separated")
    parser.add_argument("--qps", type=_numbers(float), default=[1, 2, 4, 8, 16], help="offered loads (Poisson arrivals), comma-separated")
    parser.add_argument("--output-lens", type=_numbers(int), default=[16, 128], help="generated tokens per request, comma-separated")
    parser.add_argument("--iterations", type=int, default=2, help="repetitions of the grid (new prompts and arrivals each)")
    parser.add_argument("--duration", type=float, default=12.0, help="seconds of arrivals per run (requests = QPS x this, at least --min-requests)")
    parser.add_argument("--min-requests", type=int, default=24)
    parser.add_argument("--check-per-run", type=int, default=4, help="requests per run compared with the single-engine reference")
    parser.add_argument("--request-timeout", type=float, default=120.0, help="seconds one request may take at the client")
    parser.add_argument("--settle", type=float, default=2.0, help="seconds of quiet after each run (vLLM workers spin ~1 s after a request)")
    parser.add_argument("--seed", type=int, default=0, help="prompts and arrival times derive from it")
    parser.add_argument("--nixl-as-shipped", action="store_true", help="upstream engines with NIXL's busy-polling progress thread (implies --one-stack-at-a-time)")
    parser.add_argument("--one-stack-at-a-time", action="store_true", help="run one mode's stack at a time (modes alternate per pass, not per point)")
    parser.add_argument("--kvpush-engine-tracing", action=argparse.BooleanOptionalAction, default=True,
                        help="kvpush engines and control plane export spans (the per-segment breakdown needs them; routers always do)")
    parser.add_argument("--kvpush-extra-config", type=json.loads, default={},
                        help='JSON merged into the kvpush engines\' kv_connector_extra_config, e.g. \'{"poll_interval_ms": 2}\'')
    parser.add_argument("--measure-idle", action="store_true", help="measure every running stack's idle cores after each start")
    parser.add_argument("--quick", action="store_true", help="a small grid to validate end to end: 256 and 1024 tokens, QPS 1 and 4, output 16, one iteration")
    parser.add_argument("--report-only", action="store_true", help="print the tables and targets of --results-dir and write summary.json")
    parser.add_argument("--markdown", type=Path, default=None, help="also write the report's tables as Markdown here")
    parser.add_argument("--model", type=Path, default=None, help="tiny model folder (built if missing)")
    args = parser.parse_args(argv)
    unknown = [m for m in args.modes if m not in MODES]
    if unknown:
        parser.error(f"unknown modes {unknown}")
    if args.report_only:
        return report(args.results_dir, args.modes, args.markdown)
    if args.quick:
        args.input_lens, args.qps, args.output_lens, args.iterations = [256, 1024], [1.0, 4.0], [16], 1
        args.duration, args.min_requests, args.check_per_run = 6.0, 8, 3
    args.one_stack_at_a_time = args.one_stack_at_a_time or args.nixl_as_shipped
    return run_sweep(args)


if __name__ == "__main__":
    sys.exit(main())
