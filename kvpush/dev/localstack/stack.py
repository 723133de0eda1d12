# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""A whole local P/D stack of one mode: control plane (kvpush), N prefill and M decode vLLM engines, and the router.

Modes: "kvpush" (`KvpushConnector`, the kvpush control plane, `kvpush router
--mode push`), "upstream-push" (`NixlPushConnector`, `--mode upstream-push`)
and "pull" (`NixlConnector`, `--mode pull`). `Stack.start` starts the parts
in order, every engine at once, and waits (bounded) until each serves; if
anything fails or the start is interrupted, what was started is stopped
before the error propagates. `Stack.stop` (also on leaving a `with` block)
stops every process by its process group, the latest first. Wrap a run in
`process.interrupt_on_signals()` so SIGINT and SIGTERM stop it too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from kvpush.dev.localstack.control_plane import ControlPlaneHandle, kvpush_transfer_config, start_control_plane
from kvpush.dev.localstack.engines import DEFAULT_START_TIMEOUT_S, ServerHandle, spawn_vllm_server, wait_until_healthy
from kvpush.dev.localstack.process import GroupProcess, free_fixed_port
from kvpush.dev.localstack.router import RouterHandle, start_router
from kvpush.dev.localstack.upstream import DECODE_ENGINE_ID, PREFILL_ENGINE_ID, side_channel_env, upstream_transfer_config
from kvpush.processes import group_members, parse_cpu_list, pin_threads

MODES = ("kvpush", "upstream-push", "pull")
ROUTER_MODES = {"kvpush": "push", "upstream-push": "upstream-push", "pull": "pull"}
ROLES = ("prefill", "decode")
# How long a part may take to shut down gracefully before its group is killed.
STOP_TIMEOUT_S = 20.0


def tracing_env(traces_file: Path) -> dict[str, str]:
    """The environment that makes a kvpush process append its spans to traces_file (kvpush.telemetry's file exporter)."""
    return {"OTEL_TRACES_EXPORTER": "kvpush_file", "KVPUSH_TRACES_FILE": str(traces_file)}


@dataclasses.dataclass(frozen=True)
class StackSpec:
    """What to start."""

    mode: str = "kvpush"
    prefills: int = 1
    decodes: int = 1
    prefill_cpus: str | None = None  # taskset CPU list of every prefill engine (None: not pinned)
    decode_cpus: str | None = None
    aux_cpus: str | None = None  # CPU list of the router and the control plane, every thread (None: not pinned)
    traces_file: Path | None = None  # the router's spans go here, and kvpush's engines' and control plane's with trace_engines
    trace_engines: bool = True
    # kvpush's engines and control plane keep this share of traces (OTEL_TRACES_SAMPLER=traceidratio: by trace id, so the
    # same traces as a router at parentbased_traceidratio would); the router keeps every trace. None: the SDK's default.
    trace_ratio: float | None = None
    engine_env: Mapping[str, str] = dataclasses.field(default_factory=dict)  # on top of engines.ENGINE_ENV
    engine_args: Sequence[str] = ()  # extra vLLM server arguments
    engine_args_by_role: Mapping[str, Sequence[str]] = dataclasses.field(default_factory=dict)  # role -> more, after engine_args
    prefix_caching: bool = False  # vLLM's prefix caching on both engines
    kvpush_extra: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # kv_connector_extra_config of kvpush engines
    prefill_extra: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # ... of kvpush prefill engines only, on top
    control_plane_args: Sequence[str] = ()
    router: bool = True  # False: engines only (the caller routes)
    router_args: Sequence[str] = ()
    router_log_level: str | None = None
    engine_start_timeout: float = DEFAULT_START_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, not {self.mode!r}")
        if self.prefills < 1 or self.decodes < 1:
            raise ValueError("a stack needs at least one prefill and one decode engine")
        if self.trace_ratio is not None and not 0.0 <= self.trace_ratio <= 1.0:
            raise ValueError(f"trace_ratio must be within [0, 1], not {self.trace_ratio}")
        if self.mode == "upstream-push" and self.prefills != 1:
            raise ValueError("upstream-push routes to one prefill engine's side channel: prefills must be 1")

    def engine_ids(self, role: str) -> list[str]:
        count = self.prefills if role == "prefill" else self.decodes
        if self.mode == "kvpush":
            return [f"{role}-{i}" for i in range(count)]
        base = PREFILL_ENGINE_ID if role == "prefill" else DECODE_ENGINE_ID
        return [base] if count == 1 else [f"{base}-{i}" for i in range(count)]


