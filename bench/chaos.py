# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""Chaos with real processes: the local kvpush stack under steady mixed load while faults are injected.

    python -m bench.chaos --long [--json runs/chaos.json]     # every fault, minutes of load each, the memory soak
    python -m bench.chaos                                     # the short form (what tests/e2e/test_chaos.py runs)
    python -m bench.chaos --faults p-kill,proxy-cut --pre 20 --post 20

Starts, on 127.0.0.1 only: `kvpush control-plane` (a --tokens-dir with one
token per identity, a --metrics-port), a TCP proxy in front of it
(bench/tcp_proxy.py) that only the prefill engine uses, one prefill (P,
CPU 0) and one decode (D, CPU 1) vLLM CPU engine with KvpushConnector, and
`kvpush router` (push mode). An ordinary single engine runs once at the
start for the reference outputs and is stopped. Several client threads then
send steady mixed load through the router (prompts of 5 to 2,000 tokens,
1 to 16 greedy tokens, streamed and not) while the faults below are
injected one after another; after each, the run waits until the router
serves again, keeps the load on, stops it, and waits until every KV block
of P and D is free.

Faults (`--faults`, in this order with --long):

  p-kill      kill -9 of P's process group, then P restarted (same engine id and port, a new incarnation)
  d-kill      the same for D
  cp-kill     kill -9 of the control plane, then restarted on the same port with the same tokens dir (it loses all state)
  p-stop      SIGSTOP of P's process group for longer than its lease TTL, then SIGCONT
  proxy-cut   the proxy between P and the control plane closes every connection and refuses new ones, then heals (NIXL stays up)
  disconnects clients close their HTTP connection at random times mid-request
  collide     two decode requests sent straight to D sharing one (transfer_id, attempt), plus the matching prefill leg; and
              malformed kvpush parameters sent straight to D (and P)

Each request through the router is counted once, under the fault phase it
started in: ok (tokens equal the reference's), failed (HTTP status and the
router's `reason`), hung (no answer by its deadline + 5 s), wrong (a 200
whose tokens differ from the reference), or disconnected (the client hung
up on purpose). A request's deadline is the router's --transfer-timeout-ms:
`kvpush router` takes no per-request timeout (a client's kv_transfer_params
is refused), it sends that flag's value as `timeout_ms` on both legs.

The soak (--long, or --soak N) registers two fake engine ranks with their
own tokens and holds ~N transfer attempts in flight at once at the stack's
control plane over gRPC (kvpush.client), a third waiting for prefill, a
third for registration and a third matched with orders nobody answers; it
reports the control plane's RSS and PSS and the kvpush_broker_live_attempts
gauge before, at the peak and after every attempt ended and the broker's
retention passed. The same soak runs against an in-process control plane
(kvpush.services.control_plane.running) for BrokerCore.memory_sizes.

Every process is stopped by its process group, also on Ctrl-C; every wait
is bounded. Logs and the JSON result go to runs/chaos-<timestamp>/.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import http.client
import json
import os
import random
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from bench.tcp_proxy import TcpProxy
from kvpush.client import BrokerClient, ClientConfig, RegistrarClient
from kvpush.localstack.completions import Completion, completion_body
from kvpush.localstack.control_plane import ControlPlaneHandle, kvpush_transfer_config, start_control_plane
from kvpush.localstack.engines import ServerHandle, reference_run, start_vllm_server
from kvpush.localstack.metrics import free_kv_blocks, num_kv_blocks, scrape_metrics
from kvpush.localstack.process import free_port, interrupt_on_signals
from kvpush.localstack.prompts import prompt_token_ids
from kvpush.localstack.router import RouterHandle, start_router
from kvpush.localstack.transfers import new_transfer_id, transfer_params
from kvpush.processes import pss_bytes, rss_bytes
from kvpush.registrar.v1 import registrar_service_pb2 as reg_pb
from kvpush.rendezvous.v1 import rendezvous_service_pb2 as rv_pb
from kvpush.rendezvous.v1 import transfer_pb2
from kvpush.services.common import sample_engines as sample
from kvpush.sse import DONE, sse_payloads
from kvpush.tinymodel import build_tiny_model, default_model_dir

PREFILL_ID, DECODE_ID = "prefill-0", "decode-0"
SOAK_PREFILL_ID, SOAK_DECODE_ID = "chaos-soak-prefill", "chaos-soak-decode"
ROLES = {"prefill": (PREFILL_ID, "0"), "decode": (DECODE_ID, "1")}  # role -> engine id, CPU
# Prompts of token ids (no tokenizer round trip): below one 128-token block, around block edges, long.
PROMPT_LENGTHS = (5, 40, 127, 129, 300, 1000, 2000)
MAX_TOKENS_CHOICES = (1, 2, 4, 8, 16)
MAX_TOKENS = max(MAX_TOKENS_CHOICES)
STREAM_SHARE = 0.5
# The connector's shortest hold margin: D keeps a failed request's blocks this long past its deadline without the broker's word.
HOLD_MARGIN_S = 1.5
# A request is hung when it has no answer this long past its deadline; a failure must be answered by deadline + FAILURE_SLACK_S.
HANG_SLACK_S = 5.0
FAILURE_SLACK_S = 1.0
ENGINE_START_TIMEOUT_S = 240.0
# After the control plane is healthy again, the longest a fault may keep the router from serving.
RECOVER_TIMEOUT_S = 180.0
# Soak: "near its baseline" means back within this much of the RSS before, or within this share of the peak's growth.
SOAK_RSS_SLACK_BYTES = 16 * 1024 * 1024
SOAK_RSS_SLACK_SHARE = 0.25
BROKER_RETENTION_S = 60.0  # the control plane's --retention default: settled attempts are remembered this long

FAULTS: dict[str, str] = {
    "p-kill": "kill -9 of P, then P restarted (same engine id, new incarnation)",
    "d-kill": "kill -9 of D, then D restarted",
    "cp-kill": "kill -9 of the control plane, restarted on the same port and tokens dir",
    "p-stop": "SIGSTOP of P longer than its lease TTL, then SIGCONT",
    "proxy-cut": "P's proxy to the control plane cuts every connection and refuses new ones, then heals",
    "disconnects": "clients close their HTTP connection at random times mid-request",
    "collide": "two decode legs sharing one (transfer_id, attempt) + its prefill leg, straight to D/P; malformed kvpush params",
}
LONG_ORDER = ("p-kill", "d-kill", "cp-kill", "p-stop", "proxy-cut", "disconnects", "collide")
# The CI form: the cheap faults first, the one that restarts an engine last (its restart is the longest step).
SHORT_ORDER = ("disconnects", "collide", "proxy-cut", "p-stop", "cp-kill", "p-kill")


@dataclasses.dataclass
class Settings:
    """One chaos run: which faults, how much load, how long each fault lasts."""

    faults: tuple[str, ...] = SHORT_ORDER
    clients: int = 3
    timeout_ms: int = 4000  # the router's --transfer-timeout-ms: every request's deadline
    pre_s: float = 3.0  # load before each fault
    post_s: float = 3.0  # load after the router serves again
    stop_s: float = 5.0  # p-stop: how long P stays stopped (its lease TTL is 3 s)
    cut_s: float = 8.0  # proxy-cut: how long the path stays cut
    cp_down_s: float = 1.0  # cp-kill: how long the control plane stays dead before its restart
    disconnect_s: float = 5.0  # disconnects: how long clients hang up at random
    disconnect_share: float = 0.6  # disconnects: share of requests the client hangs up on
    collide_rounds: int = 1
    think_s: float = 0.05  # each client's pause between requests
    soak_attempts: int = 0  # 0: no soak
    soak_timeout_s: float = 15.0
    soak_settle_s: float = BROKER_RETENTION_S + 10.0
    seed: int = 20261201
    run_dir: Path | None = None
    model_dir: Path | None = None

    @property
    def deadline_s(self) -> float:
        return self.timeout_ms / 1000.0

    def as_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["run_dir"] = str(self.run_dir) if self.run_dir else None
        out["model_dir"] = str(self.model_dir) if self.model_dir else None
        out["faults"] = list(self.faults)
        return out


