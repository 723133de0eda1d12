# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""One mode's running stack for the sweep, pinned, and the spans it writes."""

from __future__ import annotations

import dataclasses
import fcntl
import tempfile
from pathlib import Path
from typing import Any

from bench.upstream import engine_hooks_env
from kvpush.dev.localstack.control_plane import ControlPlaneHandle
from kvpush.dev.localstack.engines import ServerHandle
from kvpush.dev.localstack.stack import Stack, StackSpec
from kvpush.processes import cpu_seconds
from kvpush.telemetry import read_spans

PREFILL_CPUS, DECODE_CPUS = "0", "1"
NIXL_POLL_DELAY_US = 1000


class SpanTail:
    """Reads the spans appended to a shared OTLP/JSON-lines file since a byte offset."""

    def __init__(self, path: Path):
        self.path = path

    def offset(self) -> int:
        return self.path.stat().st_size if self.path.exists() else 0

    def read_since(self, offset: int) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        with self.path.open("rb") as file:
            # Writers append whole lines under an exclusive flock (kvpush.telemetry).
            fcntl.flock(file.fileno(), fcntl.LOCK_SH)
            file.seek(offset)
            chunk = file.read()
        # kvpush.telemetry.read_spans parses files: give it just the new lines.
        with tempfile.NamedTemporaryFile(suffix=".jsonl") as part:
            part.write(chunk)
            part.flush()
            return read_spans(part.name)


@dataclasses.dataclass
class ModeStack:
    """One mode's running stack (P, D, its router and, for kvpush, the control plane) and the spans it writes."""

    mode: str
    stack: Stack
    spans: SpanTail
    failure: str = ""  # set once the stack is found dead; its remaining runs are skipped

    @property
    def prefill(self) -> ServerHandle:
        return self.stack.prefill

    @property
    def decode(self) -> ServerHandle:
        return self.stack.decode

    @property
    def router_url(self) -> str:
        return self.stack.router.url

    @property
    def control_plane(self) -> ControlPlaneHandle | None:
        return self.stack.control_plane

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds used so far by each part (all processes of each engine's group)."""
        used = {"P": self.prefill.cpu_seconds(), "D": self.decode.cpu_seconds(), "router": cpu_seconds(self.stack.router.process.pid)}
        if self.control_plane is not None:
            used["control_plane"] = cpu_seconds(self.control_plane.process.pid)
        return used

    def stop(self) -> None:
        self.stack.stop()


def start_stack(mode: str, model_dir: Path, work: Path, nixl_as_shipped: bool, kvpush_engine_tracing: bool,
                kvpush_extra: dict[str, Any], vllm_spin_ms: float | None = None, step_timeline_dir: Path | None = None,
                aux_cpus: str | None = None, trace_ratio: float | None = None, prefix_caching: bool = False) -> ModeStack:
    """Starts one mode's engines (P on PREFILL_CPUS, D on DECODE_CPUS, concurrently) and router.

    Every router exports its spans (router-side timings, kvpush transfer
    ids); kvpush's engines and control plane too unless
    `kvpush_engine_tracing` is off (to measure what tracing costs them);
    with `trace_ratio` they keep that share of traces, by trace id.
    `kvpush_extra` goes into both kvpush engines' kv_connector_extra_config.
    Upstream engines get NIXL's poll delay unless `nixl_as_shipped`;
    every engine's vLLM queue readers spin at most `vllm_spin_ms` per wait
    (None: vLLM's 1 s after each read), see bench/engine_hooks; with
    `step_timeline_dir` every engine process writes its step timeline there;
    with `aux_cpus` the router and the control plane run on those CPUs only;
    `prefix_caching` turns vLLM's prefix caching on in both engines.
    """
    poll_delay_us = None if mode == "kvpush" or nixl_as_shipped else NIXL_POLL_DELAY_US
    traces = work / "traces.jsonl"
    spec = StackSpec(
        mode=mode, prefill_cpus=PREFILL_CPUS, decode_cpus=DECODE_CPUS, aux_cpus=aux_cpus, traces_file=traces, trace_engines=kvpush_engine_tracing,
        trace_ratio=trace_ratio,
        engine_env=engine_hooks_env(poll_delay_us=poll_delay_us, vllm_spin_ms=vllm_spin_ms, step_timeline_dir=step_timeline_dir), kvpush_extra=kvpush_extra,
        # Settled transfers stay queryable (GetTransfer) for the whole sweep; retention only bounds memory.
        control_plane_args=("--retention", "7200"), router_log_level="WARNING", prefix_caching=prefix_caching,
    )
    return ModeStack(mode, Stack(spec, model_dir, work).start(), SpanTail(traces))
