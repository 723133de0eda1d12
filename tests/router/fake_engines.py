# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""In-process stand-ins for vLLM's OpenAI server (aiohttp on 127.0.0.1:0) that record what the router sent them.

A fake prefill engine answers one token (and, like upstream's NixlConnector
in pull mode, kv_transfer_params naming itself); a fake decode engine
answers a fixed text, streamed as one SSE chunk per word when asked. Each
fake can be told to fail: answer an HTTP error, hang, or (decode) break off
its stream after the first chunk or stream an error event instead.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any

from aiohttp import web

DECODE_WORDS = ["alpha", "beta", "gamma", "delta"]


async def serve_app(app: web.Application) -> tuple[web.AppRunner, str]:
    """Serves app on 127.0.0.1:0; a client going away cancels its handler, as in vLLM."""
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


@dataclasses.dataclass
class Received:
    """One request a fake engine received."""

    path: str
    headers: dict[str, str]  # names lowercased
    body: dict[str, Any]
    at: float  # loop time


class FakeEngine:
    """A fake vLLM server of one role; `behaviour` is "ok", "error:<status>", "hang" or (decode, streamed) "break", "error-event" or "error-event-text".

    "error-event" streams an error event with OpenAI's error object;
    "error-event-text" one whose "error" is just the message.
    """

    def __init__(self, role: str, engine_id: str, behaviour: str = "ok", delay_s: float = 0.0, chunk_delay_s: float = 0.0,
                 keepalive_s: float | None = None):
        """keepalive_s: a request arriving on a connection idle this long is dropped unanswered and the connection closed,
        which is what vLLM's server (uvicorn) does to a request that comes as its keep-alive timer fires, made certain."""
        self.role = role
        self.engine_id = engine_id
        self.behaviour = behaviour
        self.delay_s = delay_s
        self.chunk_delay_s = chunk_delay_s  # pause after each streamed chunk
        self.keepalive_s = keepalive_s
        self.received: list[Received] = []
        self.disconnected = 0  # requests whose client went away before the answer
        self.dropped = 0  # requests dropped on a connection past keepalive_s
        self._answered_at: dict[Any, float] = {}  # connection (transport) -> loop time its last answer ended
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> FakeEngine:
        app = web.Application(middlewares=[self._keepalive] if self.keepalive_s is not None else [])
        for path in ("/v1/completions", "/v1/chat/completions"):
            app.router.add_post(path, self._complete)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        self._runner, self.url = await serve_app(app)
        return self

    async def stop(self) -> None:
        await self._runner.cleanup()

    @web.middleware
    async def _keepalive(self, request: web.Request, handler) -> web.StreamResponse:
        loop, transport = asyncio.get_running_loop(), request.transport
        answered_at = self._answered_at.get(transport)
        if answered_at is not None and loop.time() - answered_at >= self.keepalive_s:
            self.dropped += 1
            transport.close()
            raise asyncio.CancelledError  # aiohttp's handling of a request whose connection is gone
        response = await handler(request)
        self._answered_at[transport] = loop.time()  # aiohttp may still write a prepared-later answer: idle counts from about here
        return response

    async def _health(self, _request: web.Request) -> web.Response:
        return web.Response()

    async def _models(self, _request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "tiny", "object": "model"}]})

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.received.append(Received(request.path, {k.lower(): v for k, v in request.headers.items()}, body, asyncio.get_running_loop().time()))
        try:
            await asyncio.sleep(self.delay_s)
            if self.behaviour == "hang":
                await asyncio.sleep(3600)
        except asyncio.CancelledError:
            self.disconnected += 1
            raise
        if self.behaviour.startswith("error:"):
            status = int(self.behaviour.split(":")[1])
            return web.json_response({"error": {"message": f"{self.engine_id} says no", "type": "Error", "code": status}}, status=status)
        if self.role == "prefill":
            answer: dict[str, Any] = {"id": "cmpl-p", "object": "text_completion", "choices": [{"index": 0, "text": "p", "finish_reason": "length"}]}
            if "do_remote_decode" in body.get("kv_transfer_params", {}):
                answer["kv_transfer_params"] = {"do_remote_prefill": True, "remote_engine_id": self.engine_id, "remote_block_ids": [1, 2]}
            return web.json_response(answer)
        if not body.get("stream"):
            return web.json_response({"id": "cmpl-d", "object": "text_completion", "choices": [{"index": 0, "text": " ".join(DECODE_WORDS), "finish_reason": "length"}]})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        if self.behaviour.startswith("error-event"):
            message = f"{self.engine_id} failed"
            error = message if self.behaviour == "error-event-text" else {"message": message, "type": "InternalServerError", "code": 500}
            await response.write(b"data: " + json.dumps({"error": error}).encode() + b"\n\ndata: [DONE]\n\n")
            await response.write_eof()
            return response
        for index, word in enumerate(DECODE_WORDS):
            chunk = {"id": "cmpl-d", "object": "text_completion", "choices": [{"index": 0, "text": word, "finish_reason": None}]}
            await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            if self.behaviour == "break" and index == 0:
                request.transport.close()
                return response
            try:
                await asyncio.sleep(self.chunk_delay_s)
            except asyncio.CancelledError:
                self.disconnected += 1
                raise
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


def decode_stream_text() -> str:
    """What a fake decode engine streams in full, as its chunks' texts joined."""
    return "".join(DECODE_WORDS)
