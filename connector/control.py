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
from kvpush.connector.config import ConnectorConfig
from kvpush.registrar.v1 import registrar_service_pb2 as reg_pb

logger = logging.getLogger(__name__)

RECONNECT_BACKOFF_S = (0.05, 2.0)


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

    @property
    def engine_token(self) -> str:
        return self.broker.engine_token

    def set_engine_token(self, token: str) -> None:
        self.registrar.engine_token = token
        self.broker.engine_token = token

    def submit(self, coro, what: str = "") -> None:
        """Runs coro on the loop, fire-and-forget; a kvpush error is logged in one line naming `what`."""
        if self._closed:
            coro.close()
            return

        async def logged() -> None:
            try:
                await coro
            except errors.KvpushError as exc:
                logger.warning("kvpush: %s failed: %s", what or "control-plane call", exc)

        self.loop.submit(logged())

    def register_rank(self, request: reg_pb.RegisterEngineRankRequest) -> reg_pb.RegisterEngineRankResponse:
        """Registers this worker's rank, retrying until startup_timeout_s; blocks (engine start only)."""

        async def attempt() -> reg_pb.RegisterEngineRankResponse:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + self.config.startup_timeout_s
            delay = RECONNECT_BACKOFF_S[0]
            while True:
                try:
                    return await self.registrar.register_engine_rank(request)
                except (errors.Unavailable, errors.DeadlineExceeded) as exc:
                    if loop.time() + delay > deadline:
                        raise errors.Unavailable(
                            f"kvpush: control plane {self.config.control_plane} unreachable for "
                            f"{self.config.startup_timeout_s:g}s: {exc.message}",
                            reason=errors.Reason.UNAVAILABLE,
                        ) from exc
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, RECONNECT_BACKOFF_S[1])

        return self.loop.call(attempt(), timeout_s=self.config.startup_timeout_s + self.config.rpc_timeout_s)

    def keep_alive(self, request: reg_pb.RegisterEngineRankRequest, lease: reg_pb.RegisterEngineRankResponse) -> None:
        """Renews the lease every ttl/3 on a KeepAlive stream.

        The registrar ends a stream's leases when the stream ends, so after
        any failure (control plane restarted or unreachable) the rank
        registers again, with backoff, until it succeeds.
        """
        ttl_s = lease.lease_ttl.ToTimedelta().total_seconds()

        async def run() -> None:
            lease_id = lease.lease_id
            delay = RECONNECT_BACKOFF_S[0]
            while not self._closed:
                stream = self.registrar.keep_alive()
                try:
                    await stream.write(reg_pb.KeepAliveRequest(lease_ids=[lease_id]))
                    async for response in stream:
                        delay = RECONNECT_BACKOFF_S[0]
                        if lease_id in response.unknown_lease_ids:
                            break
                        await asyncio.sleep(ttl_s / 3)
                        await stream.write(reg_pb.KeepAliveRequest(lease_ids=[lease_id]))
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # any stream failure: fall through to re-registration
                    logger.warning("kvpush: lease keep-alive stream failed (%s)", exc)
                finally:
                    stream.cancel()
                while not self._closed:
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, RECONNECT_BACKOFF_S[1])
                    try:
                        response = await self.registrar.register_engine_rank(request)
                        lease_id = response.lease_id
                        self.set_engine_token(response.engine_token)
                        logger.info("kvpush: rank re-registered with the control plane")
                        break
                    except errors.KvpushError as exc:
                        logger.warning("kvpush: re-registration failed (%s); retrying", exc)

        self._tasks.append(self.loop.submit(run()))

    def follow(self, name: str, open_stream: Callable[[], Any], on_message: Callable[[Any], None]) -> None:
        """Keeps a server stream open, reconnecting with backoff, and hands each message to on_message."""

        async def run() -> None:
            delay = RECONNECT_BACKOFF_S[0]
            while not self._closed:
                stream = open_stream()
                try:
                    async for message in stream:
                        delay = RECONNECT_BACKOFF_S[0]
                        on_message(message)
                    if self._closed:
                        return
                    logger.warning("kvpush: %s stream ended; reopening", name)
                except errors.KvpushError as exc:
                    logger.warning("kvpush: %s stream failed (%s); reopening in %.2fs", name, exc, delay)
                finally:
                    stream.cancel()
                await asyncio.sleep(delay)
                delay = min(delay * 2, RECONNECT_BACKOFF_S[1])

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