def short_settings(**overrides: Any) -> Settings:
    """The CI form: one stack, the faults that fit in about three minutes with engine start."""
    return dataclasses.replace(Settings(), **overrides)


def long_settings(**overrides: Any) -> Settings:
    """The documented form: every fault, a minute of load before and after each, the soak."""
    base = Settings(
        faults=LONG_ORDER, clients=4, timeout_ms=5000, pre_s=60.0, post_s=60.0, stop_s=8.0, cut_s=10.0, cp_down_s=2.0,
        disconnect_s=60.0, collide_rounds=3, soak_attempts=1000,
    )
    return dataclasses.replace(base, **overrides)


class Log:
    """Timestamped progress lines on stdout and in the run's chaos.log."""

    def __init__(self, path: Path | None, quiet: bool = False):
        self.started = time.monotonic()
        self.path = path
        self.quiet = quiet
        self._lock = threading.Lock()

    def __call__(self, message: str) -> None:
        line = f"[{time.monotonic() - self.started:7.1f}s] {message}"
        with self._lock:
            if not self.quiet:
                print(line, flush=True)
            if self.path is not None:
                with self.path.open("a", encoding="utf-8") as handle:
                    handle.write(line + "\n")


# ---- HTTP requests with a hang watchdog and a deliberate disconnect ------------------------------


@dataclasses.dataclass
class Reply:
    """What came back for one HTTP request."""

    status: int = 0  # 0: no HTTP answer
    token_ids: list[int] = dataclasses.field(default_factory=list)
    error: dict | None = None  # the OpenAI-style error object (body or stream event)
    raw: str = ""  # the start of a body that was not understood
    elapsed_s: float = 0.0  # send -> answer complete (or the error)
    first_output_s: float | None = None
    hung: bool = False  # the watchdog ended it: no answer by deadline + HANG_SLACK_S
    disconnected: bool = False  # this client hung up on purpose
    exception: str = ""
    done: bool = False  # a complete answer arrived ([DONE] for streams)


def send(url: str, path: str, body: dict, *, hang_after_s: float, disconnect_after_s: float | None = None,
         headers: dict[str, str] | None = None) -> Reply:
    """POSTs body; a streamed body is read as SSE. Bounded: the connection is shut at hang_after_s."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=hang_after_s + 5.0)
    reply = Reply()
    lock = threading.Lock()
    finished = False

    def interrupt(kind: str) -> None:
        with lock:
            if finished or conn.sock is None:
                return
            setattr(reply, kind, True)
            with contextlib.suppress(OSError):
                conn.sock.shutdown(socket.SHUT_RDWR)

    timers = [threading.Timer(hang_after_s, interrupt, ("hung",))]
    if disconnect_after_s is not None:
        timers.append(threading.Timer(disconnect_after_s, interrupt, ("disconnected",)))
    t0 = time.monotonic()
    for timer in timers:
        timer.daemon = True
        timer.start()
    try:
        conn.request("POST", path, body=json.dumps(body).encode(), headers={"Content-Type": "application/json", **(headers or {})})
        response = conn.getresponse()
        reply.status = response.status
        if response.status != 200:
            data = response.read()
            reply.error = _error_of(data)
            if reply.error is None:
                reply.raw = data[:300].decode(errors="replace")
            reply.done = True
        elif body.get("stream"):
            # An event that is not JSON raises MalformedEvent: recorded as the reply's exception.
            for chunk in sse_payloads(response):
                if chunk == DONE:
                    reply.done = True
                    break
                if "error" in chunk:
                    reply.error = chunk["error"] if isinstance(chunk["error"], dict) else {"message": str(chunk["error"])}
                    continue
                for choice in chunk.get("choices", []):
                    ids = choice.get("token_ids") or []
                    if ids and reply.first_output_s is None:
                        reply.first_output_s = time.monotonic() - t0
                    reply.token_ids += ids
        else:
            data = response.read()
            out = json.loads(data)
            reply.token_ids = list(out["choices"][0].get("token_ids") or [])
            reply.first_output_s = time.monotonic() - t0
            reply.done = True
    except Exception as exc:  # the caller classifies: hung, disconnected, or a failure without an answer
        reply.exception = f"{type(exc).__name__}: {exc}"[:300]
    finally:
        with lock:
            finished = True
        for timer in timers:
            timer.cancel()
        conn.close()
    reply.elapsed_s = time.monotonic() - t0
    return reply


def _error_of(data: bytes) -> dict | None:
    try:
        parsed = json.loads(data)
    except ValueError:
        return None
    if isinstance(parsed, dict) and isinstance(parsed.get("error"), dict):
        return parsed["error"]
    if isinstance(parsed, dict) and "message" in parsed:  # vLLM's own error shape
        return parsed
    return None


# ---- outcomes ----------------------------------------------------------------------------------


@dataclasses.dataclass
class Outcome:
    """One request and how it ended."""

    phase: str
    source: str  # "router", or "direct-d"/"direct-p" for requests sent straight to an engine
    request_id: str
    prompt_tokens: int
    max_tokens: int
    stream: bool
    start_s: float  # since the run started
    elapsed_s: float
    deadline_s: float
    status: int
    result: str  # ok, failed, hung, wrong, disconnected
    reason: str = ""  # failed: the router's "reason" ("" when the answer had none)
    detail: str = ""


def classify(reply: Reply, expected: Sequence[int] | None, max_tokens: int) -> tuple[str, str, str]:
    """(result, reason, detail) of a reply; expected is the reference's tokens (None: any 200 is ok)."""
    if reply.disconnected:
        return "disconnected", "", ""
    if reply.hung:
        return "hung", "", f"no answer after {reply.elapsed_s:.1f} s; status {reply.status}"
    if reply.status == 200 and reply.error is None and reply.done:
        if expected is None:
            return "ok", "", ""
        want = list(expected[:max_tokens])
        if reply.token_ids != want:
            return "wrong", "", f"got {reply.token_ids[:16]} want {want[:16]}"
        return "ok", "", ""
    if reply.error is not None:
        reason = str(reply.error.get("reason") or "")
        return "failed", reason, str(reply.error.get("message", ""))[:300]
    if reply.status == 200:
        return "failed", "", f"the answer ended early ({reply.exception or 'no [DONE]'}) after {len(reply.token_ids)} tokens"
    return "failed", "", reply.exception or reply.raw


def summarize(outcomes: Sequence[Outcome]) -> dict[str, Any]:
    """Counts by result, failures by reason and status, and the latest failure relative to its deadline."""
    counts = collections.Counter(o.result for o in outcomes)
    by_reason = collections.Counter(f"{o.reason or 'NO_REASON'} ({o.status or 'no answer'})" for o in outcomes if o.result == "failed")
    failures = [o for o in outcomes if o.result == "failed"]
    over = [o.elapsed_s - o.deadline_s for o in failures]
    late = [o for o in failures if o.elapsed_s > o.deadline_s + FAILURE_SLACK_S]
    no_reason = [o for o in failures if not o.reason]
    return {
        "requests": len(outcomes),
        "ok": counts["ok"],
        "failed": counts["failed"],
        "hung": counts["hung"],
        "wrong": counts["wrong"],
        "disconnected": counts["disconnected"],
        "failures_by_reason": dict(sorted(by_reason.items())),
        "max_failure_minus_deadline_s": round(max(over), 3) if over else None,
        "late_failures": len(late),
        "failures_without_reason": len(no_reason),
        "examples": {
            "late": [dataclasses.asdict(o) for o in late[:5]],
            "without_reason": [dataclasses.asdict(o) for o in no_reason[:5]],
            "wrong": [dataclasses.asdict(o) for o in outcomes if o.result == "wrong"][:5],
            "hung": [dataclasses.asdict(o) for o in outcomes if o.result == "hung"][:5],
        },
    }


