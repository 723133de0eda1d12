#!/usr/bin/env python3
# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""A minimal push-mode router for kvpush: one prefill engine, one decode engine, non-streamed /v1/completions.

It shows the whole contract of docs/routers.md: mint a transfer key, send
both legs at once with kv_transfer_params["kvpush"] and the W3C traceparent,
cancel the attempt at the broker when a leg fails, and ask the broker how
the transfer ended (answered in the X-Kvpush-Transfer-State header).

    python examples/minimal_router.py --prefill http://127.0.0.1:8100=prefill-0 \\
        --decode http://127.0.0.1:8200=decode-0 --control-plane 127.0.0.1:50051 --token-file runs/tokens/router --port 8000
"""

import argparse
import asyncio
import uuid

import aiohttp
from aiohttp import web
from opentelemetry import trace

from kvpush.client import BrokerClient, ClientConfig
from kvpush.rendezvous.v1 import rendezvous_service_pb2 as pb
from kvpush.rendezvous.v1 import transfer_pb2
from kvpush.telemetry import inject_traceparent, setup_tracing

LEG_TIMEOUT = aiohttp.ClientTimeout(total=60)


class MinimalRouter:
    """Both legs of each request; the broker client cancels and inspects transfers."""

    def __init__(self, prefill: tuple[str, str], decode: tuple[str, str], control_plane: str, token: str):
        self.prefill, self.decode = prefill, decode
        self.broker_config = ClientConfig(target=control_plane, token=token)

    async def open_clients(self, _app: web.Application) -> None:
        self.http, self.broker = aiohttp.ClientSession(), BrokerClient(self.broker_config)

    async def close_clients(self, _app: web.Application) -> None:
        await self.http.close()
        await self.broker.close()

    async def completions(self, request: web.Request) -> web.Response:
        body = await request.json()
        (p_url, p_id), (d_url, d_id) = self.prefill, self.decode
        transfer_id, attempt = f"xfer-{uuid.uuid4().hex}", 1
        with trace.get_tracer("minimal-router").start_as_current_span("router.request", kind=trace.SpanKind.SERVER):
            carrier = inject_traceparent()  # this span's W3C context: header and kv_transfer_params
            key = {"transfer_id": transfer_id, "attempt": attempt, "timeout_ms": 30_000, "traceparent": carrier.get("traceparent", "")}
            p_body = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": {"kvpush": {**key, "role": "prefill", "decode_engine_id": d_id}}}
            d_body = {**body, "stream": False, "kv_transfer_params": {"kvpush": {**key, "role": "decode", "prefill_engine_id": p_id}}}
            legs = [asyncio.create_task(self.leg(p_url, p_body, carrier)), asyncio.create_task(self.leg(d_url, d_body, carrier))]
            try:
                _, answer = await asyncio.gather(*legs)
            except (aiohttp.ClientError, TimeoutError) as exc:
                for task in legs:
                    task.cancel()  # closing a leg's connection makes vLLM abort it
                cancel = pb.CancelTransferRequest(key=transfer_pb2.TransferKey(transfer_id=transfer_id, attempt=attempt), detail=str(exc)[:200])
                await self.broker.cancel_transfer(cancel)
                return web.json_response({"error": {"message": f"transfer {transfer_id} failed: {exc}", "code": 502}}, status=502)
            done = await self.broker.get_transfer(pb.GetTransferRequest(transfer_id=transfer_id, attempt=attempt))
            state = transfer_pb2.TransferState.Name(done.transfer.state)
            return web.json_response(answer, headers={"X-Kvpush-Transfer-Id": transfer_id, "X-Kvpush-Transfer-State": state})

    async def leg(self, url: str, payload: dict, headers: dict[str, str]) -> dict:
        async with self.http.post(url + "/v1/completions", json=payload, headers=headers, timeout=LEG_TIMEOUT) as response:
            response.raise_for_status()
            return await response.json()


def engine(text: str) -> tuple[str, str]:
    url, _, engine_id = text.rpartition("=")
    return url.rstrip("/"), engine_id


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefill", type=engine, required=True, metavar="URL=ENGINE_ID")
    parser.add_argument("--decode", type=engine, required=True, metavar="URL=ENGINE_ID")
    parser.add_argument("--control-plane", required=True, help="host:port of kvpush control-plane")
    parser.add_argument("--token-file", required=True, help="the router's own token (the 'router' file of the control plane's --tokens-dir)")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()
    setup_tracing("minimal-router")  # exports where OTEL_* / KVPUSH_TRACES_FILE say
    with open(args.token_file, encoding="utf-8") as token_file:
        router = MinimalRouter(args.prefill, args.decode, args.control_plane, token_file.read().strip())
    app = web.Application()
    app.router.add_post("/v1/completions", router.completions)
    app.on_startup.append(router.open_clients)
    app.on_cleanup.append(router.close_clients)
    web.run_app(app, host="127.0.0.1", port=args.port)


if __name__ == "__main__":
    main()
