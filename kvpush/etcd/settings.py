# SPDX-License-Identifier: Apache-2.0
"""The etcd a scaled-out control plane member runs on: `kvpush registrar --etcd` replicas and `kvpush broker --etcd` shard members."""

from __future__ import annotations

import dataclasses

from kvpush.etcd.client import EtcdClient
from kvpush.settings import Settings, setting


def endpoint_list(value: str) -> tuple[str, ...]:
    """Endpoints from "host:port,host:port" (blanks around and between items dropped); anything else is refused, naming it.

    A malformed endpoint would otherwise only show as a member that never
    reaches etcd, retrying for ever.
    """
    endpoints = tuple(item.strip() for item in value.split(",") if item.strip())
    for endpoint in endpoints:
        host, _, port = endpoint.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"etcd endpoint {endpoint!r} is not host:port")
    return endpoints


@dataclasses.dataclass(frozen=True)
class EtcdSettings(Settings):
    """Where the control plane keeps its shared state; no endpoints: a registrar keeps its directory in process, a broker is unsharded."""

    endpoints: tuple[str, ...] | None = setting(
        None,
        flag="--etcd",
        env="KVPUSH_ETCD",
        convert=endpoint_list,
        metavar="HOST:PORT,...",
        help="etcd endpoints; registrar replicas on one etcd serve one directory, brokers on one etcd are shards of one broker",
    )
    prefix: str = setting("/kvpush/", flag="--etcd-prefix", env="KVPUSH_ETCD_PREFIX", help="etcd key prefix of this deployment's keys")
    timeout_s: float = setting(5.0, flag="--etcd-timeout", env="KVPUSH_ETCD_TIMEOUT_S", convert=float, positive=True, help="deadline of each etcd call")

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.prefix.endswith("/"):
            raise ValueError(f"--etcd-prefix must end with '/', not {self.prefix!r}")

    def client(self) -> EtcdClient:
        """A client of these endpoints whose every call ends within timeout_s (there must be endpoints)."""
        return EtcdClient(self.endpoints or (), timeout_s=self.timeout_s)