class Stack:
    """Control plane, P's proxy, P and D engines and the router; every one can be killed and restarted."""

    def __init__(self, settings: Settings, run_dir: Path, model_dir: Path, log: Log):
        self.settings = settings
        self.run_dir = run_dir
        self.model_dir = model_dir
        self.log = log
        self.cp_dir = run_dir / "control-plane"
        self.metrics_port = free_port()
        self.cp: ControlPlaneHandle | None = None
        self.proxy: TcpProxy | None = None
        self.engines: dict[str, ServerHandle] = {}
        self.ports: dict[str, int] = {}
        self.router: RouterHandle | None = None
        self.prompts = [prompt_token_ids(n, seed=n) for n in PROMPT_LENGTHS]
        self.reference: list[Completion] = []
        self.kv_total: dict[str, int] = {}
        self.kv_baseline: dict[str, int] = {}

    # ---- start and stop ---------------------------------------------------------------------

    def _cp_args(self) -> list[str]:
        return ["--metrics-port", str(self.metrics_port)]

    def start_control_plane(self, port: int = 0) -> None:
        self.cp = start_control_plane(self.cp_dir, port=port, engine_ids=(PREFILL_ID, DECODE_ID, SOAK_PREFILL_ID, SOAK_DECODE_ID),
                                      extra_args=self._cp_args())

    def start(self) -> None:
        self.start_control_plane()
        self.log(f"control plane on {self.cp.address} (metrics :{self.metrics_port}), pid {self.cp.process.pid}")
        self.proxy = TcpProxy(("127.0.0.1", self.cp.port)).start()
        self.log(f"P's proxy to the control plane on {self.proxy.address}")
        self.log("starting P (CPU 0), D (CPU 1) and a single reference engine together")
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            reference = pool.submit(reference_run, self.model_dir, self.prompts, MAX_TOKENS, log_path=self.run_dir / "reference.log",
                                    start_timeout=ENGINE_START_TIMEOUT_S)
            engines = {role: pool.submit(self.start_engine, role) for role in ROLES}
            errors = []
            for future in (reference, *engines.values()):
                try:
                    future.result()
                except Exception as exc:  # all three are waited for, so none is left starting
                    errors.append(exc)
            if errors:
                raise errors[0]
            self.reference = reference.result()
        self.log(f"P at {self.engines['prefill'].url}, D at {self.engines['decode'].url}; reference outputs of {len(self.prompts)} prompts")
        self.start_router()
        self.log(f"router at {self.router_url} (--transfer-timeout-ms {self.settings.timeout_ms})")
        for index in range(2):  # an engine's first requests pay one-time costs
            reply = send(self.router_url, "/v1/completions", completion_body(self.prompts[-1 - index], 2), hang_after_s=60)
            if reply.status != 200:
                raise RuntimeError(f"warm-up through the router failed: {reply}")
        for role, handle in self.engines.items():
            self.kv_total[role] = num_kv_blocks(handle.url)
        self.kv_baseline = self.kv_free()
        self.log(f"KV blocks free at start: {self.kv_baseline} of {self.kv_total}")

    def engine_config(self, role: str) -> dict:
        engine_id, _ = ROLES[role]
        # Only P reaches the control plane through the proxy; D and the router talk to it directly.
        return kvpush_transfer_config(role, engine_id, self.cp, control_plane_address=self.proxy.address if role == "prefill" else None,
                                      hold_margin_s=HOLD_MARGIN_S, transfer_timeout_s=self.settings.deadline_s)

    def start_engine(self, role: str) -> ServerHandle:
        _, cpu = ROLES[role]
        handle = start_vllm_server(self.model_dir, name=role, port=self.ports.get(role), kv_transfer_config=self.engine_config(role), cpu_list=cpu,
                                   log_path=self.run_dir / f"{role}.log", start_timeout=ENGINE_START_TIMEOUT_S)
        self.engines[role] = handle
        self.ports[role] = handle.port
        return handle

    def start_router(self) -> None:
        self.router = start_router(self.run_dir, prefill=[f"{self.engines['prefill'].url}={PREFILL_ID}"],
                                   decode=[f"{self.engines['decode'].url}={DECODE_ID}"], control_plane=self.cp,
                                   extra_args=["--transfer-timeout-ms", str(self.settings.timeout_ms)])

    @property
    def router_url(self) -> str:
        return self.router.url

    def close(self) -> None:
        """Stops everything this stack started (each step bounded; a failure of one does not skip the others)."""
        steps: list[tuple[str, Callable[[], None]]] = []
        if self.router is not None:
            steps.append(("router", self.router.stop))
        for role, handle in self.engines.items():
            steps.append((role, lambda handle=handle: _resume_and_stop(handle)))
        if self.cp is not None:
            steps.append(("control plane", self.cp.stop))
        if self.proxy is not None:
            steps.append(("proxy", self.proxy.close))
        for name, step in steps:
            try:
                step()
            except Exception as exc:
                self.log(f"stopping {name} failed: {exc}")

    # ---- faults -------------------------------------------------------------------------------

    def kill_engine(self, role: str) -> None:
        self.engines[role].kill()

    def signal_engine(self, role: str, signum: int) -> None:
        self.engines[role].process.signal(signum)

    def kill_control_plane(self) -> None:
        self.cp.kill()

    def restart_control_plane(self) -> None:
        self.start_control_plane(port=self.cp.port)

    # ---- observations -------------------------------------------------------------------------

    def kv_free(self) -> dict[str, int]:
        """Free KV blocks of P and D, after one tiny local request each (vLLM publishes the gauge from engine steps)."""
        free = {}
        for role, handle in self.engines.items():
            with contextlib.suppress(Exception):
                send(handle.url, "/v1/completions", completion_body(prompt_token_ids(4, seed=7), 1), hang_after_s=20)
            try:
                free[role] = free_kv_blocks(handle.url)
            except Exception:
                free[role] = -1
        return free

    def router_failures(self) -> dict[str, float]:
        """kvpush_router_failed_requests_total by reason (the router's own count)."""
        try:
            samples = scrape_metrics(self.router_url)
        except Exception:
            return {}
        return {labels.get("reason", ""): value for labels, value in samples.get("kvpush_router_failed_requests_total", [])}

    def broker_gauge(self, name: str = "kvpush_broker_live_attempts") -> float | None:
        try:
            samples = scrape_metrics(f"http://127.0.0.1:{self.metrics_port}")
        except Exception:
            return None
        values = samples.get(name)
        return values[0][1] if values else None


def _resume_and_stop(handle: ServerHandle) -> None:
    handle.process.signal(signal.SIGCONT)  # a stopped group would ignore SIGTERM until the kill
    handle.stop(timeout=15)


# ---- load --------------------------------------------------------------------------------------


