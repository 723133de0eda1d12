# SPDX-License-Identifier: Apache-2.0
"""The one gRPC server builder every kvpush service uses, and the serve-until-signalled loop."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import logging
import signal
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from opentelemetry import trace
from prometheus_client import CollectorRegistry, start_http_server

from kvpush.services.common.auth import TokenAuthInterceptor
from kvpush.services.common.config import ServerConfig
from kvpush.services.common.rpc_metrics import RpcMetricsInterceptor
from kvpush.services.common.tokens import IdentityTokens
from kvpush.services.common.tracing_interceptor import TracingInterceptor

logger = logging.getLogger(__name__)
ResultT = TypeVar("ResultT")


def server_options(max_message_bytes: int) -> list[tuple[str, Any]]:
    return [
        # Oversized messages fail with RESOURCE_EXHAUSTED inside gRPC, before
        # any servicer code runs; the same bound applies to what we send.
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        # Ping idle connections every 20 s and drop them after 10 s without an
        # answer, so the streams of a vanished peer (KeepAlive, orders) end.
        ("grpc.keepalive_time_ms", 20_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        # Clients ping long-lived streams that carry no data for a while
        # (engines waiting for orders): accept pings every 5 s, without calls
        # and without data, instead of answering GOAWAY "too_many_pings".
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        # A port, fixed or picked by port 0, is never shared with another process.
        ("grpc.so_reuseport", 0),
    ]


@dataclasses.dataclass(frozen=True)
class Service:
    """One gRPC service to serve: its full name, the generated add_*_to_server function and the servicer."""

    name: str
    add_to_server: Callable[[Any, grpc.aio.Server], None]
    servicer: Any


@dataclasses.dataclass
class RunningServer:
    server: grpc.aio.Server
    health: health.aio.HealthServicer
    port: int
    service_names: tuple[str, ...]

    async def set_serving(self, name: str, serving: bool) -> None:
        await self.health.set(name, health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING)

    async def stop(self, grace_s: float) -> None:
        """Health turns NOT_SERVING, new calls are refused, open ones get grace_s to finish."""
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)


def _credentials(config: ServerConfig) -> grpc.ServerCredentials:
    cert, key, ca = config.tls_pems()
    return grpc.ssl_server_credentials(
        [(key, cert)],
        root_certificates=ca,
        require_client_auth=True,
    )


async def build_server(
    config: ServerConfig,
    services: Sequence[Service],
    *,
    registry: CollectorRegistry,
    tokens: IdentityTokens | None = None,
    tracer_provider: trace.TracerProvider | None = None,
    serving: bool = True,
) -> RunningServer:
    """Builds, binds and starts a grpc.aio server for services, with health, reflection, auth, tracing and RPC metrics (into registry).

    Token mode (no TLS in config) needs tokens. With serving=False the
    services start NOT_SERVING (e.g. until a directory is synced); the
    overall health ("") is SERVING either way once started.
    """
    # Outermost first: the metrics count what auth refuses and time the span too.
    interceptors: list[grpc.aio.ServerInterceptor] = [RpcMetricsInterceptor(registry), TracingInterceptor(tracer_provider)]
    if not config.mtls:
        if tokens is None:
            raise ValueError("token mode needs the identity tokens")
        interceptors.append(TokenAuthInterceptor(tokens))
    server = grpc.aio.server(interceptors=interceptors, options=server_options(config.max_message_bytes))
    for service in services:
        service.add_to_server(service.servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = tuple(service.name for service in services)
    reflection.enable_server_reflection((*names, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    if config.mtls:
        port = server.add_secure_port(config.listen, _credentials(config))
    else:
        port = server.add_insecure_port(config.listen)
    if port == 0:
        raise OSError(f"cannot listen on {config.listen}")
    await server.start()
    running = RunningServer(server, health_servicer, port, names)
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    for name in names:
        await running.set_serving(name, serving)
    return running


class MetricsServer:
    """Prometheus metrics over HTTP (a daemon thread), when --metrics-port is set."""

    def __init__(self, config: ServerConfig, registry: CollectorRegistry):
        self.port: int | None = None
        self._http = None
        if config.metrics_port is not None:
            self._http, _ = start_http_server(config.metrics_port, addr=config.metrics_host, registry=registry)
            self.port = self._http.server_port

    async def close(self) -> None:
        if self._http is not None:
            await asyncio.to_thread(self._http.shutdown)
            self._http.server_close()


def announce(name: str, config: ServerConfig, port: int, metrics_port: int | None) -> None:
    """Tells the operator (stdout) and tests (--port-file) where the service listens."""
    host = config.listen.rsplit(":", 1)[0]
    print(f"kvpush {name} listening on {host}:{port}", flush=True)
    if metrics_port is not None:
        print(f"kvpush {name} metrics on http://{config.metrics_host}:{metrics_port}/metrics", flush=True)
    config.write_port(port)


# Python's full (generation 2) collection walks every tracked object, and a
# broker holds every attempt of its retention window (60 s: at 1,000
# rendezvous/s ~1 million objects), so each one paused the control plane
# 0.4-1 s on this machine, several times a minute, past any deadline it
# answers in (bench/results/LOG.md, "The control plane's garbage
# collector"). A serving process freezes its heap every FREEZE_EVERY_S, so a
# collection walks only what is younger. A frozen object is still freed when
# its last reference goes (reference counting); only a reference cycle that
# was alive at a freeze waits for the full collection of everything, every
# FULL_COLLECTION_EVERY_S (the control plane makes ~15 cyclic objects per
# thousand rendezvous).
FREEZE_EVERY_S = 1.0
FULL_COLLECTION_EVERY_S = 900.0


def settle_garbage_collector() -> None:
    """A serving process: what its start made (modules, descriptors, config) is out of the collections' walks."""
    gc.collect()
    gc.freeze()


