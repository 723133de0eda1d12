# SPDX-License-Identifier: Apache-2.0
"""The services as real processes: `kvpush control-plane`, and `kvpush registrar` + `kvpush broker` apart."""

from __future__ import annotations

import asyncio
import os
import pathlib
import re
import signal
import subprocess
import sys
import time
import urllib.request

import grpc
from conftest import CALL_TIMEOUT_S, FakeEngine, expect_rpc_error, read
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvpush.errors import Reason
from kvpush.rendezvous.v1 import transfer_pb2 as tr_pb
from kvpush.services.common import sample_engines as sample

START_TIMEOUT_S = 20.0
STOP_TIMEOUT_S = 10.0
T = CALL_TIMEOUT_S


class ServiceProcess:
    """`python -m kvpush.cli <command> ...` on 127.0.0.1 port 0, its port read from --port-file."""

    def __init__(self, tmp_path: pathlib.Path, command: str, *args: str):
        self.port_file = tmp_path / f"{command}.port"
        self.log = (tmp_path / f"{command}.log").open("w")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "KVPUSH_"))}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "kvpush.cli", command, "--listen", "127.0.0.1:0", "--port-file", str(self.port_file), *args],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        self.log_path = tmp_path / f"{command}.log"

    async def port(self) -> int:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.port_file.exists():
            assert self.process.poll() is None, f"exited early:\n{self.log_path.read_text()}"
            assert time.monotonic() < deadline, f"no port within {START_TIMEOUT_S}s:\n{self.log_path.read_text()}"
            await asyncio.sleep(0.05)
        return int(self.port_file.read_text())

    def stop(self) -> int:
        """SIGTERM by PID; returns the exit status (killed if it ignores the signal)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=STOP_TIMEOUT_S)
        self.log.close()
        return self.process.returncode


async def wait_serving(channel: grpc.aio.Channel, service: str) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        response = await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=T)
        if response.status == health_pb2.HealthCheckResponse.SERVING:
            return
        assert time.monotonic() < deadline, f"{service} not SERVING within {START_TIMEOUT_S}s"
        await asyncio.sleep(0.05)


async def test_control_plane_process_writes_its_token_and_port_and_stops_cleanly(tmp_path):
    token_file = tmp_path / "token"
    service = ServiceProcess(tmp_path, "control-plane", "--token-file", str(token_file), "--metrics-port", "0")
    try:
        port = await service.port()
        assert token_file.stat().st_mode & 0o777 == 0o600
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            await wait_serving(channel, "kvpush.rendezvous.v1.RendezvousService")
        metrics_url = re.search(r"metrics on (http://127\.0\.0\.1:\d+/metrics)", service.log_path.read_text()).group(1)
        metrics = await asyncio.to_thread(lambda: urllib.request.urlopen(metrics_url, timeout=T).read().decode())
        assert "kvpush_broker_rendezvous_total 0.0" in metrics and "kvpush_registrar_engines 0.0" in metrics
    finally:
        assert service.stop() == 0
    log = service.log_path.read_text()
    assert f"listening on 127.0.0.1:{port}" in log and "metrics on http://127.0.0.1:" in log and "stopped" in log


async def test_separate_registrar_and_broker(tmp_path):
    token_file, key_file = tmp_path / "token", tmp_path / "engine-token.key"
    shared = ("--token-file", str(token_file), "--engine-token-key-file", str(key_file))
    registrar = ServiceProcess(tmp_path, "registrar", *shared, "--lease-ttl", "30")
    broker = None
    try:
        registrar_port = await registrar.port()
        broker = ServiceProcess(tmp_path, "broker", *shared, "--registrar", f"127.0.0.1:{registrar_port}")
        broker_port = await broker.port()
        token = token_file.read_text().strip()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{registrar_port}") as registrar_channel, grpc.aio.insecure_channel(f"127.0.0.1:{broker_port}") as broker_channel:
            prefill = await FakeEngine(registrar_channel, "prefill-0", sample.PREFILL, shared_token=token).register()
            decode = await FakeEngine(registrar_channel, "decode-0", sample.DECODE, shared_token=token).register()
            await wait_serving(broker_channel, "kvpush.rendezvous.v1.RendezvousService")
            prefill.channel = decode.channel = broker_channel  # the broker checks the registrar's engine tokens
            keep_alive = await FakeEngine(registrar_channel, "prefill-0", sample.PREFILL, shared_token=token, token=prefill.token, leases=prefill.leases).keep_alive()
            orders = await prefill.orders()
            events = await decode.events()
            await decode.broker.RegisterDestination(sample.destination_request("t1"), metadata=decode.metadata, timeout=T)
            await prefill.broker.ReportPrefillDone(sample.prefill_done_request("t1"), metadata=prefill.metadata, timeout=T)
            assert (await read(orders)).order.key.transfer_id == "t1"
            await expect_rpc_error(
                prefill.broker.ReportPrefillDone(sample.prefill_done_request("t2"), metadata=decode.metadata, timeout=T),
                grpc.StatusCode.PERMISSION_DENIED,
                Reason.ENGINE_IDENTITY_MISMATCH,
                "source.engine_id",
            )
            # The prefill engine's KeepAlive stream closing reaches the broker through its watch.
            await decode.broker.RegisterDestination(sample.destination_request("t3"), metadata=decode.metadata, timeout=T)
            keep_alive.cancel()
            event = (await read(events)).event
            while event.key.transfer_id != "t3":
                event = (await read(events)).event
            assert event.reason == tr_pb.END_REASON_PREFILL_ENGINE_LOST
            orders.cancel()
            events.cancel()
    finally:
        statuses = [service.stop() for service in (broker, registrar) if service is not None]
    assert statuses == [0, 0]


def test_a_broker_without_the_engine_token_key_refuses_to_start(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "kvpush.cli", "broker", "--listen", "127.0.0.1:0", "--token", "x"],
        capture_output=True,
        text=True,
        timeout=START_TIMEOUT_S,
    )
    assert result.returncode == 2
    assert "--engine-token-key-file" in result.stderr

