# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""A local scaled-out control plane: an etcd cluster, registrar replicas on it and broker shards, each part killable and restartable.

Every part listens on 127.0.0.1 on a port picked once (free a moment
before) and kept across its restarts, so the multi-address targets the
engines and the router were given stay valid: the registrars' target for
registration and engine watches, the brokers' target as the seed of the
shard map. Broker member ids stay the same across restarts, so a restarted
member owns the same transfers again. Tokens live in one directory shared by
every part (the brokers present the `broker` identity to the registrars).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

from kvpush.dev.etcd_cluster import EtcdCluster
from kvpush.dev.localstack.control_plane import CONTROL_PLANE_START_TIMEOUT_S, DEFAULT_ENGINE_IDS, TokenFiles, kvpush_transfer_config
from kvpush.dev.localstack.process import GroupProcess, free_port, wait_for_port_file
from kvpush.services.common.tokens import BROKER_IDENTITY, ROUTER_IDENTITY, create_tokens

# How long a process of a part gets to stop gracefully before its group is killed.
STOP_TIMEOUT_S = 10.0


@dataclasses.dataclass(frozen=True)
class ScaledSpec:
    """What a scaled-out control plane is made of."""

    etcd_members: int = 3
    registrars: int = 2
    brokers: int = 3
    shard_lease_ttl_s: float = 2.0
    registrar_args: Sequence[str] = ()
    broker_args: Sequence[str] = ()

    def __post_init__(self) -> None:
        if min(self.etcd_members, self.registrars, self.brokers) < 1:
            raise ValueError("a scaled control plane needs at least one etcd member, one registrar and one broker")


# front(path, address) -> the address to dial address at over that path (a fault injector's proxy), or address itself.
# Paths: "<member_id>" (engines and the router to a broker member), "<member_id>->etcd-<k>" (that member to etcd member k).
Front = Callable[[str, str], str]


def direct(path: str, address: str) -> str:
    return address


@dataclasses.dataclass
class _Part:
    """One registrar replica or broker member: its command, its fixed port, its running process (None while down)
    and where others reach it (its own address unless a front stands before it)."""

    name: str
    port: int
    argv: list[str]
    process: GroupProcess | None = None
    reached_at: str = ""

    @property
    def address(self) -> str:
        return self.reached_at or f"127.0.0.1:{self.port}"


def multi_target(addresses: Iterable[str]) -> str:
    """A gRPC target that reaches any of addresses (the channel moves on when one stops answering)."""
    return "ipv4:" + ",".join(addresses)


class ScaledControlPlane(TokenFiles):
    """etcd members, registrar replicas and broker shards under work_dir; `start()`, `stop()`, kill/restart per part."""

    def __init__(self, work_dir: Path, spec: ScaledSpec = ScaledSpec(), *, engine_ids: Sequence[str] = DEFAULT_ENGINE_IDS,
                 env: Mapping[str, str | None] | None = None, front: Front = direct):
        self.work_dir = work_dir
        self.front = front
        self.spec = spec
        self.env = dict(env or {})
        self.tokens_dir = work_dir / "tokens"
        self.engine_ids = list(engine_ids)
        self.etcd = EtcdCluster(spec.etcd_members, work_dir / "etcd")
        self.registrars: list[_Part] = []
        self.brokers: list[_Part] = []

    # ---- addresses and credentials ---------------------------------------------------------

    @property
    def registrar_target(self) -> str:
        """Where engines register and watch engines (any registrar replica)."""
        return multi_target([part.address for part in self.registrars])

    @property
    def broker_target(self) -> str:
        """The seed of the shard map: any broker member answers WatchShards with every member."""
        return multi_target([part.address for part in self.brokers])

    def member_id(self, index: int) -> str:
        return f"broker-{index}"

    def transfer_config(self, role: str, engine_id: str, **extra: object) -> dict:
        """vLLM --kv-transfer-config of a kvpush engine on this control plane; `extra` goes to kv_connector_extra_config."""
        return kvpush_transfer_config(role, engine_id, self, control_plane_address=self.registrar_target, broker=self.broker_target, **extra)

    # ---- start and stop ------------------------------------------------------------------------

    def start(self) -> ScaledControlPlane:
        """Starts etcd, the registrars, then the brokers (each bounded); on a failure stops what started."""
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        self.work_dir.mkdir(parents=True, exist_ok=True)
        create_tokens(self.tokens_dir, [ROUTER_IDENTITY, BROKER_IDENTITY, *self.engine_ids])
        self.etcd.start()
        etcd = ",".join(self.etcd.endpoints)
        for index in range(self.spec.registrars):
            port = free_port()
            self.registrars.append(_Part(f"registrar-{index}", port, [
                sys.executable, "-m", "kvpush.cli", "registrar", "--listen", f"127.0.0.1:{port}", "--tokens-dir", str(self.tokens_dir),
                "--etcd", etcd, *self.spec.registrar_args,
            ]))
        for part in self.registrars:
            self._run(part)
        for index in range(self.spec.brokers):
            port, member = free_port(), self.member_id(index)
            reached_at = self.front(member, f"127.0.0.1:{port}")
            its_etcd = ",".join(self.front(f"{member}->etcd-{k}", endpoint) for k, endpoint in enumerate(self.etcd.endpoints))
            self.brokers.append(_Part(member, port, [
                sys.executable, "-m", "kvpush.cli", "broker", "--listen", f"127.0.0.1:{port}", "--tokens-dir", str(self.tokens_dir),
                "--registrar", self.registrar_target, "--etcd", its_etcd, "--member-id", member,
                "--advertise", reached_at, "--shard-lease-ttl", f"{self.spec.shard_lease_ttl_s:g}", *self.spec.broker_args,
            ], reached_at=reached_at))
        for part in self.brokers:
            self._run(part)

    def _run(self, part: _Part) -> None:
        port_file = self.work_dir / f"{part.name}.port"
        port_file.unlink(missing_ok=True)
        part.process = GroupProcess(part.name, [*part.argv, "--port-file", str(port_file)], self.work_dir / f"{part.name}.log", env=self.env)
        wait_for_port_file(part.process, port_file, CONTROL_PLANE_START_TIMEOUT_S)

    def stop(self) -> None:
        """Stops brokers, registrars and etcd, by process group (each bounded; one failing does not skip the others)."""
        for part in [*self.brokers, *self.registrars]:
            if part.process is not None:
                part.process.stop(STOP_TIMEOUT_S)
                part.process = None
        self.etcd.stop()

    @property
    def processes(self) -> list[GroupProcess]:
        return [part.process for part in [*self.registrars, *self.brokers] if part.process is not None]

    # ---- faults --------------------------------------------------------------------------------

    def kill_broker(self, index: int) -> None:
        """kill -9 of one broker member."""
        self._kill(self.brokers[index])

    def restart_broker(self, index: int) -> None:
        """Starts a killed broker member again on its port, with its member id (it rejoins by itself)."""
        self._run(self.brokers[index])

    def kill_registrar(self, index: int) -> None:
        self._kill(self.registrars[index])

    def restart_registrar(self, index: int) -> None:
        self._run(self.registrars[index])

    def _kill(self, part: _Part) -> None:
        if part.process is not None:
            part.process.kill()
            part.process = None
