# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""What a client of the push-mode router sees when a kvpush transfer fails, against a real control plane.

The fake engines (in-process aiohttp) make the control-plane calls their
kvpush connector would, through real stubs with their own tokens: the
decode engine registers its destination and answers like vLLM once the
attempt ended (its output when DONE, else `Internal server error`); the
prefill engine reports prefill-done and its write. Each test makes the
broker end the attempt one way (deadline, lost engine, token mismatch,
failed write, a colliding transfer id) and checks the status, reason and
message the client gets, and how soon.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import pytest
from aiohttp import web
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvpush.client import BrokerClient, ClientConfig
from kvpush.localstack.process import free_port
from kvpush.registrar.v1 import registrar_service_pb2 as reg_pb
from kvpush.registrar.v1 import registrar_service_pb2_grpc as reg_grpc
from kvpush.rendezvous.v1 import rendezvous_service_pb2 as rv_pb
from kvpush.rendezvous.v1 import rendezvous_service_pb2_grpc as rv_grpc
from kvpush.rendezvous.v1 import transfer_pb2 as tr_pb
from kvpush.services import control_plane
from kvpush.services.common import sample_engines as sample
from kvpush.services.common.config import ServerConfig
from kvpush.services.common.tokens import ROUTER_IDENTITY, IdentityTokens
from kvpush.services.router.config import RouterConfig
from kvpush.services.router.core import Endpoint
from tests.router.fake_engines import DECODE_WORDS, Received, serve_app
from tests.router.router_harness import RouterUnderTest

ENGINE_IDS = ("prefill-0", "prefill-1", "decode-0", "decode-1")
BODY = {"model": "tiny", "prompt": "hello there", "max_tokens": 4, "temperature": 0.0}
CALL_TIMEOUT_S = 5.0
# Engines hold short leases and renew them often, so a lost engine (lose()) lapses within a second.
LEASE_TTL_S = 1.0
RENEW_EVERY_S = 0.2
# vLLM's answer for a request its connector failed (FINISHED_ERROR).
VLLM_ERROR = {"error": {"message": "Internal server error", "type": "InternalServerError", "param": None, "code": 500}}
ENDED_STATES = (tr_pb.TRANSFER_STATE_DONE, tr_pb.TRANSFER_STATE_FAILED, tr_pb.TRANSFER_STATE_CANCELLED, tr_pb.TRANSFER_STATE_SUPERSEDED)


def token_of(identity: str) -> str:
    return f"router-test-token-{identity}"


# ---- the control plane and the engines' calls to it ----------------------------------------


