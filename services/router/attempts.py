# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""The attempts of one request: both legs to a prefill and a decode engine, by mode, up to the decode leg's first output; a failed attempt is retried as attempt + 1.

Every wait is bounded: the prefill leg by prefill_timeout_s, the decode leg
by first_token_timeout_s until its first output (and between two streamed
chunks) and by request_timeout_s in all. The first-output bound and the
whole request's bound count from the request's arrival, the transfer
deadline (push mode) from its first attempt: a retry gets what its
predecessors left of them, so a request whose every attempt fails is still
answered by its deadline, and none is made with less left than attempts
take to their first output (attempt_times.py). A leg that fails before any output reached the client ends its
attempt: the transfer attempt is cancelled at the broker (push mode; beside the answer, which never waits for it, and
before any retry's legs), the other leg is abandoned (closing its connection
makes vLLM abort it) and, when the fault was an engine's and another engine
is left to try, both legs go out again as attempt + 1. Once output has
reached the client nothing is retried (relay.py).

Push mode answers a failed attempt with the broker's reason
(broker_view.py) without waiting for the decode engine, which fails its
request only once the attempt is fenced.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import TYPE_CHECKING

from aiohttp import web

from kvpush.services.router.broker_view import (
    at_transfer_deadline,
    cancel_transfer,
    explain_decode_failure,
    explain_overdue,
    shard_failure,
    transfer_failure,
    watch_attempt,
)
from kvpush.services.router.core import (
    CLIENT_GONE,
    NO_ENGINE,
    PULL_PREFILL_PARAMS,
    Endpoint,
    decode_body,
    explain_attempt,
    kvpush_params,
    prefill_body,
    upstream_push_decode_params,
    upstream_push_prefill_params,
)
from kvpush.services.router.failures import ClientGone, LegFailure, error_response
from kvpush.services.router.legs import DECODE, PREFILL, DecodeLeg, Opened, RequestContext, leg_span, prefill_leg
from kvpush.services.router.relay import respond
from kvpush.telemetry import ATTR_ATTEMPT

if TYPE_CHECKING:
    from kvpush.services.router.app import Router

logger = logging.getLogger(__name__)

# nginx's status for a request whose client closed the connection first (no one reads it: metrics only).
CLIENT_CLOSED_STATUS = 499
# How often a push-mode attempt waiting for the decode leg's first output
# checks that its client is still connected (aiohttp does not cancel
# handlers by default, so nothing else would notice before the answer).
CLIENT_CHECK_INTERVAL_S = 0.25


async def dispatch(router: Router, request: web.Request, ctx: RequestContext) -> web.StreamResponse:
    """Answers one checked request: attempt after attempt until one's decode leg has output, no engine is left or a failure is final."""
    failed_prefill: set[Endpoint] = set()
    failed_decode: set[Endpoint] = set()
    failure: LegFailure | None = None
    p_endpoint = d_endpoint = None
    for attempt in range(1, router.config.max_attempts + 1):
        p_endpoint = router.prefill_pool.pick(failed_prefill)
        if d_endpoint is None or d_endpoint in failed_decode:
            d_endpoint = router.decode_pool.pick(failed_decode)
        if p_endpoint is None or d_endpoint is None:
            break
        if attempt > 1:
            # A retry that cannot get output in what is left of the request would only trade the failure in hand
            # (and its reason) for a deadline error later: answer with it now.
            needed = router.attempt_times.retry_needs_s()
            left = _left_until_output(router, ctx)
            if ctx.cancelling is not None and left >= needed:
                # The failed attempt's cancel reaches the broker before the retry's legs (within what is left).
                await asyncio.wait([ctx.cancelling], timeout=left - needed)
                left = _left_until_output(router, ctx)
            if left < needed:
                router.metrics.retries_skipped.inc()
                ctx.span.add_event("retry_skipped", {ATTR_ATTEMPT: attempt, "kvpush.left_s": round(left, 3), "kvpush.needed_s": round(needed, 3)})
                break
            router.metrics.retries.inc()
            ctx.span.add_event("retry", {ATTR_ATTEMPT: attempt, "kvpush.prefill_engine_id": p_endpoint.engine_id, "kvpush.decode_engine_id": d_endpoint.engine_id})
        ctx.span.set_attributes({ATTR_ATTEMPT: attempt, "kvpush.prefill_engine_id": p_endpoint.engine_id, "kvpush.decode_engine_id": d_endpoint.engine_id})
        started = time.monotonic()
        try:
            if router.config.mode == "pull":
                opened = await _attempt_sequential(router, ctx, attempt, p_endpoint, d_endpoint)
            else:
                opened = await _attempt_concurrent(router, ctx, attempt, p_endpoint, d_endpoint)
            router.attempt_times.observe(time.monotonic() - started)
        except ClientGone:
            logger.info("request %s: the client went away before any output", ctx.client_request_id)
            ctx.failure_reason = CLIENT_GONE
            return web.Response(status=CLIENT_CLOSED_STATUS)
        except LegFailure as exc:
            failure = exc
            exc.attempt = attempt
            router.metrics.leg_failures.labels(exc.leg, exc.cause).inc()
            event: dict[str, str | int] = {"kvpush.leg": exc.leg, "kvpush.cause": exc.cause, "kvpush.reason": exc.reason, ATTR_ATTEMPT: attempt, "message": str(exc)}
            ctx.span.add_event("leg_failed", event)
            logger.warning("request %s attempt %d: %s", ctx.client_request_id, attempt, exc)
            if not exc.retryable:
                break
            if exc.blames_engine:
                (failed_prefill if exc.leg == PREFILL else failed_decode).add(exc.endpoint)
            continue
        return await respond(router, request, ctx, opened)
    if failure is not None:
        ctx.failure_reason = failure.reason
        return failure.response(ctx.transfer_id)
    role = "prefill" if p_endpoint is None else "decode"
    ctx.failure_reason = NO_ENGINE
    return error_response(503, f"no {role} engine available", leg=role, reason=NO_ENGINE)


