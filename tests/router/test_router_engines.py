# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""`kvpush router` (and examples/minimal_router.py) in front of real vLLM CPU engines running kvpush.

One engine set for the module: a control plane, a P engine on CPU 0 and a
D engine on CPU 1, plus an ordinary engine for the reference outputs. Every
routed answer, streamed or not, completions or chat, must equal the
reference (token ids equal, per-token logprobs within 1e-3); one trace must
join the router's span with the engines' p.* and d.* spans; a dead prefill
engine must give a clear 5xx within the router's bound and leave D's blocks
free, or, with another prefill engine in the pool, a correct answer from
attempt 2.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import sys
import time
from pathlib import Path

import pytest

from kvpush import errors
from kvpush.dev.localstack.completions import Completion, completions, max_logprob_diff, stream_completions
from kvpush.dev.localstack.control_plane import kvpush_transfer_config, start_control_plane
from kvpush.dev.localstack.engines import start_vllm_server
from kvpush.dev.localstack.metrics import free_kv_blocks, num_kv_blocks
from kvpush.dev.localstack.process import GroupProcess, free_port
from kvpush.dev.localstack.prompts import prompt_token_ids
from kvpush.dev.localstack.router import RouterHandle, start_router
from kvpush.dev.localstack.transfers import get_transfer
from kvpush.dev.tinymodel import build_tiny_model, default_model_dir
from kvpush.rendezvous.v1 import transfer_pb2
from kvpush.sse import DONE, sse_payloads
from kvpush.telemetry import read_spans
from tests.waiting import wait_for

pytestmark = pytest.mark.engine

PROMPT_LENGTHS = (9, 300, 1000)
CHAT_MESSAGES = [
    [{"role": "user", "content": "the people said what was in the house of the one with many words"}],
    [{"role": "system", "content": "be short"}, {"role": "user", "content": " ".join(["which of them could say it"] * 40)}],
]
MAX_TOKENS = 8
LOGPROB_TOLERANCE = 1e-3
ROUTER_START_TIMEOUT_S = 30.0
# What the failure tests allow: the router's own bound plus process and HTTP slack.
ROUTER_PREFILL_TIMEOUT_S = 10.0
ENGINE_EXTRA = {"hold_margin_s": 1.5, "transfer_timeout_s": 20.0}
ROOT = Path(__file__).resolve().parents[2]


def chat(url: str, messages: list[dict], max_tokens: int, *, stream: bool = False, headers: dict | None = None, timeout: float = 120.0) -> Completion:
    """A greedy chat completion with token ids and logprobs, streamed or not."""
    body = {"model": "tiny", "messages": messages, "max_tokens": max_tokens, "temperature": 0.0, "logprobs": True,
            "return_token_ids": True, "ignore_eos": True, "stream": stream}
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    result = Completion(token_ids=[], logprobs=[])
    try:
        conn.request("POST", "/v1/chat/completions", body=json.dumps(body), headers={"Content-Type": "application/json", **(headers or {})})
        response = conn.getresponse()
        data = response.read()
    finally:
        conn.close()
    assert response.status == 200, data[:2000]
    if stream:
        chunks = [chunk for chunk in sse_payloads(data.splitlines(keepends=True)) if chunk != DONE]
        choices = [choice for chunk in chunks for choice in chunk["choices"]]
    else:
        choices = json.loads(data)["choices"]
    for choice in choices:
        result.token_ids += choice.get("token_ids") or []
        result.logprobs += [entry["logprob"] for entry in (choice.get("logprobs") or {}).get("content") or []]
    return result


def start_example_router(argv: list[str], log_path: Path, port: int) -> GroupProcess:
    """examples/minimal_router.py on `port`, once it answers HTTP (bounded)."""
    process = GroupProcess("minimal-router", argv, log_path, cwd=ROOT)
    deadline = time.monotonic() + ROUTER_START_TIMEOUT_S
    while not _answers(f"http://127.0.0.1:{port}"):
        if not process.alive() or time.monotonic() > deadline:
            process.stop()
            raise RuntimeError(f"the example router is not serving (exit {process.returncode}):\n{process.tail()}")
        time.sleep(0.1)
    return process


