# SPDX-License-Identifier: Apache-2.0
"""The test tiers: markers for the heavy kinds, and `--fast`, the tier that needs no engine, NIXL, torch, etcd or browser.

Markers (pyproject.toml): `engine` (real vLLM engines), `etcd` (a real
etcd cluster: every test under tests/etcd), `browser` (headless Chromium),
`engine_stack` (torch, vLLM or NIXL in a subprocess), `slow` (over ~10 s).
`--fast` deselects those and refuses to import torch, vLLM or NIXL: a
module that needs them, directly or through what it imports, is skipped
as a whole when its import reaches one (pytest's module-level skip), and
a test that imports one lazily is skipped where it does. So the fast tier
is whatever runs without them, found by running, not by a list kept by
hand; `scripts/test.sh --fast` runs it, the full command runs everything.
"""

from __future__ import annotations

import importlib.abc
import sys

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

# What the fast tier never imports: the engine stack and the transfer library (and what only they pull in).
HEAVY_MODULES = ("torch", "vllm", "nixl", "nixl_cu12", "nixl_cu13", "triton")
HEAVY_MARKERS = ("engine", "etcd", "browser", "engine_stack", "slow")


class HeavyImportGuard(importlib.abc.MetaPathFinder):
    """Skips whatever imports a HEAVY_MODULES module (at collection: the module; in a test: the test)."""

    def find_spec(self, fullname, path, target=None):
        if fullname.partition(".")[0] in HEAVY_MODULES:
            pytest.skip(f"needs {fullname.partition('.')[0]} (the fast tier imports no engine stack)", allow_module_level=True)
        return None


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--fast", action="store_true", help="the fast tier: no vLLM engine, NIXL agent, torch, etcd or browser")


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("--fast"):
        loaded = sorted(name for name in sys.modules if name.partition(".")[0] in HEAVY_MODULES)
        if loaded:
            raise pytest.UsageError(f"--fast: {loaded} were imported before the tests (by a plugin?)")
        sys.meta_path.insert(0, HeavyImportGuard())
        exclude = " and ".join(f"not {marker}" for marker in HEAVY_MARKERS)
        config.option.markexpr = f"({config.option.markexpr}) and {exclude}" if config.option.markexpr else exclude


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/etcd/" in item.nodeid:
            item.add_marker(pytest.mark.etcd)


@pytest.fixture
def spans():
    """(tracer provider, in-memory exporter): what a component under test records, read back by the test."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider, exporter
    provider.shutdown()
