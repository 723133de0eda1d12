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
    COMPLETIONS_PATH,
    PULL_PREFILL_PARAMS,
    BadRequest,
    Endpoint,
    EnginePool,
    check_routable,
    decode_body,
    kvpush_params,
    prefill_body,
    upstream_push_decode_params,
    upstream_push_prefill_params,
)
from kvpush.services.router.metrics import RouterMetrics
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
ERROR_TYPES = {400: "BadRequestError", 502: "BadGatewayError", 503: "ServiceUnavailableError", 504: "GatewayTimeoutError"}


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

    def response(self, transfer_id: str) -> web.Response:
        if self.engine_body is not None and 400 <= self.status < 500:
            # The request itself was at fault: the engine's own answer says best why.
            return web.Response(status=self.status, body=self.engine_body, content_type="application/json")
        return error_response(self.status, str(self), leg=self.leg, engine_id=self.endpoint.engine_id, transfer_id=transfer_id)


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


def _sse_data(line: bytes) -> Any:
    """The JSON payload of an SSE `data:` line; None for other lines, "[DONE]" for the end marker."""
    if not line.startswith(b"data:"):
        return None
    payload = line[5:].strip()
    if payload == b"[DONE]":
        return "[DONE]"
    try:
        return json.loads(payload)
    except ValueError:
        return None


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
                data = _sse_data(line)
                if data == "[DONE]":
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
        try:
            with trace.use_span(span, end_on_exit=False):
                try:
                    body = check_routable(await request.json())
                except (ValueError, BadRequest) as exc:
                    response = error_response(400, f"invalid request: {exc}")
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
                    )
                    span.set_attribute(ATTR_TRANSFER_ID, ctx.transfer_id)
                    span.set_attribute("kvpush.stream", ctx.stream)
                    response = await self._dispatch(request, ctx)
                status = response.status
                return response
        finally:
            self.metrics.requests.labels(request.path, str(status)).inc()
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
            except LegFailure as exc:
                failure = exc
                self.metrics.leg_failures.labels(exc.leg, exc.cause).inc()
                ctx.span.add_event("leg_failed", {"kvpush.leg": exc.leg, "kvpush.cause": exc.cause, ATTR_ATTEMPT: attempt, "message": str(exc)})
                logger.warning("request %s attempt %d: %s", ctx.client_request_id, attempt, exc)
                if not exc.retryable:
                    break
                (failed_prefill if exc.leg == PREFILL else failed_decode).add(exc.endpoint)
                continue
            return await self._respond(request, ctx, opened)
        if failure is not None:
            return failure.response(ctx.transfer_id)
        role = "prefill" if p_endpoint is None else "decode"
        return error_response(503, f"no {role} engine available", leg=role)

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
            await self._first_output(ctx, p_task, d_task, p_endpoint, d_endpoint)
        except BaseException as exc:
            for task in (p_task, d_task):
                task.cancel()
            # Both tasks end at once when cancelled; their own failures were already handled here.
            await asyncio.gather(p_task, d_task, return_exceptions=True)
            decode.close(abort=True, error=str(exc) or type(exc).__name__)
            if config.mode == "push":
                await self._cancel_transfer(ctx.transfer_id, attempt, str(exc))
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
                        self.metrics.leg_failures.labels(DECODE, "after_output").inc()
                        logger.warning("request %s: %s", ctx.client_request_id, error)
                        ctx.span.set_status(Status(StatusCode.ERROR, error))
                        decode.close(abort=True, error=error)
                        event = error_body(502, error, leg=DECODE, engine_id=decode.endpoint.engine_id, transfer_id=ctx.transfer_id)
                        await response.write(b"data: " + json.dumps(event).encode() + b"\n\ndata: [DONE]\n\n")
                        break
                    if not line:
                        break
                    await response.write(line)
                    finished = finished or line.startswith(b"data: [DONE]")
                decode.close(abort=False)
                await response.write_eof()
            except ConnectionResetError:
                # A client that got [DONE] may hang up before the stream's last bytes: that is no failure.
                if finished:
                    decode.close(abort=False)
                else:
                    logger.info("request %s: the client went away", ctx.client_request_id)
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
