# SPDX-License-Identifier: Apache-2.0
"""Server settings every service shares (listen address, credentials, metrics), from flags or KVPUSH_* env."""

from __future__ import annotations

import dataclasses
import os
import pathlib
import secrets

from kvpush.settings import Settings, setting

DEFAULT_MAX_MESSAGE_BYTES = 16 * 1024 * 1024


def write_private_file(path: pathlib.Path, content: str) -> None:
    """Writes content readable by the owner only, atomically (readers never see a partial file)."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(content)
    os.replace(tmp, path)


@dataclasses.dataclass(frozen=True)
class ServerConfig(Settings):
    """How a service listens and authenticates.

    Without TLS files the service runs in token mode: each caller presents
    its own token from --tokens-dir (see services/common/tokens.py); with
    --tls-cert/--tls-key/--tls-ca it runs mutual TLS and callers are named by
    their certificate's common name.
    """

    listen: str = setting("127.0.0.1:50051", flag="--listen", env="KVPUSH_LISTEN", help="address to serve on; port 0 picks a free port")
    port_file: pathlib.Path | None = setting(None, flag="--port-file", env="KVPUSH_PORT_FILE", convert=pathlib.Path, help="file to write the bound port to")
    tokens_dir: pathlib.Path | None = setting(
        None,
        flag="--tokens-dir",
        env="KVPUSH_TOKENS_DIR",
        convert=pathlib.Path,
        help="directory of per-identity tokens: each file is named after an identity (router, broker or an engine id) and holds its token",
    )
    tls_cert: pathlib.Path | None = setting(
        None, flag="--tls-cert", env="KVPUSH_TLS_CERT", convert=pathlib.Path, help="server certificate (PEM); enables mutual TLS"
    )
    tls_key: pathlib.Path | None = setting(None, flag="--tls-key", env="KVPUSH_TLS_KEY", convert=pathlib.Path, help="server private key (PEM)")
    tls_ca: pathlib.Path | None = setting(
        None, flag="--tls-ca", env="KVPUSH_TLS_CA", convert=pathlib.Path, help="CA bundle (PEM) client certificates must chain to"
    )
    metrics_port: int | None = setting(
        None, flag="--metrics-port", env="KVPUSH_METRICS_PORT", convert=int, help="serve Prometheus metrics over HTTP on this port (0 = any free port)"
    )
    metrics_host: str = setting("127.0.0.1", flag="--metrics-host", env="KVPUSH_METRICS_HOST", help="address the metrics endpoint binds")
    grace_s: float = setting(5.0, flag="--grace", env="KVPUSH_GRACE_S", convert=float, at_least=0, help="seconds in-flight calls get at shutdown")
    max_message_bytes: int = setting(
        DEFAULT_MAX_MESSAGE_BYTES,
        flag="--max-message-bytes",
        env="KVPUSH_MAX_MESSAGE_BYTES",
        convert=int,
        at_least=1024,
        help="largest request or response message accepted",
    )

    @property
    def mtls(self) -> bool:
        return self.tls_cert is not None

    def __post_init__(self) -> None:
        super().__post_init__()
        tls = (self.tls_cert, self.tls_key, self.tls_ca)
        if any(tls) and not all(tls):
            raise ValueError("mutual TLS needs --tls-cert, --tls-key and --tls-ca together")

    def tls_pems(self) -> tuple[bytes, bytes, bytes]:
        """The certificate, private key and CA bundle (PEM) of mutual TLS, read now."""
        if self.tls_cert is None or self.tls_key is None or self.tls_ca is None:
            raise ValueError("mutual TLS is not configured: it needs --tls-cert, --tls-key and --tls-ca")
        return self.tls_cert.read_bytes(), self.tls_key.read_bytes(), self.tls_ca.read_bytes()

    def write_port(self, port: int) -> None:
        if self.port_file is not None:
            write_private_file(self.port_file, f"{port}\n")
