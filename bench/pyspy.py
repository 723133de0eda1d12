# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""py-spy around a sweep run: every process of P and D sampled while the load runs (bench.sweep --profile)."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

RATE_HZ = 100
STOP_TIMEOUT_S = 20.0


def start_profilers(stack: Any, out: Path, label: str) -> list[subprocess.Popen]:
    """py-spy record (on-CPU samples of every thread, the engines not paused) on each process of P and D; one raw file each.

    py-spy names a thread by its id only: `<label>-threads.json` maps each
    thread id to its kernel name, read when the recording starts.
    """
    out.mkdir(parents=True, exist_ok=True)
    names = {role: {str(pid): thread_names(pid) for pid in engine.pids()} for role, engine in (("P", stack.prefill), ("D", stack.decode))}
    (out / f"{label}-threads.json").write_text(json.dumps(names, indent=1))
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    profilers = []
    for role, engine in (("P", stack.prefill), ("D", stack.decode)):
        for pid in engine.pids():
            command = [spy, "record", "--pid", str(pid), "--threads", "--nonblocking", "--rate", str(RATE_HZ),
                       "--format", "raw", "--output", str(out / f"{label}-{role}-{pid}.txt")]
            profilers.append(subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    return profilers


def stop_profilers(profilers: list[subprocess.Popen]) -> None:
    """Ends each recording as Ctrl-C would (py-spy then writes its file); bounded."""
    for profiler in profilers:
        profiler.send_signal(signal.SIGINT)
    for profiler in profilers:
        try:
            profiler.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            profiler.kill()
            profiler.wait()


def thread_names(pid: int) -> dict[str, str]:
    """Thread id -> kernel name (/proc/<pid>/task/<tid>/comm) of one process; {} once it is gone."""
    names = {}
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            names[task.name] = (task / "comm").read_text().strip()
        except OSError:
            continue
    return names
