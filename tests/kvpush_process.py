# SPDX-License-Identifier: Apache-2.0
"""Shared by the tests that run kvpush services as real processes (`kvpush control-plane`, `registrar`, `broker`).

Every process leads its own process group and is stopped by it; it reads
no kvpush or tracing settings from the test's environment.
"""

from __future__ import annotations

import asyncio
import os
import pathlib
import sys
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvpush.dev.localstack.process import GroupProcess, wait_for_port_file

START_TIMEOUT_S = 20.0
T = 5.0  # a health check's deadline
CLEAN_ENV = {name: None for name in os.environ if name.startswith(("KVPUSH_", "OTEL_"))}


class KvpushProcess:
    """`python -m kvpush.cli COMMAND ... --listen 127.0.0.1:0`, its port read from --port-file, and a channel to it."""

    def __init__(self, workdir: pathlib.Path, name: str, command: str, *args: str):
        self.name = name
        self.args = (command, *args)
        self.workdir = workdir
        self.log_path = workdir / f"{name}.log"
        self.process: GroupProcess | None = None
        self.port = 0
        self.channel: grpc.aio.Channel | None = None

    async def start(self, port: int = 0) -> KvpushProcess:
        """Starts it on port (0: any free one); returns once it wrote its port (bounded)."""
        port_file = self.workdir / f"{self.name}.port"
        port_file.unlink(missing_ok=True)
        argv = [sys.executable, "-m", "kvpush.cli", *self.args, "--listen", f"127.0.0.1:{port}", "--port-file", str(port_file)]
        self.process = GroupProcess(self.name, argv, self.log_path, env=CLEAN_ENV)
        self.port = await asyncio.to_thread(wait_for_port_file, self.process, port_file, START_TIMEOUT_S)
        self.channel = grpc.aio.insecure_channel(self.address)
        return self

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def close_channel(self) -> None:
        if self.channel is not None:
            await self.channel.close()
            self.channel = None

    async def stop(self) -> int | None:
        """SIGTERM to its process group (SIGKILL to what is left after 10 s); its exit status."""
        await self.close_channel()
        if self.process is None:
            return None
        await asyncio.to_thread(self.process.stop)
        return self.process.returncode

    async def kill(self) -> None:
        """SIGKILL to its process group, as a crash would."""
        await self.close_channel()
        await asyncio.to_thread(self.process.kill)

    async def restart(self) -> None:
        """Starts it again on its address after kill(), as a restarted pod or supervisor would."""
        await self.start(self.port)

    async def health(self, service: str) -> int:
        """service's health status as the process reports it."""
        return await health_status(self.channel, service)


async def health_status(channel: grpc.aio.Channel, service: str) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return (await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=T)).status


async def wait_serving(channel: grpc.aio.Channel, service: str, timeout_s: float = START_TIMEOUT_S) -> None:
    """Waits (bounded) until service on channel is SERVING."""
    deadline = time.monotonic() + timeout_s
    while await health_status(channel, service) != health_pb2.HealthCheckResponse.SERVING:
        assert time.monotonic() < deadline, f"{service} not SERVING within {timeout_s:g}s"
        await asyncio.sleep(0.05)