class EngineAtBroker:
    """One engine (one rank) at the real control plane, making its connector's calls with its own token."""

    def __init__(self, channel: grpc.aio.Channel, engine_id: str):
        self.engine_id = engine_id
        self.role = sample.PREFILL if engine_id.startswith("prefill") else sample.DECODE
        self.metadata = (("authorization", f"Bearer {token_of(engine_id)}"),)
        self.registrar = reg_grpc.RegistrarServiceStub(channel)
        self.broker = rv_grpc.RendezvousServiceStub(channel)
        self._keep_alive: grpc.aio.StreamStreamCall | None = None
        self._renewing: asyncio.Task | None = None

    async def register(self) -> EngineAtBroker:
        """Registers the rank with a short lease and renews it on a KeepAlive stream until lose()."""
        leases = []
        for request in sample.engine_requests(self.engine_id, self.role, lease_ttl_s=LEASE_TTL_S):
            leases.append((await self.registrar.RegisterEngineRank(request, metadata=self.metadata, timeout=CALL_TIMEOUT_S)).lease_id)
        self._keep_alive = self.registrar.KeepAlive(metadata=self.metadata, timeout=120)
        await self._keep_alive.write(reg_pb.KeepAliveRequest(lease_ids=leases))
        await asyncio.wait_for(self._keep_alive.read(), CALL_TIMEOUT_S)
        self._renewing = asyncio.create_task(self._renew(leases))
        return self

    async def _renew(self, leases: list[str]) -> None:
        while True:
            await asyncio.sleep(RENEW_EVERY_S)
            await self._keep_alive.write(reg_pb.KeepAliveRequest(lease_ids=leases))
            await self._keep_alive.read()

    def lose(self) -> None:
        """Stops renewing (the engine died): its lease lapses and the broker fails its live attempts (*_ENGINE_LOST)."""
        if self._renewing is not None:
            self._renewing.cancel()
        self._keep_alive.cancel()

    async def close(self) -> None:
        self.lose()
        await asyncio.gather(self._renewing, return_exceptions=True)

    async def register_destination(self, params: dict, *, num_tokens: int = 40, client_request_id: str = "") -> None:
        request = sample.destination_request(
            params["transfer_id"], params["attempt"], decode_engine_id=self.engine_id, prefill_engine_id=params["prefill_engine_id"],
            num_tokens=num_tokens, timeout_s=params["timeout_ms"] / 1000, client_request_id=client_request_id or params["client_request_id"],
        )
        await self.broker.RegisterDestination(request, metadata=self.metadata, timeout=CALL_TIMEOUT_S)

    async def report_prefill_done(self, params: dict, *, num_tokens: int = 40) -> None:
        request = sample.prefill_done_request(
            params["transfer_id"], params["attempt"], prefill_engine_id=self.engine_id, decode_engine_id=params["decode_engine_id"],
            num_tokens=num_tokens, timeout_s=params["timeout_ms"] / 1000, client_request_id=params["client_request_id"],
        )
        await self.broker.ReportPrefillDone(request, metadata=self.metadata, timeout=CALL_TIMEOUT_S)

    async def get(self, transfer_id: str, attempt: int, wait_s: float | None = None) -> tr_pb.Transfer:
        request = rv_pb.GetTransferRequest(transfer_id=transfer_id, attempt=attempt)
        if wait_s is not None:
            request.wait.FromNanoseconds(int(wait_s * 1e9))
        return (await self.broker.GetTransfer(request, metadata=self.metadata, timeout=(wait_s or 0) + CALL_TIMEOUT_S)).transfer

    async def report_write(self, params: dict, outcome: int, error_message: str = "") -> None:
        """Reports this rank's write once the attempt is matched (its order exists); nothing if it ended first."""
        for _ in range(250):
            state = (await self.get(params["transfer_id"], params["attempt"])).state
            if state in (tr_pb.TRANSFER_STATE_MATCHED, tr_pb.TRANSFER_STATE_WRITING):
                break
            if state in ENDED_STATES:
                return
            await asyncio.sleep(0.02)
        request = sample.write_result_request(params["transfer_id"], params["attempt"], engine_id=self.engine_id, outcome=outcome)
        request.error_message = error_message
        await self.broker.ReportWriteResult(request, metadata=self.metadata, timeout=CALL_TIMEOUT_S)

    async def wait_for_end(self, params: dict) -> tr_pb.Transfer:
        """Waits until the broker ends the attempt, as the decode connector waits for its event."""
        while True:
            transfer = await self.get(params["transfer_id"], params["attempt"], wait_s=30.0)
            if transfer.state in ENDED_STATES:
                return transfer


class Plane:
    """A running control plane (registrar + broker, deadline runners on) and its engines' connections."""

    def __init__(self, started: control_plane.ControlPlane, channel: grpc.aio.Channel, engines: dict[str, EngineAtBroker]):
        self.started = started
        self.port = started.port
        self.channel = channel
        self.engines = engines

    async def transfer(self, transfer_id: str, attempt: int) -> tr_pb.Transfer:
        return await self.engines["decode-0"].get(transfer_id, attempt)


