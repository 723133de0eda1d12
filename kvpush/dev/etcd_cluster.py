# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""A real etcd cluster on 127.0.0.1 for tests, the local stack and benchmarks: members as child processes, stopped by PID.

Synchronous on purpose, so pytest fixtures and scripts use it without an
event loop. Members elect quickly (50 ms heartbeats, 500 ms election
timeout), so a killed leader is replaced within about a second, and
etcd then honours leases as short as 1 s. They run raft's pre-vote (etcd
3.5's default, off in Debian's 3.4): a killed member that restarts does not
depose the leader it finds with an election of its own, which cost every
broker member its lease certainty a second time.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc

from kvpush.dev.localstack.process import GroupProcess, StartError, free_port
from kvpush.etcd.client import STATUS_METHOD
from kvpush.etcd.v1 import etcd_pb2 as pb

ETCD_BINARY = "etcd"
HEARTBEAT_MS = 50
ELECTION_TIMEOUT_MS = 500
# Two members picking the same free port is a race another process can win
# too; a start that loses it is tried again with new ports.
START_ATTEMPTS = 3
STATUS_TIMEOUT_S = 1.0
POLL_S = 0.1


def etcd_available() -> bool:
    """Whether an etcd binary is on PATH."""
    return shutil.which(ETCD_BINARY) is not None


@dataclass
class _Member:
    name: str
    client_port: int
    peer_port: int
    data_dir: Path
    log_path: Path
    process: GroupProcess | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"


