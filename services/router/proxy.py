# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""The router's HTTP side (aiohttp): both legs of each request, W3C trace context and bounded failure handling.

Every wait is bounded: the prefill leg by prefill_timeout_s, the decode leg
by first_token_timeout_s until its first output (and between two streamed
chunks) and by request_timeout_s in all. A leg that fails before any output
reached the client ends its attempt: the transfer attempt is cancelled at
the broker (push mode), the other leg is abandoned (closing its connection
makes vLLM abort it) and, when the fault was an engine's and another engine
is left to try, both legs go out again as attempt + 1. Once output has
reached the client nothing is retried: a streamed answer ends with an
OpenAI-style error event, as vLLM ends its own failed streams.

Push mode asks the broker why a kvpush attempt failed (vLLM only tells
the decode leg "Internal server error"): when the decode leg fails, when
it has no output by the transfer deadline plus slack, and, with a long
poll, once the prefill leg has answered and the decode leg stays silent.
The client gets the broker's end reason with a fitting status
(core.explain_attempt) without waiting for the decode engine, which
fails its request only once the attempt is fenced.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import Mapping
from typing import Any

import aiohttp
from aiohttp import web
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvpush import errors
from kvpush.client import BrokerClient, ClientConfig
from kvpush.rendezvous.v1 import rendezvous_service_pb2 as rv_pb
from kvpush.services.router.config import RouterConfig
from kvpush.services.router.core import (
    CHAT_COMPLETIONS_PATH,
    CLIENT_GONE,
    COMPLETIONS_PATH,
    CONTROL_PLANE_UNREACHABLE,
    ENGINE_REJECTED,
    INVALID_REQUEST,
    LEG_FAILED,
    LEG_TIMEOUT,
    NO_ENGINE,
    OUTPUT_BROKE_OFF,
    PULL_PREFILL_PARAMS,
    ROUTER_DEADLINE_EXCEEDED,
    TRANSFER_CONFLICT,
    AttemptRecord,
    BadRequest,
    Endpoint,
    EnginePool,
    Verdict,
    check_client_request_id,
    check_routable,
    deadline_side,
    decode_body,
    explain_attempt,
    kvpush_params,
    prefill_body,
    upstream_push_decode_params,
    upstream_push_prefill_params,
)
from kvpush.services.router.metrics import RouterMetrics
from kvpush.sse import DONE, SseDecoder
from kvpush.telemetry import ATTR_ATTEMPT, ATTR_CLIENT_REQUEST_ID, ATTR_TRANSFER_ID, extract_context, inject_traceparent

logger = logging.getLogger(__name__)

TRACER_NAME = "kvpush.router"
PREFILL, DECODE = "prefill", "decode"
# The router's spans (docs/design.md, Telemetry): one per client request, one per leg.
REQUEST_SPAN = "router.request"
LEG_SPANS = {PREFILL: "router.prefill_leg", DECODE: "router.decode_leg"}
TRACE_HEADERS = ("traceparent", "tracestate", "baggage")
# A streamed chunk with top logprobs can pass aiohttp's 64 KiB read buffer.
READ_BUFSIZE = 4 * 1024 * 1024
MAX_BODY_BYTES = 64 * 1024 * 1024
ERROR_TYPES = {400: "BadRequestError", 409: "ConflictError", 502: "BadGatewayError", 503: "ServiceUnavailableError", 504: "GatewayTimeoutError"}
# nginx's status for a request whose client closed the connection first (no one reads it: metrics only).
CLIENT_CLOSED_STATUS = 499
# How often a push-mode attempt waiting for the decode leg's first output
# checks that its client is still connected (aiohttp does not cancel
# handlers by default, so nothing else would notice before the answer).
CLIENT_CHECK_INTERVAL_S = 0.25
# The longest single GetTransfer long poll (the broker honours up to 600 s);
# a longer wait polls again.
MAX_POLL_WAIT_S = 60.0


def error_body(status: int, message: str, **details: Any) -> dict[str, Any]:
    """An OpenAI-style error object; details (leg, engine_id) say which part failed."""
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "APIError"), "param": None, "code": status, **details}}


def error_response(status: int, message: str, **details: Any) -> web.Response:
    return web.json_response(error_body(status, message, **details), status=status)


