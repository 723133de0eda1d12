# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""A request's two legs to the engines: the request's context, each leg's span and headers, the prefill leg's call and the decode leg's response."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import aiohttp
from aiohttp import web
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from kvpush.services.router.core import Endpoint
from kvpush.services.router.failures import LegFailure, failure_from_exception, status_failure
from kvpush.services.router.shard_watch import Owner
from kvpush.sse import DONE, SseDecoder
from kvpush.telemetry import ATTR_ATTEMPT, ATTR_CLIENT_REQUEST_ID, ATTR_TRANSFER_ID, FIRST_OUTPUT_EVENT, inject_traceparent

if TYPE_CHECKING:
    from kvpush.services.router.app import Router

PREFILL, DECODE = "prefill", "decode"
# The leg spans (docs/design.md, Telemetry), children of the request's span.
LEG_SPANS = {PREFILL: "router.prefill_leg", DECODE: "router.decode_leg"}
# A streamed chunk with top logprobs can pass aiohttp's 64 KiB read buffer.
READ_BUFSIZE = 4 * 1024 * 1024


def finish_span(span: Span, error: str | None = None) -> None:
    if error is not None:
        span.set_status(Status(StatusCode.ERROR, error))
    span.end()


@dataclasses.dataclass
class RequestContext:
    """One client request being routed."""

    path: str
    body: dict[str, Any]
    stream: bool
    client_request_id: str
    transfer_id: str
    span: Span
    started: float  # time.monotonic() when the request arrived
    started_ns: int  # the same instant, wall clock: P's answer says when its leg arrived, by P's wall clock
    authorization: str
    incoming_trace: dict[str, str]  # the client's trace headers
    client: web.BaseRequest | None = None  # the client's request, to notice its disconnecting
    failure_reason: str = ""  # why the request failed (core.FAILURE_REASONS), "" if it did not
    prefill_answered: float = 0.0  # time.monotonic() when the current attempt's prefill leg answered (0: not yet)
    first_output_read: float = 0.0  # time.monotonic() when the router read D's first output (0: not yet)
    broker_owner: Owner = Owner()  # push mode: the broker member that holds the current attempt
    transfer_deadline: float = 0.0  # push mode: time.monotonic() when the transfer deadline passes (set by the first attempt)
    cancelling: asyncio.Task | None = None  # push mode: the last failed attempt's CancelTransfer, run beside the request

    def left_s(self, limit_s: float) -> float:
        """Seconds left of a bound limit_s counted from the request's arrival (negative once it passed): retries share it."""
        return self.started + limit_s - time.monotonic()

    def transfer_left_s(self) -> float:
        """Push mode, once the first attempt set it: seconds left of the transfer deadline (negative once it passed)."""
        return self.transfer_deadline - time.monotonic()

    def client_gone(self) -> bool:
        """Whether the client's connection closed (aiohttp drops the request's transport then)."""
        if self.client is None:
            return False
        transport = self.client.transport
        return transport is None or transport.is_closing()

    def trace_carrier(self, span: Span) -> dict[str, str]:
        """The W3C headers naming span; the client's own when tracing is off (no span to name)."""
        return inject_traceparent(trace.set_span_in_context(span)) or dict(self.incoming_trace)

    def leg_headers(self, span: Span, request_id: str) -> dict[str, str]:
        headers = {"X-Request-Id": request_id, **self.trace_carrier(span)}
        if self.authorization:
            headers["Authorization"] = self.authorization
        return headers


def leg_span(router: Router, ctx: RequestContext, leg: str, endpoint: Endpoint, attempt: int) -> Span:
    return router.tracer.start_span(
        LEG_SPANS[leg],
        context=trace.set_span_in_context(ctx.span),
        kind=SpanKind.CLIENT,
        attributes={
            ATTR_TRANSFER_ID: ctx.transfer_id,
            ATTR_ATTEMPT: attempt,
            ATTR_CLIENT_REQUEST_ID: ctx.client_request_id,
            "kvpush.engine_id": endpoint.engine_id,
            "server.address": endpoint.url,
        },
    )


