# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""The local stack under chaos: control plane, P's proxy, P and D engines and the router, each one killable and restartable.

With settings.scaled the control plane is the scaled-out form instead (an
etcd cluster, registrar replicas, broker shards; kvpush.dev.localstack.scaled)
and P reaches it directly: there is no proxy to cut.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import signal
from collections.abc import Callable
from pathlib import Path

from bench.chaos.client import send
from bench.chaos.log import Log
from bench.chaos.settings import (
    DECODE_ID,
    HOLD_MARGIN_S,
    MAX_TOKENS,
    PARTITION_FAULTS,
    PARTITIONED_MEMBER,
    PREFILL_ID,
    PROMPT_LENGTHS,
    ROLES,
    SOAK_DECODE_ID,
    SOAK_PREFILL_ID,
    Settings,
)
from bench.tcp_proxy import TcpProxy
from kvpush.dev.localstack.completions import Completion, completion_body
from kvpush.dev.localstack.control_plane import ControlPlaneHandle, kvpush_transfer_config, start_control_plane
from kvpush.dev.localstack.engines import ServerHandle, reference_run, start_vllm_server
from kvpush.dev.localstack.metrics import free_kv_blocks, num_kv_blocks, scrape_metrics
from kvpush.dev.localstack.process import free_port
from kvpush.dev.localstack.prompts import prompt_token_ids
from kvpush.dev.localstack.router import RouterHandle, start_router
from kvpush.dev.localstack.scaled import ScaledControlPlane, ScaledSpec, direct

ENGINE_START_TIMEOUT_S = 240.0