class Load:
    """Client threads sending mixed requests through the router back to back; outcomes are kept per phase."""

    def __init__(self, stack: Stack, settings: Settings, log: Log, started: float):
        self.stack = stack
        self.settings = settings
        self.log = log
        self.started = started
        self.outcomes: list[Outcome] = []
        self.phase = ""
        self.disconnect_share = 0.0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._sequence = 0
        self.last_ok_at = 0.0  # time.monotonic() of the last ok answer

    def start(self, phase: str) -> None:
        self.phase = phase
        self._stop.clear()
        self._threads = [threading.Thread(target=self._client, args=(i,), name=f"chaos-client-{i}", daemon=True) for i in range(self.settings.clients)]
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        """Lets every client finish its request (each is bounded by its deadline + HANG_SLACK_S)."""
        self._stop.set()
        bound = time.monotonic() + self.settings.deadline_s + HANG_SLACK_S + 10.0
        for thread in self._threads:
            thread.join(timeout=max(0.1, bound - time.monotonic()))
        stuck = [t.name for t in self._threads if t.is_alive()]
        if stuck:
            self.log(f"client threads still running after their bound: {stuck}")
        self._threads = []

    def _client(self, index: int) -> None:
        rng = random.Random(self.settings.seed * 1000 + index + len(self.outcomes))
        while not self._stop.is_set():
            self.one(rng)
            self._stop.wait(rng.uniform(0, 2 * self.settings.think_s))

    def one(self, rng: random.Random) -> Outcome:
        stack = self.stack
        index = rng.randrange(len(stack.prompts))
        max_tokens = rng.choice(MAX_TOKENS_CHOICES)
        stream = rng.random() < STREAM_SHARE
        with self._lock:
            self._sequence += 1
            request_id = f"chaos-{self.phase}-{self._sequence}"
        disconnect = rng.uniform(0.005, 0.4) if rng.random() < self.disconnect_share else None
        body = completion_body(stack.prompts[index], max_tokens, stream=stream)
        phase = self.phase
        start_s = time.monotonic() - self.started
        deadline_s = self.settings.deadline_s
        reply = send(stack.router_url, "/v1/completions", body, hang_after_s=deadline_s + HANG_SLACK_S, disconnect_after_s=disconnect,
                     headers={"X-Request-Id": request_id})
        result, reason, detail = classify(reply, stack.reference[index].token_ids, max_tokens)
        outcome = Outcome(phase, "router", request_id, len(stack.prompts[index]), max_tokens, stream, round(start_s, 3), round(reply.elapsed_s, 3),
                          deadline_s, reply.status, result, reason, detail)
        with self._lock:
            self.outcomes.append(outcome)
            if result == "ok":
                self.last_ok_at = time.monotonic()
        if result in ("wrong", "hung"):
            self.log(f"{result.upper()}: {request_id} prompt {len(stack.prompts[index])} tok, max_tokens {max_tokens}, stream {stream}: {detail}")
        return outcome

    def record(self, outcome: Outcome) -> None:
        with self._lock:
            self.outcomes.append(outcome)


# ---- the faults --------------------------------------------------------------------------------


