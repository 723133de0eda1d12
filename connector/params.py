# SPDX-License-Identifier: Apache-2.0
"""The per-request kvpush parameters a router puts in kv_transfer_params."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

TRANSFER_ID_PATTERN = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
MAX_TIMEOUT_S = 3600.0


class ParamError(ValueError):
    """Bad kv_transfer_params; `field` names the offending key."""

    def __init__(self, field: str, message: str):
        super().__init__(f"kv_transfer_params.kvpush.{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class TransferParams:
    """Validated kv_transfer_params["kvpush"] of one request leg."""

    role: str  # "prefill" or "decode": which leg this request is
    transfer_id: str
    attempt: int
    peer_engine_id: str  # decode leg: the prefill engine; prefill leg: the decode engine ("" = any)
    timeout_s: float | None
    traceparent: str
    client_request_id: str
    control_plane: str = ""  # host:port the router expects the engines to use ("" = the engine's own)

    @property
    def key(self) -> tuple[str, int]:
        return (self.transfer_id, self.attempt)


def parse(kv_transfer_params: dict | None) -> TransferParams | None:
    """Returns None when the request carries no kvpush parameters."""
    if not kv_transfer_params or "kvpush" not in kv_transfer_params:
        return None
    raw: Any = kv_transfer_params["kvpush"]
    if not isinstance(raw, dict):
        raise ParamError("", "must be an object")
    role = raw.get("role")
    if role not in ("prefill", "decode"):
        raise ParamError("role", f"must be 'prefill' or 'decode', not {role!r}")
    transfer_id = raw.get("transfer_id")
    if not isinstance(transfer_id, str) or not TRANSFER_ID_PATTERN.match(transfer_id):
        raise ParamError("transfer_id", "must be 1-128 characters of [A-Za-z0-9._:-]")
    attempt = raw.get("attempt", 1)
    if not isinstance(attempt, int) or isinstance(attempt, bool) or not 1 <= attempt < 2**32:
        raise ParamError("attempt", f"must be an integer >= 1, not {attempt!r}")
    peer_key = "prefill_engine_id" if role == "decode" else "decode_engine_id"
    peer = raw.get(peer_key, "")
    if not isinstance(peer, str) or (role == "decode" and not peer):
        raise ParamError(peer_key, "must name the peer engine")
    timeout_ms = raw.get("timeout_ms")
    timeout_s = None
    if timeout_ms is not None:
        if not isinstance(timeout_ms, (int, float)) or isinstance(timeout_ms, bool) or not 0 < timeout_ms <= MAX_TIMEOUT_S * 1000:
            raise ParamError("timeout_ms", f"must be a number in (0, {int(MAX_TIMEOUT_S * 1000)}]")
        timeout_s = timeout_ms / 1000.0
    traceparent = raw.get("traceparent", "")
    if not isinstance(traceparent, str):
        raise ParamError("traceparent", "must be a W3C traceparent string")
    client_request_id = raw.get("client_request_id", "")
    if not isinstance(client_request_id, str):
        raise ParamError("client_request_id", "must be a string")
    control_plane = raw.get("control_plane", "")
    if not isinstance(control_plane, str) or (control_plane and ":" not in control_plane):
        raise ParamError("control_plane", "must be host:port")
    return TransferParams(role, transfer_id, attempt, peer, timeout_s, traceparent, client_request_id, control_plane)
