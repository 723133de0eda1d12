# SPDX-License-Identifier: Apache-2.0
"""Fixtures of the gRPC tests; the helpers they use live in rpc_harness (importable by name, unlike a conftest)."""

from __future__ import annotations

import grpc
import pytest
from rpc_harness import FakeEngine, running_control_plane

from kvpush.dev import sample_engines as sample
from kvpush.services.common.config import ServerConfig


@pytest.fixture
async def plane():
    async with running_control_plane(ServerConfig(listen="127.0.0.1:0")) as started:
        yield started


@pytest.fixture
async def channel(plane):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{plane.port}") as opened:
        yield opened


@pytest.fixture
async def engines(channel):
    """prefill-0 and decode-0 (one rank each), registered."""
    prefill = await FakeEngine(channel, "prefill-0", sample.PREFILL).register()
    decode = await FakeEngine(channel, "decode-0", sample.DECODE).register()
    return prefill, decode
