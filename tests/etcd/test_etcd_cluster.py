# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""EtcdCluster itself: members start on free ports, and nothing is left behind after stop() or a failed start."""

from __future__ import annotations

import psutil
import pytest

from kvpush.dev.etcd_cluster import EtcdCluster, etcd_available
from kvpush.dev.localstack.process import StartError

pytestmark = pytest.mark.skipif(not etcd_available(), reason="etcd is not installed (scripts/setup-env.sh installs it)")


def data_dirs(workdir):
    return list(workdir.glob("kvpush-etcd-*"))


def test_stop_ends_every_member_and_removes_the_data(tmp_path):
    tmp_path = tmp_path / "made-by-start"
    with EtcdCluster(1, tmp_path) as cluster:
        assert len(cluster.endpoints) == 1 and cluster.endpoints[0].startswith("127.0.0.1:")
        pid = cluster.pid(0)
        assert psutil.pid_exists(pid) and data_dirs(tmp_path)
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert data_dirs(tmp_path) == []
    assert list(tmp_path.glob("etcd0.*.log")), "logs stay in workdir"


def test_a_failed_start_leaves_nothing_running(tmp_path):
    cluster = EtcdCluster(1, tmp_path, start_timeout_s=0.001)
    with pytest.raises(StartError):
        # No member finds a leader within a millisecond.
        cluster.start()
    assert cluster.pid(0) is None
    assert data_dirs(tmp_path) == []
