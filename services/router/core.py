# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""The router's decisions, free of HTTP and gRPC: which engine serves a leg and what each leg's body says.

Push mode (kvpush): both legs go out at once with the same transfer key;
the prefill leg generates one token and is discarded, the decode leg is
the client's answer. Pull mode (upstream NixlConnector): the prefill leg
first, then the decode leg with what the prefill engine returned.
Upstream-push mode (upstream NixlPushConnector): both legs at once,
matched by a shared X-Request-Id, the decode leg naming P's NIXL side
channel.

A kvpush attempt that fails is explained from the broker's record of it
(GetTransfer): `explain_attempt` turns the record into the client's
status, reason and message (docs/routers.md, "What a client sees when a
transfer fails").
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
from collections.abc import Iterable, Mapping
from typing import Any

from kvpush.http_errors import (
    CONTROL_PLANE_UNREACHABLE,
    END_REASONS,
    INVALID_REQUEST,
    LEG_FAILED,
    TRANSFER_CONFLICT,
    AttemptRecord,
    conflicting_owner,
    end_reason_status,
)

POLICIES = ("round_robin", "least_loaded")
COMPLETIONS_PATH = "/v1/completions"
CHAT_COMPLETIONS_PATH = "/v1/chat/completions"

# The prefill leg asks upstream's pull connector to keep the KV for a remote
# reader; vLLM's NixlConnector reads exactly these keys (reference §3.2).
PULL_PREFILL_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


# The broker's client_request_id limit (BrokerConfig.max_text_length): a
# longer X-Request-Id would get both legs' transfer refused.
MAX_CLIENT_REQUEST_ID_LENGTH = 256


class BadRequest(ValueError):
    """The client's body cannot be routed; the message says why (answered with HTTP 400)."""


@dataclasses.dataclass(frozen=True)
class Endpoint:
    """One vLLM server: its base URL and the engine_id its kv-transfer-config names."""

    url: str
    engine_id: str

    def __str__(self) -> str:
        return f"{self.engine_id} ({self.url})"


class EnginePool:
    """The engines of one role and how many legs each is serving.

    round_robin cycles through the engines; least_loaded takes the engine
    with the fewest legs in flight, ties going round-robin so equal engines
    share the load. `exclude` leaves out engines that already failed this
    request.
    """

    def __init__(self, role: str, endpoints: Iterable[Endpoint], policy: str):
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; expected one of {POLICIES}")
        self.role = role
        self.endpoints: tuple[Endpoint, ...] = tuple(endpoints)
        if not self.endpoints:
            raise ValueError(f"the {role} pool needs at least one engine")
        self.policy = policy
        self._in_flight = dict.fromkeys(self.endpoints, 0)
        self._turn = itertools.count()

    def pick(self, exclude: Iterable[Endpoint] = ()) -> Endpoint | None:
        """The engine for the next leg, or None when every engine is excluded."""
        excluded = set(exclude)
        start = next(self._turn) % len(self.endpoints)
        rotated = self.endpoints[start:] + self.endpoints[:start]
        candidates = [e for e in rotated if e not in excluded]
        if not candidates:
            return None
        if self.policy == "least_loaded":
            return min(candidates, key=lambda e: self._in_flight[e])  # min keeps the first of equals
        return candidates[0]

    def acquire(self, endpoint: Endpoint) -> None:
        self._in_flight[endpoint] += 1

    def release(self, endpoint: Endpoint) -> None:
        self._in_flight[endpoint] -= 1

    def in_flight(self, endpoint: Endpoint) -> int:
        return self._in_flight[endpoint]


def check_routable(body: Any) -> dict[str, Any]:
    """Returns the body if it is a JSON object a disaggregated pair can serve, else raises BadRequest."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    for key in ("n", "best_of"):
        value = body.get(key)
        if value is not None and value != 1:
            # Each of n sequences would need its own KV hand-off; one prompt
            # gets one transfer.
            raise BadRequest(f"{key}={value!r} is not supported by a disaggregated router; send {key}=1")
    if "kv_transfer_params" in body:
        raise BadRequest("kv_transfer_params is set by the router; leave it out of the request")
    return body


def check_client_request_id(value: str) -> str:
    """Returns the client's X-Request-Id if kvpush can carry it as client_request_id, else raises BadRequest."""
    if len(value) > MAX_CLIENT_REQUEST_ID_LENGTH:
        raise BadRequest(f"X-Request-Id is {len(value)} characters long; kvpush carries at most {MAX_CLIENT_REQUEST_ID_LENGTH}")
    return value


def kvpush_params(
    role: str,
    transfer_id: str,
    attempt: int,
    peer_engine_id: str,
    *,
    traceparent: str = "",
    client_request_id: str = "",
    timeout_ms: int | None = None,
) -> dict[str, Any]:
    """kv_transfer_params of one kvpush leg (docs/design.md, "kv_transfer_params")."""
    peer_key = "decode_engine_id" if role == "prefill" else "prefill_engine_id"
    params: dict[str, Any] = {"role": role, "transfer_id": transfer_id, "attempt": attempt, peer_key: peer_engine_id}
    if traceparent:
        params["traceparent"] = traceparent
    if client_request_id:
        params["client_request_id"] = client_request_id
    if timeout_ms is not None:
        params["timeout_ms"] = timeout_ms
    return {"kvpush": params}


def upstream_push_decode_params(
    prefill_engine_id: str, kv_host: str, side_channel_port: int, tp_size: int, pp_size: int, request_id: str, transfer_id: str
) -> dict[str, Any]:
    """The decode leg's kv_transfer_params for upstream NixlPushConnector (reference §3.1/3.2)."""
    return {
        "do_remote_decode": False,
        "do_remote_prefill": True,
        "remote_engine_id": prefill_engine_id,
        "remote_host": kv_host,
        "remote_port": side_channel_port,
        "tp_size": tp_size,
        "pp_size": pp_size,
        # Required by 0.32/0.33 but only used for heartbeats; matching is on X-Request-Id.
        "remote_request_id": request_id,
        "transfer_id": transfer_id,
    }


def upstream_push_prefill_params(transfer_id: str) -> dict[str, Any]:
    """The prefill leg's kv_transfer_params for upstream NixlPushConnector."""
    return {**PULL_PREFILL_PARAMS, "transfer_id": transfer_id}


def prefill_body(body: Mapping[str, Any], path: str, kv_transfer_params: Mapping[str, Any]) -> dict[str, Any]:
    """The prefill leg: the client's body computing the prompt and one token, not streamed.

    The one token matters: kvpush's prefill engine hands the KV off in the
    step that completes the prompt only for max_tokens=1 requests, which
    end in that same step.
    """
    leg = copy.deepcopy(dict(body))
    leg["max_tokens"] = 1
    if path == CHAT_COMPLETIONS_PATH or "max_completion_tokens" in leg:
        leg["max_completion_tokens"] = 1
    leg["stream"] = False
    # vLLM rejects stream_options without stream, and min_tokens above max_tokens.
    leg.pop("stream_options", None)
    leg.pop("min_tokens", None)
    leg["kv_transfer_params"] = dict(kv_transfer_params)
    return leg


def decode_body(body: Mapping[str, Any], kv_transfer_params: Mapping[str, Any]) -> dict[str, Any]:
    """The decode leg: the client's body as sent, plus the transfer parameters."""
    leg = copy.deepcopy(dict(body))
    leg["kv_transfer_params"] = dict(kv_transfer_params)
    return leg


# ---- transfer failures (push mode) ---------------------------------------------------------

# Causes the router itself names, beside the broker's EndReasons (the ones the engines' middleware names too are
# kvpush.http_errors').
ENGINE_REJECTED = "ENGINE_REJECTED"  # an engine's own 4xx, passed through
NO_ENGINE = "NO_ENGINE"  # 503: no engine of a role left to try
LEG_TIMEOUT = "LEG_TIMEOUT"  # 504: --prefill-timeout or --first-token-timeout passed
ROUTER_DEADLINE_EXCEEDED = "ROUTER_DEADLINE_EXCEEDED"  # 504: the transfer deadline plus slack passed without output, the broker had no reason
BROKER_MEMBER_UNREACHABLE = "BROKER_MEMBER_UNREACHABLE"  # 503: the attempt's broker member did not answer and had not left the shard map in time
OUTPUT_BROKE_OFF = "OUTPUT_BROKE_OFF"  # the decode stream broke after output had reached the client
CLIENT_GONE = "CLIENT_GONE"  # the client disconnected before its answer
ROUTER_REASONS = (
    INVALID_REQUEST, ENGINE_REJECTED, NO_ENGINE, LEG_FAILED, LEG_TIMEOUT, ROUTER_DEADLINE_EXCEEDED,
    CONTROL_PLANE_UNREACHABLE, BROKER_MEMBER_UNREACHABLE, TRANSFER_CONFLICT, OUTPUT_BROKE_OFF, CLIENT_GONE,
)
# Every reason a failed request is counted under: a bounded label set.
FAILURE_REASONS = END_REASONS + ROUTER_REASONS

# A retry_side that blames no engine: the fault was a broker shard's, so a
# new attempt may go to the same engines (its transfer's new owner serves it).
BROKER_SIDE = "broker"
# Which side's engine an EndReason blames: a retry goes to another engine of that side.
_BLAMED_SIDE = {
    "BROKER_SHARD_LOST": BROKER_SIDE,
    "BROKER_SHARD_MOVED": BROKER_SIDE,
    "PREFILL_ENGINE_LOST": "prefill",
    "CANCELLED_BY_PREFILL": "prefill",
    "WRITE_FAILED": "prefill",  # the producer rank posts the WRITE and reported it failed
    "DECODE_ENGINE_LOST": "decode",
    "CANCELLED_BY_DECODE": "decode",
    # The broker refused D's registration: mostly about the prefill engine it
    # names (not registered, restarted, an incompatible layout).
    "REGISTRATION_REFUSED": "prefill",
}


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What the client is told about a failed attempt, and whose engine a retry avoids (None: no retry; BROKER_SIDE: none)."""

    status: int
    reason: str
    message: str
    retry_side: str | None


def deadline_side(record: AttemptRecord | None, prefill_finished: bool) -> str:
    """The side to blame when a deadline passed: the one that never reached the broker, else the writer (prefill)."""
    if record is None:
        return "decode" if prefill_finished else "prefill"
    if not record.prefill_done:
        return "prefill"
    if not record.registered:
        return "decode"
    return "prefill"


def explain_attempt(record: AttemptRecord, client_request_id: str, prefill_engine_id: str, decode_engine_id: str) -> Verdict | None:
    """The client's answer for an attempt the broker holds, or None when the broker gives no reason (live, or DONE: the KV arrived).

    A record that is another request's answers 409 whatever its state, and
    is never retried (a new attempt of that transfer id would supersede the
    other request's). An attempt that ended without the KV answers
    end_reason_status; it is retried on another engine of the side its
    reason blames.
    """
    key = f"transfer {record.transfer_id} attempt {record.attempt}"
    owner = conflicting_owner(record, client_request_id, prefill_engine_id, decode_engine_id)
    if owner:
        message = f"{key} is another request's at the broker ({owner}): another router uses the same transfer id"
        return Verdict(409, TRANSFER_CONFLICT, message, None)
    if not record.ended or record.state == "DONE":
        return None
    reason = record.reason or record.state
    status = end_reason_status(reason)
    if status == 504:
        side: str | None = deadline_side(record, True)
    else:
        side = _BLAMED_SIDE.get(reason)
    message = f"{key} ended {record.state} with {reason}" + (f": {record.detail}" if record.detail else "")
    return Verdict(status, reason, message, side)