def _first_output_limit(router: Router, ctx: RequestContext) -> float:
    """The bound on the request's first output: first_token_timeout_s streamed, else the whole request's."""
    return router.config.first_token_timeout_s if ctx.stream else router.config.request_timeout_s


def _left_until_output(router: Router, ctx: RequestContext) -> float:
    """Seconds left of the request's first-output bound and, in push mode, of its transfer deadline."""
    left = ctx.left_s(_first_output_limit(router, ctx))
    if ctx.transfer_deadline:
        left = min(left, ctx.transfer_left_s())
    return left


async def _attempt_sequential(router: Router, ctx: RequestContext, attempt: int, p_endpoint: Endpoint, d_endpoint: Endpoint) -> Opened:
    """Pull mode: the prefill leg, then the decode leg with the parameters the prefill engine returned."""
    p_span = leg_span(router, ctx, PREFILL, p_endpoint, attempt)
    p_headers = ctx.leg_headers(p_span, ctx.client_request_id)
    answer = await prefill_leg(router, ctx, p_endpoint, prefill_body(ctx.body, ctx.path, PULL_PREFILL_PARAMS), p_headers, p_span)
    params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
    if not isinstance(params, dict):
        raise LegFailure(PREFILL, p_endpoint, "protocol", "answered without kv_transfer_params (is it a kv_producer with NixlConnector?)")
    d_span = leg_span(router, ctx, DECODE, d_endpoint, attempt)
    decode = DecodeLeg(router, ctx, d_endpoint, decode_body(ctx.body, params), ctx.leg_headers(d_span, ctx.client_request_id), d_span)
    limit = _first_output_limit(router, ctx)
    try:
        async with asyncio.timeout(ctx.left_s(limit)):
            await decode.open()
    except TimeoutError as exc:
        decode.close(abort=True, error="timeout")
        raise LegFailure(DECODE, d_endpoint, "timeout", f"no output within {limit:g} s of the request's arrival", status=504) from exc
    except BaseException as exc:
        decode.close(abort=True, error=str(exc) or type(exc).__name__)
        raise
    return Opened(decode, None)