async def prefill_leg(router: Router, ctx: RequestContext, endpoint: Endpoint, body: dict[str, Any], headers: Mapping[str, str], span: Span) -> dict[str, Any]:
    """Sends the prefill leg and returns its JSON answer; raises LegFailure."""
    limit = router.config.prefill_timeout_s
    timeout = aiohttp.ClientTimeout(total=limit, sock_connect=router.config.connect_timeout_s)
    ctx.prefill_answered = 0.0
    sent = time.monotonic()
    router.prefill_pool.acquire(endpoint)
    error: str | None = "abandoned"
    try:
        try:
            async with router.session.post(endpoint.url + ctx.path, json=body, headers=dict(headers), timeout=timeout, read_bufsize=READ_BUFSIZE) as response:
                if response.status != 200:
                    raise await status_failure(PREFILL, endpoint, response)
                try:
                    answer = await response.json(content_type=None)
                except ValueError as exc:
                    raise LegFailure(PREFILL, endpoint, "protocol", f"answered with invalid JSON: {exc}") from exc
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise failure_from_exception(PREFILL, endpoint, exc, limit) from exc
        error = None
        ctx.prefill_answered = time.monotonic()
        router.metrics.prefill_leg.observe(ctx.prefill_answered - sent)
        router.metrics.dispatched(ctx.started_ns, answer)
        return answer
    except LegFailure as exc:
        error = str(exc)
        raise
    finally:
        router.prefill_pool.release(endpoint)
        finish_span(span, error)


class DecodeLeg:
    """The decode leg's HTTP response, from its request to its last chunk; close() is idempotent."""

    def __init__(self, router: Router, ctx: RequestContext, endpoint: Endpoint, body: dict[str, Any], headers: dict[str, str], span: Span):
        self.router = router
        self.ctx = ctx
        self.endpoint = endpoint
        self.body = body
        self.headers = headers
        self.span = span
        self.response: aiohttp.ClientResponse | None = None
        self.buffered: list[bytes] = []  # read before the first output: the non-streamed body, or SSE lines
        # Only peeks at the stream it passes on: an event it cannot read is the client's to judge.
        self.events = SseDecoder(skip_malformed=True)
        self._closed = False
        router.decode_pool.acquire(endpoint)

    async def open(self) -> None:
        """Sends the leg and reads up to its first output (the whole body when not streamed)."""
        config = self.router.config
        # request_timeout_s bounds the whole request: a retry's leg gets what is left of it.
        timeout = aiohttp.ClientTimeout(total=max(self.ctx.left_s(config.request_timeout_s), 0.001), sock_connect=config.connect_timeout_s)
        try:
            self.response = await self.router.session.post(
                self.endpoint.url + self.ctx.path, json=self.body, headers=self.headers, timeout=timeout, read_bufsize=READ_BUFSIZE
            )
            if self.response.status != 200:
                raise await status_failure(DECODE, self.endpoint, self.response)
            if not self.ctx.stream:
                self.buffered.append(await self.response.read())
                return
            while True:
                line = await self.response.content.readline()
                read = time.monotonic()
                if not line:
                    raise LegFailure(DECODE, self.endpoint, "protocol", "the stream ended before any output")
                self.buffered.append(line)
                for data in self.events.feed(line):
                    if data == DONE:
                        raise LegFailure(DECODE, self.endpoint, "protocol", "the stream ended before any output")
                    if isinstance(data, dict) and "error" in data:
                        error = data["error"]
                        # OpenAI's error object, or (some servers) just its message.
                        message = error.get("message", error) if isinstance(error, dict) else error
                        raise LegFailure(DECODE, self.endpoint, "engine_error", f"the engine reported: {message}")
                    if isinstance(data, dict) and data.get("choices"):
                        # Splits TTFT's "D output → client" into D's part and the router's (kvpush.report.breakdown).
                        self.span.add_event(FIRST_OUTPUT_EVENT)
                        self.ctx.first_output_read = read  # decoding it is the router's relay
                        return
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise failure_from_exception(DECODE, self.endpoint, exc, config.request_timeout_s) from exc

    async def next_chunk(self) -> bytes:
        """What the streamed answer has next, as it arrived (b"" at its end), waiting at most first_token_timeout_s."""
        assert self.response is not None
        async with asyncio.timeout(self.router.config.first_token_timeout_s):
            return await self.response.content.readany()

    def close(self, *, abort: bool, error: str | None = None) -> None:
        """Ends the leg; abort closes the connection, which makes vLLM abort the request."""
        if self._closed:
            return
        self._closed = True
        if self.response is not None:
            if abort:
                self.response.close()
            else:
                self.response.release()
        self.router.decode_pool.release(self.endpoint)
        finish_span(self.span, error)


@dataclasses.dataclass
class Opened:
    """An attempt whose decode leg produced output; prefill is the P leg still finishing (concurrent modes)."""

    decode: DecodeLeg
    prefill: asyncio.Task | None
