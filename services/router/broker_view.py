# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""The broker's view of a push-mode attempt (GetTransfer), turned into the failure the client gets; and cancelling an attempt.

vLLM only tells the decode leg "Internal server error" when a kvpush
attempt fails, so the router asks the broker why: when the decode leg
fails, when it has no output by the transfer deadline plus slack, and,
with a long poll, once the prefill leg has answered and the decode leg
stays silent. The client gets the broker's end reason with a fitting
status (core.explain_attempt).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from kvpush import errors
from kvpush.client import UNSHARDED
from kvpush.rendezvous.v1 import rendezvous_service_pb2 as rv_pb
from kvpush.services.router.core import (
    BROKER_MEMBER_UNREACHABLE,
    BROKER_SIDE,
    CONTROL_PLANE_UNREACHABLE,
    ROUTER_DEADLINE_EXCEEDED,
    AttemptRecord,
    Endpoint,
    Verdict,
    deadline_side,
    explain_attempt,
)
from kvpush.services.router.failures import LegFailure, TransferFailure
from kvpush.services.router.legs import DECODE, PREFILL, RequestContext
from kvpush.services.router.shard_watch import BROKER_SHARD_MOVED

if TYPE_CHECKING:
    from kvpush.services.router.app import Router

logger = logging.getLogger(__name__)

# The longest single GetTransfer long poll (the broker honours up to 600 s);
# a longer wait polls again.
MAX_POLL_WAIT_S = 60.0


async def _lookup(router: Router, transfer_id: str, attempt: int, wait_s: float | None = None, *, answer_by: float | None = None) -> AttemptRecord:
    """The broker's record of the attempt (GetTransfer; a long poll with wait_s); raises kvpush.errors exceptions.

    answer_by: loop time of the request's own bound when the record is to explain a failure; the call then ends by it, or
    half the transfer deadline's slack after it once it has passed (gRPC's retries of an unreachable member would otherwise
    add up to --cancel-timeout to the answer).
    """
    request = rv_pb.GetTransferRequest(transfer_id=transfer_id, attempt=attempt)
    timeout_s = router.config.cancel_timeout_s
    if answer_by is not None:
        timeout_s = min(timeout_s, max(answer_by - asyncio.get_running_loop().time(), router.config.transfer_deadline_slack_s / 2))
    response = await router.broker.get_transfer(request, timeout_s=timeout_s, wait_s=wait_s)
    return AttemptRecord.from_transfer(response.transfer)


async def watch_attempt(router: Router, transfer_id: str, attempt: int, *, until: float) -> AttemptRecord | None:
    """Long-polls the broker until the attempt ends or loop time `until`; None when the broker cannot tell by then."""
    loop = asyncio.get_running_loop()
    retry_s = max(router.config.early_poll_delay_s, 0.05)
    while True:
        wait_s = min(until - loop.time(), MAX_POLL_WAIT_S)
        if wait_s <= 0:
            return None
        try:
            record = await _lookup(router, transfer_id, attempt, wait_s=wait_s)
        except errors.NotFound:
            # Neither side has reached the broker yet (the broker cannot
            # wait for an attempt it does not know): ask again, less and
            # less often; the transfer deadline guard bounds this.
            await asyncio.sleep(max(min(retry_s, until - loop.time()), 0))
            retry_s *= 2
            continue
        except errors.KvpushError as exc:
            logger.info("long poll of transfer %s attempt %d failed: %s", transfer_id, attempt, exc)
            return None
        if record.ended:
            return record


def transfer_failure(verdict: Verdict, p_endpoint: Endpoint, d_endpoint: Endpoint, seen: str) -> TransferFailure:
    if verdict.retry_side == PREFILL:
        return TransferFailure(verdict, PREFILL, p_endpoint, seen)
    return TransferFailure(verdict, DECODE, d_endpoint, seen)


def shard_failure(router: Router, ctx: RequestContext, attempt: int, d_endpoint: Endpoint, reason: str, seen: str = "") -> TransferFailure:
    """The attempt's broker member stopped serving it (shard_watch's reason): 503, retried as a new attempt on any engines."""
    owner = ctx.broker_owner
    if reason == BROKER_SHARD_MOVED:
        why = f"no longer owns it ({router.shards.owner(ctx.transfer_id).member_id} does)"
    else:
        why = "left the broker's shard map"
    message = f"transfer {ctx.transfer_id} attempt {attempt}: broker member {owner.member_id} ({owner.address}) {why}"
    return TransferFailure(Verdict(503, reason, message, BROKER_SIDE), DECODE, d_endpoint, seen)


def _unreachable(error: errors.KvpushError) -> bool:
    """Whether a failed call says nothing of the attempt: the member was not reached, or could not answer."""
    return isinstance(error, (errors.Unavailable, errors.DeadlineExceeded)) or error.code == "CANCELLED"


