# SPDX-License-Identifier: Apache-2.0
"""Server settings every service shares (listen address, credentials, metrics), from flags or KVPUSH_* env."""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import secrets
from collections.abc import Callable
from typing import Any

DEFAULT_MAX_MESSAGE_BYTES = 16 * 1024 * 1024


def add_option(
    parser: argparse.ArgumentParser,
    flag: str,
    env: str,
    *,
    default: Any = None,
    convert: Callable[[str], Any] = str,
    help_text: str,
) -> None:
    """Adds --flag whose default comes from the environment variable env, else default."""
    raw = os.environ.get(env, "")
    try:
        value = convert(raw) if raw else default
    except ValueError as exc:
        raise SystemExit(f"{env}={raw!r} is not valid: {exc}") from None
    shown = "unset" if default is None else default
    parser.add_argument(flag, type=convert, default=value, help=f"{help_text} (env {env}; default {shown})")


def write_private_file(path: pathlib.Path, content: str) -> None:
    """Writes content readable by the owner only, atomically (readers never see a partial file)."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(content)
    os.replace(tmp, path)


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """How a service listens and authenticates.

    Without TLS files the service runs in token mode: each caller presents
    its own token from --tokens-dir (see services/common/tokens.py); with
    --tls-cert/--tls-key/--tls-ca it runs mutual TLS and callers are named by
    their certificate's common name.
    """

    listen: str = "127.0.0.1:50051"
    port_file: pathlib.Path | None = None
    tokens_dir: pathlib.Path | None = None
    tls_cert: pathlib.Path | None = None
    tls_key: pathlib.Path | None = None
    tls_ca: pathlib.Path | None = None
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    grace_s: float = 5.0
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES

    @property
    def mtls(self) -> bool:
        return self.tls_cert is not None

    def __post_init__(self) -> None:
        tls = (self.tls_cert, self.tls_key, self.tls_ca)
        if any(tls) and not all(tls):
            raise ValueError("mutual TLS needs --tls-cert, --tls-key and --tls-ca together")
        if self.grace_s < 0:
            raise ValueError("--grace must not be negative")
        if self.max_message_bytes < 1024:
            raise ValueError("--max-message-bytes must be at least 1024")

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser, *, default_listen: str = "127.0.0.1:50051") -> None:
        path = pathlib.Path
        add_option(parser, "--listen", "KVPUSH_LISTEN", default=default_listen, help_text="address to serve on; port 0 picks a free port")
        add_option(parser, "--port-file", "KVPUSH_PORT_FILE", convert=path, help_text="file to write the bound port to")
        add_option(
            parser,
            "--tokens-dir",
            "KVPUSH_TOKENS_DIR",
            convert=path,
            help_text="directory of per-identity tokens: each file is named after an identity (router, broker or an engine id) and holds its token",
        )
        add_option(parser, "--tls-cert", "KVPUSH_TLS_CERT", convert=path, help_text="server certificate (PEM); enables mutual TLS")
        add_option(parser, "--tls-key", "KVPUSH_TLS_KEY", convert=path, help_text="server private key (PEM)")
        add_option(parser, "--tls-ca", "KVPUSH_TLS_CA", convert=path, help_text="CA bundle (PEM) client certificates must chain to")
        add_option(parser, "--metrics-port", "KVPUSH_METRICS_PORT", convert=int, help_text="serve Prometheus metrics over HTTP on this port (0 = any free port)")
        add_option(parser, "--metrics-host", "KVPUSH_METRICS_HOST", default="127.0.0.1", help_text="address the metrics endpoint binds")
        add_option(parser, "--grace", "KVPUSH_GRACE_S", convert=float, default=5.0, help_text="seconds in-flight calls get at shutdown")
        add_option(
            parser,
            "--max-message-bytes",
            "KVPUSH_MAX_MESSAGE_BYTES",
            convert=int,
            default=DEFAULT_MAX_MESSAGE_BYTES,
            help_text="largest request or response message accepted",
        )

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServerConfig:
        return cls(
            listen=args.listen,
            port_file=args.port_file,
            tokens_dir=args.tokens_dir,
            tls_cert=args.tls_cert,
            tls_key=args.tls_key,
            tls_ca=args.tls_ca,
            metrics_port=args.metrics_port,
            metrics_host=args.metrics_host,
            grace_s=args.grace,
            max_message_bytes=args.max_message_bytes,
        )

    def write_port(self, port: int) -> None:
        if self.port_file is not None:
            write_private_file(self.port_file, f"{port}\n")
