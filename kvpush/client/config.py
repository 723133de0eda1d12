# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""Client configuration: targets, credentials, TLS, deadlines, retries and channel options."""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Collection, Iterable

import grpc


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    """gRPC's own retries of retry-safe unary calls that failed with UNAVAILABLE (a service config retryPolicy).

    Backoff follows gRPC's retry design (gRFC A6): before retry n (from 1)
    the channel waits a uniformly random time in [0, min(max_backoff_s,
    initial_backoff_s * backoff_multiplier ** (n - 1))). No retry starts
    after the call's deadline. max_attempts counts the first try; 1 turns
    retries off, and gRPC treats more than 5 as 5.
    """

    max_attempts: int = 5
    initial_backoff_s: float = 0.05
    max_backoff_s: float = 1.0
    backoff_multiplier: float = 2.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        if self.initial_backoff_s <= 0 or self.max_backoff_s < self.initial_backoff_s:
            raise ValueError("backoffs must satisfy 0 < initial_backoff_s <= max_backoff_s")
        if self.backoff_multiplier < 1:
            raise ValueError("backoff_multiplier must be at least 1")

    def service_config(self, service: str, methods: Iterable[str]) -> str:
        """Returns the gRPC service config (JSON) that retries these methods of service with this policy."""
        return json.dumps(
            {
                "methodConfig": [
                    {
                        "name": [{"service": service, "method": method} for method in sorted(methods)],
                        "retryPolicy": {
                            "maxAttempts": self.max_attempts,
                            "initialBackoff": f"{self.initial_backoff_s:.9f}s",
                            "maxBackoff": f"{self.max_backoff_s:.9f}s",
                            "backoffMultiplier": self.backoff_multiplier,
                            "retryableStatusCodes": ["UNAVAILABLE"],
                        },
                    }
                ]
            }
        )


# The first reconnection attempt after a lost connection waits this long.
RECONNECT_BACKOFF_FLOOR_S = 0.1