class Chaos:
    """Runs the faults one after another over one stack and collects the figures."""

    def __init__(self, stack: Stack, settings: Settings, log: Log):
        self.stack = stack
        self.settings = settings
        self.log = log
        self.started = time.monotonic()
        self.load = Load(stack, settings, log, self.started)

    def wait_serving(self, since: float, timeout: float = RECOVER_TIMEOUT_S) -> float | None:
        """Seconds from `since` until a request through the router succeeds (load or a probe); None if not within timeout."""
        deadline = time.monotonic() + timeout
        probe = completion_body(self.stack.prompts[1], 2)
        while time.monotonic() < deadline:
            if self.load.last_ok_at > since:
                return self.load.last_ok_at - since
            reply = send(self.stack.router_url, "/v1/completions", probe, hang_after_s=self.settings.deadline_s + HANG_SLACK_S)
            if reply.status == 200 and reply.done:
                return time.monotonic() - since
            time.sleep(0.25)
        return None

    def settle_kv(self) -> dict[str, Any]:
        """Waits until P and D have every KV block free again (bounded by deadline + hold margin + 30 s)."""
        t0 = time.monotonic()
        bound = self.settings.deadline_s + HOLD_MARGIN_S + 30.0
        while True:
            free = self.stack.kv_free()
            settled = all(free.get(role) == self.stack.kv_baseline.get(role) for role in ROLES)
            if settled or time.monotonic() - t0 > bound:
                break
            time.sleep(0.5)
        return {
            "free": free,
            "total": dict(self.stack.kv_total),
            "baseline_free": dict(self.stack.kv_baseline),
            "all_free": settled,
            "settle_s": round(time.monotonic() - t0, 2),
        }

    def run_fault(self, name: str) -> dict[str, Any]:
        settings = self.settings
        self.log(f"=== {name}: {FAULTS[name]}")
        failures_before = self.stack.router_failures()
        t_phase = time.monotonic()
        self.load.start(name)
        time.sleep(settings.pre_s)
        injected = time.monotonic()
        notes = getattr(self, "fault_" + name.replace("-", "_"))()
        healed = time.monotonic()
        recovered = self.wait_serving(healed)
        self.log(f"{name}: injected for {healed - injected:.1f} s; router serving again {recovered if recovered is None else round(recovered, 2)} s after")
        time.sleep(settings.post_s)
        self.load.stop()
        kv = self.settle_kv()
        self.log(f"{name}: KV free {kv['free']} (baseline {kv['baseline_free']}), {'settled' if kv['all_free'] else 'NOT settled'} "
                 f"after {kv['settle_s']} s")
        outcomes = [o for o in self.load.outcomes if o.phase == name]
        routed = [o for o in outcomes if o.source == "router"]
        failures_after = self.stack.router_failures()
        router_counts = {k: v - failures_before.get(k, 0.0) for k, v in failures_after.items() if v - failures_before.get(k, 0.0) > 0}
        summary = {
            "fault": name,
            "what": FAULTS[name],
            "phase_s": round(time.monotonic() - t_phase, 1),
            "fault_s": round(healed - injected, 2),
            "recovered_s": None if recovered is None else round(recovered, 2),
            "routed": summarize(routed),
            "direct": summarize([o for o in outcomes if o.source != "router"]),
            "router_failed_requests_total": router_counts,
            "kv": kv,
            "notes": notes,
        }
        self._print_fault(summary)
        return summary

    def _print_fault(self, summary: dict[str, Any]) -> None:
        r = summary["routed"]
        over = r["max_failure_minus_deadline_s"]
        self.log(f"{summary['fault']}: routed {r['requests']} = ok {r['ok']} / failed {r['failed']} / hung {r['hung']} / wrong {r['wrong']} / "
                 f"disconnected {r['disconnected']}; max failure - deadline {over if over is None else f'{over:+.2f} s'}; "
                 f"late {r['late_failures']}, without reason {r['failures_without_reason']}")
        for reason, count in r["failures_by_reason"].items():
            self.log(f"    {count:5d} x {reason}")
        d = summary["direct"]
        if d["requests"]:
            self.log(f"{summary['fault']}: direct {d['requests']} = ok {d['ok']} / failed {d['failed']} / hung {d['hung']} / wrong {d['wrong']}")

    # Each fault_* injects its fault, undoes it and returns notes; the load runs throughout.

    def fault_p_kill(self) -> dict:
        return self._kill_and_restart("prefill")

    def fault_d_kill(self) -> dict:
        return self._kill_and_restart("decode")

    def _kill_and_restart(self, role: str) -> dict:
        old_pid = self.stack.engines[role].pid
        t0 = time.monotonic()
        self.stack.kill_engine(role)
        self.log(f"killed {role} (process group {old_pid}) with SIGKILL; restarting it")
        handle = self.stack.start_engine(role)
        restart_s = time.monotonic() - t0
        self.log(f"{role} healthy again after {restart_s:.1f} s (pid {handle.pid})")
        return {"killed_pid": old_pid, "new_pid": handle.pid, "down_s": round(restart_s, 1)}

    def fault_cp_kill(self) -> dict:
        old_pid = self.stack.cp.process.pid
        self.stack.kill_control_plane()
        time.sleep(self.settings.cp_down_s)
        t0 = time.monotonic()
        self.stack.restart_control_plane()
        self.log(f"control plane killed (pid {old_pid}) and restarted on the same port (pid {self.stack.cp.process.pid}) "
                 f"in {time.monotonic() - t0:.1f} s")
        return {"killed_pid": old_pid, "new_pid": self.stack.cp.process.pid, "down_s": round(self.settings.cp_down_s + time.monotonic() - t0, 2)}

    def fault_p_stop(self) -> dict:
        self.stack.signal_engine("prefill", signal.SIGSTOP)
        time.sleep(self.settings.stop_s)
        self.stack.signal_engine("prefill", signal.SIGCONT)
        self.log(f"P stopped for {self.settings.stop_s:g} s, continued")
        return {"stopped_s": self.settings.stop_s}

    def fault_proxy_cut(self) -> dict:
        cut = self.stack.proxy.cut()
        time.sleep(self.settings.cut_s)
        self.stack.proxy.heal()
        self.log(f"proxy cut {cut} connections, refused new ones for {self.settings.cut_s:g} s, healed")
        return {"cut_connections": cut, "cut_s": self.settings.cut_s, "proxy": self.stack.proxy.stats.as_dict()}

    def fault_disconnects(self) -> dict:
        self.load.disconnect_share = self.settings.disconnect_share
        time.sleep(self.settings.disconnect_s)
        self.load.disconnect_share = 0.0
        return {"share": self.settings.disconnect_share, "seconds": self.settings.disconnect_s}

    def fault_collide(self) -> dict:
        cases = []
        for round_ in range(self.settings.collide_rounds):
            cases.append(self._collide("decodes-first", round_))
            cases.append(self._collide("prefill-first", round_))
            cases.append(self._collide("other-length", round_))
            cases.append(self._collide("other-prompt-first", round_))
        malformed = self._malformed()
        return {"collisions": cases, "malformed": malformed}

    def _direct(self, role: str, prompt_index: int, max_tokens: int, params: dict | None, label: str, *, prompt: list[int] | None = None,
                expected: Sequence[int] | None = None, check_tokens: bool = True) -> Outcome:
        """One request straight to an engine (no router), recorded under the current phase."""
        handle = self.stack.engines[role]
        tokens = prompt if prompt is not None else self.stack.prompts[prompt_index]
        if expected is None and check_tokens:
            expected = self.stack.reference[prompt_index].token_ids
        body = completion_body(tokens, max_tokens, kv_transfer_params=params)
        timeout_ms = (params or {}).get("kvpush", {}).get("timeout_ms") if isinstance((params or {}).get("kvpush"), dict) else None
        deadline_s = (timeout_ms if isinstance(timeout_ms, (int, float)) and 0 < timeout_ms < 60_000 else self.settings.timeout_ms) / 1000
        # Straight to D a failure comes only once its blocks are safe: by the deadline plus the hold margin.
        deadline_s += HOLD_MARGIN_S if role == "decode" else 0.0
        start_s = time.monotonic() - self.started
        reply = send(handle.url, "/v1/completions", body, hang_after_s=deadline_s + HANG_SLACK_S, headers={"X-Request-Id": label})
        result, reason, detail = classify(reply, expected if check_tokens else None, max_tokens)
        if result == "failed" and not reason:
            reason = f"ENGINE_{reply.status or 'NO_ANSWER'}"
        outcome = Outcome(self.load.phase, f"direct-{role[0]}", label, len(tokens), max_tokens, False, round(start_s, 3), round(reply.elapsed_s, 3),
                          deadline_s, reply.status, result, reason, detail or (reply.error or {}).get("message", "")[:200])
        self.load.record(outcome)
        if result in ("wrong", "hung"):
            self.log(f"{result.upper()}: {label}: {detail}")
        return outcome

    def _collide(self, order: str, round_: int) -> dict:
        """Two decode legs with one transfer key (+ the prefill leg): at most one may get the KV, and only with the right tokens."""
        transfer_id = new_transfer_id()
        timeout_ms = self.settings.timeout_ms
        d_params = transfer_params("decode", transfer_id, PREFILL_ID, timeout_ms=timeout_ms)
        p_params = transfer_params("prefill", transfer_id, DECODE_ID, timeout_ms=timeout_ms)
        first = PROMPT_LENGTHS.index(300)
        second = PROMPT_LENGTHS.index(40) if order.startswith("other") else first
        label = f"collide-{order}-{round_}"
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            if order == "prefill-first":
                p = pool.submit(self._direct, "prefill", first, 1, p_params, f"{label}-p", check_tokens=False)
                time.sleep(0.05)
                d1 = pool.submit(self._direct, "decode", first, 8, d_params, f"{label}-d1")
                time.sleep(0.05)
                d2 = pool.submit(self._direct, "decode", second, 8, d_params, f"{label}-d2")
            elif order == "other-prompt-first":
                # The other prompt holds the key: P's prompt must not fill its blocks (PROMPT_MISMATCH).
                d2 = pool.submit(self._direct, "decode", second, 8, d_params, f"{label}-d2")
                time.sleep(0.3)
                d1 = pool.submit(self._direct, "decode", first, 8, d_params, f"{label}-d1")
                time.sleep(0.3)
                p = pool.submit(self._direct, "prefill", first, 1, p_params, f"{label}-p", check_tokens=False)
            else:
                d1 = pool.submit(self._direct, "decode", first, 8, d_params, f"{label}-d1")
                d2 = pool.submit(self._direct, "decode", second, 8, d_params, f"{label}-d2")
                time.sleep(0.3)
                p = pool.submit(self._direct, "prefill", first, 1, p_params, f"{label}-p", check_tokens=False)
            results = {"d1": d1.result(), "d2": d2.result(), "p": p.result()}
        record = _broker_record(self.stack, transfer_id)
        decoded = [name for name in ("d1", "d2") if results[name].status == 200]
        case = {
            "order": order,
            "transfer_id": transfer_id,
            "outcomes": {k: {"status": v.status, "result": v.result, "elapsed_s": v.elapsed_s, "detail": v.detail[:160]} for k, v in results.items()},
            "broker": record,
            "at_most_one_decode_answered": len(decoded) <= 1,
            "no_wrong_or_hung": all(v.result not in ("wrong", "hung") for v in results.values()),
        }
        self.log(f"{label}: d1 {results['d1'].result} ({results['d1'].status}, {results['d1'].elapsed_s:.2f} s), "
                 f"d2 {results['d2'].result} ({results['d2'].status}, {results['d2'].elapsed_s:.2f} s), "
                 f"p {results['p'].result} ({results['p'].status}); broker: {record}")
        return case

    def _malformed(self) -> list[dict]:
        """Bad kvpush parameters straight to D (and a few to P): each answered in time, nothing wrong, the engine keeps serving."""
        tid = new_transfer_id
        timeout_ms = self.settings.timeout_ms
        valid = {"role": "decode", "attempt": 1, "prefill_engine_id": PREFILL_ID, "timeout_ms": timeout_ms}
        to_decode: list[tuple[str, Any]] = [
            ("not-an-object", "x"),
            ("no-transfer-id", {"role": "decode", "prefill_engine_id": PREFILL_ID}),
            ("bad-transfer-id", {**valid, "transfer_id": "bad id!"}),
            ("long-transfer-id", {**valid, "transfer_id": "x" * 129}),
            ("attempt-zero", {**valid, "transfer_id": tid(), "attempt": 0}),
            ("attempt-string", {**valid, "transfer_id": tid(), "attempt": "1"}),
            ("attempt-huge", {**valid, "transfer_id": tid(), "attempt": 2**40}),
            ("timeout-negative", {**valid, "transfer_id": tid(), "timeout_ms": -5}),
            ("timeout-huge", {**valid, "transfer_id": tid(), "timeout_ms": 10**12}),
            ("timeout-string", {**valid, "transfer_id": tid(), "timeout_ms": "5000"}),
            ("no-prefill-engine", {"role": "decode", "transfer_id": tid(), "timeout_ms": timeout_ms}),
            ("unknown-prefill-engine", {**valid, "transfer_id": tid(), "prefill_engine_id": "no-such-engine"}),
            ("decode-engine-as-prefill", {**valid, "transfer_id": tid(), "prefill_engine_id": DECODE_ID}),
            ("bad-role", {**valid, "transfer_id": tid(), "role": "bogus"}),
            ("other-control-plane", {**valid, "transfer_id": tid(), "control_plane": "10.255.255.1:1"}),
            ("bad-traceparent", {**valid, "transfer_id": tid(), "traceparent": 12}),
            ("prefill-role-to-decode", {"role": "prefill", "transfer_id": tid(), "decode_engine_id": DECODE_ID, "timeout_ms": timeout_ms}),
        ]
        to_prefill: list[tuple[str, Any]] = [
            ("not-an-object", "x"),
            ("bad-transfer-id", {"role": "prefill", "transfer_id": "bad id!", "decode_engine_id": DECODE_ID}),
            ("decode-role-to-prefill", {**valid, "transfer_id": tid()}),
            ("unknown-decode-engine", {"role": "prefill", "transfer_id": tid(), "decode_engine_id": "no-such-engine", "timeout_ms": timeout_ms}),
        ]
        prompt_index = PROMPT_LENGTHS.index(129)
        results = []
        for role, cases, max_tokens in (("decode", to_decode, 4), ("prefill", to_prefill, 1)):
            for name, params in cases:
                outcome = self._direct(role, prompt_index, max_tokens, {"kvpush": params}, f"malformed-{role}-{name}")
                results.append({"engine": role, "case": name, "status": outcome.status, "result": outcome.result, "elapsed_s": outcome.elapsed_s,
                                "detail": outcome.detail[:160]})
                self.log(f"malformed {role} {name}: {outcome.result} ({outcome.status}) in {outcome.elapsed_s:.2f} s")
        return results


