# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""Processes on Linux, read from /proc: process groups, CPU time, memory and CPU affinity of whole engines."""

from __future__ import annotations

import os
from pathlib import Path


def group_members(group: int) -> list[int]:
    """Live (not zombie) processes of a process group, sorted: an engine's API server, engine core and workers share one."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        # Fields after the parenthesised command name: state ppid pgrp ...
        state, _, pgrp = stat[stat.rfind(")") + 2 :].split()[:3]
        if int(pgrp) == group and state != "Z":
            members.append(int(entry))
    return sorted(members)


def name_os_thread(name: str) -> None:
    """Names the calling thread in the kernel (/proc/<pid>/task/<tid>/comm, top -H, perf), so its CPU can be told apart.

    Python's thread names stay inside Python; this sets the one the kernel
    shows (at most 15 bytes). A no-op where prctl is not available.
    """
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def _stat_cpu_seconds(stat_path: str) -> float:
    """User plus system CPU seconds from a /proc stat file (a process's or one thread's); 0 if it is gone."""
    try:
        stat = Path(stat_path).read_text()
    except OSError:
        return 0.0
    fields = stat[stat.rfind(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds a process has used (all its threads); 0 if it is gone."""
    return _stat_cpu_seconds(f"/proc/{pid}/stat")


def thread_cpu_seconds(pids: list[int]) -> dict[str, float]:
    """CPU seconds per thread name over the given processes: "<process name>/<thread name>" -> user + system seconds.

    Threads of the same name add up; threads that already exited are not counted.
    """
    totals: dict[str, float] = {}
    for pid in pids:
        try:
            process = Path(f"/proc/{pid}/comm").read_text().strip()
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                thread = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
            except OSError:
                continue
            key = f"{process}/{thread}"
            totals[key] = totals.get(key, 0.0) + _stat_cpu_seconds(f"/proc/{pid}/task/{tid}/stat")
    return totals


def parse_cpu_list(cpu_list: str) -> set[int]:
    """CPU ids of a taskset-style list such as "0", "0-1" or "0,2-3"."""
    cpus: set[int] = set()
    for part in cpu_list.split(","):
        lo, _, hi = part.strip().partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def pin_threads(pids: list[int], cpus: set[int]) -> int:
    """Sets the CPU affinity of every thread of `pids` (threads that vanish meanwhile are skipped); returns how many had another one."""
    moved = 0
    for pid in pids:
        try:
            tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        except OSError:
            continue
        for tid in tids:
            try:
                moved += os.sched_getaffinity(tid) != cpus
                os.sched_setaffinity(tid, cpus)
            except OSError:
                pass
    return moved


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
