# SPDX-License-Identifier: Apache-2.0
"""A Router under test: served in-process on 127.0.0.1:0 with an HTTP client pointed at it."""

from __future__ import annotations

import time

import aiohttp
from aiohttp import web
from opentelemetry.sdk.trace import TracerProvider

from kvpush.services.router.app import Router
from kvpush.services.router.config import RouterConfig


class RouterUnderTest:
    """A Router served on 127.0.0.1:0 with an HTTP client pointed at it."""

    def __init__(self, config: RouterConfig, provider: TracerProvider):
        self.router = Router(config, tracer_provider=provider)
        self.runner: web.AppRunner | None = None
        self.url = ""
        self.client: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> RouterUnderTest:
        self.runner = web.AppRunner(self.router.build_app())
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"
        self.client = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30))
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.client.close()
        await self.runner.cleanup()

    async def post(self, path: str, body: dict, headers: dict | None = None) -> tuple[int, bytes, float]:
        t0 = time.monotonic()
        async with self.client.post(self.url + path, json=body, headers=headers or {}) as response:
            return response.status, await response.read(), time.monotonic() - t0

    async def metrics(self) -> str:
        async with self.client.get(self.url + "/metrics") as response:
            return (await response.read()).decode()