@pytest.fixture
async def plane():
    tokens = IdentityTokens({identity: token_of(identity) for identity in (ROUTER_IDENTITY, *ENGINE_IDS)})
    async with (
        control_plane.running(ServerConfig(listen="127.0.0.1:0"), tokens=tokens) as started,
        grpc.aio.insecure_channel(f"127.0.0.1:{started.port}") as channel,
    ):
        engines = {engine_id: await EngineAtBroker(channel, engine_id).register() for engine_id in ENGINE_IDS}
        try:
            yield Plane(started, channel, engines)
        finally:
            for engine in engines.values():
                await engine.close()


# ---- engines over HTTP ------------------------------------------------------------------------

Script = Callable[[dict], Awaitable[str]]


class ScriptedEngine:
    """A fake vLLM server whose script(kvpush params) runs per leg and says how to answer.

    "ok": the decode words (or the prefill token); "vllm-error": what vLLM
    answers for a request its connector failed (HTTP 500, or an error event
    in a stream); "hang": never answer.
    """

    def __init__(self, role: str, engine_id: str, script: Script, *, delay_s: float = 0.0):
        self.role = role
        self.engine_id = engine_id
        self.script = script
        self.delay_s = delay_s  # before an "ok" answer
        self.received: list[Received] = []
        self.disconnected = 0
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def start(self) -> ScriptedEngine:
        app = web.Application()
        app.router.add_post("/v1/completions", self._complete)
        self._runner, self.url = await serve_app(app)
        return self

    async def stop(self) -> None:
        await self._runner.cleanup()

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.received.append(Received(request.path, {k.lower(): v for k, v in request.headers.items()}, body, asyncio.get_running_loop().time()))
        try:
            answer = await self.script(body["kv_transfer_params"]["kvpush"])
            if answer == "hang":
                await asyncio.sleep(3600)
            await asyncio.sleep(self.delay_s)
        except asyncio.CancelledError:
            self.disconnected += 1
            raise
        stream = bool(body.get("stream"))
        if answer == "vllm-error" and not stream:
            return web.json_response(VLLM_ERROR, status=500)
        if self.role == "prefill":
            return web.json_response({"id": "cmpl-p", "object": "text_completion", "choices": [{"index": 0, "text": "p", "finish_reason": "length"}]})
        if not stream:
            return web.json_response({"id": "cmpl-d", "object": "text_completion", "choices": [{"index": 0, "text": " ".join(DECODE_WORDS), "finish_reason": "length"}]})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        if answer == "vllm-error":
            await response.write(b"data: " + json.dumps(VLLM_ERROR).encode() + b"\n\n")
        else:
            for word in DECODE_WORDS:
                chunk = {"id": "cmpl-d", "object": "text_completion", "choices": [{"index": 0, "text": word, "finish_reason": None}]}
                await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


def decode_like_vllm(engine: EngineAtBroker, *, after_registering: Callable[[dict], Awaitable[str | None]] | None = None) -> Script:
    """The decode connector: register, wait for the attempt's end, answer (its output when DONE, else vLLM's error).

    after_registering may return an answer of its own ("hang": the engine lost the broker and waits for its deadline).
    """

    async def script(params: dict) -> str:
        try:
            await engine.register_destination(params)
        except grpc.aio.AioRpcError:
            return "vllm-error"  # a refused registration fails the request at once
        if after_registering is not None:
            outcome = await after_registering(params)
            if outcome is not None:
                return outcome
        transfer = await engine.wait_for_end(params)
        return "ok" if transfer.state == tr_pb.TRANSFER_STATE_DONE else "vllm-error"

    return script


def prefill_like_vllm(engine: EngineAtBroker, *, write: int | None = tr_pb.WRITE_OUTCOME_WRITTEN, error_message: str = "", num_tokens: int = 40) -> Script:
    """The prefill connector: report prefill-done, answer the one token, and write (or fail to) in the background."""
    background: set[asyncio.Task] = set()

    async def write_in_background(params: dict) -> None:
        # A write report the broker refuses, or one the test's end cuts off, changes nothing.
        with contextlib.suppress(Exception):
            await engine.report_write(params, write, error_message)

    async def script(params: dict) -> str:
        with contextlib.suppress(grpc.aio.AioRpcError):  # a refused report leaves the answer as it is
            await engine.report_prefill_done(params, num_tokens=num_tokens)
            if write is not None:
                task = asyncio.create_task(write_in_background(params))
                background.add(task)
                task.add_done_callback(background.discard)
        return "ok"

    return script


