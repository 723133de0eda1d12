# SPDX-License-Identifier: Apache-2.0
"""The connector's settings, read once from vLLM's kv_transfer_config."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, fields
from typing import Any

ENGINE_ID_PATTERN = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
# The shortest hold margin accepted: the broker's default fence margin (1 s) plus a short WRITE timeout.
MIN_HOLD_MARGIN_S = 1.5
ROLES = {"kv_producer": "prefill", "kv_consumer": "decode"}
PROGRESSIVE_PUSH = ("auto", "on", "off")


class ConfigError(ValueError):
    """A bad kvpush setting; the message names the setting."""


@dataclass(frozen=True)
class ConnectorConfig:
    """kvpush settings for one engine (kv_connector_extra_config keys in parentheses)."""

    engine_id: str
    role: str  # "prefill" or "decode", from kv_role
    control_plane: str  # (control_plane) host:port of the control plane
    token: str  # (token_file / $KVPUSH_TOKEN_FILE / $KVPUSH_TOKEN) this engine's own token (its file in the control plane's --tokens-dir); "" with mTLS
    tls_ca: str = ""  # (tls_ca) CA bundle for mTLS
    tls_cert: str = ""  # (tls_cert) client certificate; its CN must equal engine_id
    tls_key: str = ""  # (tls_key)
    backends: tuple[str, ...] = ("UCX",)  # (backends) NIXL backends, e.g. ["UCX"] or ["LIBFABRIC"]
    transfer_timeout_s: float = 30.0  # (transfer_timeout_s) default deadline of a transfer
    hold_margin_s: float = 5.0  # (hold_margin_s) D keeps a request's blocks this long past its deadline when the broker never said they are safe; the broker fits its WRITE timeout for the request inside it
    early_orders: bool = True  # (early_orders) P matches registrations locally (see docs/design.md)
    progressive_push: str = "auto"  # (progressive_push) P writes each layer's KV as soon as it is computed: "on", "off", or "auto" (on when the KV cache is in GPU memory)
    idle_wait_ms: float = 5.0  # (idle_wait_ms) how long an idle engine step sleeps waiting for transfer progress
    poll_interval_ms: float = 0.5  # (poll_interval_ms) NIXL progress interval while a transfer is expected
    idle_poll_ms: float = 250.0  # (idle_poll_ms) NIXL progress interval while nothing is expected (each wake-up takes the GIL from the forward)
    lease_ttl_s: float = 3.0  # (lease_ttl_s) lease each rank asks the registrar for: a dead engine's transfers fail this long after it died
    rpc_timeout_s: float = 5.0  # (rpc_timeout_s) deadline of each control-plane call
    startup_timeout_s: float = 60.0  # (startup_timeout_s) how long registration may take at engine start

    @classmethod
    def from_kv_transfer_config(cls, kv_transfer_config: Any) -> ConnectorConfig:
        extra: dict = dict(kv_transfer_config.kv_connector_extra_config or {})
        if "token" in extra:
            raise ConfigError("kvpush: pass the engine's token via token_file or $KVPUSH_TOKEN, not in the engine's command line")
        known = {f.name for f in fields(cls)} - {"engine_id", "role", "token"} | {"token_file"}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ConfigError(f"kvpush: unknown kv_connector_extra_config keys {unknown}; known: {sorted(known)}")
        role = ROLES.get(kv_transfer_config.kv_role)
        if role is None:
            raise ConfigError(f"kvpush: kv_role must be kv_producer (prefill) or kv_consumer (decode), not {kv_transfer_config.kv_role!r}")
        engine_id = kv_transfer_config.engine_id or ""
        if not ENGINE_ID_PATTERN.match(engine_id):
            raise ConfigError(f"kvpush: engine_id {engine_id!r} must be 1-128 characters of [A-Za-z0-9._:-]")
        control_plane = extra.pop("control_plane", os.environ.get("KVPUSH_CONTROL_PLANE", ""))
        if not control_plane or ":" not in control_plane:
            raise ConfigError("kvpush: kv_connector_extra_config.control_plane (or $KVPUSH_CONTROL_PLANE) must be host:port")
        token = os.environ.get("KVPUSH_TOKEN", "")
        token_file = extra.pop("token_file", os.environ.get("KVPUSH_TOKEN_FILE", ""))
        if token_file:
            try:
                token = open(token_file, encoding="utf-8").read().strip()
            except OSError as exc:
                raise ConfigError(f"kvpush: kv_connector_extra_config.token_file: cannot read {token_file}: {exc}") from exc
        values: dict[str, Any] = {"engine_id": engine_id, "role": role, "control_plane": control_plane, "token": token}
        for f in fields(cls):
            if f.name not in extra:
                continue
            raw = extra[f.name]
            try:
                if f.type == "tuple[str, ...]":
                    if not isinstance(raw, (list, tuple)) or not raw or not all(isinstance(b, str) and b for b in raw):
                        raise TypeError("a non-empty list of backend names")
                    value: Any = tuple(raw)
                elif f.type == "bool":
                    if not isinstance(raw, bool):
                        raise TypeError("true or false")
                    value = raw
                elif f.type == "float":
                    value = float(raw)
                    if not value > 0:
                        raise TypeError("a positive number")
                else:
                    value = str(raw)
            except (TypeError, ValueError) as exc:
                raise ConfigError(f"kvpush: kv_connector_extra_config.{f.name}={raw!r}: expected {exc}") from exc
            values[f.name] = value
        config = cls(**values)
        if not config.token and not config.tls_cert:
            raise ConfigError("kvpush: no credentials: set token_file / $KVPUSH_TOKEN (this engine's token) or tls_cert/tls_key/tls_ca (mTLS)")
        if config.hold_margin_s < MIN_HOLD_MARGIN_S:
            raise ConfigError(
                f"kvpush: kv_connector_extra_config.hold_margin_s={config.hold_margin_s:g} is too short: it must cover a WRITE's "
                f"timeout plus the broker's fence margin (at least {MIN_HOLD_MARGIN_S:g}s; the broker refuses registrations it cannot fit)"
            )
        if config.progressive_push not in PROGRESSIVE_PUSH:
            raise ConfigError(f"kvpush: kv_connector_extra_config.progressive_push={config.progressive_push!r}: expected one of {list(PROGRESSIVE_PUSH)}")
        if bool(config.tls_cert) != bool(config.tls_key):
            raise ConfigError("kvpush: tls_cert and tls_key go together")
        return config
