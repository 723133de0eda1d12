# SPDX-License-Identifier: Apache-2.0
"""The connector's settings, read once from vLLM's kv_transfer_config."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any

from kvpush.logs import LEVELS
from kvpush.settings import Settings, declared, setting

ENGINE_ID_PATTERN = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
# The shortest hold margin accepted: the broker's default fence margin (1 s) plus a short WRITE timeout.
MIN_HOLD_MARGIN_S = 1.5
ROLES = {"kv_producer": "prefill", "kv_consumer": "decode"}
PROGRESSIVE_PUSH = ("auto", "on", "off")


class ConfigError(ValueError):
    """A bad kvpush setting; the message names the setting."""


def _backend_names(raw: object) -> tuple[str, ...]:
    if not isinstance(raw, (list, tuple)) or not raw or not all(isinstance(b, str) and b for b in raw):
        raise TypeError("a non-empty list of backend names")
    return tuple(raw)


def _ms_or_auto(raw: object) -> int | None:
    if raw == "auto":
        return None
    if isinstance(raw, bool) or not isinstance(raw, (int, str)) or (isinstance(raw, str) and not raw.isdigit()):
        raise TypeError('"auto" or whole milliseconds')
    return int(raw)


def _true_or_false(raw: object) -> bool:
    if not isinstance(raw, bool):
        raise TypeError("true or false")
    return raw


@dataclass(frozen=True)
class ConnectorConfig(Settings):
    """kvpush settings for one engine; the declared settings are kv_connector_extra_config keys."""

    engine_id: str
    role: str  # "prefill" or "decode", from kv_role
    control_plane: str = field(metadata=declared(env="KVPUSH_CONTROL_PLANE", help="host:port of the control plane"))
    # token is this engine's own token (its file in the control plane's
    # --tokens-dir), read from token_file or $KVPUSH_TOKEN; "" with mTLS.
    token: str
    broker: str = setting(
        "",
        env="KVPUSH_BROKER",
        help="gRPC target of the broker when it runs apart from the registrar (control_plane): host:port, or a sharded broker's "
        "seed (any member, a headless Service, ipv4:h1:p1,h2:p2); \"\" = control_plane",
    )
    token_file: str = setting("", env="KVPUSH_TOKEN_FILE", help="file holding this engine's token")
    tls_ca: str = setting("", help="CA bundle for mTLS")
    tls_cert: str = setting("", help="client certificate; its CN must equal engine_id")
    tls_key: str = setting("", help="client key for mTLS")
    backends: tuple[str, ...] = setting(("UCX",), convert=_backend_names, help='NIXL backends, e.g. ["UCX"] or ["LIBFABRIC"]')
    transfer_timeout_s: float = setting(30.0, convert=float, positive=True, help="default deadline of a transfer")
    hold_margin_s: float = setting(
        5.0,
        convert=float,
        positive=True,
        help="D keeps a request's blocks this long past its deadline when the broker never said they are safe; "
        "the broker fits its WRITE timeout for the request inside it",
    )
    early_orders: bool = setting(True, convert=_true_or_false, help="P matches registrations locally (see docs/design.md)")
    progressive_push: str = setting(
        "auto",
        choices=PROGRESSIVE_PUSH,
        help='P writes each layer\'s KV as soon as it is computed: "on", "off", or "auto" (on when the KV cache is in GPU memory)',
    )
    idle_wait_ms: float = setting(5.0, convert=float, positive=True, help="how long an idle engine step sleeps waiting for transfer progress")
    poll_interval_ms: float = setting(0.5, convert=float, positive=True, help="NIXL polling interval while a WRITE is due (P posts it, or posted a part); on D the engine thread polls at this interval in steps with nothing to compute")
    waiting_poll_ms: int | None = setting(
        None,
        convert=_ms_or_auto,
        at_least=0,
        help="D's NIXL polling interval while its receives wait for prefills not about to end (P sends a due notification "
        "due_notice_ms before the forward's predicted end; the most a receive's latency grows by when it is late); 0: poll every poll_interval_ms "
        'throughout; "auto" (default): 5 for a KV cache in host memory (each poll takes the GIL and the core from the decode forward), '
        "0 in GPU memory",
    )
    due_notice_ms: float = setting(
        10.0,
        convert=float,
        at_least=0,
        help="P tells a decode rank its WRITE is due this long before the forward computing it is predicted to end "
        "(more than D's waiting_poll_ms, so D polls fast by then)",
    )
    fresh_poll_ms: float = setting(
        20.0,
        convert=float,
        at_least=0,
        help="D polls at poll_interval_ms this long after a receive is expected: a prefill already done writes right after D's registration",
    )
    nixl_progress_thread_ms: int | None = setting(
        None,
        convert=_ms_or_auto,
        at_least=0,
        help="NIXL's own progress thread (C++, no GIL), sleeping on the UCX worker's events and waking at least every this many ms; "
        '0: none (UCX progresses only when kvpush\'s transfer thread polls); "auto" (default): for a KV cache in host memory 100 on a '
        'prefill engine and 5 on a decode engine, '
        "0 for one in GPU memory (measured: bench/results/LOG.md, docs/gpu-datapath.md)",
    )
    idle_poll_ms: float = setting(
        250.0, convert=float, positive=True, help="NIXL progress interval while nothing is expected (each wake-up takes the GIL from the forward)"
    )
    lease_ttl_s: float = setting(
        3.0, convert=float, positive=True, help="lease each rank asks the registrar for: a dead engine's transfers fail this long after it died"
    )
    rpc_timeout_s: float = setting(5.0, convert=float, positive=True, help="deadline of each control-plane call")
    startup_timeout_s: float = setting(60.0, convert=float, positive=True, help="how long registration may take at engine start")
    log_level: str = setting(
        "info",
        env="KVPUSH_LOG_LEVEL",
        choices=LEVELS,
        help="the lowest level of kvpush's own log lines in the engine's stderr (broker members joining and leaving are info)",
    )

    @classmethod
    def from_kv_transfer_config(cls, kv_transfer_config: Any) -> ConnectorConfig:
        extra: dict = dict(kv_transfer_config.kv_connector_extra_config or {})
        if "token" in extra:
            raise ConfigError("kvpush: pass the engine's token via token_file or $KVPUSH_TOKEN, not in the engine's command line")
        try:
            values = cls.values_from_mapping(extra, source="kv_connector_extra_config")
        except ValueError as exc:
            raise ConfigError(f"kvpush: {exc}") from exc
        role = ROLES.get(kv_transfer_config.kv_role)
        if role is None:
            raise ConfigError(f"kvpush: kv_role must be kv_producer (prefill) or kv_consumer (decode), not {kv_transfer_config.kv_role!r}")
        engine_id = kv_transfer_config.engine_id or ""
        if not ENGINE_ID_PATTERN.match(engine_id):
            raise ConfigError(f"kvpush: engine_id {engine_id!r} must be 1-128 characters of [A-Za-z0-9._:-]")
        if ":" not in values.get("control_plane", ""):
            raise ConfigError("kvpush: kv_connector_extra_config.control_plane (or $KVPUSH_CONTROL_PLANE) must be host:port")
        if values.get("broker") and ":" not in values["broker"]:
            raise ConfigError("kvpush: kv_connector_extra_config.broker (or $KVPUSH_BROKER) must be host:port or a gRPC target")
        token = os.environ.get("KVPUSH_TOKEN", "")
        token_file = values.get("token_file", "")
        if token_file:
            try:
                token = open(token_file, encoding="utf-8").read().strip()
            except OSError as exc:
                raise ConfigError(f"kvpush: kv_connector_extra_config.token_file: cannot read {token_file}: {exc}") from exc
        config = cls(engine_id=engine_id, role=role, token=token, **values)
        if not config.token and not config.tls_cert:
            raise ConfigError("kvpush: no credentials: set token_file / $KVPUSH_TOKEN (this engine's token) or tls_cert/tls_key/tls_ca (mTLS)")
        if config.hold_margin_s < MIN_HOLD_MARGIN_S:
            raise ConfigError(
                f"kvpush: kv_connector_extra_config.hold_margin_s={config.hold_margin_s:g} is too short: it must cover a WRITE's "
                f"timeout plus the broker's fence margin (at least {MIN_HOLD_MARGIN_S:g}s; the broker refuses registrations it cannot fit)"
            )
        if bool(config.tls_cert) != bool(config.tls_key):
            raise ConfigError("kvpush: tls_cert and tls_key go together")
        return config
