# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""bench/engine_hooks: the benchmark-only patches reach vLLM's real shared-memory queue and NIXL's real API in a fresh interpreter."""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.upstream import ENGINE_HOOKS_DIR, engine_hooks_env

pytestmark = pytest.mark.engine_stack  # each test starts an interpreter that imports vLLM or NIXL

READER = r"""
import json, pickle, sys, time
from vllm.distributed.device_communicators import shm_broadcast
handle = pickle.loads(bytes.fromhex(sys.stdin.readline().strip()))
queue = shm_broadcast.MessageQueue.create_from_handle(handle, 0)
queue.wait_until_ready()
condition = queue._spin_condition
print(json.dumps({"busy_loop_s": condition.busy_loop_s,
                  "recheck_ms": shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS}), flush=True)
while True:
    sent_at, index = queue.dequeue(timeout=30)
    print(json.dumps({"index": index, "late_s": time.monotonic() - sent_at}), flush=True)
    if index < 0:
        break
"""


def start_reader(env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", READER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            env={**os.environ, **env}, text=True)


@pytest.mark.parametrize("spin_ms", [0, 2])
def test_the_spin_patch_makes_readers_wait_on_notifications_and_bounds_a_dropped_one(spin_ms):
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

    writer = MessageQueue(n_reader=1, n_local_reader=1, max_chunk_bytes=1 << 16, max_chunks=4)
    reader = start_reader(engine_hooks_env(vllm_spin_ms=spin_ms))
    try:
        reader.stdin.write(pickle.dumps(writer.export_handle()).hex() + "\n")
        reader.stdin.flush()
        writer.wait_until_ready()
        settings = json.loads(reader.stdout.readline())
        # The reader's queue spins spin_ms, not vLLM's 1 s, and re-checks every 10 ms, not 5 s.
        assert settings == {"busy_loop_s": spin_ms / 1000, "recheck_ms": 10}
        received = []
        for index in range(0, 200, 2):
            # Pauses of 0-18 ms, then two messages back to back: the pattern in which
            # vLLM's PUB socket (SNDHWM=1) drops notifications. With no spin and vLLM's
            # 5 s re-check, 7 of 200 reads here waited 5 s.
            time.sleep(0.003 * (index % 7))
            writer.enqueue((time.monotonic(), index))
            writer.enqueue((time.monotonic(), index + 1))
            received += [json.loads(reader.stdout.readline()) for _ in range(2)]
        writer.enqueue((time.monotonic(), -1))
        assert reader.wait(timeout=30) == 0
    finally:
        if reader.poll() is None:
            reader.kill()
            reader.wait(timeout=10)
    assert [r["index"] for r in received] == list(range(200))
    # A dropped notification costs at most about the 10 ms re-check, not 5 s
    # (the bound leaves room for a slow, loaded machine).
    assert max(r["late_s"] for r in received) < 1.0


def test_without_the_variables_nothing_is_patched():
    assert engine_hooks_env() == {}
    probe = ("import json; from vllm.distributed.device_communicators import shm_broadcast as s; import nixl_cu12._api as a; "
             "print(json.dumps({'recheck_ms': s.SHM_READER_RECHECK_INTERVAL_MS, 'spin': hasattr(s.SpinCondition, '_kvpush_spin_ms'), "
             "'nixl': type(a.nixlBind).__name__}))")
    env = {**os.environ, "PYTHONPATH": str(ENGINE_HOOKS_DIR)}
    env.pop("KVPUSH_NIXL_PTHR_DELAY_US", None)
    env.pop("KVPUSH_VLLM_SPIN_MS", None)
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"recheck_ms": 5000, "spin": False, "nixl": "module"}


def test_the_nixl_delay_patch_wraps_the_agent_bindings():
    probe = "import nixl_cu12._api as a; print(type(a.nixlBind).__name__, a.nixlBind._delay_us)"
    env = {**os.environ, **engine_hooks_env(poll_delay_us=1000)}
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["_BindingsWithDelay", "1000"]
    assert Path(ENGINE_HOOKS_DIR, "sitecustomize.py").is_file()


def test_the_step_timeline_times_each_part_of_the_engine_step(tmp_path):
    probe = ("import json, importlib, sitecustomize as h\n"
             "parts = {}\n"
             "for module, cls, method, part in h.STEP_PARTS:\n"
             "    parts[part] = getattr(getattr(importlib.import_module(module), cls), method)._kvpush_part\n"
             "print(json.dumps(parts))")
    env = {**os.environ, **engine_hooks_env(step_timeline_dir=tmp_path)}
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120, check=True)
    parts = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(parts) == 8 and all(part == patched for part, patched in parts.items())


def test_a_timed_call_leaves_one_line_in_its_process_file(tmp_path):
    spec = importlib.util.spec_from_file_location("engine_hooks_under_test", ENGINE_HOOKS_DIR / "sitecustomize.py")
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)

    class Step:
        def run(self, seconds):
            time.sleep(seconds)
            return "ran"

    module = type(sys)("stand_in")
    module.Step = Step
    hooks.patch_step_part(module, "Step", "run", "core.step", hooks.StepTimeline(str(tmp_path)))
    hooks.patch_step_part(module, "Step", "run", "core.step", hooks.StepTimeline(str(tmp_path)))  # patched once only
    assert Step().run(0.02) == "ran"
    (log,) = tmp_path.iterdir()
    assert log.name == f"{os.getpgid(0)}-{os.getpid()}.log"
    (line,) = log.read_text().splitlines()
    part, start, end = line.split()
    assert part == "core.step" and 0.02 <= float(end) - float(start) < 1.0
