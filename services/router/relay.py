# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""Sends the decode leg's answer to the client: the JSON body, or the SSE stream relayed chunk by chunk; nothing is retried from here on.

A stream that breaks off after output reached the client ends with an
OpenAI-style error event, as vLLM ends its own failed streams.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import TYPE_CHECKING

import aiohttp
from aiohttp import web
from opentelemetry.trace import Status, StatusCode

from kvpush.services.router.core import CLIENT_GONE, OUTPUT_BROKE_OFF
from kvpush.services.router.failures import LegFailure, error_body
from kvpush.services.router.legs import DECODE, PREFILL, Opened, RequestContext
from kvpush.sse import DONE
from kvpush.telemetry import FIRST_TOKEN_EVENT

if TYPE_CHECKING:
    from kvpush.services.router.app import Router

logger = logging.getLogger(__name__)


def _record_first_output(router: Router, ctx: RequestContext) -> None:
    ttft_s = time.monotonic() - ctx.started
    ctx.span.add_event(FIRST_TOKEN_EVENT)
    ctx.span.set_attribute("kvpush.ttft_ms", ttft_s * 1000)
    router.metrics.ttft.observe(ttft_s)
    if ctx.first_output_read:
        router.metrics.segment_relay.observe(time.monotonic() - ctx.first_output_read)
    if ctx.prefill_answered:
        router.metrics.after_prefill_leg.observe(time.monotonic() - ctx.prefill_answered)


async def respond(router: Router, request: web.Request, ctx: RequestContext, opened: Opened) -> web.StreamResponse:
    """Sends the decode leg's answer to the client; nothing is retried from here on."""
    decode = opened.decode
    try:
        if not ctx.stream:
            ctx.span.set_attribute("kvpush.response_ms", (time.monotonic() - ctx.started) * 1000)
            decode.close(abort=False)
            return web.Response(status=200, body=decode.buffered[0], content_type="application/json")
        response = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        finished = False  # the [DONE] marker went out: the client has the whole answer
        try:
            await response.write(b"".join(decode.buffered))
            _record_first_output(router, ctx)
            while True:
                try:
                    # Relayed as it arrives, not line by line: one write to the client per read, not two per event.
                    chunk = await decode.next_chunk()
                except (TimeoutError, aiohttp.ClientError) as exc:
                    error = f"decode leg to {decode.endpoint} broke off after output started: {type(exc).__name__}: {exc}"
                    ctx.failure_reason = OUTPUT_BROKE_OFF
                    router.metrics.leg_failures.labels(DECODE, "after_output").inc()
                    logger.warning("request %s: %s", ctx.client_request_id, error)
                    ctx.span.set_status(Status(StatusCode.ERROR, error))
                    decode.close(abort=True, error=error)
                    event = error_body(502, error, reason=OUTPUT_BROKE_OFF, leg=DECODE, engine_id=decode.endpoint.engine_id, transfer_id=ctx.transfer_id)
                    await response.write(b"data: " + json.dumps(event).encode() + b"\n\ndata: [DONE]\n\n")
                    break
                if not chunk:
                    break
                # Read before the write: a client that hangs up on the blank line ending [DONE] has its answer.
                # Undecoded: the chunks pass through, and JSON-decoding each would cost the router CPU per token.
                finished = finished or any(data.strip() == DONE for data in decode.events.feed_chunk(chunk))
                await response.write(chunk)
            decode.close(abort=False)
            await response.write_eof()
        except ConnectionResetError:
            # A client that got [DONE] may hang up before the stream's last bytes: that is no failure.
            if finished:
                decode.close(abort=False)
            else:
                logger.info("request %s: the client went away", ctx.client_request_id)
                ctx.failure_reason = CLIENT_GONE
                ctx.span.set_status(Status(StatusCode.ERROR, "client went away"))
                decode.close(abort=True, error="client went away")
        return response
    finally:
        decode.close(abort=True, error="abandoned")
        await _settle_prefill(router, ctx, opened.prefill)


async def _settle_prefill(router: Router, ctx: RequestContext, task: asyncio.Task | None) -> None:
    """Collects the prefill leg's outcome once the answer is out (the task is bounded by prefill_timeout_s)."""
    if task is None:
        return
    try:
        await task
    except LegFailure as exc:
        router.metrics.leg_failures.labels(PREFILL, "after_output").inc()
        logger.warning("request %s: %s (after the decode leg had answered)", ctx.client_request_id, exc)