def _answers(url: str) -> bool:
    host, port = url.removeprefix("http://").split(":")
    try:
        conn = http.client.HTTPConnection(host, int(port), timeout=1.0)
        conn.request("GET", "/")
        conn.getresponse().read()
        conn.close()
        return True
    except OSError:
        return False


def get_json(url: str) -> tuple[int, dict]:
    host, port = url.removeprefix("http://").split("/")[0].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request("GET", "/" + url.removeprefix("http://").split("/", 1)[1])
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    model_dir = build_tiny_model(default_model_dir())
    work = tmp_path_factory.mktemp("router-stack")
    prompts = [prompt_token_ids(n, seed=n) for n in PROMPT_LENGTHS]
    traces = work / "traces.jsonl"
    env = {"KVPUSH_TRACES_FILE": str(traces)}
    control_plane = start_control_plane(work / "control-plane", env=env)
    started = []
    routers: list[RouterHandle] = []

    def reference():
        with start_vllm_server(model_dir, log_path=work / "reference.log") as server:
            return ([completions(server.url, p, MAX_TOKENS) for p in prompts], [chat(server.url, m, MAX_TOKENS) for m in CHAT_MESSAGES])

    def engine(role, engine_id, cpu):
        server = start_vllm_server(model_dir, kv_transfer_config=kvpush_transfer_config(role, engine_id, control_plane, **ENGINE_EXTRA),
                                   env=env, cpu_list=cpu, log_path=work / f"{role}.log")
        started.append(server)
        return server

    try:
        # The three engines start together: a start is mostly one core's work.
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            ref, p, d = pool.submit(reference), pool.submit(engine, "prefill", "prefill-0", "0"), pool.submit(engine, "decode", "decode-0", "1")
            (reference_completions, reference_chats), prefill, decode = ref.result(), p.result(), d.result()

        def start_named_router(name, prefills, extra=()):
            router = start_router(work, name=name, prefill=[f"{url}=prefill-0" for url in prefills], decode=[f"{decode.url}=decode-0"],
                                  control_plane=control_plane, extra_args=extra, env=env)
            routers.append(router)
            return router

        router = start_named_router("router", [prefill.url])
        # Warm-up: an engine's first request pays one-time costs (seconds).
        completions(router.url, prompt_token_ids(20, seed=99), 2)
        yield {
            "work": work, "traces": traces, "control_plane": control_plane, "prefill": prefill, "decode": decode, "router": router,
            "start_router": start_named_router, "prompts": prompts, "reference": reference_completions, "reference_chats": reference_chats,
        }
    finally:
        for process in routers:
            process.stop()
        for server in started:
            server.stop()
        control_plane.stop()


def assert_matches(reference: Completion, actual: Completion) -> None:
    assert actual.token_ids == reference.token_ids
    assert max_logprob_diff(reference, actual) <= LOGPROB_TOLERANCE


@pytest.mark.parametrize("index", range(len(PROMPT_LENGTHS)), ids=[f"{n}-tokens" for n in PROMPT_LENGTHS])
def test_completions_equal_reference(stack, index):
    assert_matches(stack["reference"][index], completions(stack["router"].url, stack["prompts"][index], MAX_TOKENS))


@pytest.mark.parametrize("index", range(len(PROMPT_LENGTHS)), ids=[f"{n}-tokens" for n in PROMPT_LENGTHS])
def test_streamed_completions_equal_reference(stack, index):
    streamed = stream_completions(stack["router"].url, stack["prompts"][index], MAX_TOKENS)
    assert_matches(stack["reference"][index], streamed)
    assert streamed.ttft_s is not None and streamed.ttft_s <= streamed.total_s


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_chat_completions_equal_reference(stack, stream):
    for messages, reference in zip(CHAT_MESSAGES, stack["reference_chats"]):
        assert_matches(reference, chat(stack["router"].url, messages, MAX_TOKENS, stream=stream))