class EtcdCluster:
    """`size` etcd members on free 127.0.0.1 ports; data in a temporary folder removed by stop().

    Logs go to workdir (kept after stop) or, without one, beside the data.
    Use as a context manager or call start() and stop().
    """

    def __init__(self, size: int = 3, workdir: Path | str | None = None, *, start_timeout_s: float = 30.0):
        if size < 1:
            raise ValueError("size must be at least 1")
        self.size = size
        self.start_timeout_s = start_timeout_s
        self.workdir = Path(workdir) if workdir is not None else None
        self._tmp: Path | None = None
        self._members: list[_Member] = []

    @property
    def endpoints(self) -> list[str]:
        """Every member's client address, "127.0.0.1:PORT", in member order."""
        return [member.endpoint for member in self._members]

    def pid(self, index: int) -> int | None:
        """The PID of member index, None while it is not running."""
        process = self._members[index].process
        return process.pid if process is not None and process.alive() else None

    def start(self) -> EtcdCluster:
        """Starts every member and returns once all of them know a leader (bounded by start_timeout_s per try).

        On failure everything started is stopped and removed again.
        """
        if self.workdir is not None:
            self.workdir.mkdir(parents=True, exist_ok=True)
        self._tmp = Path(tempfile.mkdtemp(prefix="kvpush-etcd-", dir=self.workdir))
        try:
            for attempt in range(1, START_ATTEMPTS + 1):
                self._members = [self._new_member(index, attempt) for index in range(self.size)]
                for index in range(self.size):
                    self._launch(index)
                try:
                    self._wait_healthy(range(self.size), self.start_timeout_s)
                    return self
                except StartError:
                    lost_port_race = any(m.process is not None and "address already in use" in m.process.tail() for m in self._members)
                    self._stop_members()
                    if not lost_port_race or attempt == START_ATTEMPTS:
                        raise
            raise AssertionError("unreachable")
        except BaseException:
            self.stop()
            raise

    def kill(self, index: int) -> None:
        """SIGKILL to member index, as a crash would; returns once it is gone."""
        process = self._members[index].process
        if process is not None:
            process.kill()
            self._members[index].process = None

    def restart(self, index: int, timeout_s: float | None = None) -> None:
        """Starts member index again on its ports and data (after kill()) and waits until it knows a leader."""
        self.kill(index)
        self._launch(index)
        self._wait_healthy([index], timeout_s or self.start_timeout_s)

    def pause(self, index: int) -> None:
        """SIGSTOP to member index: it stays connected but answers nothing, as a hung machine would."""
        self._signal(index, signal.SIGSTOP)

    def resume(self, index: int) -> None:
        """SIGCONT to a paused member (wait_healthy() waits until it serves again)."""
        self._signal(index, signal.SIGCONT)

    @contextlib.contextmanager
    def paused(self, indexes: Iterable[int] | None = None) -> Iterator[None]:
        """Pauses members (every one unless indexes says which) for the block and resumes them on the way out (wait_healthy() waits until they serve again)."""
        paused: list[int] = []
        try:
            for index in range(self.size) if indexes is None else indexes:
                self.pause(index)
                paused.append(index)
            yield
        finally:
            for index in paused:
                self.resume(index)

    def wait_healthy(self, timeout_s: float | None = None) -> None:
        """Returns once every running member knows a leader; raises StartError after timeout_s."""
        self._wait_healthy([i for i, m in enumerate(self._members) if m.process is not None], timeout_s or self.start_timeout_s)

    def stop(self) -> None:
        """Stops every member (by process group, bounded) and removes the data."""
        self._stop_members()
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def __enter__(self) -> EtcdCluster:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    @property
    def _scratch(self) -> Path:
        """The cluster's temporary folder: start() makes it, stop() removes it."""
        if self._tmp is None:
            raise RuntimeError("the etcd cluster is not started")
        return self._tmp

    def _new_member(self, index: int, attempt: int) -> _Member:
        name = f"etcd{index}"
        data_dir = self._scratch / f"{name}.data"
        shutil.rmtree(data_dir, ignore_errors=True)
        log_path = (self.workdir or self._scratch) / f"{name}.attempt{attempt}.log"
        return _Member(name, free_port(), free_port(), data_dir, log_path)

    def _launch(self, index: int) -> None:
        member = self._members[index]
        initial_cluster = ",".join(f"{m.name}={m.peer_url}" for m in self._members)
        client_url = f"http://{member.endpoint}"
        argv = [
            ETCD_BINARY,
            f"--name={member.name}",
            f"--data-dir={member.data_dir}",
            f"--listen-client-urls={client_url}",
            f"--advertise-client-urls={client_url}",
            f"--listen-peer-urls={member.peer_url}",
            f"--initial-advertise-peer-urls={member.peer_url}",
            f"--initial-cluster={initial_cluster}",
            "--initial-cluster-state=new",
            f"--initial-cluster-token={self._scratch.name}",
            f"--heartbeat-interval={HEARTBEAT_MS}",
            f"--election-timeout={ELECTION_TIMEOUT_MS}",
            "--pre-vote",
            "--logger=zap",
            "--log-outputs=stderr",
        ]
        member.process = GroupProcess(member.name, argv, member.log_path)

    def _signal(self, index: int, signum: int) -> None:
        process = self._members[index].process
        if process is not None:
            process.signal(signum)

    def _stop_members(self) -> None:
        for member in self._members:
            if member.process is not None:
                member.process.signal(signal.SIGCONT)  # a paused member cannot act on SIGTERM
                member.process.stop(timeout=5.0)
                member.process = None

    def _wait_healthy(self, indexes, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        waiting = list(indexes)
        while waiting:
            late = list(waiting)
            for index in list(waiting):
                member = self._members[index]
                if member.process is None or not member.process.alive():
                    raise StartError(f"etcd member {member.name} exited; log {member.log_path}:\n{member.process.tail() if member.process else ''}")
                if _knows_leader(member.endpoint):
                    waiting.remove(index)
            # A poll that ended after the deadline does not count: one slow poll must not stretch the bound.
            if time.monotonic() > deadline:
                names = ", ".join(self._members[i].name for i in late)
                raise StartError(f"etcd members {names} found no leader within {timeout_s:g} s; logs in {self.workdir or self._tmp}")
            if waiting:
                time.sleep(POLL_S)


def _knows_leader(endpoint: str) -> bool:
    """Whether the member at endpoint answers Maintenance.Status with a leader and no alarms."""
    with grpc.insecure_channel(endpoint) as channel:
        status = channel.unary_unary(STATUS_METHOD, request_serializer=pb.StatusRequest.SerializeToString,
                                     response_deserializer=pb.StatusResponse.FromString)
        try:
            response = status(pb.StatusRequest(), timeout=STATUS_TIMEOUT_S)
        except grpc.RpcError:
            return False
    return response.leader != 0 and not response.errors
