# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""Router settings: one frozen dataclass, from flags or KVPUSH_ROUTER_* / KVPUSH_* environment variables."""

from __future__ import annotations

import dataclasses
import pathlib
from urllib.parse import urlsplit

from kvpush.services.router.core import POLICIES, Endpoint
from kvpush.settings import Settings, setting

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


@dataclasses.dataclass(frozen=True)
class RouterConfig(Settings):
    """How the router listens, which engines it drives and how long it waits for each of them."""

    prefill: tuple[Endpoint, ...] = setting(
        flag="--prefill", env="KVPUSH_ROUTER_PREFILL", convert=parse_endpoint, repeatable=True, metavar="URL=ENGINE_ID", help="a prefill engine, repeatable"
    )
    decode: tuple[Endpoint, ...] = setting(
        flag="--decode", env="KVPUSH_ROUTER_DECODE", convert=parse_endpoint, repeatable=True, metavar="URL=ENGINE_ID", help="a decode engine, repeatable"
    )
    listen: str = setting("127.0.0.1:8000", flag="--listen", env="KVPUSH_ROUTER_LISTEN", help="HTTP address to serve on; port 0 picks a free port")
    port_file: pathlib.Path | None = setting(
        None, flag="--port-file", env="KVPUSH_ROUTER_PORT_FILE", convert=pathlib.Path, help="file to write the bound port to"
    )
    policy: str = setting("round_robin", flag="--policy", env="KVPUSH_ROUTER_POLICY", choices=POLICIES, help=f"engine choice: {' or '.join(POLICIES)}")
    mode: str = setting("push", flag="--mode", env="KVPUSH_ROUTER_MODE", choices=MODES, help=f"transfer protocol: {', '.join(MODES)}")
    # control_plane (host:port) is where the router cancels transfers (push mode).
    control_plane: str = setting("", flag="--control-plane", env="KVPUSH_CONTROL_PLANE", help="kvpush control plane host:port (push mode)")
    token: str = setting("", flag="--token", env="KVPUSH_TOKEN", help="the router's own control-plane token (identity 'router')")
    token_file: pathlib.Path | None = setting(
        None,
        flag="--token-file",
        env="KVPUSH_TOKEN_FILE",
        convert=pathlib.Path,
        help="file holding the router's own control-plane token (the 'router' file of the control plane's --tokens-dir)",
    )
    tls_ca: str = setting("", flag="--tls-ca", env="KVPUSH_TLS_CA", help="CA bundle for mTLS to the control plane")
    tls_cert: str = setting("", flag="--tls-cert", env="KVPUSH_TLS_CERT", help="client certificate (CN 'router') for mTLS")
    tls_key: str = setting("", flag="--tls-key", env="KVPUSH_TLS_KEY", help="client key for mTLS")
    connect_timeout_s: float = setting(
        5.0, flag="--connect-timeout", env="KVPUSH_ROUTER_CONNECT_TIMEOUT_S", convert=float, positive=True, help="seconds to open a connection to an engine"
    )
    # engine_keepalive_s: an engine's server closes a connection idle for its own
    # keep-alive (vLLM's uvicorn: VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s); a request
    # sent on it as that timer fires is lost (ServerDisconnectedError), so the
    # router stops reusing a connection first.
    engine_keepalive_s: float = setting(
        4.0,
        flag="--engine-keepalive",
        env="KVPUSH_ROUTER_ENGINE_KEEPALIVE_S",
        convert=float,
        positive=True,
        help="seconds an idle connection to an engine is reused; keep it below the engines' own keep-alive (vLLM: 5 s)",
    )
    # prefill_timeout_s bounds the whole prefill leg (its response comes after one token).
    prefill_timeout_s: float = setting(
        60.0, flag="--prefill-timeout", env="KVPUSH_ROUTER_PREFILL_TIMEOUT_S", convert=float, positive=True, help="seconds the prefill leg may take"
    )
    # first_token_timeout_s bounds the request until its first output (from
    # its arrival, across retries), and any later gap between two streamed chunks.
    first_token_timeout_s: float = setting(
        60.0,
        flag="--first-token-timeout",
        env="KVPUSH_ROUTER_FIRST_TOKEN_TIMEOUT_S",
        convert=float,
        positive=True,
        help="seconds from a request's arrival until its first output, retries included (and between streamed chunks)",
    )
    request_timeout_s: float = setting(
        600.0, flag="--request-timeout", env="KVPUSH_ROUTER_REQUEST_TIMEOUT_S", convert=float, positive=True, help="seconds a whole request may take"
    )
    # transfer_timeout_ms is the request's kvpush transfer deadline: its first
    # attempt carries it as timeout_ms, a retry what is left of it.
    transfer_timeout_ms: int = setting(
        30_000,
        flag="--transfer-timeout-ms",
        env="KVPUSH_ROUTER_TRANSFER_TIMEOUT_MS",
        convert=int,
        positive=True,
        help="push: the request's transfer deadline, sent as the first attempt's timeout_ms; a retry carries what is left of it",
    )
    # transfer_deadline_slack_s: a push-mode decode leg without output this
    # long past its transfer's deadline is answered 504 and closed (unless the
    # broker says the KV arrived).
    transfer_deadline_slack_s: float = setting(
        0.5,
        flag="--transfer-deadline-slack",
        env="KVPUSH_ROUTER_TRANSFER_DEADLINE_SLACK_S",
        convert=float,
        at_least=0,
        help="push: seconds past the transfer deadline a decode leg may go without output before it is answered 504 and closed",
    )
    # early_poll_delay_s: once the prefill leg has answered, how long the
    # decode leg may stay without output before the router long-polls the
    # broker for the attempt's end (push mode).
    early_poll_delay_s: float = setting(
        0.25,
        flag="--early-poll-delay",
        env="KVPUSH_ROUTER_EARLY_POLL_DELAY_S",
        convert=float,
        at_least=0,
        help="push: seconds after the prefill leg answered before a decode leg without output makes the router long-poll the broker",
    )
    # cancel_timeout_s bounds each CancelTransfer and GetTransfer call (a long
    # poll gets its wait on top).
    cancel_timeout_s: float = setting(
        2.0,
        flag="--cancel-timeout",
        env="KVPUSH_ROUTER_CANCEL_TIMEOUT_S",
        convert=float,
        positive=True,
        help="deadline of CancelTransfer and GetTransfer calls (a long poll gets its wait on top)",
    )
    # shard_loss_wait_s: a sharded broker's member that cannot be reached may
    # be dead with its membership lease not lapsed yet; the router waits up to
    # this long for its shard map to drop it (BROKER_SHARD_LOST, retried),
    # never past the request's own bound, before answering
    # BROKER_MEMBER_UNREACHABLE. Above the members' --shard-lease-ttl.
    shard_loss_wait_s: float = setting(
        5.0,
        flag="--shard-loss-wait",
        env="KVPUSH_ROUTER_SHARD_LOSS_WAIT_S",
        convert=float,
        at_least=0,
        help="push, sharded broker: seconds to wait for the shard map to drop an unreachable broker member (never past the request's deadline) "
        "before answering BROKER_MEMBER_UNREACHABLE",
    )
    max_attempts: int = setting(
        2, flag="--max-attempts", env="KVPUSH_ROUTER_MAX_ATTEMPTS", convert=int, at_least=1, help="dispatches per request, counting the first"
    )
    health_timeout_s: float = setting(
        2.0, flag="--health-timeout", env="KVPUSH_ROUTER_HEALTH_TIMEOUT_S", convert=float, positive=True, help="deadline of each engine probe behind /health"
    )
    # upstream-push mode: the prefill engine's NIXL side channel, as upstream
    # NixlPushConnector needs it in the decode leg (one P identity, like its demo proxy).
    prefill_kv_host: str = setting(
        "127.0.0.1", flag="--prefill-kv-host", env="KVPUSH_ROUTER_PREFILL_KV_HOST", help="upstream-push: P's NIXL side-channel host"
    )
    prefill_side_channel_port: int = setting(
        5600,
        flag="--prefill-side-channel-port",
        env="KVPUSH_ROUTER_PREFILL_SIDE_CHANNEL_PORT",
        convert=int,
        help="upstream-push: P's NIXL side-channel port",
    )
    prefill_tp_size: int = setting(1, flag="--prefill-tp-size", env="KVPUSH_ROUTER_PREFILL_TP_SIZE", convert=int, help="upstream-push: P's tensor-parallel size")
    prefill_pp_size: int = setting(1, flag="--prefill-pp-size", env="KVPUSH_ROUTER_PREFILL_PP_SIZE", convert=int, help="upstream-push: P's pipeline-parallel size")

    def __post_init__(self) -> None:
        if not self.prefill or not self.decode:
            raise ValueError("at least one --prefill and one --decode URL=ENGINE_ID are required")
        super().__post_init__()
        if self.mode == "push" and ":" not in self.control_plane:
            raise ValueError("--mode push needs --control-plane host:port (the router cancels failed transfers there)")
        if self.mode == "push" and not (self.token or self.token_file or self.tls_cert):
            raise ValueError("--mode push needs control-plane credentials: --token-file (or $KVPUSH_TOKEN) or --tls-cert/--tls-key/--tls-ca")
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