def _broker_record(stack: Stack, transfer_id: str) -> dict[str, Any]:
    """The broker's record of a transfer's latest attempt (state, end reason), or the error that prevented reading it."""

    async def fetch() -> dict[str, Any]:
        config = ClientConfig(target=stack.cp.address, token=stack.cp.token, default_timeout_s=3.0)
        async with BrokerClient(config) as broker:
            transfer = (await broker.get_transfer(rv_pb.GetTransferRequest(transfer_id=transfer_id))).transfer
        return {
            "attempt": transfer.key.attempt,
            "state": transfer_pb2.TransferState.Name(transfer.state),
            "end_reason": transfer_pb2.EndReason.Name(transfer.end_reason),
            "detail": transfer.detail[:200],
        }

    try:
        return asyncio.run(fetch())
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"[:200]}


# ---- the control-plane memory soak ---------------------------------------------------------------


async def soak(target: str, tokens: dict[str, str], attempts: int, timeout_s: float, settle_s: float,
               probe: Callable[[], dict[str, Any]], log: Log, label: str) -> dict[str, Any]:
    """Holds ~`attempts` transfer attempts in flight at once at one control plane, lets them end, waits settle_s; returns the samples.

    Two fake engines register one rank each with their own tokens and keep
    their leases; a third of the attempts only registers a destination, a
    third only reports prefill done, a third does both, so the broker sends
    the fake producer a write order that is never answered (the attempt
    ends at its deadline and is fenced by its time bound).
    """
    configs = {engine_id: ClientConfig(target=target, token=tokens[engine_id], default_timeout_s=10.0) for engine_id in (SOAK_PREFILL_ID, SOAK_DECODE_ID)}
    incarnation = "soak-" + os.urandom(4).hex()
    samples: dict[str, Any] = {"before": probe()}
    peak: dict[str, Any] = {}
    errors: collections.Counter[str] = collections.Counter()
    orders = 0
    background: list[asyncio.Task] = []
    registrars = {engine_id: RegistrarClient(config) for engine_id, config in configs.items()}
    brokers = {engine_id: BrokerClient(config) for engine_id, config in configs.items()}
    leases: dict[str, str] = {}
    try:
        for engine_id, role in ((SOAK_PREFILL_ID, sample_role(True)), (SOAK_DECODE_ID, sample_role(False))):
            request = sample.rank_request(engine_id, role, incarnation=incarnation, num_blocks=100_000, lease_ttl_s=10.0)
            leases[engine_id] = (await registrars[engine_id].register_engine_rank(request)).lease_id

        async def keep_alive(engine_id: str) -> None:
            stream = registrars[engine_id].keep_alive()
            async with stream:
                await stream.write(reg_pb.KeepAliveRequest(lease_ids=[leases[engine_id]]))
                async for _ in stream:
                    await asyncio.sleep(2.0)
                    await stream.write(reg_pb.KeepAliveRequest(lease_ids=[leases[engine_id]]))

        async def consume_orders() -> None:
            nonlocal orders
            request = rv_pb.StreamWriteOrdersRequest(engine_id=SOAK_PREFILL_ID, incarnation=incarnation, early_orders=False)
            async with brokers[SOAK_PREFILL_ID].stream_write_orders(request) as stream:
                async for message in stream:
                    if message.WhichOneof("message") == "order":
                        orders += 1

        async def sampler() -> None:
            while True:
                now = await asyncio.to_thread(probe)
                for key, value in now.items():
                    if isinstance(value, (int, float)) and (key not in peak or value > peak[key]):
                        peak[key] = value
                    elif isinstance(value, dict):
                        inner = peak.setdefault(key, {})
                        for k, v in value.items():
                            inner[k] = max(inner.get(k, v), v)
                await asyncio.sleep(0.25)

        background = [asyncio.create_task(keep_alive(e)) for e in configs] + [asyncio.create_task(consume_orders()), asyncio.create_task(sampler())]
        await asyncio.sleep(0.5)
        gate = asyncio.Semaphore(64)

        async def one(i: int) -> None:
            transfer_id = f"soak-{incarnation}-{i}"
            kind = i % 3
            first_block = (i * 4) % 99_000
            kwargs = {"num_tokens": 40, "first_block": first_block, "timeout_s": timeout_s, "incarnation": incarnation}
            destination = sample.destination_request(transfer_id, decode_engine_id=SOAK_DECODE_ID, prefill_engine_id=SOAK_PREFILL_ID, **kwargs)
            prefill_done = sample.prefill_done_request(transfer_id, prefill_engine_id=SOAK_PREFILL_ID, decode_engine_id=SOAK_DECODE_ID, **kwargs)
            async with gate:
                try:
                    if kind in (0, 2):
                        await brokers[SOAK_DECODE_ID].register_destination(destination)
                    if kind in (1, 2):
                        await brokers[SOAK_PREFILL_ID].report_prefill_done(prefill_done)
                except Exception as exc:
                    errors[type(exc).__name__ + ": " + str(exc)[:80]] += 1

        t0 = time.monotonic()
        await asyncio.gather(*(one(i) for i in range(attempts)))
        launched_s = time.monotonic() - t0
        log(f"soak {label}: {attempts} attempts sent in {launched_s:.1f} s ({sum(errors.values())} errors); waiting for them to end")
        await asyncio.sleep(1.0)
        samples["in_flight"] = await asyncio.to_thread(probe)
        # Every attempt ends at its deadline; the matched ones are fenced by their time bound after it.
        end_by = time.monotonic() + timeout_s + 30.0
        while time.monotonic() < end_by:
            now = await asyncio.to_thread(probe)
            if now.get("live_attempts") == 0:
                break
            await asyncio.sleep(0.5)
        samples["ended"] = await asyncio.to_thread(probe)
        samples["ended_after_s"] = round(time.monotonic() - t0, 1)
        for engine_id, lease in leases.items():
            with contextlib.suppress(Exception):
                await registrars[engine_id].deregister_engine_rank(reg_pb.DeregisterEngineRankRequest(lease_id=lease))
    finally:
        for task in background:
            task.cancel()
        await asyncio.gather(*background, return_exceptions=True)
        for client in (*registrars.values(), *brokers.values()):
            with contextlib.suppress(Exception):
                await client.close()
    log(f"soak {label}: every attempt ended; waiting {settle_s:g} s for the broker's retention to pass")
    await asyncio.sleep(settle_s)
    samples["after"] = await asyncio.to_thread(probe)
    samples["peak"] = peak
    samples["orders_received"] = orders
    samples["errors"] = dict(errors)
    samples["attempts"] = attempts
    return samples