async def answer(outcome: str, *_args: Any) -> str:
    return outcome


def just(outcome: str) -> Script:
    """A script that makes no control-plane call and answers outcome."""
    return lambda params: answer(outcome)


# ---- the router -------------------------------------------------------------------------------


@pytest.fixture
def spans():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


def router_under_test(port: int, prefills: list, decodes: list, provider: TracerProvider, **overrides: Any) -> RouterUnderTest:
    """A push-mode Router in front of the given engines, pointed at the control plane on port."""
    settings = {
        "prefill": tuple(Endpoint(e.url, e.engine_id) for e in prefills),
        "decode": tuple(Endpoint(e.url, e.engine_id) for e in decodes),
        "control_plane": f"127.0.0.1:{port}",
        "token": token_of(ROUTER_IDENTITY),
        "prefill_timeout_s": 10.0,
        "first_token_timeout_s": 10.0,
        "request_timeout_s": 20.0,
        "transfer_timeout_ms": 5000,
        **overrides,
    }
    return RouterUnderTest(RouterConfig(**settings), provider)


async def serve(*engines: ScriptedEngine) -> list[ScriptedEngine]:
    return [await engine.start() for engine in engines]


async def stop(*engines: ScriptedEngine) -> None:
    for engine in engines:
        await engine.stop()


def error_of(body: bytes) -> dict:
    return json.loads(body)["error"]


def key_of(engine: ScriptedEngine, index: int = 0) -> tuple[str, int]:
    params = engine.received[index].body["kv_transfer_params"]["kvpush"]
    return params["transfer_id"], params["attempt"]