class Stack:
    """The processes of one StackSpec; files under work_dir, logs under log_dir (default work_dir)."""

    def __init__(self, spec: StackSpec, model_dir: Path, work_dir: Path, *, log_dir: Path | None = None,
                 say: Callable[[str], None] | None = None):
        self.spec = spec
        self.model_dir = model_dir
        self.work_dir = work_dir
        self.log_dir = log_dir or work_dir
        self.say = say or (lambda message: None)
        self.control_plane: ControlPlaneHandle | None = None
        self.engines: dict[str, list[ServerHandle]] = {role: [] for role in ROLES}
        self.router: RouterHandle | None = None
        self.side_channel_ports: dict[str, int] = {}  # upstream: engine id -> its NIXL side-channel port
        self._processes: list[GroupProcess] = []  # in start order

    @property
    def prefill(self) -> ServerHandle:
        return self.engines["prefill"][0]

    @property
    def decode(self) -> ServerHandle:
        return self.engines["decode"][0]

    def endpoints(self, role: str) -> list[str]:
        """The role's engines as the router's "URL=ENGINE_ID" arguments."""
        return [f"{server.url}={engine_id}" for server, engine_id in zip(self.engines[role], self.spec.engine_ids(role))]

    @property
    def processes(self) -> list[GroupProcess]:
        """Every process started and not stopped yet, in start order."""
        return list(self._processes)

    def dead_parts(self) -> list[str]:
        """The parts that exited, with their exit status."""
        return [f"{p.name} (exit {p.returncode})" for p in self._processes if not p.alive()]

    def repin(self) -> int:
        """Pins every engine's threads to its CPUs again (and the router's and control plane's to aux_cpus); returns how many
        engine threads had moved."""
        self._pin_aux()
        return sum(server.repin() for servers in self.engines.values() for server in servers)

    def _pin_aux(self) -> None:
        # Threads started later inherit their creator's affinity: pinning every thread once holds, repin only re-checks.
        if self.spec.aux_cpus is not None:
            aux = [handle.process for handle in (self.control_plane, self.router) if handle is not None]
            pin_threads([pid for process in aux for pid in group_members(process.pid)], parse_cpu_list(self.spec.aux_cpus))

    def start(self) -> Stack:
        """Starts control plane (kvpush), engines and router; on any failure or interruption stops what started."""
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        spec = self.spec
        self.work_dir.mkdir(parents=True, exist_ok=True)
        tracing = tracing_env(spec.traces_file) if spec.traces_file is not None else {}
        kvpush_tracing = tracing if spec.mode == "kvpush" and spec.trace_engines else {}
        if kvpush_tracing and spec.trace_ratio is not None:
            kvpush_tracing = {**kvpush_tracing, "OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": f"{spec.trace_ratio:g}"}
        if spec.mode == "kvpush":
            self.control_plane = start_control_plane(self.work_dir / "control-plane", env=kvpush_tracing, extra_args=spec.control_plane_args,
                                                     engine_ids=[*spec.engine_ids("prefill"), *spec.engine_ids("decode")],
                                                     log_path=self.log_dir / "control-plane.log")
            self._processes.append(self.control_plane.process)
            self.say(f"control plane listening on {self.control_plane.address}")
        spawns = []
        for role in ROLES:
            ids = spec.engine_ids(role)
            cpus = spec.prefill_cpus if role == "prefill" else spec.decode_cpus
            for index, engine_id in enumerate(ids):
                name = role if len(ids) == 1 else f"{role}-{index}"
                spawns.append((role, engine_id, name, cpus))
        described = " and ".join(f"the {name} engine" + (f" on CPU {cpus}" if cpus else "") for _, _, name, cpus in spawns)
        self.say(f"starting {described} (the longest step)")
        for role, engine_id, name, cpus in spawns:
            server = spawn_vllm_server(self.model_dir, name=name, kv_transfer_config=self._transfer_config(role, engine_id),
                                       env={**kvpush_tracing, **self._engine_env(engine_id), **spec.engine_env}, cpu_list=cpus,
                                       extra_args=[*spec.engine_args, *spec.engine_args_by_role.get(role, ())],
                                       prefix_caching=spec.prefix_caching, log_path=self.log_dir / f"{name}.log")
            self._processes.append(server.process)
            self.engines[role].append(server)
        wait_until_healthy([s for role in ROLES for s in self.engines[role]], spec.engine_start_timeout, self.say)
        if spec.router:
            self.router = start_router(self.work_dir, prefill=self.endpoints("prefill"), decode=self.endpoints("decode"),
                                       mode=ROUTER_MODES[spec.mode], control_plane=self.control_plane, extra_args=self._router_args(),
                                       env=tracing, log_path=self.log_dir / "router.log", log_level=spec.router_log_level)
            self._processes.append(self.router.process)
            self.say(f"router listening on {self.router.url}")
        self._pin_aux()

    def _transfer_config(self, role: str, engine_id: str) -> dict:
        if self.spec.mode == "kvpush":
            extra = {**self.spec.kvpush_extra, **(self.spec.prefill_extra if role == "prefill" else {})}
            assert self.control_plane is not None, "kvpush mode starts the control plane before the engines"
            return kvpush_transfer_config(role, engine_id, self.control_plane, **extra)
        return upstream_transfer_config("push" if self.spec.mode == "upstream-push" else "pull", role, engine_id)

    def _engine_env(self, engine_id: str) -> dict[str, str]:
        if self.spec.mode == "kvpush":
            return {}
        self.side_channel_ports[engine_id] = free_fixed_port()  # NIXL's side channel is told its port (no port 0)
        return side_channel_env(self.side_channel_ports[engine_id])

    def _router_args(self) -> list[str]:
        if self.spec.mode != "upstream-push":
            return list(self.spec.router_args)
        [prefill_id] = self.spec.engine_ids("prefill")
        return ["--prefill-side-channel-port", str(self.side_channel_ports[prefill_id]), *self.spec.router_args]

    def stop(self) -> None:
        """Stops every process by its group, the latest first (each bounded; one failing does not skip the others)."""
        while self._processes:
            process = self._processes.pop()
            if process.alive():
                self.say(f"stopping {process.name} (pid {process.pid})")
            try:
                process.stop(STOP_TIMEOUT_S)
            except Exception as exc:  # the others are stopped all the same
                self.say(f"stopping {process.name} failed: {exc}")

    def __enter__(self) -> Stack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
