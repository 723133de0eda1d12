# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""A real control plane, scripted fake engines and a push-mode router: what the transfer-failure tests drive.

The fake engines (in-process aiohttp) make the control-plane calls their
kvpush connector would, through real stubs with their own tokens: the
decode engine registers its destination and answers like vLLM once the
attempt ended (its output when DONE, else `Internal server error`); the
prefill engine reports prefill-done and its write. Each test makes the
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from aiohttp import web
from opentelemetry.sdk.trace import TracerProvider

from kvpush.dev import sample_engines as sample
from kvpush.registrar.v1 import registrar_service_pb2 as reg_pb
from kvpush.registrar.v1 import registrar_service_pb2_grpc as reg_grpc
from kvpush.rendezvous.v1 import rendezvous_service_pb2 as rv_pb
from kvpush.rendezvous.v1 import rendezvous_service_pb2_grpc as rv_grpc
from kvpush.rendezvous.v1 import transfer_pb2 as tr_pb
from kvpush.services import control_plane
from kvpush.services.common.tokens import ROUTER_IDENTITY
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


