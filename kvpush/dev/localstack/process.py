# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""Child processes in their own process group, with a log file, stopped by group: every process the local stack starts."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from kvpush.processes import group_members

PORT_FILE_POLL_S = 0.05


class StartError(RuntimeError):
    """A part of the stack exited or did not serve in time; the message carries its log tail."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_fixed_port(rng: random.Random | None = None, attempts: int = 200) -> int:
    """A free TCP port on 127.0.0.1 below the kernel's ephemeral range, for a server that must be told its port.

    A port from bind(0) comes from the ephemeral range, where any process's
    outgoing connection (a TP group's gloo or ZMQ sockets starting alongside)
    may take it before the server binds it; below the range only a bind can.
    """
    rng = rng or random.Random()
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for _ in range(attempts):
        port = rng.randrange(max(1024, low // 2), low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port below the ephemeral range (from {low}) after {attempts} tries")


def log_tail(path: Path, lines: int = 40) -> str:
    """The last `lines` lines of a log file ('' if unreadable)."""
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _environment(changes: Mapping[str, str | None]) -> dict[str, str]:
    """The current environment with changes applied (None unsets a variable)."""
    environment = {**os.environ, **changes}
    return {name: value for name, value in environment.items() if value is not None}


class GroupProcess:
    """A child that leads its own process group (id = its PID), its output appended to `log_path` after the command line.

    `env` is applied to the current environment: a value sets its variable, None unsets it.
    """

    def __init__(self, name: str, argv: Sequence[str], log_path: Path, env: Mapping[str, str | None] | None = None, cwd: Path | None = None):
        self.name = name
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            log.write(("$ " + " ".join(argv) + "\n").encode())
            log.flush()
            self.popen = subprocess.Popen(list(argv), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          env=_environment(env or {}), cwd=cwd, start_new_session=True)

    @property
    def pid(self) -> int:
        """PID of the leader, also the process group id."""
        return self.popen.pid

    @property
    def returncode(self) -> int | None:
        """The leader's exit status; None while it runs."""
        return self.popen.poll()

    def alive(self) -> bool:
        return self.popen.poll() is None

    def running(self) -> bool:
        """Whether the leader or any other member of its group is still there."""
        return self.alive() or bool(group_members(self.pid))

    def tail(self, lines: int = 40) -> str:
        return log_tail(self.log_path, lines)

    def signal(self, signum: int) -> None:
        """Sends signum to the whole group (nothing if it is gone)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signum)

    def stop(self, timeout: float = 10.0, kill_timeout: float = 10.0) -> None:
        """SIGTERM to the group (graceful shutdown), SIGKILL to what is left after `timeout`; returns once the group is gone (bounded)."""
        for signum, wait_s in ((signal.SIGTERM, timeout), (signal.SIGKILL, kill_timeout)):
            if not self.running():
                break
            self.signal(signum)
            self._wait_gone(wait_s)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(5)

    def kill(self, timeout: float = 15.0) -> None:
        """Abrupt death of the whole group (SIGKILL), as a crash would; returns once it is gone (bounded)."""
        self.signal(signal.SIGKILL)
        self._wait_gone(timeout)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(5)

    def _wait_gone(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.running() and time.monotonic() < deadline:
            time.sleep(0.1)


def wait_for_port_file(process: GroupProcess, port_file: Path, timeout: float) -> int:
    """The port a service started with --port-file writes once it serves; bounded, and the process is stopped on failure."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not process.alive():
            process.stop()
            raise StartError(f"{process.name} exited with {process.returncode}; log {process.log_path}:\n{process.tail()}")
        text = port_file.read_text().strip() if port_file.exists() else ""
        if text:
            return int(text)
        time.sleep(PORT_FILE_POLL_S)
    process.kill()
    raise StartError(f"{process.name} did not start within {timeout:g} s; log {process.log_path}:\n{process.tail()}")


@contextlib.contextmanager
def interrupt_on_signals(signums: Sequence[int] = (signal.SIGINT, signal.SIGTERM)) -> Iterator[None]:
    """Inside, the signals raise KeyboardInterrupt in the main thread, so `finally` and `with` blocks stop what was started.

    SIGINT is named too: a shell's background job starts with it ignored.
    """

    def interrupted(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)

    previous = {signum: signal.signal(signum, interrupted) for signum in signums}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