async def keep_heap_frozen() -> None:
    """Freezes the heap every FREEZE_EVERY_S; every FULL_COLLECTION_EVERY_S unfreezes it and collects all of it first."""
    full_at = time.monotonic() + FULL_COLLECTION_EVERY_S
    while True:
        await asyncio.sleep(FREEZE_EVERY_S)
        if time.monotonic() >= full_at:
            gc.unfreeze()
            gc.collect()
            full_at = time.monotonic() + FULL_COLLECTION_EVERY_S
        gc.freeze()


async def serve_until_signalled(
    running: RunningServer,
    config: ServerConfig,
    *,
    background: Sequence[Awaitable[None]] = (),
    before_stop: Sequence[Callable[[], Awaitable[None] | None]] = (),
    after_stop: Sequence[Callable[[], Awaitable[None] | None]] = (),
) -> int:
    """Serves until SIGTERM or SIGINT, then shuts down in order.

    Order: health NOT_SERVING; before_stop (a broker member leaves its
    shard map; cores end their subscriptions so long-lived streams
    finish); server.stop(grace); background tasks cancelled; after_stop
    (close cores and clients). A background task that fails stops the
    service too (exit status 1).
    """
    settle_garbage_collector()
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    tasks = [asyncio.ensure_future(job) for job in (*background, keep_heap_frozen())]
    stopper = asyncio.ensure_future(stop.wait())
    pending: set[asyncio.Future] = {stopper, *tasks}
    failed: list[asyncio.Future] = []
    try:
        while stopper in pending and not failed:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            failed = [task for task in done if task is not stopper and not task.cancelled() and task.exception() is not None]
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)
    for task in failed:
        logger.error("background task failed, stopping", exc_info=task.exception())
    logger.info("shutting down")
    await running.health.enter_graceful_shutdown()
    for hook in before_stop:
        result = hook()
        if result is not None:
            await result
    await running.server.stop(config.grace_s)
    stopper.cancel()
    for task in tasks:
        task.cancel()
    for task in (stopper, *tasks):
        with contextlib.suppress(BaseException):
            await task
    for hook in after_stop:
        result = hook()
        if result is not None:
            await result
    logger.info("stopped")
    return 1 if failed else 0


def run_event_loop(main: Coroutine[Any, Any, ResultT]) -> ResultT:
    """Runs main on uvloop when it is installed (faster gRPC streams), else on asyncio's default loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)
