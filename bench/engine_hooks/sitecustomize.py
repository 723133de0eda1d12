# SPDX-License-Identifier: Apache-2.0
"""Benchmark-only patches for engine processes, each switched on by its own environment variable.

Put this folder on `PYTHONPATH` of the engine servers (their engine core and
workers inherit it). Nothing is imported eagerly: a meta-path hook patches a
module right after it loads, so vLLM's own import order is unchanged.

* `KVPUSH_NIXL_PTHR_DELAY_US`: NIXL 1.5.1's Python API (`nixl_cu12/_api.py`,
  `nixl_cu13/_api.py`) builds every agent with `agent_config.pthrDelay = 0`:
  the UCX progress thread polls with a zero timeout and burns a whole core
  even when idle. With the variable set, every `nixl_agent` gets that many
  microseconds instead. The delay only bounds how long the thread sleeps in
  `poll()` when there is no work; UCX events wake it earlier.
* `KVPUSH_VLLM_SPIN_MS`: vLLM 0.32's shared-memory message queue
  (`shm_broadcast.SpinCondition`, `busy_loop_s = 1`, hard-coded) makes every
  reader (the worker waiting for its next step, the engine core waiting for
  the worker's answer) spin with `sched_yield()` for a second after each read,
  so each engine burns about a core for a second after every step. With the
  variable set, a reader spins at most that many milliseconds from the start
  of each wait and then waits on the queue's ZMQ notification. That
  notification is best-effort (PUB with `SNDHWM=1`): vLLM re-checks the
  queue every `SHM_READER_RECHECK_INTERVAL_MS` (5 s) in case one is dropped,
  which a short spin makes frequent (with no spin, p50 latency was seconds
  here), so the re-check becomes `KVPUSH_VLLM_RECHECK_MS` (default 10).
* `KVPUSH_STEP_TIMELINE_DIR`: every engine process appends one line per call
  of the engine step's parts (`<part> <start> <end>`, CLOCK_MONOTONIC seconds,
  shared by all processes) to `<dir>/<process group>-<pid>.log`: the engine
  core's `step`, `schedule`, `update_from_output`, its wait for the
  worker's `execute_model` answer and its `sample_tokens` call; the worker's
  `execute_model`, `_model_forward` and `sample_tokens`. The process group is
  the engine's (its API server's pid), so P's and D's lines can be told
  apart; `bench.step_timeline` reads them.
"""

from __future__ import annotations

import importlib.abc
import os
import sys
import time
from collections.abc import Callable

PTHR_DELAY_ENV = "KVPUSH_NIXL_PTHR_DELAY_US"
VLLM_SPIN_ENV = "KVPUSH_VLLM_SPIN_MS"
VLLM_RECHECK_ENV = "KVPUSH_VLLM_RECHECK_MS"
DEFAULT_VLLM_RECHECK_MS = 10
NIXL_API_MODULES = ("nixl_cu12._api", "nixl_cu13._api")
SHM_BROADCAST_MODULE = "vllm.distributed.device_communicators.shm_broadcast"
STEP_TIMELINE_ENV = "KVPUSH_STEP_TIMELINE_DIR"
# (module, class, method, part): the engine step's parts the timeline records.
STEP_PARTS = (
    ("vllm.v1.engine.core", "EngineCore", "step", "core.step"),
    ("vllm.v1.core.sched.scheduler", "Scheduler", "schedule", "core.schedule"),
    ("vllm.v1.core.sched.scheduler", "Scheduler", "update_from_output", "core.update_from_output"),
    ("vllm.v1.executor.multiproc_executor", "FutureWrapper", "result", "core.wait_execute_model"),
    ("vllm.v1.executor.multiproc_executor", "MultiprocExecutor", "sample_tokens", "core.sample_tokens"),
    ("vllm.v1.worker.gpu_worker", "Worker", "execute_model", "worker.execute_model"),
    ("vllm.v1.worker.gpu_worker", "Worker", "sample_tokens", "worker.sample_tokens"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "_model_forward", "worker.model_forward"),
)


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


def patch_nixl_api(module, delay_us: int) -> None:
    """Makes `nixl_agent.__init__` of a loaded `nixl_cu*._api` module use `delay_us`."""
    if not isinstance(module.nixlBind, _BindingsWithDelay):
        module.nixlBind = _BindingsWithDelay(module.nixlBind, delay_us)


