# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""Fixtures of the etcd tests: one real 3-member cluster per session, a fresh key prefix and client per test.

Tests that kill, pause or restart members leave every member running and
healthy again when they end, so later tests find the whole cluster.
"""

from __future__ import annotations

import os
import re
import uuid

import pytest

from kvpush.dev.etcd_cluster import EtcdCluster, etcd_available
from kvpush.etcd.client import EtcdClient


@pytest.fixture(scope="session")
def etcd_cluster(tmp_path_factory):
    """A 3-member etcd cluster on 127.0.0.1, shared by the session."""
    if not etcd_available():
        # CI runs scripts/setup-env.sh as root, which installs it: missing there is a failure.
        if os.environ.get("CI"):
            pytest.fail("etcd is missing: scripts/setup-env.sh installs it (apt-get install -y etcd-server)")
        pytest.skip("etcd is not installed: run scripts/setup-env.sh as root, or apt-get install -y etcd-server")
    with EtcdCluster(3, tmp_path_factory.mktemp("etcd")) as cluster:
        yield cluster


@pytest.fixture
def etcd_prefix(request) -> bytes:
    """A key prefix no other test uses: /kvpush-test/<test name>/<random>/."""
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", request.node.name)[:80]
    return f"/kvpush-test/{name}/{uuid.uuid4().hex[:8]}/".encode()


@pytest.fixture
async def etcd(etcd_cluster):
    """An EtcdClient over every member of the session cluster."""
    client = EtcdClient(etcd_cluster.endpoints, timeout_s=5.0)
    yield client
    await client.close()
