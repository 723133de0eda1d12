# SPDX-License-Identifier: Apache-2.0
"""`kvpush control-plane`: the registrar and the broker in one process on one gRPC server (the embedded default)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import sys
from collections.abc import AsyncIterator

from opentelemetry import trace
from prometheus_client import CollectorRegistry

from kvpush.clock import Clock, SystemClock
from kvpush.registrar.v1 import registrar_service_pb2_grpc as reg_grpc
from kvpush.rendezvous.v1 import rendezvous_service_pb2_grpc as rv_grpc
from kvpush.services.broker import servicer as broker_servicer
from kvpush.services.broker.config import BrokerConfig
from kvpush.services.broker.core import BrokerCore
from kvpush.services.broker.metrics import BrokerMetrics
from kvpush.services.common.auth import Authenticator
from kvpush.services.common.config import ServerConfig
from kvpush.services.common.deadline_runner import DeadlineRunner
from kvpush.services.common.server import (
    MetricsServer,
    RunningServer,
    Service,
    announce,
    build_server,
    run_event_loop,
    serve_until_signalled,
)
from kvpush.services.common.tokens import IdentityTokens, server_tokens
from kvpush.services.registrar import servicer as registrar_servicer
from kvpush.services.registrar.config import RegistrarConfig
from kvpush.services.registrar.core import LocalLeases, RegistrarCore
from kvpush.services.registrar.metrics import register_registrar_metrics
from kvpush.telemetry import configure_tracing


def configure_parser(parser: argparse.ArgumentParser) -> None:
    ServerConfig.add_arguments(parser)
    RegistrarConfig.add_arguments(parser)
    BrokerConfig.add_arguments(parser)


@dataclasses.dataclass
class ControlPlane:
    """A started control plane: both cores on one running server, plus their deadline runners."""

    registrar: RegistrarCore
    broker: BrokerCore
    running: RunningServer
    registry: CollectorRegistry
    runners: tuple[DeadlineRunner, ...]

    @property
    def port(self) -> int:
        return self.running.port


async def start(
    server_config: ServerConfig,
    registrar_config: RegistrarConfig,
    broker_config: BrokerConfig,
    *,
    tokens: IdentityTokens | None,
    clock: Clock | None = None,
    tracer_provider: trace.TracerProvider | None = None,
) -> ControlPlane:
    """Builds both cores and serves them on one server (the runners are not started yet).

    tokens are the identities' tokens in token mode (None with mTLS).
    """
    clock = clock or SystemClock()
    registrar = RegistrarCore(registrar_config, clock)
    registry = CollectorRegistry()
    register_registrar_metrics(registry, registrar)
    broker = BrokerCore(registrar, broker_config, clock, metrics=BrokerMetrics(registry), tracer_provider=tracer_provider)
    auth = Authenticator(mtls=server_config.mtls)
    running = await build_server(
        server_config,
        [
            Service(registrar_servicer.SERVICE_NAME, reg_grpc.add_RegistrarServiceServicer_to_server, registrar_servicer.RegistrarServicer(registrar, LocalLeases(registrar), auth)),
            Service(broker_servicer.SERVICE_NAME, rv_grpc.add_RendezvousServiceServicer_to_server, broker_servicer.BrokerServicer(broker, auth)),
        ],
        registry=registry,
        tokens=tokens,
        tracer_provider=tracer_provider,
    )
    leases = DeadlineRunner(registrar.sweep, clock, "lease expiry")
    registrar.set_wakeup(leases.wake)
    deadlines = DeadlineRunner(broker.tick, clock, "transfer deadlines")
    broker.set_wakeup(deadlines.wake)
    return ControlPlane(registrar, broker, running, registry, (leases, deadlines))


@contextlib.asynccontextmanager
async def running(
    server_config: ServerConfig,
    registrar_config: RegistrarConfig | None = None,
    broker_config: BrokerConfig | None = None,
    *,
    tokens: IdentityTokens | None,
    tracer_provider: trace.TracerProvider | None = None,
) -> AsyncIterator[ControlPlane]:
    """A started control plane with its deadline runners running, stopped on exit (in-process use: tests, benchmarks)."""
    plane = await start(
        server_config, registrar_config or RegistrarConfig(), broker_config or BrokerConfig(), tokens=tokens, tracer_provider=tracer_provider
    )
    tasks = [asyncio.create_task(runner.run()) for runner in plane.runners]
    try:
        yield plane
    finally:
        plane.broker.close()
        plane.registrar.close()
        await plane.running.stop(0)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def serve(server_config: ServerConfig, registrar_config: RegistrarConfig, broker_config: BrokerConfig, tokens: IdentityTokens | None) -> int:
    configure_tracing("kvpush-control-plane")
    plane = await start(server_config, registrar_config, broker_config, tokens=tokens)
    metrics = MetricsServer(server_config, plane.registry)
    announce("control-plane", server_config, plane.port, metrics.port)
    return await serve_until_signalled(
        plane.running,
        server_config,
        background=[runner.run() for runner in plane.runners],
        before_stop=[plane.broker.close, plane.registrar.close],
        after_stop=[metrics.close],
    )


def run(args: argparse.Namespace) -> int:
    try:
        server_config = ServerConfig.from_args(args)
        configs = (server_config, RegistrarConfig.from_args(args), BrokerConfig.from_args(args), server_tokens(server_config))
    except (ValueError, OSError) as exc:
        print(f"kvpush control-plane: {exc}", file=sys.stderr)
        return 2
    return run_event_loop(serve(*configs))
