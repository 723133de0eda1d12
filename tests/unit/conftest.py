# SPDX-License-Identifier: Apache-2.0
"""Fixtures shared by the test modules of one core: a NIXL producer/consumer pair, a RegistrarCore on a ManualClock."""

from __future__ import annotations

import pytest

from kvpush.clock import ManualClock
from kvpush.services.registrar.config import RegistrarConfig
from kvpush.services.registrar.core import RegistrarCore


@pytest.fixture
def pair():
    from nixl_pair import Pair  # NIXL and torch: only the tests that take a pair import them (the fast tier has neither)

    started = Pair().start()
    yield started
    started.close()


@pytest.fixture
def stalled():
    from nixl_pair import Pair

    started = Pair(stalled=True).start()
    yield started
    started.close()


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def registrar(clock: ManualClock) -> RegistrarCore:
    return RegistrarCore(RegistrarConfig(default_lease_ttl_s=10.0, min_lease_ttl_s=2.0, max_lease_ttl_s=30.0, watch_queue_capacity=8), clock)


@pytest.fixture
def removals(registrar: RegistrarCore) -> list[tuple[str, str, str]]:
    seen: list[tuple[str, str, str]] = []
    registrar.add_removal_listener(lambda *args: seen.append(args))
    return seen