def test_concurrent_requests_equal_reference(stack):
    with concurrent.futures.ThreadPoolExecutor(len(stack["prompts"])) as pool:
        answers = list(pool.map(lambda p: stream_completions(stack["router"].url, p, MAX_TOKENS), stack["prompts"]))
    for reference, answer in zip(stack["reference"], answers):
        assert_matches(reference, answer)


def test_one_trace_joins_router_and_engine_spans(stack):
    trace_id = "5d0f9a8e7c6b5a4f3e2d1c0b9a887766"
    traceparent = f"00-{trace_id}-1122334455667788-01"
    streamed = stream_completions(stack["router"].url, stack["prompts"][1], MAX_TOKENS, headers={"traceparent": traceparent, "X-Request-Id": "trace-test"})
    assert_matches(stack["reference"][1], streamed)
    wanted = {"router.request", "router.prefill_leg", "router.decode_leg", "p.queue", "p.prefill", "p.write_transfer", "d.wait_for_kv", "d.first_decode_step"}

    def trace_spans():
        spans = [s for s in read_spans(stack["traces"]) if s["trace_id"] == trace_id]
        return spans if wanted <= {s["name"] for s in spans} else None

    spans = wait_for(trace_spans, timeout=10.0, what="the request's spans in the traces file")
    by_id = {s["span_id"]: s for s in spans}
    (root,) = [s for s in spans if s["name"] == "router.request"]
    assert root["parent_span_id"] == "1122334455667788" and root["kind"] == "SERVER"
    assert root["attributes"]["kvpush.client_request_id"] == "trace-test"
    assert 0 < root["attributes"]["kvpush.ttft_ms"] <= streamed.ttft_s * 1000
    assert [e["name"] for e in root["events"]] == ["first_token"]

    def ancestors(span):
        names = []
        while span["parent_span_id"] in by_id:
            span = by_id[span["parent_span_id"]]
            names.append(span["name"])
        return names

    engine_spans = [s for s in spans if s["name"].startswith(("p.", "d."))]
    assert {s["service_name"] for s in engine_spans} >= {"kvpush-prefill", "kvpush-decode"}
    for span in engine_spans:
        assert span["attributes"]["kvpush.transfer_id"] == root["attributes"]["kvpush.transfer_id"]
        leg = "router.prefill_leg" if span["name"].startswith("p.") else "router.decode_leg"
        assert ancestors(span)[-2:] == [leg, "router.request"], span["name"]