def sample_role(prefill: bool) -> int:
    return sample.PREFILL if prefill else sample.DECODE


async def _soak_both(stack: Stack, settings: Settings, log: Log) -> dict[str, Any]:
    """The soak against the stack's control plane (RSS, PSS, live-attempts gauge) and, at once, an in-process one (memory_sizes)."""
    from kvpush.services import control_plane
    from kvpush.services.common.config import ServerConfig
    from kvpush.services.common.tokens import load_tokens_dir

    tokens = {path.name: path.read_text().strip() for path in stack.cp.tokens_dir.iterdir() if path.is_file()}
    pid = stack.cp.process.pid

    def external() -> dict[str, Any]:
        return {"rss_bytes": rss_bytes(pid), "pss_bytes": pss_bytes(pid), "live_attempts": stack.broker_gauge(),
                "pending_registrations": stack.broker_gauge("kvpush_broker_pending_registrations"),
                "pending_prefill_dones": stack.broker_gauge("kvpush_broker_pending_prefill_dones")}

    async with control_plane.running(ServerConfig(listen="127.0.0.1:0"), tokens=load_tokens_dir(stack.cp.tokens_dir)) as plane:

        def internal() -> dict[str, Any]:
            return {"live_attempts": plane.broker.live_attempts, "memory_sizes": plane.broker.memory_sizes}

        out_ext, out_int = await asyncio.gather(
            soak(stack.cp.address, tokens, settings.soak_attempts, settings.soak_timeout_s, settings.soak_settle_s, external, log, "external"),
            soak(f"127.0.0.1:{plane.port}", tokens, settings.soak_attempts, settings.soak_timeout_s, settings.soak_settle_s, internal, log, "in-process"),
        )
    return {"external": out_ext, "in_process": out_int}


def soak_verdict(result: dict[str, Any]) -> dict[str, Any]:
    ext, internal = result["external"], result["in_process"]
    before, peak, after = ext["before"]["rss_bytes"], ext["peak"].get("rss_bytes", 0), ext["after"]["rss_bytes"]
    allowed = before + max(SOAK_RSS_SLACK_BYTES, SOAK_RSS_SLACK_SHARE * max(0, peak - before))
    sizes_before, sizes_after = internal["before"]["memory_sizes"], internal["after"]["memory_sizes"]
    checks = {
        "peak_live_attempts": ext["peak"].get("live_attempts"),
        "live_attempts_after": ext["after"].get("live_attempts"),
        "rss_before_mib": round(before / 2**20, 1),
        "rss_peak_mib": round(peak / 2**20, 1),
        "rss_after_mib": round(after / 2**20, 1),
        "rss_allowed_after_mib": round(allowed / 2**20, 1),
        "pss_before_mib": round(ext["before"]["pss_bytes"] / 2**20, 1),
        "pss_peak_mib": round(ext["peak"].get("pss_bytes", 0) / 2**20, 1),
        "pss_after_mib": round(ext["after"]["pss_bytes"] / 2**20, 1),
        "memory_sizes_before": sizes_before,
        "memory_sizes_peak": internal["peak"].get("memory_sizes"),
        "memory_sizes_after": sizes_after,
    }
    checks["rss_back_near_baseline"] = after <= allowed
    checks["tables_back_to_baseline"] = sizes_after == sizes_before
    checks["live_attempts_back_to_zero"] = ext["after"].get("live_attempts") == 0 and internal["after"]["live_attempts"] == 0
    checks["passed"] = checks["rss_back_near_baseline"] and checks["tables_back_to_baseline"] and checks["live_attempts_back_to_zero"]
    return checks


# ---- the run -----------------------------------------------------------------------------------


def verdict(faults: list[dict[str, Any]], soak_checks: dict[str, Any] | None) -> dict[str, Any]:
    """The targets: 0 hung, 0 wrong, every block free after each fault, failures answered in time with a reason, memory back."""
    routed = [f["routed"] for f in faults]
    direct = [f["direct"] for f in faults]
    out = {
        "hung": sum(r["hung"] for r in routed + direct),
        "wrong": sum(r["wrong"] for r in routed + direct),
        "faults_not_settled": [f["fault"] for f in faults if not f["kv"]["all_free"]],
        "faults_not_recovered": [f["fault"] for f in faults if f["recovered_s"] is None],
        "late_failures": sum(r["late_failures"] for r in routed),
        "failures_without_reason": sum(r["failures_without_reason"] for r in routed),
        "max_failure_minus_deadline_s": max((r["max_failure_minus_deadline_s"] for r in routed if r["max_failure_minus_deadline_s"] is not None), default=None),
    }
    collisions = [case for f in faults for case in f["notes"].get("collisions", [])]
    out["collisions_ok"] = all(c["at_most_one_decode_answered"] and c["no_wrong_or_hung"] for c in collisions)
    targets = {
        "0 hung": out["hung"] == 0,
        "0 wrong outputs": out["wrong"] == 0,
        "0 blocks left allocated after any fault": not out["faults_not_settled"],
        "every failure answered <= deadline + 1 s with its reason": out["late_failures"] == 0 and out["failures_without_reason"] == 0,
        "router serves again after every fault": not out["faults_not_recovered"],
        "colliding keys: at most one decode answered, never wrong": out["collisions_ok"],
    }
    if soak_checks is not None:
        targets["control-plane memory back near its baseline after the soak"] = soak_checks["passed"]
    out["targets"] = targets
    out["passed"] = all(targets.values())
    return out


def run(settings: Settings, *, quiet: bool = False) -> dict[str, Any]:
    """Starts the stack, injects settings.faults under load, runs the soak if asked; returns the figures (also written to the run dir)."""
    run_dir = settings.run_dir or Path("runs") / time.strftime("chaos-%Y%m%d-%H%M%S")
    run_dir.mkdir(parents=True, exist_ok=True)
    settings = dataclasses.replace(settings, run_dir=run_dir)
    log = Log(run_dir / "chaos.log", quiet=quiet)
    unknown = [f for f in settings.faults if f not in FAULTS]
    if unknown:
        raise ValueError(f"unknown faults {unknown}; known: {', '.join(FAULTS)}")
    started = time.monotonic()
    model_dir = build_tiny_model(settings.model_dir or default_model_dir())
    log(f"writing to {run_dir}; faults {', '.join(settings.faults)}; {settings.clients} clients; deadline {settings.timeout_ms} ms")
    stack = Stack(settings, run_dir, model_dir, log)
    result: dict[str, Any] = {"benchmark": "chaos", "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "command": " ".join(sys.argv),
                              "settings": settings.as_dict(), "cpus": os.cpu_count()}
    faults: list[dict[str, Any]] = []
    soak_result = soak_checks = None
    try:
        stack.start()
        result["startup_s"] = round(time.monotonic() - started, 1)
        chaos = Chaos(stack, settings, log)
        for name in settings.faults:
            faults.append(chaos.run_fault(name))
        if settings.soak_attempts:
            log(f"=== soak: {settings.soak_attempts} attempts in flight at once at the control plane")
            try:
                soak_result = asyncio.run(_soak_both(stack, settings, log))
                soak_checks = soak_verdict(soak_result)
            except Exception as exc:  # the faults' figures are kept; the soak counts as missed
                log(f"soak failed: {type(exc).__name__}: {exc}")
                soak_result, soak_checks = {}, {"passed": False, "error": f"{type(exc).__name__}: {exc}"}
            log(f"soak: {json.dumps(soak_checks)}")
        result["logs"] = {name: str(run_dir / f"{name}.log") for name in ("prefill", "decode", "router", "reference")}
        result["logs"]["control-plane"] = str(stack.cp_dir / "control-plane.log")
        result["all_outcomes"] = len(chaos.load.outcomes)
        with (run_dir / "outcomes.jsonl").open("w", encoding="utf-8") as handle:
            for outcome in chaos.load.outcomes:
                handle.write(json.dumps(dataclasses.asdict(outcome)) + "\n")
    finally:
        stack.close()
    result["faults"] = faults
    result["total"] = summarize_totals(faults)
    if soak_result is not None:
        result["soak"] = {"raw": soak_result, "checks": soak_checks}
    result["verdict"] = verdict(faults, soak_checks)
    result["wall_s"] = round(time.monotonic() - started, 1)
    (run_dir / "result.json").write_text(json.dumps(result, indent=1, default=str), encoding="utf-8")
    return result


