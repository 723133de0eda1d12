# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""The router's HTTP server (aiohttp): its endpoints, its clients' lifecycle, and each completion request's checks, span and metrics.

attempts.py routes a checked request to the engines; W3C trace context
comes in on the client's headers and goes out on both legs.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Coroutine
from typing import Any

import aiohttp
from aiohttp import web
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvpush.client import ClientConfig, ShardedBrokerClient
from kvpush.services.router.attempt_times import AttemptTimes
from kvpush.services.router.attempts import dispatch
from kvpush.services.router.config import RouterConfig
from kvpush.services.router.core import (
    CHAT_COMPLETIONS_PATH,
    COMPLETIONS_PATH,
    INVALID_REQUEST,
    BadRequest,
    Endpoint,
    EnginePool,
    check_client_request_id,
    check_routable,
)
from kvpush.services.router.failures import error_response
from kvpush.services.router.legs import DECODE, PREFILL, RequestContext
from kvpush.services.router.metrics import RouterMetrics
from kvpush.services.router.shard_watch import ShardWatch
from kvpush.telemetry import ATTR_CLIENT_REQUEST_ID, ATTR_TRANSFER_ID, extract_context

TRACER_NAME = "kvpush.router"
# The request's span (docs/design.md, Telemetry); legs.LEG_SPANS are its children.
REQUEST_SPAN = "router.request"
TRACE_HEADERS = ("traceparent", "tracestate", "baggage")
MAX_BODY_BYTES = 64 * 1024 * 1024


class Router:
    """Routes OpenAI requests over a prefill and a decode pool."""

    def __init__(self, config: RouterConfig, *, tracer_provider: trace.TracerProvider | None = None):
        self.config = config
        self.prefill_pool = EnginePool(PREFILL, config.prefill, config.policy)
        self.decode_pool = EnginePool(DECODE, config.decode, config.policy)
        self.metrics = RouterMetrics((self.prefill_pool, self.decode_pool))
        self.attempt_times = AttemptTimes()  # what a retry needs left of its request's time
        self._tracer_provider = tracer_provider
        self.tracer = trace.get_tracer(TRACER_NAME, tracer_provider=tracer_provider)
        # Made by start(): the engines' HTTP session, and in push mode the broker client and its shard watch.
        self._session: aiohttp.ClientSession | None = None
        self._broker: ShardedBrokerClient | None = None
        self._shards: ShardWatch | None = None  # which attempts' broker members are gone
        self._cancels: set[asyncio.Task] = set()  # push mode: CancelTransfer calls still running (failed attempts)

    # ---- lifecycle ----------------------------------------------------------------------

    async def start(self, _app: web.Application | None = None) -> None:
        # No pool limit: the engines' own queues are the backpressure.
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=self.config.engine_keepalive_s)
        self._session = aiohttp.ClientSession(connector=connector, raise_for_status=False)
        if self.config.mode == "push":
            client_config = ClientConfig(
                target=self.config.control_plane,
                token=self.config.resolve_token(),
                ca_cert_path=self.config.tls_ca,
                client_cert_path=self.config.tls_cert,
                client_key_path=self.config.tls_key,
                default_timeout_s=self.config.cancel_timeout_s,
            )
            self._broker = ShardedBrokerClient(client_config, tracer_provider=self._tracer_provider)
            self._shards = ShardWatch(self._broker.shard_map)
            self._broker.shard_map.start()

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("the router has not started: no HTTP session to the engines yet")
        return self._session

    @property
    def broker(self) -> ShardedBrokerClient:
        if self._broker is None:
            raise RuntimeError("no broker client: the router is not started in push mode")
        return self._broker

    @property
    def shards(self) -> ShardWatch:
        if self._shards is None:
            raise RuntimeError("no shard watch: the router is not started in push mode")
        return self._shards

    def cancel_later(self, cancel: Coroutine[Any, Any, None]) -> asyncio.Task:
        """Runs a failed attempt's CancelTransfer beside the request: its answer does not wait for the broker."""
        task = asyncio.create_task(cancel)
        self._cancels.add(task)
        task.add_done_callback(self._cancels.discard)
        return task

    async def close(self, _app: web.Application | None = None) -> None:
        if self._cancels:  # each call is bounded by --cancel-timeout
            await asyncio.wait(set(self._cancels), timeout=self.config.cancel_timeout_s)
        if self._session is not None:
            await self._session.close()
        if self._shards is not None:
            self._shards.close()
        if self._broker is not None:
            await self._broker.close()

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
        started, started_ns = time.monotonic(), time.time_ns()
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
        response: web.StreamResponse
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
                        started_ns=started_ns,
                        authorization=request.headers.get("Authorization", ""),
                        incoming_trace=carrier,
                        client=request,
                    )
                    span.set_attribute(ATTR_TRANSFER_ID, ctx.transfer_id)
                    span.set_attribute("kvpush.stream", ctx.stream)
                    try:
                        response = await dispatch(self, request, ctx)
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
