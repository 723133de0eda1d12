# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""What a client gets when a leg fails: OpenAI-style error bodies and the failures an attempt raises.

A failed leg is a LegFailure naming the leg, its engine, the cause (a
metrics label) and the HTTP status; a push-mode attempt the broker
explains is a TransferFailure carrying the broker's reason.
"""

from __future__ import annotations

import json
from typing import Any

import aiohttp
from aiohttp import web

from kvpush.http_errors import INVALID_REQUEST, error_body
from kvpush.services.router.core import (
    BROKER_MEMBER_UNREACHABLE,
    BROKER_SIDE,
    ENGINE_REJECTED,
    LEG_FAILED,
    LEG_TIMEOUT,
    TRANSFER_CONFLICT,
    Endpoint,
    Verdict,
)


def error_response(status: int, message: str, **details: Any) -> web.Response:
    return web.json_response(error_body(status, message, **details), status=status)


# Every cause a failed leg is counted under (kvpush_router_leg_failures_total{cause}): a bounded set, so that its
# series can exist from the start. after_output: the leg failed after output reached the client.
LEG_CAUSES = ("connect", "connection", "timeout", "rejected", "engine_error", "protocol", "transfer", "after_output")


class LegFailure(Exception):
    """A leg that did not deliver: which leg, which engine, the cause, and what the client gets.

    retryable: another engine might succeed (the engine or the path to it
    failed, not the client's request). engine_body: a 4xx answer of the
    engine, passed to the client as is.
    """

    # cancel_attempt: whether the attempt is ours to cancel at the broker.
    cancel_attempt = True
    # blames_engine: a retry avoids this leg's engine (false when the fault was a broker shard's).
    blames_engine = True

    def __init__(
        self, leg: str, endpoint: Endpoint, cause: str, message: str, *, status: int = 502, retryable: bool = True, engine_body: bytes | None = None
    ):
        super().__init__(f"{leg} leg to {endpoint}: {message}")
        assert cause in LEG_CAUSES, f"a leg failure's cause must be one of LEG_CAUSES, not {cause!r}"
        self.leg = leg
        self.endpoint = endpoint
        self.cause = cause
        self.status = status
        self.retryable = retryable
        self.engine_body = engine_body
        self.attempt = 0  # set by the dispatch loop

    @property
    def reason(self) -> str:
        """The failure's reason (core.FAILURE_REASONS): its body's "reason" and its metrics label."""
        if self.cause == "rejected":
            return ENGINE_REJECTED
        return LEG_TIMEOUT if self.cause == "timeout" else LEG_FAILED

    def response(self, transfer_id: str) -> web.Response:
        if self.engine_body is not None and 400 <= self.status < 500:
            # The request itself was at fault: the engine's own answer says best why.
            return web.Response(status=self.status, body=self.engine_body, content_type="application/json")
        details: dict[str, Any] = {"reason": self.reason, "leg": self.leg, "engine_id": self.endpoint.engine_id, "transfer_id": transfer_id}
        if self.attempt:
            details["attempt"] = self.attempt
        return error_response(self.status, str(self), **details)


class TransferFailure(LegFailure):
    """A push-mode attempt that failed for a reason the broker (or the router's transfer deadline) gives.

    leg and endpoint name the engine a retry avoids (the side the reason
    blames), or the decode leg when none is blamed. The message is the
    verdict's, followed by what the router saw of the legs.
    """

    def __init__(self, verdict: Verdict, leg: str, endpoint: Endpoint, seen: str = ""):
        LegFailure.__init__(self, leg, endpoint, "transfer", verdict.message, status=verdict.status, retryable=verdict.retry_side is not None)
        self.args = (verdict.message + (f" ({seen})" if seen else ""),)
        self.verdict = verdict
        # A record that is another request's is never ours to cancel; a member that
        # did not answer would not answer a cancel either (the decode engine's own
        # deadline frees the blocks, as for any lost cancel).
        self.cancel_attempt = verdict.reason not in (TRANSFER_CONFLICT, BROKER_MEMBER_UNREACHABLE)
        self.blames_engine = verdict.retry_side != BROKER_SIDE

    @property
    def reason(self) -> str:
        return self.verdict.reason


class ClientGone(Exception):
    """The client disconnected before its answer."""


def failure_from_exception(leg: str, endpoint: Endpoint, exc: BaseException, limit_s: float) -> LegFailure:
    if isinstance(exc, TimeoutError):  # aiohttp's timeouts subclass it
        return LegFailure(leg, endpoint, "timeout", f"no answer within {limit_s:g} s", status=504)
    if isinstance(exc, aiohttp.ClientConnectorError):
        return LegFailure(leg, endpoint, "connect", f"cannot connect: {exc.os_error.strerror or exc.os_error}")
    return LegFailure(leg, endpoint, "connection", f"connection failed: {type(exc).__name__}: {exc}")


def _transfer_answer(error: Any) -> bool:
    """An engine's kvpush middleware answered a failed transfer (kvpush.connector.middleware): the broker's word decides, as for a 5xx."""
    return isinstance(error, dict) and "transfer_id" in error and error.get("reason") not in (None, INVALID_REQUEST)


async def status_failure(leg: str, endpoint: Endpoint, response: aiohttp.ClientResponse) -> LegFailure:
    body = await response.read()
    try:
        error = json.loads(body)["error"]
        message = error["message"]
    except (ValueError, KeyError, TypeError):
        error, message = {}, body[:500].decode(errors="replace")
    if 400 <= response.status < 500 and not _transfer_answer(error):
        return LegFailure(leg, endpoint, "rejected", f"HTTP {response.status}: {message}", status=response.status, retryable=False, engine_body=body)
    return LegFailure(leg, endpoint, "engine_error", f"HTTP {response.status}: {message}")