class LegFailure(Exception):
    """A leg that did not deliver: which leg, which engine, the cause, and what the client gets.

    retryable: another engine might succeed (the engine or the path to it
    failed, not the client's request). engine_body: a 4xx answer of the
    engine, passed to the client as is.
    """

    # cancel_attempt: whether the attempt is ours to cancel at the broker.
    cancel_attempt = True

    def __init__(
        self, leg: str, endpoint: Endpoint, cause: str, message: str, *, status: int = 502, retryable: bool = True, engine_body: bytes | None = None
    ):
        super().__init__(f"{leg} leg to {endpoint}: {message}")
        self.leg = leg
        self.endpoint = endpoint
        self.cause = cause
        self.status = status
        self.retryable = retryable
        self.engine_body = engine_body
        self.attempt = 0  # set by the dispatch loop

    @property
    def reason(self) -> str:
        """The failure's reason (core.FAILURE_REASONS): its body's "reason" and its metrics label."""
        if self.cause == "rejected":
            return ENGINE_REJECTED
        return LEG_TIMEOUT if self.cause == "timeout" else LEG_FAILED

    def response(self, transfer_id: str) -> web.Response:
        if self.engine_body is not None and 400 <= self.status < 500:
            # The request itself was at fault: the engine's own answer says best why.
            return web.Response(status=self.status, body=self.engine_body, content_type="application/json")
        details: dict[str, Any] = {"reason": self.reason, "leg": self.leg, "engine_id": self.endpoint.engine_id, "transfer_id": transfer_id}
        if self.attempt:
            details["attempt"] = self.attempt
        return error_response(self.status, str(self), **details)


class TransferFailure(LegFailure):
    """A push-mode attempt that failed for a reason the broker (or the router's transfer deadline) gives.

    leg and endpoint name the engine a retry avoids (the side the reason
    blames), or the decode leg when none is blamed. The message is the
    verdict's, followed by what the router saw of the legs.
    """

    def __init__(self, verdict: Verdict, leg: str, endpoint: Endpoint, seen: str = ""):
        LegFailure.__init__(self, leg, endpoint, "transfer", verdict.message, status=verdict.status, retryable=verdict.retry_side is not None)
        self.args = (verdict.message + (f" ({seen})" if seen else ""),)
        self.verdict = verdict
        # A record that is another request's is never ours to cancel.
        self.cancel_attempt = verdict.reason != TRANSFER_CONFLICT

    @property
    def reason(self) -> str:
        return self.verdict.reason


class ClientGone(Exception):
    """The client disconnected before its answer."""


def _failure_from_exception(leg: str, endpoint: Endpoint, exc: BaseException, limit_s: float) -> LegFailure:
    if isinstance(exc, TimeoutError):  # aiohttp's timeouts subclass it
        return LegFailure(leg, endpoint, "timeout", f"no answer within {limit_s:g} s", status=504)
    if isinstance(exc, aiohttp.ClientConnectorError):
        return LegFailure(leg, endpoint, "connect", f"cannot connect: {exc.os_error.strerror or exc.os_error}")
    return LegFailure(leg, endpoint, "connection", f"connection failed: {type(exc).__name__}: {exc}")


async def _status_failure(leg: str, endpoint: Endpoint, response: aiohttp.ClientResponse) -> LegFailure:
    body = await response.read()
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = body[:500].decode(errors="replace")
    if 400 <= response.status < 500:
        return LegFailure(leg, endpoint, "rejected", f"HTTP {response.status}: {message}", status=response.status, retryable=False, engine_body=body)
    return LegFailure(leg, endpoint, "engine_error", f"HTTP {response.status}: {message}")


def _finish_span(span: Span, error: str | None = None) -> None:
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
    authorization: str
    incoming_trace: dict[str, str]  # the client's trace headers
    client: web.BaseRequest | None = None  # the client's request, to notice its disconnecting
    failure_reason: str = ""  # why the request failed (core.FAILURE_REASONS), "" if it did not
    prefill_answered: float = 0.0  # time.monotonic() when the current attempt's prefill leg answered (0: not yet)

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
        timeout = aiohttp.ClientTimeout(total=config.request_timeout_s, sock_connect=config.connect_timeout_s)
        try:
            self.response = await self.router.session.post(
                self.endpoint.url + self.ctx.path, json=self.body, headers=self.headers, timeout=timeout, read_bufsize=READ_BUFSIZE
            )
            if self.response.status != 200:
                raise await _status_failure(DECODE, self.endpoint, self.response)
            if not self.ctx.stream:
                self.buffered.append(await self.response.read())
                return
            while True:
                line = await self.response.content.readline()
                if not line:
                    raise LegFailure(DECODE, self.endpoint, "protocol", "the stream ended before any output")
                self.buffered.append(line)
                for data in self.events.feed(line):
                    if data == DONE:
                        raise LegFailure(DECODE, self.endpoint, "protocol", "the stream ended before any output")
                    if isinstance(data, dict) and "error" in data:
                        raise LegFailure(DECODE, self.endpoint, "engine_error", f"the engine reported: {data['error'].get('message', data['error'])}")
                    if isinstance(data, dict) and data.get("choices"):
                        return
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise _failure_from_exception(DECODE, self.endpoint, exc, config.request_timeout_s) from exc

    async def next_line(self) -> bytes:
        """The next line of a streamed answer (b"" at its end), waiting at most first_token_timeout_s."""
        assert self.response is not None
        return await asyncio.wait_for(self.response.content.readline(), self.router.config.first_token_timeout_s)

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
        _finish_span(self.span, error)


