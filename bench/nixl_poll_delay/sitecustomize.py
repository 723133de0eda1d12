# SPDX-License-Identifier: Apache-2.0
"""Gives NIXL's UCX progress thread a poll delay, so an idle agent stops busy-polling a core.

NIXL 1.5.1's Python API (`nixl_cu12/_api.py`, `nixl_cu13/_api.py`) builds
every agent with `agent_config.pthrDelay = 0`: the progress thread polls
with a zero timeout and burns a whole core even when idle. Put this folder on
`PYTHONPATH` of the engine servers (workers inherit it) and every
`nixl_agent` created in them gets `pthrDelay = $KVPUSH_NIXL_PTHR_DELAY_US`
microseconds (default 1000). The delay only bounds how long the thread sleeps
in `poll()` when there is no work; UCX events wake it earlier.

Nothing is imported eagerly: a meta-path hook patches the `_api` module of
whichever NIXL backend package gets imported, right after it loads, so vLLM's
own import order (it sets `UCX_RCACHE_MAX_UNRELEASED` before importing NIXL)
is unchanged.
"""

from __future__ import annotations

import importlib.abc
import os
import sys

PTHR_DELAY_ENV = "KVPUSH_NIXL_PTHR_DELAY_US"
DEFAULT_PTHR_DELAY_US = 1000
PATCHED_MODULES = ("nixl_cu12._api", "nixl_cu13._api")


class _BindingsWithDelay:
    """Stands in for an `_api` module's `nixlBind`: every attribute is the real one except `nixlAgent`."""

    def __init__(self, bindings, delay_us: int):
        self._bindings = bindings
        self._delay_us = delay_us

    def __getattr__(self, name: str):
        return getattr(self._bindings, name)

    def nixlAgent(self, name, agent_config):  # noqa: N802 (mirrors the binding's name)
        """Creates the agent with the poll delay written into its config."""
        agent_config.pthrDelay = self._delay_us
        return self._bindings.nixlAgent(name, agent_config)


def patch_api_module(module, delay_us: int) -> None:
    """Makes `nixl_agent.__init__` of a loaded `nixl_cu*._api` module use `delay_us`."""
    if not isinstance(module.nixlBind, _BindingsWithDelay):
        module.nixlBind = _BindingsWithDelay(module.nixlBind, delay_us)


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader, delay_us: int):
        self._loader = loader
        self._delay_us = delay_us

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        patch_api_module(module, self._delay_us)


class _NixlApiFinder(importlib.abc.MetaPathFinder):
    """Wraps the loader of the NIXL `_api` modules so they are patched once executed."""

    def __init__(self, delay_us: int):
        self._delay_us = delay_us

    def find_spec(self, fullname, path, target=None):
        if fullname not in PATCHED_MODULES:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _PatchingLoader(spec.loader, self._delay_us)
                return spec
        return None


def install(delay_us: int) -> None:
    """Installs the import hook (patching already-imported NIXL modules too)."""
    for name in PATCHED_MODULES:
        if name in sys.modules:
            patch_api_module(sys.modules[name], delay_us)
    if not any(isinstance(f, _NixlApiFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _NixlApiFinder(delay_us))


install(int(os.environ.get(PTHR_DELAY_ENV, DEFAULT_PTHR_DELAY_US)))