def summarize_totals(faults: list[dict[str, Any]]) -> dict[str, Any]:
    total: dict[str, Any] = {"requests": 0, "ok": 0, "failed": 0, "hung": 0, "wrong": 0, "disconnected": 0, "failures_by_reason": collections.Counter()}
    for fault in faults:
        for part in ("routed", "direct"):
            r = fault[part]
            for key in ("requests", "ok", "failed", "hung", "wrong", "disconnected"):
                total[key] += r[key]
            if part == "routed":
                total["failures_by_reason"].update(r["failures_by_reason"])
    total["failures_by_reason"] = dict(sorted(total["failures_by_reason"].items()))
    overs = [f["routed"]["max_failure_minus_deadline_s"] for f in faults if f["routed"]["max_failure_minus_deadline_s"] is not None]
    total["max_failure_minus_deadline_s"] = max(overs) if overs else None
    return total


def format_report(result: dict[str, Any]) -> str:
    """The figures as a text table: per fault, in total, the soak and the verdict."""
    lines = []
    deadline_ms = result["settings"]["timeout_ms"]
    lines.append(f"chaos run {result['date']}: deadline {deadline_ms} ms, {result['settings']['clients']} clients, wall {result.get('wall_s')} s")
    header = f"{'fault':<12}{'routed':>7}{'ok':>6}{'failed':>7}{'hung':>5}{'wrong':>6}{'disc':>5}{'fail-dl s':>10}{'late':>5}{'direct':>7}" \
             f"{'recover s':>10}{'KV P free':>11}{'KV D free':>11}{'settle s':>9}"
    lines.append(header)
    for f in result["faults"]:
        r, d, kv = f["routed"], f["direct"], f["kv"]
        over = "-" if r["max_failure_minus_deadline_s"] is None else f"{r['max_failure_minus_deadline_s']:+.2f}"
        recover = "never" if f["recovered_s"] is None else f"{f['recovered_s']:.1f}"
        kv_p = f"{kv['free'].get('prefill')}/{kv['baseline_free'].get('prefill')}"
        kv_d = f"{kv['free'].get('decode')}/{kv['baseline_free'].get('decode')}"
        lines.append(f"{f['fault']:<12}{r['requests']:>7}{r['ok']:>6}{r['failed']:>7}{r['hung']:>5}{r['wrong']:>6}{r['disconnected']:>5}{over:>10}"
                     f"{r['late_failures']:>5}{d['requests']:>7}{recover:>10}{kv_p:>11}{kv_d:>11}{kv['settle_s']:>9.1f}")
    t = result["total"]
    over = "-" if t["max_failure_minus_deadline_s"] is None else f"{t['max_failure_minus_deadline_s']:+.2f}"
    lines.append(f"{'total':<12}{t['requests']:>7}{t['ok']:>6}{t['failed']:>7}{t['hung']:>5}{t['wrong']:>6}{t['disconnected']:>5}{over:>10}")
    lines.append("(KV free: free/at start, after one tiny request to each engine; routed counts exclude the direct requests, totals include them)")
    for f in result["faults"]:
        if f["routed"]["failures_by_reason"]:
            lines.append(f"failures by reason, {f['fault']}: " + ", ".join(f"{k} x{v}" for k, v in f["routed"]["failures_by_reason"].items()))
        if f["direct"]["requests"]:
            lines.append(f"direct requests, {f['fault']}: ok {f['direct']['ok']}, failed {f['direct']['failed']} "
                         + "(" + ", ".join(f"{k} x{v}" for k, v in f["direct"]["failures_by_reason"].items()) + f"), hung {f['direct']['hung']}, "
                         f"wrong {f['direct']['wrong']}")
    soak_result = result.get("soak")
    if soak_result and "error" in soak_result["checks"]:
        lines.append(f"soak failed: {soak_result['checks']['error']}")
    elif soak_result:
        c = soak_result["checks"]
        lines.append(f"soak ({soak_result['raw']['external']['attempts']} attempts): live attempts peak {c['peak_live_attempts']}, after {c['live_attempts_after']}; "
                     f"RSS {c['rss_before_mib']} -> peak {c['rss_peak_mib']} -> after {c['rss_after_mib']} MiB (allowed {c['rss_allowed_after_mib']}); "
                     f"PSS {c['pss_before_mib']} -> {c['pss_peak_mib']} -> {c['pss_after_mib']} MiB")
        lines.append(f"soak memory_sizes (in-process): before {c['memory_sizes_before']}, peak {c['memory_sizes_peak']}, after {c['memory_sizes_after']}")
    v = result["verdict"]
    lines.append("targets:")
    for name, held in v["targets"].items():
        lines.append(f"  {'held  ' if held else 'MISSED'}  {name}")
    lines.append(f"verdict: {'all targets held' if v['passed'] else 'targets missed'}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.chaos", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--long", action="store_true", help="every fault, a minute of load before and after each, and the memory soak")
    parser.add_argument("--faults", help=f"comma-separated faults, in order (known: {', '.join(FAULTS)}; '' for none: only the soak)")
    parser.add_argument("--clients", type=int, help="concurrent client threads")
    parser.add_argument("--timeout-ms", type=int, help="the router's --transfer-timeout-ms: every request's deadline")
    parser.add_argument("--pre", type=float, help="seconds of load before each fault")
    parser.add_argument("--post", type=float, help="seconds of load after the router serves again")
    parser.add_argument("--cut", type=float, help="seconds the proxy stays cut")
    parser.add_argument("--stop", type=float, help="seconds P stays SIGSTOPped")
    parser.add_argument("--soak", type=int, help="transfer attempts held in flight in the memory soak (0: none)")
    parser.add_argument("--run-dir", type=Path, help="where logs and result.json go (default runs/chaos-<timestamp>)")
    parser.add_argument("--model-dir", type=Path, help="the tiny model (built if missing)")
    parser.add_argument("--json", metavar="PATH", help="also write the result as JSON to PATH ('-' for stdout, after the report)")
    args = parser.parse_args(argv)
    settings = long_settings() if args.long else short_settings()
    overrides = {
        "faults": tuple(f for f in args.faults.split(",") if f) if args.faults is not None else None, "clients": args.clients, "timeout_ms": args.timeout_ms, "pre_s": args.pre,
        "post_s": args.post, "cut_s": args.cut, "stop_s": args.stop, "soak_attempts": args.soak, "run_dir": args.run_dir, "model_dir": args.model_dir,
    }
    settings = dataclasses.replace(settings, **{k: v for k, v in overrides.items() if v is not None})
    try:
        with interrupt_on_signals():
            result = run(settings)
    except KeyboardInterrupt:
        print("chaos: interrupted (every process it started was stopped)", file=sys.stderr)
        return 130
    print()
    print(format_report(result))
    if args.json == "-":
        print(json.dumps(result, default=str))
    elif args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, default=str), encoding="utf-8")
    return 0 if result["verdict"]["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