async def _shard_lost(
    router: Router, ctx: RequestContext, attempt: int, d_endpoint: Endpoint, error: errors.KvpushError, seen: str, *, until: float
) -> TransferFailure | None:
    """What to answer when the broker failed to answer (or did not know the attempt) of a sharded attempt, else None.

    shard_failure when the attempt's member left the map. A member that cannot
    be reached may be dead with its lease not lapsed yet: the shard map gets
    shard_loss_wait_s to drop it, but never past `until` (loop time: the
    request's own bound), so a late lease lapse cannot make a request end
    late; a member still listed then is answered BROKER_MEMBER_UNREACHABLE,
    naming it.
    """
    if ctx.broker_owner.member_id == UNSHARDED:
        return None
    loop = asyncio.get_running_loop()
    unreachable = _unreachable(error)
    lost = router.shards.watch(ctx.transfer_id, ctx.broker_owner)
    try:
        wait_s = min(router.config.shard_loss_wait_s, until - loop.time())
        if not lost.done() and unreachable and wait_s > 0:
            await asyncio.wait([lost], timeout=wait_s)
        reason = lost.result() if lost.done() else ""
    finally:
        router.shards.unwatch(lost)
    if reason:
        return shard_failure(router, ctx, attempt, d_endpoint, reason, seen)
    if not unreachable:
        return None
    owner = ctx.broker_owner
    message = (
        f"transfer {ctx.transfer_id} attempt {attempt}: broker member {owner.member_id} ({owner.address}) did not answer ({error}) "
        "and had not left the broker's shard map"
    )
    return TransferFailure(Verdict(503, BROKER_MEMBER_UNREACHABLE, message, None), DECODE, d_endpoint, seen)


async def explain_decode_failure(
    router: Router, ctx: RequestContext, attempt: int, p_endpoint: Endpoint, d_endpoint: Endpoint, failure: LegFailure, *, until: float
) -> LegFailure:
    """What to answer for a decode leg that failed (5xx, an error event, no output): the broker's reason, else the leg's own failure.

    until: loop time of the request's own bound, which no wait here passes.
    """
    try:
        record = await _lookup(router, ctx.transfer_id, attempt, answer_by=until)
    except errors.KvpushError as exc:
        lost = await _shard_lost(router, ctx, attempt, d_endpoint, exc, str(failure), until=until)
        if lost is not None:
            return lost
        if not isinstance(exc, errors.NotFound):
            # Not an engine's fault that another engine would fix: no retry.
            message = f"{failure}; the kvpush control plane could not say why: {exc}"
            return TransferFailure(Verdict(503, CONTROL_PLANE_UNREACHABLE, message, None), DECODE, d_endpoint)
        # The decode engine failed the request before registering it (its log says why).
        failure.args = (f"{failure}; the broker has no record of transfer {ctx.transfer_id} attempt {attempt}",)
        return failure
    verdict = explain_attempt(record, ctx.client_request_id, p_endpoint.engine_id, d_endpoint.engine_id)
    if verdict is None:
        failure.args = (f"{failure}; transfer {ctx.transfer_id} attempt {attempt}: {record.describe()}",)
        return failure
    return transfer_failure(verdict, p_endpoint, d_endpoint, str(failure))


async def explain_overdue(router: Router, ctx: RequestContext, attempt: int, p_endpoint: Endpoint, d_endpoint: Endpoint, failure: LegFailure) -> LegFailure:
    """A leg timeout (the request's bound has passed): the broker's reason when the attempt ended without the KV, else the timeout itself."""
    now = asyncio.get_running_loop().time()
    try:
        record = await _lookup(router, ctx.transfer_id, attempt, answer_by=now)
    except errors.KvpushError as exc:
        return await _shard_lost(router, ctx, attempt, d_endpoint, exc, str(failure), until=now) or failure
    verdict = explain_attempt(record, ctx.client_request_id, p_endpoint.engine_id, d_endpoint.engine_id)
    return failure if verdict is None else transfer_failure(verdict, p_endpoint, d_endpoint, str(failure))


async def at_transfer_deadline(
    router: Router, ctx: RequestContext, attempt: int, p_endpoint: Endpoint, d_endpoint: Endpoint, *, prefill_finished: bool
) -> LegFailure | None:
    """The transfer deadline plus slack passed without decode output: None if the broker says the KV arrived, else the failure to answer."""
    config = router.config
    record: AttemptRecord | None = None
    now = asyncio.get_running_loop().time()
    try:
        record = await _lookup(router, ctx.transfer_id, attempt, answer_by=now)
    except errors.KvpushError as exc:
        lost = await _shard_lost(router, ctx, attempt, d_endpoint, exc, "no decode output by the transfer deadline", until=now)
        if lost is not None:
            return lost
        if isinstance(exc, errors.NotFound):
            known = "the broker never heard of the attempt"
        else:
            known = f"the kvpush control plane could not say why: {exc}"
    else:
        if record.state == "DONE":
            return None
        verdict = explain_attempt(record, ctx.client_request_id, p_endpoint.engine_id, d_endpoint.engine_id)
        if verdict is not None:
            return transfer_failure(verdict, p_endpoint, d_endpoint, "no decode output by the transfer deadline")
        known = record.describe()
    message = (
        f"transfer {ctx.transfer_id} attempt {attempt}: no first token before the transfer deadline "
        f"({config.transfer_timeout_ms} ms + {config.transfer_deadline_slack_s:g} s); {known}"
    )
    side = deadline_side(record, prefill_finished)
    return transfer_failure(Verdict(504, ROUTER_DEADLINE_EXCEEDED, message, side), p_endpoint, d_endpoint, "")


async def cancel_transfer(router: Router, transfer_id: str, attempt: int, detail: str) -> None:
    """Cancels one transfer attempt at the broker (bounded); failures are logged, D's own deadline still frees its blocks."""
    request = rv_pb.CancelTransferRequest(detail=detail[:200])
    request.key.transfer_id, request.key.attempt = transfer_id, attempt
    try:
        await router.broker.cancel_transfer(request, timeout_s=router.config.cancel_timeout_s)
    except errors.KvpushError as exc:
        router.metrics.cancel_failures.inc()
        logger.warning("cancel of transfer %s attempt %d failed: %s", transfer_id, attempt, exc)
