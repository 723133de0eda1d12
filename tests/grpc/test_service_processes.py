# SPDX-License-Identifier: Apache-2.0
"""The services as real processes: `kvpush control-plane`, and `kvpush registrar` + `kvpush broker` apart."""

from __future__ import annotations

import asyncio
import os
import pathlib
import re
import subprocess
import sys
import urllib.request

import grpc
import pytest
from rpc_harness import CALL_TIMEOUT_S, FakeEngine, expect_rpc_error, read

from kvpush.dev import sample_engines as sample
from kvpush.errors import Reason
from kvpush.registrar.v1 import registrar_service_pb2 as reg_pb
from kvpush.registrar.v1 import registrar_service_pb2_grpc as reg_grpc
from kvpush.rendezvous.v1 import transfer_pb2 as tr_pb
from kvpush.services.common.tokens import create_tokens
from tests.kvpush_process import KvpushProcess, wait_serving

START_TIMEOUT_S = 20.0
T = CALL_TIMEOUT_S


def kvpush(*args: str) -> subprocess.CompletedProcess:
    """`python -m kvpush.cli ARGS` to completion."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "KVPUSH_"))}
    return subprocess.run([sys.executable, "-m", "kvpush.cli", *args], capture_output=True, text=True, timeout=START_TIMEOUT_S, env=env)


def bearer_of(tokens_dir: pathlib.Path, identity: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {(tokens_dir / identity).read_text().strip()}"),)


async def test_kvpush_tokens_then_a_control_plane_serving_those_identities_and_stopping_cleanly(tmp_path):
    tokens_dir = tmp_path / "tokens"
    created = kvpush("tokens", "--dir", str(tokens_dir), "router", "prefill-0")
    assert created.returncode == 0, created.stderr
    kept = kvpush("tokens", "--dir", str(tokens_dir), "router", "decode-0")
    tokens = {path.name: path.read_text().strip() for path in tokens_dir.iterdir()}
    assert sorted(tokens) == ["decode-0", "prefill-0", "router"] and len(set(tokens.values())) == 3
    assert all((tokens_dir / name).stat().st_mode & 0o777 == 0o600 for name in tokens)
    assert "created decode-0; kept router" in kept.stdout
    assert not any(
        token in created.stdout + created.stderr + kept.stdout + kept.stderr for token in tokens.values()
    )  # nothing secret printed
    service = KvpushProcess(tmp_path, "control-plane", "control-plane", "--tokens-dir", str(tokens_dir), "--metrics-port", "0")
    try:
        port = (await service.start()).port
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            await wait_serving(channel, "kvpush.rendezvous.v1.RendezvousService")
            registrar = reg_grpc.RegistrarServiceStub(channel)
            await registrar.RegisterEngineRank(
                sample.rank_request("decode-0", sample.DECODE), metadata=bearer_of(tokens_dir, "decode-0"), timeout=T
            )
            await expect_rpc_error(
                registrar.RegisterEngineRank(
                    sample.rank_request("prefill-0", sample.PREFILL), metadata=bearer_of(tokens_dir, "router"), timeout=T
                ),
                grpc.StatusCode.PERMISSION_DENIED,
                Reason.ENGINE_IDENTITY_MISMATCH,
                "rank.engine_id",
            )
        metrics_url = re.search(r"metrics on (http://127\.0\.0\.1:\d+/metrics)", service.log_path.read_text()).group(1)
        metrics = await asyncio.to_thread(lambda: urllib.request.urlopen(metrics_url, timeout=T).read().decode())
        assert "kvpush_broker_rendezvous_total 0.0" in metrics and "kvpush_registrar_engines 1.0" in metrics
    finally:
        assert await service.stop() == 0
    log = service.log_path.read_text()
    assert f"listening on 127.0.0.1:{port}" in log and "metrics on http://127.0.0.1:" in log and "stopped" in log


async def test_separate_registrar_and_broker(tmp_path):
    tokens_dir = tmp_path / "tokens"
    create_tokens(tokens_dir, ["router", "broker", "prefill-0", "decode-0"])
    token = {path.name: path.read_text().strip() for path in tokens_dir.iterdir()}
    shared = ("--tokens-dir", str(tokens_dir))
    registrar = KvpushProcess(tmp_path, "registrar", "registrar", *shared, "--lease-ttl", "30")
    broker = None
    try:
        registrar_port = (await registrar.start()).port
        broker = KvpushProcess(tmp_path, "broker", "broker", *shared, "--registrar", f"127.0.0.1:{registrar_port}")
        broker_port = (await broker.start()).port
        async with (
            grpc.aio.insecure_channel(f"127.0.0.1:{registrar_port}") as registrar_channel,
            grpc.aio.insecure_channel(f"127.0.0.1:{broker_port}") as broker_channel,
        ):
            prefill = await FakeEngine(registrar_channel, "prefill-0", sample.PREFILL, token=token["prefill-0"]).register()
            decode = await FakeEngine(registrar_channel, "decode-0", sample.DECODE, token=token["decode-0"]).register()
            # The broker mirrors the registrar as `broker`, which may read engines and nothing else.
            await wait_serving(broker_channel, "kvpush.rendezvous.v1.RendezvousService")
            await expect_rpc_error(
                reg_grpc.RegistrarServiceStub(registrar_channel).DeregisterEngineRank(
                    reg_pb.DeregisterEngineRankRequest(lease_id=prefill.leases[0]), metadata=bearer_of(tokens_dir, "broker"), timeout=T
                ),
                grpc.StatusCode.PERMISSION_DENIED,
                Reason.ENGINE_IDENTITY_MISMATCH,
                "lease_id",
            )
            prefill.channel = decode.channel = broker_channel
            keep_alive = await FakeEngine(
                registrar_channel, "prefill-0", sample.PREFILL, token=prefill.token, leases=prefill.leases
            ).keep_alive()
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
            # The prefill engine leaving the registrar reaches the broker through its watch.
            await decode.broker.RegisterDestination(sample.destination_request("t3"), metadata=decode.metadata, timeout=T)
            keep_alive.cancel()
            await reg_grpc.RegistrarServiceStub(registrar_channel).DeregisterEngineRank(
                reg_pb.DeregisterEngineRankRequest(lease_id=prefill.leases[0]), metadata=prefill.metadata, timeout=T
            )
            event = (await read(events)).event
            while event.key.transfer_id != "t3":
                event = (await read(events)).event
            assert event.reason == tr_pb.END_REASON_PREFILL_ENGINE_LOST
            orders.cancel()
            events.cancel()
    finally:
        statuses = [await service.stop() for service in (broker, registrar) if service is not None]
    assert statuses == [0, 0]


def test_a_broker_without_its_own_token_refuses_to_start(tmp_path):
    create_tokens(tmp_path, ["router", "prefill-0"])
    result = kvpush("broker", "--listen", "127.0.0.1:0", "--tokens-dir", str(tmp_path))
    assert result.returncode == 2
    assert "no 'broker' file" in result.stderr


@pytest.mark.parametrize("command", ["control-plane", "registrar", "broker"])
def test_token_mode_needs_a_tokens_dir(command):
    result = kvpush(command, "--listen", "127.0.0.1:0")
    assert result.returncode == 2
    assert "--tokens-dir" in result.stderr


@pytest.mark.parametrize("command", ["control-plane", "registrar", "broker"])
def test_duplicate_tokens_are_refused_at_startup(tmp_path, command):
    create_tokens(tmp_path, ["router", "broker"])
    (tmp_path / "prefill-0").write_text((tmp_path / "router").read_text())
    result = kvpush(command, "--listen", "127.0.0.1:0", "--tokens-dir", str(tmp_path))
    assert result.returncode == 2
    assert f"{tmp_path / 'prefill-0'} and {tmp_path / 'router'} hold the same token" in result.stderr


def test_kvpush_tokens_refuses_a_name_that_is_no_identity(tmp_path):
    result = kvpush("tokens", "--dir", str(tmp_path / "tokens"), "router", "not/an-id")
    assert result.returncode == 2 and "'not/an-id' is not an identity" in result.stderr
    assert not (tmp_path / "tokens").exists()
