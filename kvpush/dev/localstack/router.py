# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""A local `kvpush router` process in front of the stack's engines."""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvpush.dev.localstack.control_plane import ControlPlaneHandle
from kvpush.dev.localstack.process import GroupProcess, wait_for_port_file

ROUTER_START_TIMEOUT_S = 30.0


@dataclass
class RouterHandle:
    """A running `kvpush router` (leader of its own process group)."""

    process: GroupProcess
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.process.log_path

    def stop(self, timeout: float = 10.0) -> None:
        self.process.stop(timeout)


def start_router(work_dir: Path, *, prefill: Sequence[str], decode: Sequence[str], mode: str = "push",
                 control_plane: ControlPlaneHandle | None = None, extra_args: Sequence[str] = (), env: Mapping[str, str] | None = None,
                 name: str = "router", log_path: Path | None = None, log_level: str | None = None) -> RouterHandle:
    """Starts `kvpush router --mode mode` on a free port and waits (bounded) until it serves.

    `prefill` and `decode` are "URL=ENGINE_ID" endpoints; with a
    `control_plane` the router gets its address and the router's token
    file. Files: work_dir/<name>.port, and the log at work_dir/<name>.log
    unless `log_path`.
    """
    work_dir.mkdir(parents=True, exist_ok=True)
    port_file = work_dir / f"{name}.port"
    port_file.unlink(missing_ok=True)
    argv = [sys.executable, "-m", "kvpush.cli", *(["--log-level", log_level] if log_level else []), "router",
            "--listen", "127.0.0.1:0", "--port-file", str(port_file), "--mode", mode,
            *[arg for endpoint in prefill for arg in ("--prefill", endpoint)], *[arg for endpoint in decode for arg in ("--decode", endpoint)]]
    if control_plane is not None:
        argv += ["--control-plane", control_plane.address, "--token-file", str(control_plane.token_file)]
    process = GroupProcess(name, [*argv, *extra_args], log_path or work_dir / f"{name}.log", env=env)
    return RouterHandle(process, wait_for_port_file(process, port_file, ROUTER_START_TIMEOUT_S))