def patch_shm_broadcast(module, spin_ms: float, recheck_ms: int) -> None:
    """Makes the readers of a loaded `shm_broadcast` module spin `spin_ms` from the start of each wait and re-check every `recheck_ms`.

    vLLM counts its spin from the reader's last read. A worker comes back to
    wait after its forward, an engine core while the forward runs, so with a
    window of a few milliseconds counted from the read, every decode step
    would go through a ZMQ wake-up (and a dropped notification through the
    re-check). Counted from the start of the wait, a reader still catches a
    message that comes within `spin_ms` without sleeping, and spins at most
    that long per wait.
    """
    spin_condition = module.SpinCondition
    if getattr(spin_condition, "_kvpush_spin_ms", None) is not None:
        return
    original_init, original_wait = spin_condition.__init__, spin_condition.wait

    def init_with_spin(self, is_reader, context, notify_address, busy_loop_s=1):
        original_init(self, is_reader, context, notify_address, busy_loop_s=spin_ms / 1000 if is_reader else busy_loop_s)
        self._read_since_wait = True

    def record_read(self):
        self._read_since_wait = True

    def wait_spinning_from_its_start(self, timeout_ms=None):
        if self._read_since_wait:
            self.last_read = time.monotonic()  # vLLM's window now opens when the wait does
            self._read_since_wait = False
        original_wait(self, timeout_ms)

    spin_condition.__init__ = init_with_spin
    spin_condition.record_read = record_read
    spin_condition.wait = wait_spinning_from_its_start
    spin_condition._kvpush_spin_ms = spin_ms
    module.SHM_READER_RECHECK_INTERVAL_MS = recheck_ms


class StepTimeline:
    """Appends `<part> <start> <end>` lines of one process to its file (opened on the first line)."""

    def __init__(self, folder: str):
        self._path = os.path.join(folder, f"{os.getpgid(0)}-{os.getpid()}.log")
        self._file = None

    def record(self, part: str, start: float, end: float) -> None:
        if self._file is None:
            self._file = open(self._path, "a", buffering=1)  # noqa: SIM115 (open for the process's life)
        self._file.write(f"{part} {start:.6f} {end:.6f}\n")


def patch_step_part(module, class_name: str, method: str, part: str, timeline: StepTimeline) -> None:
    """Times every call of `class_name.method` of a loaded module as `part`."""
    cls = getattr(module, class_name)
    original = getattr(cls, method)
    if getattr(original, "_kvpush_part", None) is not None:
        return

    def timed(self, *args, **kwargs):
        start = time.monotonic()
        try:
            return original(self, *args, **kwargs)
        finally:
            timeline.record(part, start, time.monotonic())

    timed._kvpush_part = part
    setattr(cls, method, timed)


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader, patch: Callable):
        self._loader = loader
        self._patch = patch

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        self._patch(module)


class _PatchingFinder(importlib.abc.MetaPathFinder):
    """Wraps the loader of the named modules so each is patched once executed."""

    def __init__(self, patches: dict[str, Callable]):
        self.patches = patches

    def find_spec(self, fullname, path, target=None):
        patch = self.patches.get(fullname)
        if patch is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _PatchingLoader(spec.loader, patch)
                return spec
        return None


def install(patches: dict[str, Callable]) -> None:
    """Installs the import hook for `patches` (module name -> patch), patching already-imported modules too."""
    for name, patch in patches.items():
        if name in sys.modules:
            patch(sys.modules[name])
    if patches and not any(isinstance(f, _PatchingFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchingFinder(patches))


def patches_from_env(env) -> dict[str, Callable]:
    """The patches the environment asks for."""
    patches: dict[str, Callable] = {}
    if env.get(PTHR_DELAY_ENV):
        delay_us = int(env[PTHR_DELAY_ENV])
        patches.update({name: lambda m, d=delay_us: patch_nixl_api(m, d) for name in NIXL_API_MODULES})
    if env.get(VLLM_SPIN_ENV):
        spin_ms = float(env[VLLM_SPIN_ENV])
        recheck_ms = int(env.get(VLLM_RECHECK_ENV) or DEFAULT_VLLM_RECHECK_MS)
        patches[SHM_BROADCAST_MODULE] = lambda m: patch_shm_broadcast(m, spin_ms, recheck_ms)
    if env.get(STEP_TIMELINE_ENV):
        timeline = StepTimeline(env[STEP_TIMELINE_ENV])
        for module in {m for m, _, _, _ in STEP_PARTS}:
            parts = [(c, meth, part) for m, c, meth, part in STEP_PARTS if m == module]
            patches[module] = lambda mod, parts=parts: [patch_step_part(mod, c, meth, part, timeline) for c, meth, part in parts]
    return patches


install(patches_from_env(os.environ))
