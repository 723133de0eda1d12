# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""What an HTTP client is told when kvpush fails its request: the one mapping `kvpush router` and the engines' middleware share.

* `error_body`: OpenAI's error shape, `{"error": {"message", "type",
  "param", "code"}}`, plus kvpush's fields (`reason`, the transfer key, ...).
* `end_reason_status`: the HTTP status of an attempt that ended with a
  broker EndReason (docs/routers.md, "What a client sees when a transfer
  fails").
* `AttemptRecord`: the broker's record of one attempt (GetTransfer) as
  plain values, and `conflicting_owner`: whether that record is another
  request's.

Imported by `kvpush.services.router` and by `kvpush.connector.middleware`
(in each engine's API server), so it imports neither.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from kvpush.rendezvous.v1 import transfer_pb2

ERROR_TYPES = {400: "BadRequestError", 409: "ConflictError", 502: "BadGatewayError", 503: "ServiceUnavailableError", 504: "GatewayTimeoutError"}


def error_body(status: int, message: str, *, param: str | None = None, **details: Any) -> dict[str, Any]:
    """An OpenAI-style error object; details (reason, leg, engine_id, transfer_id, attempt) say which part failed and why."""
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "APIError"), "param": param, "code": status, **details}}


# EndReason names (without the END_REASON_ prefix) a failed attempt can end with.
END_REASONS: tuple[str, ...] = tuple(
    name.removeprefix("END_REASON_") for name in transfer_pb2.EndReason.keys() if name not in ("END_REASON_UNSPECIFIED", "END_REASON_COMPLETED")
)
# Causes named beside the broker's EndReasons, by the router and by the engines' middleware.
INVALID_REQUEST = "INVALID_REQUEST"  # 400: the request's parameters were refused
LEG_FAILED = "LEG_FAILED"  # 502: a leg failed (connection, 5xx, no output) and the broker had no reason
CONTROL_PLANE_UNREACHABLE = "CONTROL_PLANE_UNREACHABLE"  # 503: the broker could not say why a leg failed
TRANSFER_CONFLICT = "TRANSFER_CONFLICT"  # 409: the broker's record of the attempt (or the engine's) is another request's

_END_REASON_STATUS = {
    "REGISTRATION_DEADLINE_EXCEEDED": 504,
    "PREFILL_DEADLINE_EXCEEDED": 504,
    "PREFILL_ENGINE_LOST": 503,
    "DECODE_ENGINE_LOST": 503,
    # The prompt tokenizes differently on P and D (or, for PROMPT_MISMATCH,
    # another request reused the transfer id): retrying on other engines won't help.
    "TOKEN_COUNT_MISMATCH": 400,
    "PROMPT_MISMATCH": 400,
    # Only a newer attempt supersedes one, and this router makes none while
    # it still waits on the old one: another router used the same transfer id.
    "SUPERSEDED": 409,
    # The broker member that held the attempt died, lost its membership or
    # no longer owns the transfer: a new attempt goes to the new owner.
    "BROKER_SHARD_LOST": 503,
    "BROKER_SHARD_MOVED": 503,
}


def end_reason_status(reason: str) -> int:
    """The HTTP status for an attempt that ended with `reason` (an EndReason name, with or without its prefix); 502 for any other."""
    return _END_REASON_STATUS.get(reason.removeprefix("END_REASON_"), 502)


_TERMINAL_STATES = frozenset({"DONE", "FAILED", "CANCELLED", "SUPERSEDED"})


def _enum_name(enum: Any, value: int, prefix: str) -> str:
    """An enum value's name without its prefix; a value a newer broker added shows as its number."""
    try:
        return enum.Name(value).removeprefix(prefix)
    except ValueError:
        return str(value)


@dataclasses.dataclass(frozen=True)
class AttemptRecord:
    """The broker's record of one transfer attempt (GetTransfer), as plain values; enum names without their prefixes."""

    transfer_id: str
    attempt: int
    state: str  # e.g. "WAITING_FOR_PREFILL", "DONE", "FAILED"
    reason: str  # e.g. "PREFILL_ENGINE_LOST"; "" until the attempt ended, "COMPLETED" when DONE
    detail: str
    client_request_id: str
    prefill_engine_id: str
    decode_engine_id: str
    registered: bool  # the decode side's registration reached the broker
    prefill_done: bool  # the prefill side's prefill-done reached the broker

    @classmethod
    def from_transfer(cls, transfer: transfer_pb2.Transfer) -> AttemptRecord:
        kinds = {entry.kind for entry in transfer.timeline}
        return cls(
            transfer_id=transfer.key.transfer_id,
            attempt=transfer.key.attempt,
            state=_enum_name(transfer_pb2.TransferState, transfer.state, "TRANSFER_STATE_"),
            reason=_enum_name(transfer_pb2.EndReason, transfer.end_reason, "END_REASON_") if transfer.end_reason else "",
            detail=transfer.detail,
            client_request_id=transfer.client_request_id,
            prefill_engine_id=transfer.prefill_engine_id,
            decode_engine_id=transfer.decode_engine_id,
            registered=transfer_pb2.TIMELINE_ENTRY_KIND_REGISTERED in kinds,
            prefill_done=transfer_pb2.TIMELINE_ENTRY_KIND_PREFILL_DONE in kinds,
        )

    @property
    def ended(self) -> bool:
        return self.state in _TERMINAL_STATES

    def describe(self) -> str:
        """The attempt in a few words, for messages: its state, or its end reason and detail."""
        if not self.ended:
            return f"the broker holds it as {self.state}"
        return f"{self.state} {self.reason}" + (f": {self.detail}" if self.detail else "")


def conflicting_owner(record: AttemptRecord, client_request_id: str, prefill_engine_id: str, decode_engine_id: str) -> str:
    """Why the broker's record of our transfer key is another request's ("" when it is ours).

    Empty fields say nothing (an attempt cancelled before either side
    arrived has no engines; a caller that sets no client_request_id
    compares none); a set one that differs from what the request sent
    means another request minted the same transfer id.
    """
    if record.client_request_id and client_request_id and record.client_request_id != client_request_id:
        return f"it belongs to request {record.client_request_id!r}, not {client_request_id!r}"
    if record.prefill_engine_id and prefill_engine_id and record.prefill_engine_id != prefill_engine_id:
        return f"it names prefill engine {record.prefill_engine_id!r}, not {prefill_engine_id!r}"
    if record.decode_engine_id and decode_engine_id and record.decode_engine_id != decode_engine_id:
        return f"it names decode engine {record.decode_engine_id!r}, not {decode_engine_id!r}"
    return ""
