# SPDX-License-Identifier: Apache-2.0
"""Servicer plumbing: kvpush errors become rich statuses, outboxes drain into streams, the code a call ended with."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable

import grpc
from opentelemetry import trace

from kvpush import status
from kvpush.errors import Internal, KvpushError, Reason
from kvpush.services.common.outbox import Outbox
from kvpush.telemetry import span_attributes

logger = logging.getLogger(__name__)


def rpc_method(method):
    """Wraps an async servicer method: KvpushError aborts with its rich status, anything else with INTERNAL.

    No exception escapes as UNKNOWN. Streaming methods write with
    context.write() (they are coroutines, not generators), so one wrapper
    fits every RPC shape.
    """

    @functools.wraps(method)
    async def wrapper(self, request, context: grpc.aio.ServicerContext):
        _tag_transfer(request)
        try:
            return await method(self, request, context)
        except KvpushError as err:
            await context.abort_with_status(status.to_status(err))
        except grpc.aio.AbortError:
            raise
        except Exception:
            logger.exception("%s failed", method.__qualname__)
            await context.abort_with_status(status.to_status(Internal("internal error; see the server log", reason=Reason.INTERNAL)))

    return wrapper


def final_status_code(context: grpc.aio.ServicerContext, error: BaseException | None) -> grpc.StatusCode:
    """The status code a call ends with, seen from around its handler (error: what the handler raised, if anything)."""
    if isinstance(error, asyncio.CancelledError):
        return grpc.StatusCode.CANCELLED
    if error is not None and not isinstance(error, grpc.aio.AbortError):
        return grpc.StatusCode.UNKNOWN
    return context.code() or grpc.StatusCode.OK


def _tag_transfer(request) -> None:
    """Puts the transfer a call is about on its server span, so traces join on it."""
    span = trace.get_current_span()
    if not span.is_recording():
        return
    key = getattr(request, "key", None)
    if key is not None and key.transfer_id:
        span.set_attributes(span_attributes(key.transfer_id, key.attempt))
    elif getattr(request, "transfer_id", ""):
        span.set_attributes(span_attributes(request.transfer_id, request.attempt))


async def drain_to_stream(
    outbox: Outbox,
    context: grpc.aio.ServicerContext,
    wanted: Callable[[], bool],
    *,
    heartbeat: Callable[[], object] | None = None,
    heartbeat_interval_s: float | None = None,
) -> None:
    """Writes what the outbox receives to the stream until it closes or wanted() turns False.

    A stream that fails loses what was drained but not written: subscribers
    resync on their next stream, so nothing is put back. With heartbeat, a
    stream quiet for heartbeat_interval_s gets heartbeat() written.
    """
    while wanted():
        items = outbox.drain()
        if not items:
            if outbox.closed:
                return
            if heartbeat is None:
                await outbox.wait()
                continue
            try:
                async with asyncio.timeout(heartbeat_interval_s):
                    await outbox.wait()
            except TimeoutError:
                items = [heartbeat()]
        for item in items:
            await context.write(item)
