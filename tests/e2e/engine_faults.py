# SPDX-License-Identifier: Apache-2.0
"""What the engine fault tests share: vLLM's own free-block count once settled, a transfer's broker record, P's engine
core paused, a call on a thread."""

from __future__ import annotations

import contextlib
import threading
import time

import psutil

from kvpush.dev.localstack.completions import completions
from kvpush.dev.localstack.metrics import free_kv_blocks
from kvpush.dev.localstack.prompts import prompt_token_ids
from kvpush.dev.localstack.transfers import get_transfer
from tests.waiting import wait_for

STEP_PROMPT = prompt_token_ids(4, seed=7)


def settled_free_blocks(server) -> int:
    # vLLM publishes the gauge from engine steps: a short local request makes the engine step first.
    completions(server.url, STEP_PROMPT, 1)
    return free_kv_blocks(server.url)


def assert_free_blocks_return(servers, before: tuple[int, ...], timeout: float = 30.0) -> None:
    """Each server's free KV blocks come back to `before` (in order) within `timeout`."""
    wait_for(lambda: tuple(settled_free_blocks(s) for s in servers) == before or None, timeout, interval=0.5,
             what=f"free blocks back to {before}")


def transfer_or_none(pair, transfer_id: str):
    with contextlib.suppress(Exception):  # NOT_FOUND until D registers
        return get_transfer(pair.control_plane, transfer_id)
    return None


def engine_core(server) -> psutil.Process:
    """The server's engine core process (vLLM titles it VLLM::EngineCore): it schedules; the worker computes."""
    for pid in server.pids():
        with contextlib.suppress(psutil.Error):
            process = psutil.Process(pid)
            if "EngineCore" in " ".join(process.cmdline()):
                return process
    raise AssertionError(f"no EngineCore process among {server.pids()}")


@contextlib.contextmanager
def paused(process: psutil.Process):
    """SIGSTOP for the block; SIGCONT after it, whatever happened (psutil checks it is still the same process)."""
    process.suspend()
    try:
        yield
    finally:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.resume()


def background(fn) -> tuple[threading.Thread, dict]:
    """Runs fn() on a thread; the returned dict gets its result or exception under "result"."""
    outcome: dict = {}

    def run():
        t0 = time.monotonic()
        try:
            outcome["result"] = fn()
        except Exception as exc:  # asserted on by the caller
            outcome["result"] = exc
        outcome["seconds"] = time.monotonic() - t0

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome
