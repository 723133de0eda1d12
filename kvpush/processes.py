# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""Processes on Linux (psutil; thread names from /proc): process groups, CPU time, memory and CPU affinity of whole engines."""

from __future__ import annotations

import os
from pathlib import Path

import psutil


def group_members(group: int) -> list[int]:
    """Live (not zombie) processes of a process group, sorted: an engine's API server, engine core and workers share one."""
    members = []
    for process in psutil.process_iter(["status"]):
        try:
            # psutil has no process group; os.getpgid asks the kernel for it.
            if os.getpgid(process.pid) == group and process.info["status"] != psutil.STATUS_ZOMBIE:
                members.append(process.pid)
        except ProcessLookupError:
            continue
    return sorted(members)


def thread_ids(pids: list[int]) -> list[int]:
    """Ids of every thread of the given processes; processes already gone are skipped."""
    tids: list[int] = []
    for pid in pids:
        try:
            tids.extend(thread.id for thread in psutil.Process(pid).threads())
        except psutil.NoSuchProcess:
            continue
    return tids


def name_os_thread(name: str) -> None:
    """Names the calling thread in the kernel (/proc/<pid>/task/<tid>/comm, top -H, perf), so its CPU can be told apart.

    Python's thread names stay inside Python; this sets the one the kernel
    shows (at most 15 bytes); psutil only reads process names. A no-op
    where prctl is not available.
    """
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds a process has used (all its threads); 0 if it is gone."""
    try:
        times = psutil.Process(pid).cpu_times()
    except psutil.NoSuchProcess:
        return 0.0
    return times.user + times.system


def _comm(pid: int, tid: int) -> str | None:
    """The kernel's name of a thread (what name_os_thread set); None if it is gone.

    psutil lists threads but does not name them, and its process name()
    swaps a 15-byte name for the command line's, so both come from here.
    """
    try:
        return Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
    except OSError:
        return None


def thread_cpu_seconds(pids: list[int]) -> dict[str, float]:
    """CPU seconds per thread name over the given processes: "<process name>/<thread name>" -> user + system seconds.

    Threads of the same name add up; threads that already exited are not counted.
    """
    totals: dict[str, float] = {}
    for pid in pids:
        process_name = _comm(pid, pid)  # the main thread's name is the process's
        try:
            threads = psutil.Process(pid).threads()
        except psutil.NoSuchProcess:
            continue
        for thread in threads:
            thread_name = _comm(pid, thread.id)
            if process_name is None or thread_name is None:
                continue
            key = f"{process_name}/{thread_name}"
            totals[key] = totals.get(key, 0.0) + thread.user_time + thread.system_time
    return totals


def thread_runqueue_wait_seconds(pids: list[int]) -> dict[str, float]:
    """Seconds each thread name spent runnable but not running (waiting for its CPU), same keys as thread_cpu_seconds.

    From /proc/<pid>/task/<tid>/schedstat (run, runqueue wait, timeslices; ns):
    for a pinned engine, how long others on its core kept each of its threads waiting.
    """
    totals: dict[str, float] = {}
    for pid in pids:
        process_name = _comm(pid, pid)
        for tid in thread_ids([pid]):
            thread_name = _comm(pid, tid)
            try:
                waited_ns = int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if process_name is None or thread_name is None:
                continue
            key = f"{process_name}/{thread_name}"
            totals[key] = totals.get(key, 0.0) + waited_ns / 1e9
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
    for tid in thread_ids(pids):
        try:
            moved += os.sched_getaffinity(tid) != cpus
            os.sched_setaffinity(tid, cpus)
        except OSError:
            pass
    return moved


def pss_bytes(pid: int) -> int:
    """Proportional set size of a process in bytes; 0 if gone."""
    try:
        return psutil.Process(pid).memory_full_info().pss
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return 0


def rss_bytes(pid: int) -> int:
    """Resident set size of a process in bytes; 0 if gone."""
    try:
        return psutil.Process(pid).memory_info().rss
    except psutil.NoSuchProcess:
        return 0
