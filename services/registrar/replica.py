# SPDX-License-Identifier: Apache-2.0
"""One replica of an etcd-backed registrar: its etcd client, its mirror's Directory and the etcd lease authority."""

from __future__ import annotations

from kvpush.clock import Clock
from kvpush.etcd.settings import EtcdSettings
from kvpush.services.registrar.config import RegistrarConfig
from kvpush.services.registrar.directory import Directory
from kvpush.services.registrar.etcd_keys import EtcdKeys
from kvpush.services.registrar.etcd_leases import EtcdLeases
from kvpush.services.registrar.etcd_mirror import EtcdMirror


class EtcdReplica:
    """Serve `directory` and `leases` once `mirror.synced`; run mirror.run() until stopping, then close()."""

    def __init__(self, config: RegistrarConfig, etcd: EtcdSettings, clock: Clock):
        self.client = etcd.client()
        keys = EtcdKeys(etcd.prefix)
        self.directory = Directory(config, clock)
        self.mirror = EtcdMirror(self.client, keys, self.directory, clock)
        self.leases = EtcdLeases(self.client, keys, self.mirror, config, clock, timeout_s=etcd.timeout_s)

    async def close(self) -> None:
        self.directory.close()
        await self.client.close()
