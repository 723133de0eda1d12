# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""Fixtures of the transfer-failure tests: a real control plane with its engines registered, a tracer provider."""

from __future__ import annotations

import grpc
import pytest

from kvpush.services import control_plane
from kvpush.services.common.config import ServerConfig
from kvpush.services.common.tokens import ROUTER_IDENTITY, IdentityTokens
from tests.router.transfer_failure_harness import (
    ENGINE_IDS,
    EngineAtBroker,
    Plane,
    token_of,
)


@pytest.fixture
async def plane():
    tokens = IdentityTokens({identity: token_of(identity) for identity in (ROUTER_IDENTITY, *ENGINE_IDS)})
    async with (
        control_plane.running(ServerConfig(listen="127.0.0.1:0"), tokens=tokens) as started,
        grpc.aio.insecure_channel(f"127.0.0.1:{started.port}") as channel,
    ):
        engines = {engine_id: await EngineAtBroker(channel, engine_id).register() for engine_id in ENGINE_IDS}
        try:
            yield Plane(started, channel, engines)
        finally:
            for engine in engines.values():
                await engine.close()