@dataclasses.dataclass(frozen=True)
class ClientConfig:
    """How a RegistrarClient or BrokerClient reaches the control plane.

    The embedded control plane serves both services on one address
    (`target`); registrar_target / broker_target override it per service.

    Keepalive: the client pings every keepalive_time_s while a call is open
    (long streams go quiet for minutes) and only then, so an idle channel
    stays silent. A server must accept pings that often
    (grpc.http2.min_recv_ping_interval_without_data_ms <= keepalive_time_s),
    or it answers with GOAWAY "too_many_pings".
    """

    target: str = "127.0.0.1:50051"
    registrar_target: str = ""
    broker_target: str = ""
    # token is the caller's own token (its identity's file in the control
    # plane's --tokens-dir), sent as "authorization: Bearer <token>".
    token: str = ""
    # TLS turns on with tls=True or any of the paths below; cert + key make it mTLS.
    tls: bool = False
    ca_cert_path: str = ""
    client_cert_path: str = ""
    client_key_path: str = ""
    # tls_server_name overrides the name checked against the server's
    # certificate (for addresses that are not in its SANs).
    tls_server_name: str = ""
    default_timeout_s: float = 5.0
    retry: RetryPolicy = dataclasses.field(default_factory=RetryPolicy)
    keepalive_time_s: float = 30.0
    keepalive_timeout_s: float = 10.0
    # Control-plane members (the embedded control plane, a broker shard, a
    # registrar replica) restart on the same address: after a lost
    # connection the channel tries again within this long, not after gRPC's
    # default backoff (1 s growing to 120 s), which would keep an engine away
    # from a restarted member for seconds to minutes.
    max_reconnect_backoff_s: float = 1.0
    # own_connections: the channel keeps its connections to itself instead
    # of sharing them, through gRPC's process-wide subchannel pool, with
    # other channels to the same address. A broker member's channel, opened
    # when the member (re)joins, then connects at once: a shared connection
    # to that address (the seed's, a multi-address target of every member)
    # may still be failing since the member's last process died, and a call
    # on the new channel would fail with that old error until the shared
    # connection's next attempt, a second or more later.
    own_connections: bool = False
    # KV layouts list a region per layer and plane and WatchEngines sends
    # every rank of an engine at once: more than gRPC's 4 MiB default.
    max_message_bytes: int = 64 * 1024 * 1024

    def __post_init__(self) -> None:
        if not (self.target or (self.registrar_target and self.broker_target)):
            raise ValueError("target is required")
        if bool(self.client_cert_path) != bool(self.client_key_path):
            raise ValueError("client_cert_path and client_key_path go together")
        if self.default_timeout_s <= 0:
            raise ValueError("default_timeout_s must be positive")
        if self.keepalive_time_s <= 0 or self.keepalive_timeout_s <= 0:
            raise ValueError("keepalive times must be positive")
        if self.max_message_bytes <= 0:
            raise ValueError("max_message_bytes must be positive")
        if self.max_reconnect_backoff_s < RECONNECT_BACKOFF_FLOOR_S:
            raise ValueError(f"max_reconnect_backoff_s must be at least {RECONNECT_BACKOFF_FLOOR_S:g}")

    @property
    def uses_tls(self) -> bool:
        return self.tls or bool(self.ca_cert_path or self.client_cert_path)

    def channel_options(self, service: str = "", retry_safe: Collection[str] = ()) -> list[tuple[str, int | str]]:
        """Returns the grpc channel arguments this config implies; gRPC retries retry_safe methods of service."""
        options: list[tuple[str, int | str]] = [
            ("grpc.keepalive_time_ms", int(self.keepalive_time_s * 1000)),
            ("grpc.keepalive_timeout_ms", int(self.keepalive_timeout_s * 1000)),
            ("grpc.keepalive_permit_without_calls", 0),
            ("grpc.max_send_message_length", self.max_message_bytes),
            ("grpc.max_receive_message_length", self.max_message_bytes),
            ("grpc.initial_reconnect_backoff_ms", int(RECONNECT_BACKOFF_FLOOR_S * 1000)),
            ("grpc.min_reconnect_backoff_ms", int(RECONNECT_BACKOFF_FLOOR_S * 1000)),
            ("grpc.max_reconnect_backoff_ms", int(self.max_reconnect_backoff_s * 1000)),
        ]
        if self.own_connections:
            options.append(("grpc.use_local_subchannel_pool", 1))
        if self.tls_server_name:
            options.append(("grpc.ssl_target_name_override", self.tls_server_name))
        if retry_safe and self.retry.max_attempts > 1:
            options += [
                ("grpc.enable_retries", 1),
                ("grpc.service_config", self.retry.service_config(service, retry_safe)),
                # gRPC keeps a call's request for retries only up to this size
                # (256 KiB by default) and does not retry a larger one; engine
                # registrations carry whole KV layouts.
                ("grpc.per_rpc_retry_buffer_size", self.max_message_bytes),
            ]
        return options

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Returns TLS credentials from the configured files (system roots when no CA is given)."""

        def read(path: str) -> bytes | None:
            return pathlib.Path(path).read_bytes() if path else None

        return grpc.ssl_channel_credentials(
            root_certificates=read(self.ca_cert_path),
            private_key=read(self.client_key_path),
            certificate_chain=read(self.client_cert_path),
        )

    def open_channel(self, target: str, *, service: str = "", retry_safe: Collection[str] = ()) -> grpc.aio.Channel:
        """Opens a grpc.aio channel to target; call it on the event loop that will use the channel.

        gRPC retries the retry_safe methods of service after UNAVAILABLE, as
        the retry policy says.
        """
        options = self.channel_options(service, retry_safe)
        if self.uses_tls:
            return grpc.aio.secure_channel(target, self.channel_credentials(), options=options)
        return grpc.aio.insecure_channel(target, options=options)
