# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""`kvpush router`: the OpenAI-compatible P/D router over HTTP (aiohttp)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from aiohttp import web

from kvpush.services.common.config import write_private_file
from kvpush.services.common.server import run_event_loop
from kvpush.services.router.app import Router
from kvpush.services.router.config import RouterConfig
from kvpush.telemetry import configure_tracing

logger = logging.getLogger(__name__)


def configure_parser(parser: argparse.ArgumentParser) -> None:
    RouterConfig.add_arguments(parser)


async def serve(config: RouterConfig) -> int:
    """Serves until SIGTERM or SIGINT, then lets in-flight requests finish (aiohttp's shutdown) and closes the clients."""
    configure_tracing("kvpush-router")
    router = Router(config)
    runner = web.AppRunner(router.build_app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port)
    await site.start()
    port = runner.addresses[0][1]
    print(f"kvpush router listening on http://{config.listen.rpartition(':')[0]}:{port} (mode {config.mode}, policy {config.policy})", flush=True)
    if config.port_file is not None:
        write_private_file(config.port_file, f"{port}\n")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    try:
        await stop.wait()
    finally:
        logger.info("shutting down")
        await runner.cleanup()
    return 0


def run(args: argparse.Namespace) -> int:
    try:
        config = RouterConfig.from_args(args)
    except ValueError as exc:
        print(f"kvpush router: {exc}", file=sys.stderr)
        return 2
    return run_event_loop(serve(config))