async def _attempt_concurrent(router: Router, ctx: RequestContext, attempt: int, p_endpoint: Endpoint, d_endpoint: Endpoint) -> Opened:
    """Push modes: both legs at once; returns once the decode leg produced output."""
    config = router.config
    p_span = leg_span(router, ctx, PREFILL, p_endpoint, attempt)
    d_span = leg_span(router, ctx, DECODE, d_endpoint, attempt)
    if config.mode == "push":
        ctx.broker_owner = router.shards.owner(ctx.transfer_id)
        if ctx.broker_owner.member_id:
            ctx.span.set_attribute("kvpush.broker_member_id", ctx.broker_owner.member_id)
        # The transfer deadline is the request's: the first attempt carries it,
        # a retry what is left of it (dispatch keeps that >= what an attempt takes).
        if ctx.transfer_deadline:
            timeout_ms = max(1, int(ctx.transfer_left_s() * 1000))
        else:
            ctx.transfer_deadline = time.monotonic() + config.transfer_timeout_ms / 1000
            timeout_ms = config.transfer_timeout_ms
        p_params = kvpush_params(PREFILL, ctx.transfer_id, attempt, d_endpoint.engine_id, traceparent=ctx.trace_carrier(p_span).get("traceparent", ""),
                                 client_request_id=ctx.client_request_id, timeout_ms=timeout_ms)
        d_params = kvpush_params(DECODE, ctx.transfer_id, attempt, p_endpoint.engine_id, traceparent=ctx.trace_carrier(d_span).get("traceparent", ""),
                                 client_request_id=ctx.client_request_id, timeout_ms=timeout_ms)
        p_headers = ctx.leg_headers(p_span, ctx.client_request_id)
        d_headers = ctx.leg_headers(d_span, ctx.client_request_id)
    else:
        # Upstream NixlPushConnector matches the legs on X-Request-Id: a fresh one per attempt.
        request_id = uuid.uuid4().hex
        p_params = upstream_push_prefill_params(ctx.transfer_id)
        d_params = upstream_push_decode_params(
            p_endpoint.engine_id, config.prefill_kv_host, config.prefill_side_channel_port, config.prefill_tp_size, config.prefill_pp_size,
            request_id, ctx.transfer_id,
        )
        p_headers = ctx.leg_headers(p_span, request_id)
        d_headers = ctx.leg_headers(d_span, request_id)
    p_task = asyncio.create_task(prefill_leg(router, ctx, p_endpoint, prefill_body(ctx.body, ctx.path, p_params), p_headers, p_span))
    decode = DecodeLeg(router, ctx, d_endpoint, decode_body(ctx.body, d_params), d_headers, d_span)
    d_task = asyncio.create_task(decode.open())
    try:
        if config.mode == "push":
            await _first_output_push(router, ctx, attempt, p_task, d_task, p_endpoint, d_endpoint)
        else:
            await _first_output(router, ctx, p_task, d_task, p_endpoint, d_endpoint)
    except BaseException as exc:
        for task in (p_task, d_task):
            task.cancel()
        # Both tasks end at once when cancelled; their own failures were already handled here.
        await asyncio.gather(p_task, d_task, return_exceptions=True)
        error = "client went away" if isinstance(exc, ClientGone) else str(exc) or type(exc).__name__
        decode.close(abort=True, error=error)
        if config.mode == "push" and getattr(exc, "cancel_attempt", True):
            # Beside the answer: a broker that does not answer would otherwise hold it up to --cancel-timeout.
            ctx.cancelling = router.cancel_later(cancel_transfer(router, ctx.transfer_id, attempt, error))
        raise
    return Opened(decode, p_task)


