# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""A local `kvpush control-plane` process and the `--kv-transfer-config` of the kvpush engines that use it.

It runs on 127.0.0.1 (port 0 by default, read back from its port file) with
a tokens directory (one token per identity: the router and each engine)
kept in a work directory, so it can be stopped and restarted on the same
port with the same credentials.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvpush.dev.localstack.process import GroupProcess, wait_for_port_file
from kvpush.services.common.tokens import ROUTER_IDENTITY, create_tokens

CONTROL_PLANE_START_TIMEOUT_S = 30.0
# The engines a control plane started here has tokens for, unless told others.
DEFAULT_ENGINE_IDS = ("prefill-0", "decode-0")


class TokenFiles:
    """The token files of a local control plane whose tokens_dir holds one per identity (the router and each engine it was started for)."""

    tokens_dir: Path

    @property
    def address(self) -> str:
        """Where engines reach the control plane."""
        raise NotImplementedError(f"{type(self).__name__} has no one address: pass control_plane_address")

    def token_file_of(self, identity: str) -> Path:
        """The token file of identity (the router or an engine the control plane was started for)."""
        path = self.tokens_dir / identity
        if not path.exists():
            raise ValueError(f"no token for {identity!r}: pass it in engine_ids")
        return path

    @property
    def token_file(self) -> Path:
        """The router's token file (what a router, or a test querying transfers, presents)."""
        return self.token_file_of(ROUTER_IDENTITY)

    @property
    def token(self) -> str:
        """The router's token."""
        return self.token_file.read_text().strip()


@dataclass
class ControlPlaneHandle(TokenFiles):
    """A running `kvpush control-plane` process."""

    process: GroupProcess
    port: int
    work_dir: Path
    tokens_dir: Path = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.tokens_dir = _tokens_dir(self.work_dir)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM (graceful shutdown), then SIGKILL if it is still there after `timeout`."""
        self.process.stop(timeout)

    def kill(self) -> None:
        """Abrupt death (SIGKILL), as a crash would."""
        self.process.kill()


def _tokens_dir(work_dir: Path) -> Path:
    return work_dir / "tokens"


def start_control_plane(work_dir: Path, *, port: int = 0, env: Mapping[str, str | None] | None = None, extra_args: Sequence[str] = (),
                        engine_ids: Sequence[str] = DEFAULT_ENGINE_IDS, log_path: Path | None = None,
                        name: str = "control-plane") -> ControlPlaneHandle:
    """Starts the embedded control plane and waits until it serves (bounded).

    The router and engine_ids get tokens (kept across restarts in the same
    work_dir); the log goes to work_dir/control-plane.log unless `log_path`.
    `env` changes the inherited environment (None unsets a variable).
    """
    work_dir.mkdir(parents=True, exist_ok=True)
    create_tokens(_tokens_dir(work_dir), [ROUTER_IDENTITY, *engine_ids])
    port_file = work_dir / "port"
    port_file.unlink(missing_ok=True)
    cmd = [
        sys.executable, "-m", "kvpush.cli", "control-plane",
        "--listen", f"127.0.0.1:{port}",
        "--port-file", str(port_file),
        "--tokens-dir", str(_tokens_dir(work_dir)),
        *extra_args,
    ]
    process = GroupProcess(name, cmd, log_path or work_dir / "control-plane.log", env=env)
    port = wait_for_port_file(process, port_file, CONTROL_PLANE_START_TIMEOUT_S)
    return ControlPlaneHandle(process, port, work_dir)


def kvpush_transfer_config(role: str, engine_id: str, control_plane: TokenFiles, *, control_plane_address: str | None = None,
                           **extra: object) -> dict:
    """vLLM --kv-transfer-config for a kvpush engine; `extra` goes to kv_connector_extra_config.

    `control_plane_address` overrides where the engine reaches the control
    plane (a proxy in front of it, or a scaled plane's registrars, whose
    broker target then comes in `extra`); its token stays the control plane's.
    """
    return {
        "kv_connector": "KvpushConnector",
        "kv_role": {"prefill": "kv_producer", "decode": "kv_consumer"}[role],
        "engine_id": engine_id,
        "kv_connector_extra_config": {
            "control_plane": control_plane_address or control_plane.address,
            "token_file": str(control_plane.token_file_of(engine_id)),
            **extra,
        },
    }
