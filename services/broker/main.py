# SPDX-License-Identifier: Apache-2.0
"""`kvpush broker`: the rendezvous broker alone, mirroring a registrar at --registrar; with --etcd, one member of a sharded broker."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
from collections.abc import Awaitable, Callable

import grpc
from prometheus_client import CollectorRegistry

from kvpush.clock import SystemClock
from kvpush.etcd.settings import EtcdSettings
from kvpush.registrar.v1 import registrar_service_pb2_grpc as reg_grpc
from kvpush.rendezvous.v1 import rendezvous_service_pb2_grpc as rv_grpc
from kvpush.services.broker import servicer as broker_servicer
from kvpush.services.broker.config import BrokerConfig, ShardMembership, UpstreamRegistrar
from kvpush.services.broker.core import BrokerCore
from kvpush.services.broker.engine_reach import EngineReach
from kvpush.services.broker.etcd_membership import EtcdMembership
from kvpush.services.broker.metrics import BrokerMetrics
from kvpush.services.broker.remote_directory import RemoteEngineDirectory
from kvpush.services.common.auth import AUTHORIZATION_KEY, BEARER_PREFIX, Authenticator
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
from kvpush.services.common.tokens import BROKER_IDENTITY, IdentityTokens, server_tokens
from kvpush.telemetry import configure_tracing


def configure_parser(parser: argparse.ArgumentParser) -> None:
    ServerConfig.add_arguments(parser, listen="127.0.0.1:50053")
    BrokerConfig.add_arguments(parser)
    UpstreamRegistrar.add_arguments(parser)
    EtcdSettings.add_arguments(parser)
    ShardMembership.add_arguments(parser)

# How often the health status is checked against serving() even without a change heard (a lease can lapse unannounced).
HEALTH_RECHECK_S = 0.5
# How often a sharded member looks at its engine streams (a quarter of the silence bound when that is shorter).
REACH_CHECK_S = 0.25


def _registrar_channel(server_config: ServerConfig, target: str) -> grpc.aio.Channel:
    if server_config.mtls:
        # The broker's own certificate (common name "broker") is its identity towards the registrar.
        cert, key, ca = server_config.tls_pems()
        credentials = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
        return grpc.aio.secure_channel(target, credentials)
    return grpc.aio.insecure_channel(target)


def _registrar_metadata(tokens: IdentityTokens | None) -> tuple[tuple[str, str], ...]:
    """What the broker's calls to the registrar carry: in token mode, the `broker` identity's token."""
    if tokens is None:
        return ()
    token = tokens.token_of(BROKER_IDENTITY)
    if token is None:
        raise ValueError(f"--tokens-dir has no {BROKER_IDENTITY!r} file: the broker presents that identity's token to the registrar")
    return ((AUTHORIZATION_KEY, BEARER_PREFIX + token),)


async def _follow_health(running: RunningServer, directory: RemoteEngineDirectory, broker: BrokerCore) -> None:
    """RendezvousService is SERVING once the engine mirror is synced, and then while the member serves its shard."""
    await directory.synced.wait()
    changed = asyncio.Event()
    broker.membership.add_listener(changed.set)
    reported = None
    while True:
        serving = broker.membership.serving()
        if serving != reported:
            await running.set_serving(broker_servicer.SERVICE_NAME, serving)
            reported = serving
        changed.clear()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(HEALTH_RECHECK_S):
                await changed.wait()


async def _step_down_when_cut_off(broker: BrokerCore, membership: EtcdMembership, silence_s: float) -> None:
    """Steps the member out of the map while no engine reaches it but engines reach another member."""
    loop = asyncio.get_running_loop()
    reach = EngineReach(silence_s, loop.time())
    while True:
        await asyncio.sleep(min(silence_s / 4, REACH_CHECK_S))
        now = loop.time()
        streams = broker.engine_streams()
        reach.observe(streams=streams, serving=membership.serving(), now=now)
        membership.set_engines_attached(reach.attached(now))
        if reach.cut_off(now=now, peers_attached=membership.peers_attached()):
            membership.step_down(reach.next_hold_off(), f"no engine stream for {silence_s:.1f}s while engines reach other members")


async def serve(
    server_config: ServerConfig, broker_config: BrokerConfig, tokens: IdentityTokens | None, registrar: UpstreamRegistrar,
    etcd_settings: EtcdSettings,
    shards: ShardMembership,
) -> int:
    configure_tracing("kvpush-broker")
    clock = SystemClock()
    channel = _registrar_channel(server_config, registrar.target)
    directory = RemoteEngineDirectory(reg_grpc.RegistrarServiceStub(channel), metadata=_registrar_metadata(tokens), rpc_timeout_s=registrar.timeout_s)
    registry = CollectorRegistry()
    etcd = etcd_settings.client() if etcd_settings.endpoints else None
    membership = None
    if etcd is not None:
        membership = EtcdMembership(etcd, member_id=shards.member_id, prefix=etcd_settings.prefix, lease_ttl_s=shards.lease_ttl_s)
    broker = BrokerCore(directory, broker_config, clock, metrics=BrokerMetrics(registry), membership=membership)
    auth = Authenticator(mtls=server_config.mtls)
    running = await build_server(
        server_config,
        [Service(broker_servicer.SERVICE_NAME, rv_grpc.add_RendezvousServiceServicer_to_server, broker_servicer.BrokerServicer(broker, auth))],
        registry=registry,
        tokens=tokens,
        serving=False,
    )
    deadlines = DeadlineRunner(broker.tick, clock, "transfer deadlines")
    broker.set_wakeup(deadlines.wake)
    metrics = MetricsServer(server_config, registry)

    background = [directory.run(), deadlines.run(), _follow_health(running, directory, broker)]
    before_stop: list[Callable[[], Awaitable[None] | None]] = [broker.close]
    after_stop: list[Callable[[], Awaitable[None] | None]] = [metrics.close, channel.close]
    if membership is not None:
        membership.address = shards.address(server_config.listen, running.port)
        background.append(membership.run())
        if shards.engine_silence_s:
            background.append(_step_down_when_cut_off(broker, membership, shards.engine_silence_s))
        # A stopping member leaves the map first (at once, not a lease ttl later), so callers go to the new owners;
        # its live attempts end BROKER_SHARD_LOST while their streams are still open.
        before_stop.insert(0, membership.close)
        assert etcd is not None, "membership is built only on etcd"
        after_stop.append(etcd.close)
    announce("broker", server_config, running.port, metrics.port)
    return await serve_until_signalled(running, server_config, background=background, before_stop=before_stop, after_stop=after_stop)


def run(args: argparse.Namespace) -> int:
    try:
        server_config = ServerConfig.from_args(args)
        tokens = server_tokens(server_config)
        _registrar_metadata(tokens)  # a missing `broker` token stops the start here, with a clear message
        etcd, shards = EtcdSettings.from_args(args), ShardMembership.from_args(args)
        if etcd.endpoints:
            shards.check_on_etcd(server_config.listen)  # no --member-id, or a wildcard --listen without --advertise, stops the start here
        configs = (server_config, BrokerConfig.from_args(args), tokens, UpstreamRegistrar.from_args(args), etcd, shards)
    except (ValueError, OSError) as exc:
        print(f"kvpush broker: {exc}", file=sys.stderr)
        return 2
    return run_event_loop(serve(*configs))