class Stack:
    """Control plane, P's proxy, P and D engines and the router; every one can be killed and restarted."""

    def __init__(self, settings: Settings, run_dir: Path, model_dir: Path, log: Log):
        self.settings = settings
        self.run_dir = run_dir
        self.model_dir = model_dir
        self.log = log
        self.cp_dir = run_dir / "control-plane"
        self.metrics_port = free_port()
        self.cp: ControlPlaneHandle | None = None
        self.scaled: ScaledControlPlane | None = None
        self.proxy: TcpProxy | None = None
        # The partition faults' proxies in front of one broker member, by path (kvpush.dev.localstack.scaled.Front).
        self.fronts: dict[str, TcpProxy] = {}
        self.engines: dict[str, ServerHandle] = {}
        self.ports: dict[str, int] = {}
        self.router: RouterHandle | None = None
        self.prompts = [prompt_token_ids(n, seed=n) for n in PROMPT_LENGTHS]
        self.reference: list[Completion] = []
        self.kv_total: dict[str, int] = {}
        self.kv_baseline: dict[str, int] = {}

    # ---- start and stop ---------------------------------------------------------------------

    def _cp_args(self) -> list[str]:
        return ["--metrics-port", str(self.metrics_port)]

    def start_control_plane(self, port: int = 0) -> None:
        self.cp = start_control_plane(self.cp_dir, port=port, engine_ids=(PREFILL_ID, DECODE_ID, SOAK_PREFILL_ID, SOAK_DECODE_ID),
                                      extra_args=self._cp_args())

    def start(self) -> None:
        if self.settings.scaled:
            spec = ScaledSpec(brokers=self.settings.shards, shard_lease_ttl_s=self.settings.shard_lease_ttl_s)
            partitions = any(fault in PARTITION_FAULTS for fault in self.settings.faults)
            self.scaled = ScaledControlPlane(self.cp_dir, spec, engine_ids=(PREFILL_ID, DECODE_ID, SOAK_PREFILL_ID, SOAK_DECODE_ID),
                                             front=self._front if partitions else direct)
            self.scaled.start()
            self.log(f"scaled control plane: etcd {self.scaled.etcd.endpoints}, registrars {self.scaled.registrar_target}, "
                     f"brokers {self.scaled.broker_target}")
        else:
            self.start_control_plane()
            self.log(f"control plane on {self.cp.address} (metrics :{self.metrics_port}), pid {self.cp.process.pid}")
            self.proxy = TcpProxy(("127.0.0.1", self.cp.port)).start()
            self.log(f"P's proxy to the control plane on {self.proxy.address}")
        self.log("starting P (CPU 0), D (CPU 1) and a single reference engine together")
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            reference = pool.submit(reference_run, self.model_dir, self.prompts, MAX_TOKENS, log_path=self.run_dir / "reference.log",
                                    start_timeout=ENGINE_START_TIMEOUT_S)
            engines = {role: pool.submit(self.start_engine, role) for role in ROLES}
            errors = []
            for future in (reference, *engines.values()):
                try:
                    future.result()
                except Exception as exc:  # all three are waited for, so none is left starting
                    errors.append(exc)
            if errors:
                raise errors[0]
            self.reference = reference.result()
        self.log(f"P at {self.engines['prefill'].url}, D at {self.engines['decode'].url}; reference outputs of {len(self.prompts)} prompts")
        self.start_router()
        self.log(f"router at {self.router_url} (--transfer-timeout-ms {self.settings.timeout_ms})")
        for index in range(2):  # an engine's first requests pay one-time costs
            reply = send(self.router_url, "/v1/completions", completion_body(self.prompts[-1 - index], 2), hang_after_s=60)
            if reply.status != 200:
                raise RuntimeError(f"warm-up through the router failed: {reply}")
        for role, handle in self.engines.items():
            self.kv_total[role] = num_kv_blocks(handle.url)
        self.kv_baseline = self.kv_free()
        self.log(f"KV blocks free at start: {self.kv_baseline} of {self.kv_total}")

    def _front(self, path: str, address: str) -> str:
        """A proxy on each path to and from the partitioned broker member (only those: the proxies cost CPU on every message)."""
        if path.partition("->")[0] != PARTITIONED_MEMBER:
            return address
        host, port = address.rsplit(":", 1)
        proxy = self.fronts[path] = TcpProxy((host, int(port))).start()
        return proxy.address

    @property
    def broker_address(self) -> str:
        """Where the broker answers (the shard map's seed when scaled)."""
        return self.scaled.broker_target if self.scaled is not None else self.cp.address

    @property
    def router_token(self) -> str:
        return (self.scaled or self.cp).token_file.read_text().strip()

    def engine_config(self, role: str) -> dict:
        engine_id, _ = ROLES[role]
        if self.scaled is not None:
            return self.scaled.transfer_config(role, engine_id, hold_margin_s=HOLD_MARGIN_S, transfer_timeout_s=self.settings.deadline_s)
        # Only P reaches the control plane through the proxy; D and the router talk to it directly.
        return kvpush_transfer_config(role, engine_id, self.cp, control_plane_address=self.proxy.address if role == "prefill" else None,
                                      hold_margin_s=HOLD_MARGIN_S, transfer_timeout_s=self.settings.deadline_s)

    def start_engine(self, role: str) -> ServerHandle:
        _, cpu = ROLES[role]
        handle = start_vllm_server(self.model_dir, name=role, port=self.ports.get(role), kv_transfer_config=self.engine_config(role), cpu_list=cpu,
                                   log_path=self.run_dir / f"{role}.log", start_timeout=ENGINE_START_TIMEOUT_S)
        self.engines[role] = handle
        self.ports[role] = handle.port
        return handle

    def start_router(self) -> None:
        extra = ["--transfer-timeout-ms", str(self.settings.timeout_ms)]
        if self.scaled is not None:
            extra += ["--control-plane", self.scaled.broker_target, "--token-file", str(self.scaled.token_file)]
        self.router = start_router(self.run_dir, prefill=[f"{self.engines['prefill'].url}={PREFILL_ID}"],
                                   decode=[f"{self.engines['decode'].url}={DECODE_ID}"], control_plane=self.cp, extra_args=extra)

    @property
    def router_url(self) -> str:
        return self.router.url

    def close(self) -> None:
        """Stops everything this stack started (each step bounded; a failure of one does not skip the others)."""
        steps: list[tuple[str, Callable[[], None]]] = []
        if self.router is not None:
            steps.append(("router", self.router.stop))
        for role, handle in self.engines.items():
            steps.append((role, lambda handle=handle: _resume_and_stop(handle)))
        if self.cp is not None:
            steps.append(("control plane", self.cp.stop))
        if self.scaled is not None:
            steps.append(("scaled control plane", self.scaled.stop))
        if self.proxy is not None:
            steps.append(("proxy", self.proxy.close))
        for path, proxy in self.fronts.items():
            steps.append((f"proxy {path}", proxy.close))
        for name, step in steps:
            try:
                step()
            except Exception as exc:
                self.log(f"stopping {name} failed: {exc}")

    # ---- faults -------------------------------------------------------------------------------

    def kill_engine(self, role: str) -> None:
        self.engines[role].kill()

    def signal_engine(self, role: str, signum: int) -> None:
        self.engines[role].process.signal(signum)

    def kill_control_plane(self) -> None:
        self.cp.kill()

    def restart_control_plane(self) -> None:
        self.start_control_plane(port=self.cp.port)

    # ---- observations -------------------------------------------------------------------------

    def kv_free(self) -> dict[str, int]:
        """Free KV blocks of P and D, after one tiny local request each (vLLM publishes the gauge from engine steps)."""
        free = {}
        for role, handle in self.engines.items():
            with contextlib.suppress(Exception):
                send(handle.url, "/v1/completions", completion_body(prompt_token_ids(4, seed=7), 1), hang_after_s=20)
            try:
                free[role] = free_kv_blocks(handle.url)
            except Exception:
                free[role] = -1
        return free

    def router_failures(self) -> dict[str, float]:
        """kvpush_router_failed_requests_total by reason (the router's own count)."""
        try:
            samples = scrape_metrics(self.router_url)
        except Exception:
            return {}
        return {labels.get("reason", ""): value for labels, value in samples.get("kvpush_router_failed_requests_total", [])}

    def broker_gauge(self, name: str = "kvpush_broker_live_attempts") -> float | None:
        try:
            samples = scrape_metrics(f"http://127.0.0.1:{self.metrics_port}")
        except Exception:
            return None
        values = samples.get(name)
        return values[0][1] if values else None


def _resume_and_stop(handle: ServerHandle) -> None:
    handle.process.signal(signal.SIGCONT)  # a stopped group would ignore SIGTERM until the kill
    handle.stop(timeout=15)
