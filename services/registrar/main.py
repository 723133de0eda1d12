# SPDX-License-Identifier: Apache-2.0
"""`kvpush registrar`: the registrar alone (a broker elsewhere mirrors it through WatchEngines).

Without --etcd it keeps the directory in process (one registrar). With
--etcd it is one of any number of stateless replicas of one directory kept
in etcd: it serves once its mirror holds etcd's engines.
"""

from __future__ import annotations

import argparse
import sys

from prometheus_client import CollectorRegistry

from kvpush.clock import SystemClock
from kvpush.etcd.settings import EtcdSettings
from kvpush.registrar.v1 import registrar_service_pb2_grpc as reg_grpc
from kvpush.services.common.auth import Authenticator
from kvpush.services.common.config import ServerConfig
from kvpush.services.common.deadline_runner import DeadlineRunner
from kvpush.services.common.server import MetricsServer, Service, announce, build_server, run_event_loop, serve_until_signalled
from kvpush.services.common.tokens import IdentityTokens, server_tokens
from kvpush.services.registrar import servicer as registrar_servicer
from kvpush.services.registrar.config import RegistrarConfig
from kvpush.services.registrar.core import LocalLeases, RegistrarCore
from kvpush.services.registrar.metrics import register_registrar_metrics
from kvpush.services.registrar.replica import EtcdReplica
from kvpush.telemetry import configure_tracing


def configure_parser(parser: argparse.ArgumentParser) -> None:
    ServerConfig.add_arguments(parser, listen="127.0.0.1:50052")
    RegistrarConfig.add_arguments(parser)
    EtcdSettings.add_arguments(parser)


async def serve(server_config: ServerConfig, registrar_config: RegistrarConfig, etcd: EtcdSettings, tokens: IdentityTokens | None) -> int:
    configure_tracing("kvpush-registrar")
    clock = SystemClock()
    leases: registrar_servicer.LeaseAuthority
    if etcd.endpoints:
        replica = EtcdReplica(registrar_config, etcd, clock)
        directory, leases = replica.directory, replica.leases
    else:
        core = RegistrarCore(registrar_config, clock)
        directory, leases = core, LocalLeases(core)
    registry = CollectorRegistry()
    register_registrar_metrics(registry, directory)
    auth = Authenticator(mtls=server_config.mtls)
    running = await build_server(
        server_config,
        [Service(registrar_servicer.SERVICE_NAME, reg_grpc.add_RegistrarServiceServicer_to_server, registrar_servicer.RegistrarServicer(directory, leases, auth))],
        registry=registry,
        tokens=tokens,
        serving=not etcd.endpoints,  # a replica serves once its mirror holds etcd's engines
    )
    if etcd.endpoints:

        async def serving_once_synced() -> None:
            await replica.mirror.synced.wait()
            await running.set_serving(registrar_servicer.SERVICE_NAME, True)

        background, after_stop = [replica.mirror.run(), serving_once_synced(), replica.leases.expire_silent_ranks()], [replica.close]
    else:
        expiry = DeadlineRunner(core.sweep, clock, "lease expiry")
        core.set_wakeup(expiry.wake)
        background, after_stop = [expiry.run()], []
    metrics = MetricsServer(server_config, registry)
    announce("registrar", server_config, running.port, metrics.port)
    return await serve_until_signalled(
        running, server_config, background=background, before_stop=[directory.close], after_stop=[metrics.close, *after_stop]
    )


def run(args: argparse.Namespace) -> int:
    try:
        server_config = ServerConfig.from_args(args)
        configs = (server_config, RegistrarConfig.from_args(args), EtcdSettings.from_args(args), server_tokens(server_config))
    except (ValueError, OSError) as exc:
        print(f"kvpush registrar: {exc}", file=sys.stderr)
        return 2
    return run_event_loop(serve(*configs))
