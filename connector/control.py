# SPDX-License-Identifier: Apache-2.0
"""The connector's link to the control plane.

All gRPC runs on one asyncio loop in a background thread (LoopThread); the
engine thread only hands work over and never waits on the network, except
once at startup to register its rank.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from kvpush import errors
from kvpush.client import BrokerClient, ClientConfig, LoopThread, RegistrarClient
from kvpush.client.backoff import Backoff
from kvpush.connector.config import ConnectorConfig
from kvpush.connector.report_stream import ReportStream
from kvpush.registrar.v1 import registrar_service_pb2 as reg_pb

logger = logging.getLogger(__name__)


class ControlSession:
    """One loop thread with a registrar and a broker client, plus long-lived streams."""

    def __init__(self, config: ConnectorConfig, name: str):
        self.config = config
        client_config = ClientConfig(
            target=config.control_plane,
            token=config.token,
            ca_cert_path=config.tls_ca,
            client_cert_path=config.tls_cert,
            client_key_path=config.tls_key,
            default_timeout_s=config.rpc_timeout_s,
        )
        self.loop = LoopThread(name)
        self.registrar = RegistrarClient(client_config)
        self.broker = BrokerClient(client_config)
        self._tasks: list[Any] = []
        self._closed = False

    def report_stream(self, engine_id: str) -> ReportStream:
        """Opens this session's EngineReports stream for engine_id; it stays open (reopened after failures) until close()."""
        stream = ReportStream(self.broker, engine_id, self.loop.loop, self.config.rpc_timeout_s, lambda: self._closed)
        self._tasks.append(self.loop.submit(stream.run()))
        return stream

    def register_rank(self, request: reg_pb.RegisterEngineRankRequest) -> reg_pb.RegisterEngineRankResponse:
        """Registers this worker's rank, retrying until startup_timeout_s; blocks (engine start only)."""

        async def attempt() -> reg_pb.RegisterEngineRankResponse:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + self.config.startup_timeout_s
            backoff = Backoff()
            while True:
                try:
                    return await self.registrar.register_engine_rank(request)
                except (errors.Unavailable, errors.DeadlineExceeded) as exc:
                    if loop.time() + backoff.delay_s > deadline:
                        raise errors.Unavailable(
                            f"kvpush: control plane {self.config.control_plane} unreachable for "
                            f"{self.config.startup_timeout_s:g}s: {exc.message}",
                            reason=errors.Reason.UNAVAILABLE,
                        ) from exc
                    await backoff.sleep()

        return self.loop.call(attempt(), timeout_s=self.config.startup_timeout_s + self.config.rpc_timeout_s)

    def keep_alive(self, request: reg_pb.RegisterEngineRankRequest, lease: reg_pb.RegisterEngineRankResponse) -> None:
        """Renews the lease every ttl/3 on a KeepAlive stream, reopening the stream after any failure.

        A lease lapses only by time at the registrar, so a new stream keeps
        renewing the same lease; only when the registrar no longer knows it
        (it lapsed, or the control plane restarted) does the rank register
        again, with backoff, until it succeeds.
        """
        ttl_s = lease.lease_ttl.ToTimedelta().total_seconds()

        async def register_again() -> str:
            backoff = Backoff()
            while True:
                try:
                    response = await self.registrar.register_engine_rank(request)
                    logger.info("kvpush: rank re-registered with the control plane")
                    return response.lease_id
                except errors.KvpushError as exc:
                    logger.warning("kvpush: re-registration failed (%s); retrying", exc)
                await backoff.sleep()

        async def run() -> None:
            lease_id = lease.lease_id
            backoff = Backoff()
            while not self._closed:
                stream = self.registrar.keep_alive()
                unknown = False
                try:
                    await stream.write(reg_pb.KeepAliveRequest(lease_ids=[lease_id]))
                    async for response in stream:
                        backoff.reset()
                        if lease_id in response.unknown_lease_ids:
                            unknown = True
                            break
                        await asyncio.sleep(ttl_s / 3)
                        await stream.write(reg_pb.KeepAliveRequest(lease_ids=[lease_id]))
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # any stream failure: open another one
                    logger.warning("kvpush: lease keep-alive stream failed (%s)", exc)
                finally:
                    stream.cancel()
                if unknown:
                    lease_id = await register_again()
                    continue
                await backoff.sleep()

        self._tasks.append(self.loop.submit(run()))

    def follow(
        self,
        name: str,
        open_stream: Callable[[], Any],
        on_message: Callable[[Any], None] | None,
        *,
        on_open: Callable[[], Callable[[Any], None]] | None = None,
        on_lost: Callable[[], None] | None = None,
    ) -> None:
        """Keeps a server stream open, reconnecting with backoff, and hands each message over.

        on_open, if given, is called for every new stream and returns that
        stream's message handler (instead of on_message); on_lost is called
        whenever a stream ends. Any failure, including one of a handler,
        ends the stream and opens a new one: nothing kills the follower.
        """

        async def run() -> None:
            backoff = Backoff()
            while not self._closed:
                stream = open_stream()
                handle = on_open() if on_open is not None else on_message
                try:
                    async for message in stream:
                        backoff.reset()
                        handle(message)
                    if self._closed:
                        return
                    logger.warning("kvpush: %s stream ended; reopening", name)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    logger.warning("kvpush: %s stream failed (%s); reopening in %.2fs", name, exc, backoff.delay_s)
                finally:
                    stream.cancel()
                    if on_lost is not None:
                        on_lost()
                await backoff.sleep()

        self._tasks.append(self.loop.submit(run()))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for task in self._tasks:
            task.cancel()

        async def shutdown() -> None:
            await self.registrar.close(0.5)
            await self.broker.close(0.5)

        try:
            self.loop.call(shutdown(), timeout_s=2.0)
        except Exception:  # the process is going away; never hang shutdown on the network
            logger.debug("kvpush: control session close", exc_info=True)
        self.loop.stop()