@dataclasses.dataclass
class Opened:
    """An attempt whose decode leg produced output; prefill is the P leg still finishing (concurrent modes)."""

    decode: DecodeLeg
    prefill: asyncio.Task | None


class Router:
    """Routes OpenAI requests over a prefill and a decode pool."""

    def __init__(self, config: RouterConfig, *, tracer_provider: trace.TracerProvider | None = None):
        self.config = config
        self.prefill_pool = EnginePool(PREFILL, config.prefill, config.policy)
        self.decode_pool = EnginePool(DECODE, config.decode, config.policy)
        self.metrics = RouterMetrics((self.prefill_pool, self.decode_pool))
        self._tracer_provider = tracer_provider
        self.tracer = trace.get_tracer(TRACER_NAME, tracer_provider=tracer_provider)
        self.session: aiohttp.ClientSession | None = None
        self.broker: BrokerClient | None = None

    # ---- lifecycle ----------------------------------------------------------------------

    async def start(self, _app: web.Application | None = None) -> None:
        # No pool limit: the engines' own queues are the backpressure.
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), raise_for_status=False)
        if self.config.mode == "push":
            client_config = ClientConfig(
                target=self.config.control_plane,
                token=self.config.resolve_token(),
                ca_cert_path=self.config.tls_ca,
                client_cert_path=self.config.tls_cert,
                client_key_path=self.config.tls_key,
                default_timeout_s=self.config.cancel_timeout_s,
            )
            self.broker = BrokerClient(client_config, tracer_provider=self._tracer_provider)

    async def close(self, _app: web.Application | None = None) -> None:
        if self.session is not None:
            await self.session.close()
        if self.broker is not None:
            await self.broker.close()

    def build_app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        app.router.add_post(COMPLETIONS_PATH, self.serve)
        app.router.add_post(CHAT_COMPLETIONS_PATH, self.serve)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.prometheus)
        app.on_startup.append(self.start)
        app.on_cleanup.append(self.close)
        return app

    # ---- small endpoints ----------------------------------------------------------------

    async def _probe(self, endpoint: Endpoint) -> bool:
        try:
            async with self.session.get(endpoint.url + "/health", timeout=aiohttp.ClientTimeout(total=self.config.health_timeout_s)) as response:
                return response.status == 200
        except (TimeoutError, aiohttp.ClientError):
            return False

    async def health(self, _request: web.Request) -> web.Response:
        """200 when each pool has a healthy engine, else 503; the body lists every engine."""
        pools = (self.prefill_pool, self.decode_pool)
        endpoints = [(pool, e) for pool in pools for e in pool.endpoints]
        healthy = await asyncio.gather(*(self._probe(e) for _, e in endpoints))
        report: dict[str, Any] = {"mode": self.config.mode, "policy": self.config.policy}
        for pool in pools:
            report[pool.role] = [
                {"url": e.url, "engine_id": e.engine_id, "healthy": ok, "in_flight": pool.in_flight(e)} for (p, e), ok in zip(endpoints, healthy) if p is pool
            ]
        ready = all(any(entry["healthy"] for entry in report[pool.role]) for pool in pools)
        report["status"] = "ok" if ready else "unavailable"
        return web.json_response(report, status=200 if ready else 503)

    async def models(self, _request: web.Request) -> web.Response:
        """The first answering decode engine's model list (P and D serve the same model)."""
        timeout = aiohttp.ClientTimeout(total=self.config.health_timeout_s)
        for endpoint in self.decode_pool.endpoints:
            try:
                async with self.session.get(endpoint.url + "/v1/models", timeout=timeout) as response:
                    if response.status == 200:
                        return web.Response(body=await response.read(), content_type="application/json")
            except (TimeoutError, aiohttp.ClientError):
                continue
        return error_response(503, "no decode engine answered /v1/models")

    async def prometheus(self, _request: web.Request) -> web.Response:
        response = web.Response(body=generate_latest(self.metrics.registry))
        response.content_type = CONTENT_TYPE_LATEST.split(";")[0]
        return response

    # ---- completions --------------------------------------------------------------------

    async def serve(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/completions and /v1/chat/completions."""
        started = time.monotonic()
        carrier = {key: request.headers[key] for key in TRACE_HEADERS if key in request.headers}
        client_request_id = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        span = self.tracer.start_span(
            REQUEST_SPAN,
            context=extract_context(carrier),
            kind=SpanKind.SERVER,
            attributes={"http.request.method": "POST", "http.route": request.path, ATTR_CLIENT_REQUEST_ID: client_request_id, "kvpush.mode": self.config.mode},
        )
        status = 500
        failure_reason = ""
        try:
            with trace.use_span(span, end_on_exit=False):
                try:
                    body = check_routable(await request.json())
                    if self.config.mode == "push":
                        check_client_request_id(client_request_id)
                except (ValueError, BadRequest) as exc:
                    response = error_response(400, f"invalid request: {exc}", reason=INVALID_REQUEST)
                    failure_reason = INVALID_REQUEST
                else:
                    ctx = RequestContext(
                        path=request.path,
                        body=body,
                        stream=bool(body.get("stream")),
                        client_request_id=client_request_id,
                        transfer_id="xfer-" + uuid.uuid4().hex,
                        span=span,
                        started=started,
                        authorization=request.headers.get("Authorization", ""),
                        incoming_trace=carrier,
                        client=request,
                    )
                    span.set_attribute(ATTR_TRANSFER_ID, ctx.transfer_id)
                    span.set_attribute("kvpush.stream", ctx.stream)
                    try:
                        response = await self._dispatch(request, ctx)
                    finally:
                        failure_reason = ctx.failure_reason
                status = response.status
                return response
        finally:
            self.metrics.requests.labels(request.path, str(status)).inc()
            if failure_reason:
                self.metrics.failed(failure_reason)
                span.set_attribute("kvpush.failure_reason", failure_reason)
            span.set_attribute("http.response.status_code", status)
            if status >= 400 and span.is_recording():
                span.set_status(Status(StatusCode.ERROR, f"HTTP {status}"))
            span.end()

    async def _dispatch(self, request: web.Request, ctx: RequestContext) -> web.StreamResponse:
        failed_prefill: set[Endpoint] = set()
        failed_decode: set[Endpoint] = set()
        failure: LegFailure | None = None
        p_endpoint = d_endpoint = None
        for attempt in range(1, self.config.max_attempts + 1):
            p_endpoint = self.prefill_pool.pick(failed_prefill)
            if d_endpoint is None or d_endpoint in failed_decode:
                d_endpoint = self.decode_pool.pick(failed_decode)
            if p_endpoint is None or d_endpoint is None:
                break
            if attempt > 1:
                self.metrics.retries.inc()
                ctx.span.add_event("retry", {ATTR_ATTEMPT: attempt, "kvpush.prefill_engine_id": p_endpoint.engine_id, "kvpush.decode_engine_id": d_endpoint.engine_id})
            ctx.span.set_attributes({ATTR_ATTEMPT: attempt, "kvpush.prefill_engine_id": p_endpoint.engine_id, "kvpush.decode_engine_id": d_endpoint.engine_id})
            try:
                if self.config.mode == "pull":
                    opened = await self._attempt_sequential(ctx, attempt, p_endpoint, d_endpoint)
                else:
                    opened = await self._attempt_concurrent(ctx, attempt, p_endpoint, d_endpoint)
            except ClientGone:
                logger.info("request %s: the client went away before any output", ctx.client_request_id)
                ctx.failure_reason = CLIENT_GONE
                return web.Response(status=CLIENT_CLOSED_STATUS)
            except LegFailure as exc:
                failure = exc
                exc.attempt = attempt
                self.metrics.leg_failures.labels(exc.leg, exc.cause).inc()
                event = {"kvpush.leg": exc.leg, "kvpush.cause": exc.cause, "kvpush.reason": exc.reason, ATTR_ATTEMPT: attempt, "message": str(exc)}
                ctx.span.add_event("leg_failed", event)
                logger.warning("request %s attempt %d: %s", ctx.client_request_id, attempt, exc)
                if not exc.retryable:
                    break
                (failed_prefill if exc.leg == PREFILL else failed_decode).add(exc.endpoint)
                continue
            return await self._respond(request, ctx, opened)
        if failure is not None:
            ctx.failure_reason = failure.reason
            return failure.response(ctx.transfer_id)
        role = "prefill" if p_endpoint is None else "decode"
        ctx.failure_reason = NO_ENGINE
        return error_response(503, f"no {role} engine available", leg=role, reason=NO_ENGINE)

    def _leg_span(self, ctx: RequestContext, leg: str, endpoint: Endpoint, attempt: int) -> Span:
        return self.tracer.start_span(
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

    async def _prefill_leg(self, ctx: RequestContext, endpoint: Endpoint, body: dict[str, Any], headers: Mapping[str, str], span: Span) -> dict[str, Any]:
        """Sends the prefill leg and returns its JSON answer; raises LegFailure."""
        limit = self.config.prefill_timeout_s
        timeout = aiohttp.ClientTimeout(total=limit, sock_connect=self.config.connect_timeout_s)
        ctx.prefill_answered = 0.0
        sent = time.monotonic()
        self.prefill_pool.acquire(endpoint)
        error: str | None = "abandoned"
        try:
            try:
                async with self.session.post(endpoint.url + ctx.path, json=body, headers=dict(headers), timeout=timeout, read_bufsize=READ_BUFSIZE) as response:
                    if response.status != 200:
                        raise await _status_failure(PREFILL, endpoint, response)
                    try:
                        answer = await response.json(content_type=None)
                    except ValueError as exc:
                        raise LegFailure(PREFILL, endpoint, "protocol", f"answered with invalid JSON: {exc}") from exc
            except (TimeoutError, aiohttp.ClientError) as exc:
                raise _failure_from_exception(PREFILL, endpoint, exc, limit) from exc
            error = None
            ctx.prefill_answered = time.monotonic()
            self.metrics.prefill_leg.observe(ctx.prefill_answered - sent)
            return answer
        except LegFailure as exc:
            error = str(exc)
            raise
        finally:
            self.prefill_pool.release(endpoint)
            _finish_span(span, error)

    async def _attempt_concurrent(self, ctx: RequestContext, attempt: int, p_endpoint: Endpoint, d_endpoint: Endpoint) -> Opened:
        """Push modes: both legs at once; returns once the decode leg produced output."""
        config = self.config
        p_span = self._leg_span(ctx, PREFILL, p_endpoint, attempt)
        d_span = self._leg_span(ctx, DECODE, d_endpoint, attempt)
        if config.mode == "push":
            common = {"client_request_id": ctx.client_request_id, "timeout_ms": config.transfer_timeout_ms}
            p_params = kvpush_params(PREFILL, ctx.transfer_id, attempt, d_endpoint.engine_id, traceparent=ctx.trace_carrier(p_span).get("traceparent", ""), **common)
            d_params = kvpush_params(DECODE, ctx.transfer_id, attempt, p_endpoint.engine_id, traceparent=ctx.trace_carrier(d_span).get("traceparent", ""), **common)
            p_headers = ctx.leg_headers(p_span, ctx.client_request_id)
            d_headers = ctx.leg_headers(d_span, ctx.client_request_id)
        else:
            # Upstream NixlPushConnector matches the legs on X-Request-Id: a fresh one per attempt.
            request_id = uuid.uuid4().hex
            p_params = upstream_push_prefill_params(ctx.transfer_id)
            d_params = upstream_push_decode_params(
                p_endpoint.engine_id, config.prefill_kv_host, config.prefill_side_channel_port, config.prefill_tp_size, config.prefill_pp_size,
                request_id, ctx.transfer_id,
            )
            p_headers = ctx.leg_headers(p_span, request_id)
            d_headers = ctx.leg_headers(d_span, request_id)
        p_task = asyncio.create_task(self._prefill_leg(ctx, p_endpoint, prefill_body(ctx.body, ctx.path, p_params), p_headers, p_span))
        decode = DecodeLeg(self, ctx, d_endpoint, decode_body(ctx.body, d_params), d_headers, d_span)
        d_task = asyncio.create_task(decode.open())
        try:
            if config.mode == "push":
                await self._first_output_push(ctx, attempt, p_task, d_task, p_endpoint, d_endpoint)
            else:
                await self._first_output(ctx, p_task, d_task, p_endpoint, d_endpoint)
        except BaseException as exc:
            for task in (p_task, d_task):
                task.cancel()
            # Both tasks end at once when cancelled; their own failures were already handled here.
            await asyncio.gather(p_task, d_task, return_exceptions=True)
            error = "client went away" if isinstance(exc, ClientGone) else str(exc) or type(exc).__name__
            decode.close(abort=True, error=error)
            if config.mode == "push" and getattr(exc, "cancel_attempt", True):
                await self._cancel_transfer(ctx.transfer_id, attempt, error)
            raise
        return Opened(decode, p_task)

    async def _first_output(self, ctx: RequestContext, p_task: asyncio.Task, d_task: asyncio.Task, p_endpoint: Endpoint, d_endpoint: Endpoint) -> None:
        """Waits for the decode leg's first output; raises the first leg failure, or a timeout naming the leg waited on."""
        loop = asyncio.get_running_loop()
        limit = self.config.first_token_timeout_s if ctx.stream else self.config.request_timeout_s
        deadline = loop.time() + limit
        pending: set[asyncio.Task] = {p_task, d_task}
        while not d_task.done():
            remaining = deadline - loop.time()
            if remaining <= 0:
                if not p_task.done():
                    raise LegFailure(PREFILL, p_endpoint, "timeout", f"no answer within {limit:g} s while the decode leg waited for the KV", status=504)
                raise LegFailure(DECODE, d_endpoint, "timeout", f"no output within {limit:g} s", status=504)
            done, pending = await asyncio.wait(pending, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
            if p_task in done and p_task.exception() is not None:
                raise p_task.exception()
        d_task.result()

    async def _first_output_push(
        self, ctx: RequestContext, attempt: int, p_task: asyncio.Task, d_task: asyncio.Task, p_endpoint: Endpoint, d_endpoint: Endpoint
    ) -> None:
        """Push mode: waits for the decode leg's first output; raises the failure to answer, with the broker's reason where it has one.

        Besides the leg timeouts of _first_output:
        * transfer deadline guard: no output by the attempt's timeout_ms plus
          transfer_deadline_slack_s answers at once (the broker's reason, else
          504), unless the broker says the KV arrived (DONE: a long
          non-streamed answer is still being generated);
        * early failure: once the prefill leg has answered and the decode leg
          stayed silent for early_poll_delay_s, a GetTransfer long poll
          returns when the attempt ends; an end without the KV is answered
          at once, without waiting for the decode engine (it fails its
          request only once the broker has fenced the attempt, or at its own
          deadline plus a margin when it lost the broker). Polling only
          after the prefill leg answered, and only after a delay, keeps the
          RPC off successful streamed requests: their decode leg's first
          chunk follows P's answer within a WRITE and one decode step. A
          non-streamed request's output is its whole answer, so a long one
          does make this one call (answered as soon as the attempt is DONE);
        * a client that disconnects ends the attempt (ClientGone).
        """
        loop = asyncio.get_running_loop()
        config = self.config
        started = loop.time()
        limit = config.first_token_timeout_s if ctx.stream else config.request_timeout_s
        deadline = started + limit
        guard_at = started + config.transfer_timeout_ms / 1000 + config.transfer_deadline_slack_s
        poll_at = float("inf")  # when the long poll starts: set once the prefill leg has answered
        poll: asyncio.Task | None = None
        kv_arrived = False  # the broker said DONE: nothing left to ask it
        client_watch = asyncio.create_task(self._watch_client(ctx))
        pending: set[asyncio.Task] = {p_task, d_task, client_watch}
        try:
            while not d_task.done():
                now = loop.time()
                if client_watch.done():
                    raise ClientGone()
                if now >= deadline:
                    if not p_task.done():
                        raise LegFailure(PREFILL, p_endpoint, "timeout", f"no answer within {limit:g} s while the decode leg waited for the KV", status=504)
                    timeout = LegFailure(DECODE, d_endpoint, "timeout", f"no output within {limit:g} s", status=504)
                    raise await self._explain_overdue(ctx, attempt, p_endpoint, d_endpoint, timeout)
                if now >= guard_at:
                    guard_at = float("inf")
                    failure = await self._at_transfer_deadline(ctx, attempt, p_endpoint, d_endpoint, prefill_finished=p_task.done())
                    if failure is not None:
                        raise failure
                    kv_arrived = True  # only the leg timeouts bound the decode leg now
                    continue
                if poll is None and not kv_arrived and now >= poll_at:
                    poll = asyncio.create_task(self._watch_attempt(ctx.transfer_id, attempt, until=guard_at))
                    pending.add(poll)
                wake = min(deadline, guard_at, poll_at if poll is None and not kv_arrived else float("inf"))
                done, pending = await asyncio.wait(pending, timeout=max(wake - now, 0), return_when=asyncio.FIRST_COMPLETED)
                if p_task in done:
                    if p_task.exception() is not None:
                        raise p_task.exception()
                    poll_at = loop.time() + config.early_poll_delay_s
                if poll is not None and poll in done:
                    record = poll.result()
                    if record is not None and record.ended:
                        verdict = explain_attempt(record, ctx.client_request_id, p_endpoint.engine_id, d_endpoint.engine_id)
                        if verdict is not None:
                            raise self._transfer_failure(verdict, p_endpoint, d_endpoint, "the decode leg had no output yet")
                        # DONE: the KV arrived; only the leg timeouts bound the decode leg now.
                        guard_at, kv_arrived = float("inf"), True
        finally:
            helpers = [task for task in (poll, client_watch) if task is not None and not task.done()]
            for task in helpers:
                task.cancel()
            await asyncio.gather(*helpers, return_exceptions=True)
        try:
            d_task.result()
        except LegFailure as exc:
            if exc.status < 500 or exc.cause == "connect":
                raise  # the engine refused the request itself, or never got it: the broker knows nothing more
            explained = await self._explain_decode_failure(ctx, attempt, p_endpoint, d_endpoint, exc)
            if explained is exc:
                raise
            raise explained from exc

    @staticmethod
    async def _watch_client(ctx: RequestContext) -> None:
        """Returns once the client's connection is gone (a sleep loop of its own: cheaper than waking the attempt's wait)."""
        while not ctx.client_gone():
            await asyncio.sleep(CLIENT_CHECK_INTERVAL_S)

    # ---- the broker's view of an attempt (push mode) ------------------------------------

    async def _lookup(self, transfer_id: str, attempt: int, wait_s: float | None = None) -> AttemptRecord:
        """The broker's record of the attempt (GetTransfer; a long poll with wait_s); raises kvpush.errors exceptions."""
        request = rv_pb.GetTransferRequest(transfer_id=transfer_id, attempt=attempt)
        response = await self.broker.get_transfer(request, timeout_s=self.config.cancel_timeout_s, wait_s=wait_s)
        return AttemptRecord.from_transfer(response.transfer)

    async def _watch_attempt(self, transfer_id: str, attempt: int, *, until: float) -> AttemptRecord | None:
        """Long-polls the broker until the attempt ends or loop time `until`; None when the broker cannot tell by then."""
        loop = asyncio.get_running_loop()
        retry_s = max(self.config.early_poll_delay_s, 0.05)
        while True:
            wait_s = min(until - loop.time(), MAX_POLL_WAIT_S)
            if wait_s <= 0:
                return None
            try:
                record = await self._lookup(transfer_id, attempt, wait_s=wait_s)
            except errors.NotFound:
                # Neither side has reached the broker yet (the broker cannot
                # wait for an attempt it does not know): ask again, less and
                # less often; the transfer deadline guard bounds this.
                await asyncio.sleep(max(min(retry_s, until - loop.time()), 0))
                retry_s *= 2
                continue
            except errors.KvpushError as exc:
                logger.info("long poll of transfer %s attempt %d failed: %s", transfer_id, attempt, exc)
                return None
            if record.ended:
                return record

    def _transfer_failure(self, verdict: Verdict, p_endpoint: Endpoint, d_endpoint: Endpoint, seen: str) -> TransferFailure:
        if verdict.retry_side == PREFILL:
            return TransferFailure(verdict, PREFILL, p_endpoint, seen)
        return TransferFailure(verdict, DECODE, d_endpoint, seen)

    async def _explain_decode_failure(self, ctx: RequestContext, attempt: int, p_endpoint: Endpoint, d_endpoint: Endpoint, failure: LegFailure) -> LegFailure:
        """What to answer for a decode leg that failed (5xx, an error event, no output): the broker's reason, else the leg's own failure."""
        try:
            record = await self._lookup(ctx.transfer_id, attempt)
        except errors.NotFound:
            # The decode engine failed the request before registering it (its log says why).
            failure.args = (f"{failure}; the broker has no record of transfer {ctx.transfer_id} attempt {attempt}",)
            return failure
        except errors.KvpushError as exc:
            # Not an engine's fault that another engine would fix: no retry.
            message = f"{failure}; the kvpush control plane could not say why: {exc}"
            return TransferFailure(Verdict(503, CONTROL_PLANE_UNREACHABLE, message, None), DECODE, d_endpoint)
        verdict = explain_attempt(record, ctx.client_request_id, p_endpoint.engine_id, d_endpoint.engine_id)
        if verdict is None:
            failure.args = (f"{failure}; transfer {ctx.transfer_id} attempt {attempt}: {record.describe()}",)
            return failure
        return self._transfer_failure(verdict, p_endpoint, d_endpoint, str(failure))

    async def _explain_overdue(self, ctx: RequestContext, attempt: int, p_endpoint: Endpoint, d_endpoint: Endpoint, failure: LegFailure) -> LegFailure:
        """A leg timeout: the broker's reason when the attempt ended without the KV, else the timeout itself."""
        try:
            record = await self._lookup(ctx.transfer_id, attempt)
        except errors.KvpushError:
            return failure
        verdict = explain_attempt(record, ctx.client_request_id, p_endpoint.engine_id, d_endpoint.engine_id)
        return failure if verdict is None else self._transfer_failure(verdict, p_endpoint, d_endpoint, str(failure))

    async def _at_transfer_deadline(
        self, ctx: RequestContext, attempt: int, p_endpoint: Endpoint, d_endpoint: Endpoint, *, prefill_finished: bool
    ) -> LegFailure | None:
        """The transfer deadline plus slack passed without decode output: None if the broker says the KV arrived, else the failure to answer."""
        config = self.config
        record: AttemptRecord | None = None
        try:
            record = await self._lookup(ctx.transfer_id, attempt)
        except errors.NotFound:
            known = "the broker never heard of the attempt"
        except errors.KvpushError as exc:
            known = f"the kvpush control plane could not say why: {exc}"
        else:
            if record.state == "DONE":
                return None
            verdict = explain_attempt(record, ctx.client_request_id, p_endpoint.engine_id, d_endpoint.engine_id)
            if verdict is not None:
                return self._transfer_failure(verdict, p_endpoint, d_endpoint, "no decode output by the transfer deadline")
            known = record.describe()
        message = (
            f"transfer {ctx.transfer_id} attempt {attempt}: no first token before the transfer deadline "
            f"({config.transfer_timeout_ms} ms + {config.transfer_deadline_slack_s:g} s); {known}"
        )
        side = deadline_side(record, prefill_finished)
        return self._transfer_failure(Verdict(504, ROUTER_DEADLINE_EXCEEDED, message, side), p_endpoint, d_endpoint, "")

    async def _attempt_sequential(self, ctx: RequestContext, attempt: int, p_endpoint: Endpoint, d_endpoint: Endpoint) -> Opened:
        """Pull mode: the prefill leg, then the decode leg with the parameters the prefill engine returned."""
        p_span = self._leg_span(ctx, PREFILL, p_endpoint, attempt)
        p_headers = ctx.leg_headers(p_span, ctx.client_request_id)
        answer = await self._prefill_leg(ctx, p_endpoint, prefill_body(ctx.body, ctx.path, PULL_PREFILL_PARAMS), p_headers, p_span)
        params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
        if not isinstance(params, dict):
            raise LegFailure(PREFILL, p_endpoint, "protocol", "answered without kv_transfer_params (is it a kv_producer with NixlConnector?)")
        d_span = self._leg_span(ctx, DECODE, d_endpoint, attempt)
        decode = DecodeLeg(self, ctx, d_endpoint, decode_body(ctx.body, params), ctx.leg_headers(d_span, ctx.client_request_id), d_span)
        limit = self.config.first_token_timeout_s if ctx.stream else self.config.request_timeout_s
        try:
            await asyncio.wait_for(decode.open(), limit)
        except TimeoutError as exc:
            decode.close(abort=True, error="timeout")
            raise LegFailure(DECODE, d_endpoint, "timeout", f"no output within {limit:g} s", status=504) from exc
        except BaseException as exc:
            decode.close(abort=True, error=str(exc) or type(exc).__name__)
            raise
        return Opened(decode, None)

    async def _cancel_transfer(self, transfer_id: str, attempt: int, detail: str) -> None:
        """Cancels one transfer attempt at the broker (bounded); failures are logged, D's own deadline still frees its blocks."""
        request = rv_pb.CancelTransferRequest(detail=detail[:200])
        request.key.transfer_id, request.key.attempt = transfer_id, attempt
        try:
            await self.broker.cancel_transfer(request, timeout_s=self.config.cancel_timeout_s)
        except errors.KvpushError as exc:
            self.metrics.cancel_failures.inc()
            logger.warning("cancel of transfer %s attempt %d failed: %s", transfer_id, attempt, exc)

    def _record_first_output(self, ctx: RequestContext) -> None:
        ttft_s = time.monotonic() - ctx.started
        ctx.span.add_event("first_token")
        ctx.span.set_attribute("kvpush.ttft_ms", ttft_s * 1000)
        self.metrics.ttft.observe(ttft_s)
        if ctx.prefill_answered:
            self.metrics.after_prefill_leg.observe(time.monotonic() - ctx.prefill_answered)

    async def _respond(self, request: web.Request, ctx: RequestContext, opened: Opened) -> web.StreamResponse:
        """Sends the decode leg's answer to the client; nothing is retried from here on."""
        decode = opened.decode
        try:
            if not ctx.stream:
                ctx.span.set_attribute("kvpush.response_ms", (time.monotonic() - ctx.started) * 1000)
                decode.close(abort=False)
                return web.Response(status=200, body=decode.buffered[0], content_type="application/json")
            response = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await response.prepare(request)
            finished = False  # the [DONE] marker went out: the client has the whole answer
            try:
                for line in decode.buffered:
                    await response.write(line)
                self._record_first_output(ctx)
                while True:
                    try:
                        line = await decode.next_line()
                    except (TimeoutError, aiohttp.ClientError) as exc:
                        error = f"decode leg to {decode.endpoint} broke off after output started: {type(exc).__name__}: {exc}"
                        ctx.failure_reason = OUTPUT_BROKE_OFF
                        self.metrics.leg_failures.labels(DECODE, "after_output").inc()
                        logger.warning("request %s: %s", ctx.client_request_id, error)
                        ctx.span.set_status(Status(StatusCode.ERROR, error))
                        decode.close(abort=True, error=error)
                        event = error_body(502, error, reason=OUTPUT_BROKE_OFF, leg=DECODE, engine_id=decode.endpoint.engine_id, transfer_id=ctx.transfer_id)
                        await response.write(b"data: " + json.dumps(event).encode() + b"\n\ndata: [DONE]\n\n")
                        break
                    if not line:
                        break
                    # Read before the write: a client that hangs up on the blank line ending [DONE] has its answer.
                    # Undecoded: the chunks pass through, and JSON-decoding each would cost the router CPU per token.
                    finished = finished or any(data.strip() == DONE for data in decode.events.feed_data(line))
                    await response.write(line)
                decode.close(abort=False)
                await response.write_eof()
            except ConnectionResetError:
                # A client that got [DONE] may hang up before the stream's last bytes: that is no failure.
                if finished:
                    decode.close(abort=False)
                else:
                    logger.info("request %s: the client went away", ctx.client_request_id)
                    ctx.failure_reason = CLIENT_GONE
                    ctx.span.set_status(Status(StatusCode.ERROR, "client went away"))
                    decode.close(abort=True, error="client went away")
            return response
        finally:
            decode.close(abort=True, error="abandoned")
            await self._settle_prefill(ctx, opened.prefill)

    async def _settle_prefill(self, ctx: RequestContext, task: asyncio.Task | None) -> None:
        """Collects the prefill leg's outcome once the answer is out (the task is bounded by prefill_timeout_s)."""
        if task is None:
            return
        try:
            await task
        except LegFailure as exc:
            self.metrics.leg_failures.labels(PREFILL, "after_output").inc()
            logger.warning("request %s: %s (after the decode leg had answered)", ctx.client_request_id, exc)