async def _first_output(router: Router, ctx: RequestContext, p_task: asyncio.Task, d_task: asyncio.Task, p_endpoint: Endpoint, d_endpoint: Endpoint) -> None:
    """Waits for the decode leg's first output; raises the first leg failure, or a timeout naming the leg waited on."""
    loop = asyncio.get_running_loop()
    limit = _first_output_limit(router, ctx)
    deadline = loop.time() + ctx.left_s(limit)
    pending: set[asyncio.Task] = {p_task, d_task}
    while not d_task.done():
        remaining = deadline - loop.time()
        if remaining <= 0:
            if not p_task.done():
                raise LegFailure(PREFILL, p_endpoint, "timeout", f"no answer within {limit:g} s of the request's arrival while the decode leg waited for the KV", status=504)
            raise LegFailure(DECODE, d_endpoint, "timeout", f"no output within {limit:g} s of the request's arrival", status=504)
        done, pending = await asyncio.wait(pending, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
        if p_task in done and (prefill_error := p_task.exception()) is not None:
            raise prefill_error
    d_task.result()


async def _first_output_push(
    router: Router, ctx: RequestContext, attempt: int, p_task: asyncio.Task, d_task: asyncio.Task, p_endpoint: Endpoint, d_endpoint: Endpoint
) -> None:
    """Push mode: waits for the decode leg's first output; raises the failure to answer, with the broker's reason where it has one.

    Besides the leg timeouts of _first_output:
    * transfer deadline guard: no output by the request's transfer deadline plus
      transfer_deadline_slack_s answers at once (the broker's reason, else
      504), unless the broker says the KV arrived (DONE: a long
      non-streamed answer is still being generated);
    * early failure: once the prefill leg has answered and the decode leg
      stayed silent for early_poll_delay_s, a GetTransfer long poll
      returns when the attempt ends; an end without the KV is answered
      at once, without waiting for the decode engine (it fails its
      request only once the broker has fenced the attempt, or at its own
      deadline plus a margin when it lost the broker). Polling only
      after the prefill leg answered, and only after a delay, keeps the
      RPC off successful streamed requests: their decode leg's first
      chunk follows P's answer within a WRITE and one decode step. A
      non-streamed request's output is its whole answer, so a long one
      does make this one call (answered as soon as the attempt is DONE);
    * a client that disconnects ends the attempt (ClientGone);
    * the broker member holding the attempt leaving the shard map (or no
      longer owning the transfer) ends it at once: BROKER_SHARD_LOST (or
      _MOVED), retried on any engines.
    """
    loop = asyncio.get_running_loop()
    config = router.config
    limit = _first_output_limit(router, ctx)
    deadline = loop.time() + ctx.left_s(limit)
    guard_at = loop.time() + ctx.transfer_left_s() + config.transfer_deadline_slack_s
    poll_at = float("inf")  # when the long poll starts: set once the prefill leg has answered
    poll: asyncio.Task | None = None
    kv_arrived = False  # the broker said DONE: nothing left to ask it
    client_watch = asyncio.create_task(_watch_client(ctx))
    shard_lost = router.shards.watch(ctx.transfer_id, ctx.broker_owner)
    pending: set[asyncio.Future] = {p_task, d_task, client_watch, shard_lost}
    try:
        while not d_task.done():
            now = loop.time()
            if client_watch.done():
                raise ClientGone()
            if not kv_arrived and shard_lost.done() and not shard_lost.cancelled():
                raise shard_failure(router, ctx, attempt, d_endpoint, shard_lost.result(), "the decode leg had no output yet")
            if now >= deadline:
                if not p_task.done():
                    raise LegFailure(PREFILL, p_endpoint, "timeout", f"no answer within {limit:g} s of the request's arrival while the decode leg waited for the KV", status=504)
                timeout = LegFailure(DECODE, d_endpoint, "timeout", f"no output within {limit:g} s of the request's arrival", status=504)
                raise await explain_overdue(router, ctx, attempt, p_endpoint, d_endpoint, timeout)
            if now >= guard_at:
                guard_at = float("inf")
                failure = await at_transfer_deadline(router, ctx, attempt, p_endpoint, d_endpoint, prefill_finished=p_task.done())
                if failure is not None:
                    raise failure
                kv_arrived = True  # only the leg timeouts bound the decode leg now
                _forget(router, shard_lost, pending)
                continue
            if poll is None and not kv_arrived and now >= poll_at:
                poll = asyncio.create_task(watch_attempt(router, ctx.transfer_id, attempt, until=guard_at))
                pending.add(poll)
            wake = min(deadline, guard_at, poll_at if poll is None and not kv_arrived else float("inf"))
            done, pending = await asyncio.wait(pending, timeout=max(wake - now, 0), return_when=asyncio.FIRST_COMPLETED)
            if p_task in done:
                if (prefill_error := p_task.exception()) is not None:
                    raise prefill_error
                poll_at = loop.time() + config.early_poll_delay_s
            if poll is not None and poll in done:
                record = poll.result()
                if record is not None and record.ended:
                    verdict = explain_attempt(record, ctx.client_request_id, p_endpoint.engine_id, d_endpoint.engine_id)
                    if verdict is not None:
                        raise transfer_failure(verdict, p_endpoint, d_endpoint, "the decode leg had no output yet")
                    # DONE: the KV arrived; only the leg timeouts bound the decode leg now.
                    guard_at, kv_arrived = float("inf"), True
                    _forget(router, shard_lost, pending)
    finally:
        router.shards.unwatch(shard_lost)
        helpers = [task for task in (poll, client_watch) if task is not None and not task.done()]
        for task in helpers:
            task.cancel()
        await asyncio.gather(*helpers, return_exceptions=True)
    try:
        d_task.result()
    except LegFailure as exc:
        if exc.status < 500 or exc.cause == "connect":
            raise  # the engine refused the request itself, or never got it: the broker knows nothing more
        explained = await explain_decode_failure(router, ctx, attempt, p_endpoint, d_endpoint, exc, until=min(deadline, guard_at))
        if explained is exc:
            raise
        raise explained from exc


def _forget(router: Router, shard_lost: asyncio.Future, pending: set[asyncio.Future]) -> None:
    """The KV arrived: the attempt's broker member no longer matters to it."""
    router.shards.unwatch(shard_lost)
    pending.discard(shard_lost)


async def _watch_client(ctx: RequestContext) -> None:
    """Returns once the client's connection is gone (a sleep loop of its own: cheaper than waking the attempt's wait)."""
    while not ctx.client_gone():
        await asyncio.sleep(CLIENT_CHECK_INTERVAL_S)