def test_the_first_decode_step_span_holds_the_step_that_made_the_first_token(stack):
    # It starts when D's first decode step is scheduled and ends when vLLM took that step's token; ending
    # it when the step was scheduled (the mistake this guards against) left the forward out: then it
    # lasted a fraction of a millisecond, while the step it stands for lasts about one inter-token gap.
    trace_id = "6e1f0a9b8d7c6b5a4f3e2d1c0b9a8877"
    streamed = stream_completions(stack["router"].url, stack["prompts"][2], MAX_TOKENS,
                                  headers={"traceparent": f"00-{trace_id}-2233445566778899-01"})
    assert_matches(stack["reference"][2], streamed)

    def first_step():
        spans = [s for s in read_spans(stack["traces"]) if s["trace_id"] == trace_id and s["name"] == "d.first_decode_step"]
        return spans[0] if spans else None

    span = wait_for(first_step, timeout=10.0, what="the request's d.first_decode_step span")
    gaps = sorted(b - a for a, b in zip(streamed.token_times_s, streamed.token_times_s[1:]))
    step_ms = (span["end_ns"] - span["start_ns"]) / 1e6
    assert step_ms >= 0.3 * gaps[len(gaps) // 2] * 1000, (step_ms, gaps)


def test_health_lists_both_engines(stack):
    status, report = get_json(stack["router"].url + "/health")
    assert status == 200 and report["status"] == "ok" and report["mode"] == "push"
    assert [(e["engine_id"], e["healthy"]) for e in report["prefill"] + report["decode"]] == [("prefill-0", True), ("decode-0", True)]
    status, models = get_json(stack["router"].url + "/v1/models")
    assert status == 200 and models["data"][0]["id"] == "tiny"


def test_dead_prefill_engine_gives_a_clear_5xx_and_frees_decode_blocks(stack):
    dead_url = f"http://127.0.0.1:{free_port()}"
    router = stack["start_router"]("router-dead-prefill", [dead_url], ["--prefill-timeout", str(ROUTER_PREFILL_TIMEOUT_S)])
    decode = stack["decode"]
    total = num_kv_blocks(decode.url) - 1
    t0 = time.monotonic()
    host, port = router.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", "/v1/completions", body=json.dumps({"model": "tiny", "prompt": stack["prompts"][2], "max_tokens": MAX_TOKENS, "stream": True}),
                 headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    error = json.loads(response.read())["error"]
    conn.close()
    assert time.monotonic() - t0 < ROUTER_PREFILL_TIMEOUT_S
    assert response.status == 502
    assert (error["leg"], error["engine_id"]) == ("prefill", "prefill-0")
    assert error["message"].startswith(f"prefill leg to prefill-0 ({dead_url}): cannot connect")
    # The router cancels the attempt beside its answer, not before it: until then the broker may not know it yet.
    def cancelled() -> bool:
        try:
            return get_transfer(stack["control_plane"], error["transfer_id"], 1).state == transfer_pb2.TRANSFER_STATE_CANCELLED
        except errors.NotFound:
            return False

    wait_for(cancelled, timeout=5.0, interval=0.1, what="attempt 1 cancelled by the router")
    # Engines publish the gauge only while stepping: a small request makes D step once its abandoned one is gone.
    wait_for(lambda: completions(decode.url, [5, 6, 7], 1) and free_kv_blocks(decode.url) == total, timeout=30.0, interval=0.5,
             what="all of D's blocks free")
    status, report = get_json(router.url + "/health")
    assert status == 503 and report["prefill"][0]["healthy"] is False


def test_dead_prefill_engine_is_retried_on_the_live_one(stack):
    dead_url = f"http://127.0.0.1:{free_port()}"
    router = stack["start_router"]("router-retry", [dead_url, stack["prefill"].url])  # round robin tries the dead one first
    streamed = stream_completions(router.url, stack["prompts"][1], MAX_TOKENS)
    assert_matches(stack["reference"][1], streamed)
    metrics = http.client.HTTPConnection(*router.url.removeprefix("http://").split(":"), timeout=10)
    metrics.request("GET", "/metrics")
    text = metrics.getresponse().read().decode()
    metrics.close()
    assert "kvpush_router_retries_total 1.0" in text


def test_minimal_router_example(stack):
    port = free_port()
    argv = [sys.executable, str(ROOT / "examples" / "minimal_router.py"), "--prefill", f"{stack['prefill'].url}=prefill-0",
            "--decode", f"{stack['decode'].url}=decode-0", "--control-plane", stack["control_plane"].address,
            "--token-file", str(stack["control_plane"].token_file), "--port", str(port)]
    example = start_example_router(argv, stack["work"] / "minimal-router.log", port)
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        body = {"model": "tiny", "prompt": stack["prompts"][1], "max_tokens": MAX_TOKENS, "temperature": 0.0, "logprobs": 1, "return_token_ids": True,
                "ignore_eos": True}
        conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        answer = json.loads(response.read())
        conn.close()
    finally:
        example.stop()
    assert response.status == 200, answer
    assert response.getheader("X-Kvpush-Transfer-State") == "TRANSFER_STATE_DONE"
    choice = answer["choices"][0]
    assert_matches(stack["reference"][1], Completion(token_ids=choice["token_ids"], logprobs=choice["logprobs"]["token_logprobs"]))
