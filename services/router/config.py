# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""Router settings: one frozen dataclass, from flags or KVPUSH_ROUTER_* / KVPUSH_* environment variables."""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
from urllib.parse import urlsplit

from kvpush.services.common.config import add_option
from kvpush.services.router.core import POLICIES, Endpoint

MODES = ("push", "pull", "upstream-push")


def parse_endpoint(text: str) -> Endpoint:
    """Parses URL=ENGINE_ID (e.g. http://10.0.0.5:8100=prefill-0)."""
    url, sep, engine_id = text.rpartition("=")
    if not sep or not url or not engine_id:
        raise ValueError(f"{text!r} is not URL=ENGINE_ID")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.port is None:
        raise ValueError(f"{url!r} is not an http(s)://host:port URL")
    return Endpoint(url.rstrip("/"), engine_id)


def _endpoints_from_env(name: str) -> list[Endpoint]:
    return [parse_endpoint(item.strip()) for item in os.environ.get(name, "").split(",") if item.strip()]


@dataclasses.dataclass(frozen=True)
class RouterConfig:
    """How the router listens, which engines it drives and how long it waits for each of them."""

    prefill: tuple[Endpoint, ...]
    decode: tuple[Endpoint, ...]
    listen: str = "127.0.0.1:8000"
    port_file: pathlib.Path | None = None
    policy: str = "round_robin"
    mode: str = "push"
    # control_plane (host:port) is where the router cancels transfers (push mode).
    control_plane: str = ""
    token: str = ""
    token_file: pathlib.Path | None = None
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    connect_timeout_s: float = 5.0
    # prefill_timeout_s bounds the whole prefill leg (its response comes after one token).
    prefill_timeout_s: float = 60.0
    # first_token_timeout_s bounds the decode leg until its first output, and
    # any later gap between two streamed chunks.
    first_token_timeout_s: float = 60.0
    request_timeout_s: float = 600.0
    # transfer_timeout_ms is the kvpush deadline each transfer attempt carries.
    transfer_timeout_ms: int = 30_000
    # transfer_deadline_slack_s: a push-mode decode leg without output this
    # long past its transfer's deadline is answered 504 and closed (unless the
    # broker says the KV arrived).
    transfer_deadline_slack_s: float = 0.5
    # early_poll_delay_s: once the prefill leg has answered, how long the
    # decode leg may stay without output before the router long-polls the
    # broker for the attempt's end (push mode).
    early_poll_delay_s: float = 0.25
    # cancel_timeout_s bounds each CancelTransfer and GetTransfer call (a long
    # poll gets its wait on top).
    cancel_timeout_s: float = 2.0
    max_attempts: int = 2
    health_timeout_s: float = 2.0
    # upstream-push mode: the prefill engine's NIXL side channel, as upstream
    # NixlPushConnector needs it in the decode leg (one P identity, like its demo proxy).
    prefill_kv_host: str = "127.0.0.1"
    prefill_side_channel_port: int = 5600
    prefill_tp_size: int = 1
    prefill_pp_size: int = 1

    def __post_init__(self) -> None:
        if not self.prefill or not self.decode:
            raise ValueError("at least one --prefill and one --decode URL=ENGINE_ID are required")
        if self.policy not in POLICIES:
            raise ValueError(f"--policy must be one of {', '.join(POLICIES)}, not {self.policy!r}")
        if self.mode not in MODES:
            raise ValueError(f"--mode must be one of {', '.join(MODES)}, not {self.mode!r}")
        if self.mode == "push" and ":" not in self.control_plane:
            raise ValueError("--mode push needs --control-plane host:port (the router cancels failed transfers there)")
        if self.mode == "push" and not (self.token or self.token_file or self.tls_cert):
            raise ValueError("--mode push needs control-plane credentials: --token-file (or $KVPUSH_TOKEN) or --tls-cert/--tls-key/--tls-ca")
        timeouts = (self.connect_timeout_s, self.prefill_timeout_s, self.first_token_timeout_s, self.request_timeout_s, self.cancel_timeout_s, self.health_timeout_s)
        if min(timeouts) <= 0 or self.transfer_timeout_ms <= 0:
            raise ValueError("every timeout must be positive")
        if self.transfer_deadline_slack_s < 0 or self.early_poll_delay_s < 0:
            raise ValueError("--transfer-deadline-slack and --early-poll-delay must not be negative")
        if self.max_attempts < 1:
            raise ValueError("--max-attempts must be at least 1")
        _, sep, port = self.listen.rpartition(":")
        if not sep or not port.isdigit():
            raise ValueError(f"--listen must be host:port, not {self.listen!r}")

    @property
    def host(self) -> str:
        return self.listen.rpartition(":")[0].strip("[]")

    @property
    def port(self) -> int:
        return int(self.listen.rpartition(":")[2])

    def resolve_token(self) -> str:
        """The control-plane token: --token / $KVPUSH_TOKEN, else the token file's content."""
        if self.token or self.token_file is None:
            return self.token
        return self.token_file.read_text(encoding="utf-8").strip()

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        path = pathlib.Path
        parser.add_argument(
            "--prefill", action="append", type=parse_endpoint, default=None, metavar="URL=ENGINE_ID",
            help="a prefill engine, repeatable (env KVPUSH_ROUTER_PREFILL, comma-separated)",
        )
        parser.add_argument(
            "--decode", action="append", type=parse_endpoint, default=None, metavar="URL=ENGINE_ID",
            help="a decode engine, repeatable (env KVPUSH_ROUTER_DECODE, comma-separated)",
        )
        add_option(parser, "--listen", "KVPUSH_ROUTER_LISTEN", default="127.0.0.1:8000", help_text="HTTP address to serve on; port 0 picks a free port")
        add_option(parser, "--port-file", "KVPUSH_ROUTER_PORT_FILE", convert=path, help_text="file to write the bound port to")
        add_option(parser, "--policy", "KVPUSH_ROUTER_POLICY", default="round_robin", help_text=f"engine choice: {' or '.join(POLICIES)}")
        add_option(parser, "--mode", "KVPUSH_ROUTER_MODE", default="push", help_text=f"transfer protocol: {', '.join(MODES)}")
        add_option(parser, "--control-plane", "KVPUSH_CONTROL_PLANE", default="", help_text="kvpush control plane host:port (push mode)")
        add_option(parser, "--token", "KVPUSH_TOKEN", default="", help_text="the router's own control-plane token (identity 'router')")
        add_option(parser, "--token-file", "KVPUSH_TOKEN_FILE", convert=path, help_text="file holding the router's own control-plane token (the 'router' file of the control plane's --tokens-dir)")
        add_option(parser, "--tls-ca", "KVPUSH_TLS_CA", default="", help_text="CA bundle for mTLS to the control plane")
        add_option(parser, "--tls-cert", "KVPUSH_TLS_CERT", default="", help_text="client certificate (CN 'router') for mTLS")
        add_option(parser, "--tls-key", "KVPUSH_TLS_KEY", default="", help_text="client key for mTLS")
        add_option(parser, "--connect-timeout", "KVPUSH_ROUTER_CONNECT_TIMEOUT_S", convert=float, default=5.0, help_text="seconds to open a connection to an engine")
        add_option(parser, "--prefill-timeout", "KVPUSH_ROUTER_PREFILL_TIMEOUT_S", convert=float, default=60.0, help_text="seconds the prefill leg may take")
        add_option(
            parser, "--first-token-timeout", "KVPUSH_ROUTER_FIRST_TOKEN_TIMEOUT_S", convert=float, default=60.0,
            help_text="seconds until the decode leg's first output (and between streamed chunks)",
        )
        add_option(parser, "--request-timeout", "KVPUSH_ROUTER_REQUEST_TIMEOUT_S", convert=float, default=600.0, help_text="seconds a whole request may take")
        add_option(parser, "--transfer-timeout-ms", "KVPUSH_ROUTER_TRANSFER_TIMEOUT_MS", convert=int, default=30_000, help_text="kvpush deadline of each transfer attempt")
        add_option(
            parser, "--transfer-deadline-slack", "KVPUSH_ROUTER_TRANSFER_DEADLINE_SLACK_S", convert=float, default=0.5,
            help_text="push: seconds past the transfer deadline a decode leg may go without output before it is answered 504 and closed",
        )
        add_option(
            parser, "--early-poll-delay", "KVPUSH_ROUTER_EARLY_POLL_DELAY_S", convert=float, default=0.25,
            help_text="push: seconds after the prefill leg answered before a decode leg without output makes the router long-poll the broker",
        )
        add_option(
            parser, "--cancel-timeout", "KVPUSH_ROUTER_CANCEL_TIMEOUT_S", convert=float, default=2.0,
            help_text="deadline of CancelTransfer and GetTransfer calls (a long poll gets its wait on top)",
        )
        add_option(parser, "--max-attempts", "KVPUSH_ROUTER_MAX_ATTEMPTS", convert=int, default=2, help_text="dispatches per request, counting the first")
        add_option(parser, "--health-timeout", "KVPUSH_ROUTER_HEALTH_TIMEOUT_S", convert=float, default=2.0, help_text="deadline of each engine probe behind /health")
        add_option(parser, "--prefill-kv-host", "KVPUSH_ROUTER_PREFILL_KV_HOST", default="127.0.0.1", help_text="upstream-push: P's NIXL side-channel host")
        add_option(
            parser, "--prefill-side-channel-port", "KVPUSH_ROUTER_PREFILL_SIDE_CHANNEL_PORT", convert=int, default=5600,
            help_text="upstream-push: P's NIXL side-channel port",
        )
        add_option(parser, "--prefill-tp-size", "KVPUSH_ROUTER_PREFILL_TP_SIZE", convert=int, default=1, help_text="upstream-push: P's tensor-parallel size")
        add_option(parser, "--prefill-pp-size", "KVPUSH_ROUTER_PREFILL_PP_SIZE", convert=int, default=1, help_text="upstream-push: P's pipeline-parallel size")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RouterConfig:
        return cls(
            prefill=tuple(args.prefill or _endpoints_from_env("KVPUSH_ROUTER_PREFILL")),
            decode=tuple(args.decode or _endpoints_from_env("KVPUSH_ROUTER_DECODE")),
            listen=args.listen,
            port_file=args.port_file,
            policy=args.policy,
            mode=args.mode,
            control_plane=args.control_plane,
            token=args.token,
            token_file=args.token_file,
            tls_ca=args.tls_ca,
            tls_cert=args.tls_cert,
            tls_key=args.tls_key,
            connect_timeout_s=args.connect_timeout,
            prefill_timeout_s=args.prefill_timeout,
            first_token_timeout_s=args.first_token_timeout,
            request_timeout_s=args.request_timeout,
            transfer_timeout_ms=args.transfer_timeout_ms,
            transfer_deadline_slack_s=args.transfer_deadline_slack,
            early_poll_delay_s=args.early_poll_delay,
            cancel_timeout_s=args.cancel_timeout,
            max_attempts=args.max_attempts,
            health_timeout_s=args.health_timeout,
            prefill_kv_host=args.prefill_kv_host,
            prefill_side_channel_port=args.prefill_side_channel_port,
            prefill_tp_size=args.prefill_tp_size,
            prefill_pp_size=args.prefill_pp_size,
        )