async def wait_until(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        await asyncio.sleep(0.02)


# ---- what the client sees, per end reason ------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_a_failed_write_answers_502_with_the_brokers_reason(plane, spans, stream):
    prefill_at, decode_at = plane.engines["prefill-0"], plane.engines["decode-0"]
    prefill, decode = await serve(
        ScriptedEngine("prefill", "prefill-0", prefill_like_vllm(prefill_at, write=tr_pb.WRITE_OUTCOME_FAILED, error_message="NIXL_ERR_REMOTE_DISCONNECT")),
        ScriptedEngine("decode", "decode-0", decode_like_vllm(decode_at)),
    )
    try:
        async with router_under_test(plane.port, [prefill], [decode], spans[0]) as router:
            status, body, _ = await router.post("/v1/completions", {**BODY, "stream": stream}, {"X-Request-Id": "client-7"})
            metrics = await router.metrics()
    finally:
        await stop(prefill, decode)
    transfer_id, attempt = key_of(decode)
    error = error_of(body)
    assert status == 502 and error["code"] == 502 and error["type"] == "BadGatewayError"
    assert (error["reason"], error["transfer_id"], error["attempt"]) == ("WRITE_FAILED", transfer_id, 1)
    assert f"transfer {transfer_id} attempt 1 ended FAILED with WRITE_FAILED" in error["message"]
    assert "NIXL_ERR_REMOTE_DISCONNECT" in error["message"]
    assert (error["leg"], error["engine_id"]) == ("prefill", "prefill-0")
    assert len(prefill.received) == 1, "no other prefill engine: no retry"
    assert (await plane.transfer(transfer_id, attempt)).end_reason == tr_pb.END_REASON_WRITE_FAILED
    assert 'kvpush_router_failed_requests_total{reason="WRITE_FAILED"} 1.0' in metrics
    assert 'kvpush_router_failed_requests_total{reason="PREFILL_ENGINE_LOST"} 0.0' in metrics


@pytest.mark.parametrize("side", ["prefill", "decode"])
async def test_a_lost_engine_answers_503(plane, spans, side):
    prefill_at, decode_at = plane.engines["prefill-0"], plane.engines["decode-0"]

    async def lose_prefill_after_answering(params: dict) -> str:
        await prefill_at.report_prefill_done(params)
        asyncio.get_running_loop().call_later(0.1, prefill_at.lose)  # P dies once its leg answered
        return "ok"

    async def lose_decode(params: dict) -> str:
        decode_at.lose()
        return "hang"

    if side == "prefill":
        scripts = (lose_prefill_after_answering, decode_like_vllm(decode_at))
    else:
        # D loses the control plane after registering and goes on waiting (its own deadline would end it).
        scripts = (prefill_like_vllm(prefill_at, write=None), decode_like_vllm(decode_at, after_registering=lose_decode))
    prefill, decode = await serve(ScriptedEngine("prefill", "prefill-0", scripts[0]), ScriptedEngine("decode", "decode-0", scripts[1]))
    try:
        async with router_under_test(plane.port, [prefill], [decode], spans[0]) as router:
            status, body, elapsed = await router.post("/v1/completions", BODY)
    finally:
        await stop(prefill, decode)
    reason = f"{side.upper()}_ENGINE_LOST"
    error = error_of(body)
    assert status == 503 and error["type"] == "ServiceUnavailableError"
    assert (error["reason"], error["leg"], error["engine_id"], error["attempt"]) == (reason, side, f"{side}-0", 1)
    assert f"ended FAILED with {reason}: {side} engine {side}-0 lost" in error["message"] and "LEASE_EXPIRED" in error["message"]
    assert elapsed < 3.0, "answered when the broker ended the attempt, long before the 5 s transfer deadline"


async def test_a_lost_decode_engine_is_retried_on_another_and_answers_only_if_retries_run_out(plane, spans):
    prefill_at, lost_at, good_at = plane.engines["prefill-0"], plane.engines["decode-0"], plane.engines["decode-1"]

    async def lose(params: dict) -> str:
        lost_at.lose()
        return "hang"  # lost the broker: it would wait for its own deadline

    write_to_live_decode = prefill_like_vllm(prefill_at)

    async def prefill_script(params: dict) -> str:
        if params["decode_engine_id"] == "decode-0":
            # The WRITE to a dying engine never completes: P holds it until the broker revokes it.
            return await prefill_like_vllm(prefill_at, write=None)(params)
        return await write_to_live_decode(params)

    prefill, lost, good = await serve(
        ScriptedEngine("prefill", "prefill-0", prefill_script),
        ScriptedEngine("decode", "decode-0", decode_like_vllm(lost_at, after_registering=lose)),
        ScriptedEngine("decode", "decode-1", decode_like_vllm(good_at)),
    )
    try:
        async with router_under_test(plane.port, [prefill], [lost, good], spans[0]) as router:
            status, body, _ = await router.post("/v1/completions", BODY)
    finally:
        await stop(prefill, lost, good)
    assert status == 200 and json.loads(body)["choices"][0]["text"] == " ".join(DECODE_WORDS)
    transfer_id, _ = key_of(lost)
    assert key_of(good) == (transfer_id, 2)
    assert (await plane.transfer(transfer_id, 1)).end_reason == tr_pb.END_REASON_DECODE_ENGINE_LOST
    assert (await plane.transfer(transfer_id, 2)).state == tr_pb.TRANSFER_STATE_DONE
    await wait_until(lambda: lost.disconnected == 1)
    assert lost.disconnected == 1, "the failed attempt's decode leg was closed"


@pytest.mark.parametrize("reason", ["REGISTRATION_DEADLINE_EXCEEDED", "PREFILL_DEADLINE_EXCEEDED"])
async def test_a_broker_deadline_answers_504(plane, spans, reason):
    prefill_at, decode_at = plane.engines["prefill-0"], plane.engines["decode-0"]
    if reason == "REGISTRATION_DEADLINE_EXCEEDED":
        # D registered; P served the request without reporting it (as when it refuses the transfer).
        scripts = (just("ok"), decode_like_vllm(decode_at))
    else:
        # P reported; D never got to allocate blocks and register (queued), nor answers.
        scripts = (prefill_like_vllm(prefill_at, write=None), just("hang"))
    prefill, decode = await serve(ScriptedEngine("prefill", "prefill-0", scripts[0]), ScriptedEngine("decode", "decode-0", scripts[1]))
    try:
        async with router_under_test(plane.port, [prefill], [decode], spans[0], transfer_timeout_ms=1000) as router:
            status, body, elapsed = await router.post("/v1/completions", BODY)
    finally:
        await stop(prefill, decode)
    error = error_of(body)
    assert status == 504 and error["type"] == "GatewayTimeoutError"
    assert error["reason"] == reason and f"ended FAILED with {reason}" in error["message"] and "deadline passed" in error["message"]
    assert 1.0 <= elapsed < 1.5, "the broker's deadline, before the router's own (1 s + 0.5 s slack)"
    if reason == "PREFILL_DEADLINE_EXCEEDED":
        await wait_until(lambda: decode.disconnected == 1)
        assert decode.disconnected == 1, "the silent decode leg was closed"


async def test_a_token_count_mismatch_answers_400(plane, spans):
    prefill_at, decode_at = plane.engines["prefill-0"], plane.engines["decode-0"]
    prefill, decode = await serve(
        ScriptedEngine("prefill", "prefill-0", prefill_like_vllm(prefill_at, num_tokens=30, write=None)),
        ScriptedEngine("decode", "decode-0", decode_like_vllm(decode_at)),
    )
    try:
        async with router_under_test(plane.port, [prefill], [decode], spans[0]) as router:
            status, body, _ = await router.post("/v1/completions", BODY)
    finally:
        await stop(prefill, decode)
    error = error_of(body)
    assert status == 400 and error["type"] == "BadRequestError"
    assert error["reason"] == "TOKEN_COUNT_MISMATCH"
    assert "ended FAILED with TOKEN_COUNT_MISMATCH: the prefill side computed 30 tokens; the destination needs 40" in error["message"]
    assert len(prefill.received) == len(decode.received) == 1, "the request's own fault: no retry"


async def test_a_colliding_transfer_id_answers_409_and_leaves_the_other_attempt_alone(plane, spans):
    decode_at, other_at = plane.engines["decode-0"], plane.engines["decode-1"]

    async def other_router_first(params: dict) -> str:
        # Another router's request took the same transfer key with its own decode engine a moment earlier.
        await other_at.register_destination(params, client_request_id="someone-else")
        return await decode_like_vllm(decode_at)(params)

    prefill, decode = await serve(ScriptedEngine("prefill", "prefill-0", just("ok")), ScriptedEngine("decode", "decode-0", other_router_first))
    try:
        async with router_under_test(plane.port, [prefill], [decode], spans[0]) as router:
            status, body, _ = await router.post("/v1/completions", BODY, {"X-Request-Id": "mine"})
    finally:
        await stop(prefill, decode)
    transfer_id, attempt = key_of(decode)
    error = error_of(body)
    assert status == 409 and error["type"] == "ConflictError"
    assert (error["reason"], error["transfer_id"], error["attempt"]) == ("TRANSFER_CONFLICT", transfer_id, 1)
    assert "'someone-else'" in error["message"] and "another router uses the same transfer id" in error["message"]
    assert len(decode.received) == 1, "retrying would supersede the other request's attempt"
    other = await plane.transfer(transfer_id, attempt)
    assert (other.state, other.client_request_id) == (tr_pb.TRANSFER_STATE_WAITING_FOR_PREFILL, "someone-else"), "not cancelled by this router"


async def test_an_unreachable_control_plane_answers_503(spans):
    prefill, decode = await serve(ScriptedEngine("prefill", "prefill-0", just("ok")), ScriptedEngine("decode", "decode-0", just("vllm-error")))
    try:
        async with router_under_test(free_port(), [prefill], [decode], spans[0], cancel_timeout_s=0.5) as router:
            status, body, elapsed = await router.post("/v1/completions", BODY)
    finally:
        await stop(prefill, decode)
    error = error_of(body)
    assert status == 503 and error["reason"] == "CONTROL_PLANE_UNREACHABLE"
    assert "HTTP 500: Internal server error" in error["message"] and "control plane could not say why" in error["message"]
    assert len(decode.received) == 1, "not an engine's fault: no retry"
    assert elapsed < 3.0


async def test_an_overlong_request_id_is_refused_with_400_before_any_leg(plane, spans):
    prefill, decode = await serve(ScriptedEngine("prefill", "prefill-0", just("ok")), ScriptedEngine("decode", "decode-0", just("ok")))
    try:
        async with router_under_test(plane.port, [prefill], [decode], spans[0]) as router:
            status, body, _ = await router.post("/v1/completions", BODY, {"X-Request-Id": "r" * 300})
            metrics = await router.metrics()
    finally:
        await stop(prefill, decode)
    error = error_of(body)
    assert status == 400 and error["reason"] == "INVALID_REQUEST" and "X-Request-Id" in error["message"]
    assert not prefill.received and not decode.received
    assert 'kvpush_router_failed_requests_total{reason="INVALID_REQUEST"} 1.0' in metrics


# ---- answering promptly ------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_the_transfer_deadline_guard_answers_504_and_closes_the_decode_leg(plane, spans, stream):
    prefill, decode = await serve(ScriptedEngine("prefill", "prefill-0", just("ok")), ScriptedEngine("decode", "decode-0", just("hang")))
    try:
        async with router_under_test(plane.port, [prefill], [decode], spans[0], transfer_timeout_ms=1000, max_attempts=1) as router:
            status, body, elapsed = await router.post("/v1/completions", {**BODY, "stream": stream})
            await wait_until(lambda: decode.disconnected == 1)
    finally:
        await stop(prefill, decode)
    transfer_id, attempt = key_of(decode)
    error = error_of(body)
    assert status == 504 and error["reason"] == "ROUTER_DEADLINE_EXCEEDED"
    assert "no first token before the transfer deadline (1000 ms + 0.5 s)" in error["message"]
    assert 1.5 <= elapsed < 1.0 + 0.5 + 0.5
    assert decode.disconnected == 1
    transfer = await plane.transfer(transfer_id, attempt)
    assert (transfer.state, transfer.end_reason) == (tr_pb.TRANSFER_STATE_CANCELLED, tr_pb.END_REASON_CANCELLED_BY_ROUTER)


async def test_an_attempt_failing_at_the_broker_is_answered_while_the_decode_engine_hangs(plane, spans):
    prefill_at, decode_at = plane.engines["prefill-0"], plane.engines["decode-0"]

    async def register_and_hang(params: dict) -> str:
        await decode_at.register_destination(params)
        return "hang"  # e.g. waiting for a fence that a silent producer rank holds up

    async def fail_the_write_later(params: dict) -> str:
        await prefill_at.report_prefill_done(params)

        async def fail() -> None:
            await asyncio.sleep(0.5)
            await prefill_at.report_write(params, tr_pb.WRITE_OUTCOME_FAILED, "NIXL_ERR_BACKEND")

        asyncio.get_running_loop().create_task(fail())
        return "ok"

    prefill, decode = await serve(ScriptedEngine("prefill", "prefill-0", fail_the_write_later), ScriptedEngine("decode", "decode-0", register_and_hang))
    provider, exporter = spans
    try:
        async with router_under_test(plane.port, [prefill], [decode], provider, transfer_timeout_ms=10_000) as router:
            status, body, elapsed = await router.post("/v1/completions", {**BODY, "stream": True})
            await wait_until(lambda: decode.disconnected == 1)
    finally:
        await stop(prefill, decode)
    error = error_of(body)
    assert status == 502 and error["reason"] == "WRITE_FAILED" and "NIXL_ERR_BACKEND" in error["message"]
    assert 0.5 <= elapsed < 1.5, "answered when the write failed, not at the 10 s deadline"
    assert decode.disconnected == 1, "the decode leg was closed, not waited for"
    polls = [s for s in exporter.get_finished_spans() if s.name == "kvpush.rpc/GetTransfer"]
    assert polls, "the router long-polled the broker"


async def test_a_done_transfer_keeps_waiting_for_a_long_answer_past_the_deadline(plane, spans):
    prefill_at, decode_at = plane.engines["prefill-0"], plane.engines["decode-0"]
    prefill, decode = await serve(
        ScriptedEngine("prefill", "prefill-0", prefill_like_vllm(prefill_at)),
        ScriptedEngine("decode", "decode-0", decode_like_vllm(decode_at), delay_s=1.5),  # a long non-streamed generation
    )
    try:
        async with router_under_test(plane.port, [prefill], [decode], spans[0], transfer_timeout_ms=500) as router:
            status, body, elapsed = await router.post("/v1/completions", BODY)
    finally:
        await stop(prefill, decode)
    assert status == 200 and json.loads(body)["choices"][0]["text"] == " ".join(DECODE_WORDS)
    assert elapsed >= 1.5 and decode.disconnected == 0


async def test_a_successful_streamed_request_makes_no_get_transfer_call(plane, spans):
    provider, exporter = spans
    prefill_at, decode_at = plane.engines["prefill-0"], plane.engines["decode-0"]
    prefill, decode = await serve(
        ScriptedEngine("prefill", "prefill-0", prefill_like_vllm(prefill_at)), ScriptedEngine("decode", "decode-0", decode_like_vllm(decode_at))
    )
    try:
        async with router_under_test(plane.port, [prefill], [decode], provider) as router:
            status, body, _ = await router.post("/v1/completions", {**BODY, "stream": True})
    finally:
        await stop(prefill, decode)
    assert status == 200 and b"data: [DONE]" in body and b'"error"' not in body
    assert not [s.name for s in exporter.get_finished_spans() if s.name.startswith("kvpush.rpc/")]


async def test_get_transfer_long_polls_within_a_deadline_beyond_its_wait(plane):
    params = {"transfer_id": "xfer-poll", "attempt": 1, "prefill_engine_id": "prefill-0", "timeout_ms": 30_000, "client_request_id": "r"}
    await plane.engines["decode-0"].register_destination(params)
    config = ClientConfig(target=f"127.0.0.1:{plane.port}", token=token_of(ROUTER_IDENTITY), default_timeout_s=0.2)
    async with BrokerClient(config) as broker:
        request = rv_pb.GetTransferRequest(transfer_id="xfer-poll", attempt=1)
        t0 = time.monotonic()
        live = (await broker.get_transfer(request, wait_s=0.5)).transfer  # the call's deadline is 0.5 + 0.2 s
        waited = time.monotonic() - t0
        assert live.state == tr_pb.TRANSFER_STATE_WAITING_FOR_PREFILL and 0.45 <= waited < 0.7
        assert not request.HasField("wait"), "the caller's request is left as it was"
        cancel = rv_pb.CancelTransferRequest(key=tr_pb.TransferKey(transfer_id="xfer-poll", attempt=1), detail="enough")
        asyncio.get_running_loop().call_later(0.2, lambda: asyncio.ensure_future(broker.cancel_transfer(cancel)))
        t0 = time.monotonic()
        ended = (await broker.get_transfer(request, wait_s=5.0)).transfer
        assert ended.state == tr_pb.TRANSFER_STATE_CANCELLED and time.monotonic() - t0 < 1.0, "answered when the attempt ended"
