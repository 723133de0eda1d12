# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""py-spy around a benchmark's load: P's and D's processes sampled while it runs (bench.sweep --profile, bench.handoff --profile)."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

RATE_HZ = 100
STOP_TIMEOUT_S = 20.0
MISSING = "needs py-spy (pip install py-spy, or the [profile] extra)"


def pyspy_binary() -> str | None:
    """py-spy on PATH or beside this interpreter, or None."""
    beside = Path(sys.executable).with_name("py-spy")
    return shutil.which("py-spy") or (str(beside) if beside.exists() else None)


def start_profilers(stack: Any, out: Path, label: str, *, gil: bool = False, only: Callable[[int], bool] | None = None) -> list[subprocess.Popen]:
    """py-spy record (on-CPU samples of every thread, the engines not paused) on each process of P and D; one raw file each.

    gil: sample only the thread holding the GIL; only: which processes (by
    pid) to sample, all by default. Until stop_profilers. py-spy names a
    thread by its id only: `<label>-threads.json` maps each thread id to its
    kernel name, read when the recording starts.
    """
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob(f"{label}-*.txt"):
        stale.unlink()  # an earlier run's processes
    pids = {role: [pid for pid in engine.pids() if only is None or only(pid)] for role, engine in (("P", stack.prefill), ("D", stack.decode))}
    names = {role: {str(pid): thread_names(pid) for pid in role_pids} for role, role_pids in pids.items()}
    (out / f"{label}-threads.json").write_text(json.dumps(names, indent=1))
    spy = pyspy_binary() or "py-spy"
    profilers = []
    for role, role_pids in pids.items():
        for pid in role_pids:
            command = [spy, "record", "--pid", str(pid), "--threads", "--nonblocking", "--rate", str(RATE_HZ),
                       "--format", "raw", "--output", str(out / f"{label}-{role}-{pid}.txt")] + (["--gil"] if gil else [])
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
