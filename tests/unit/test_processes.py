# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""kvpush.processes against this test process: its group, its threads and their CPU."""

from __future__ import annotations

import os
import select
import subprocess
import sys
import threading
import time

from kvpush.processes import cpu_seconds, group_members, name_os_thread, thread_cpu_seconds, thread_ids, thread_runqueue_wait_seconds


def test_group_members_lists_a_new_group_and_not_its_zombie():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True)
    try:
        assert group_members(child.pid) == [child.pid]
        assert os.getpid() in group_members(os.getpgid(0))
    finally:
        child.kill()
    deadline = time.monotonic() + 5
    while group_members(child.pid) and time.monotonic() < deadline:  # killed, not yet reaped: a zombie
        time.sleep(0.01)
    assert group_members(child.pid) == []
    child.wait()


def test_cpu_and_threads_of_a_named_thread():
    started, stop = threading.Event(), threading.Event()
    native_id = []

    def spin():
        name_os_thread("kvpush-tspin")
        native_id.append(threading.get_native_id())
        started.set()
        spin_until = time.monotonic() + 0.2
        while time.monotonic() < spin_until:
            pass
        stop.wait(5)

    thread = threading.Thread(target=spin)
    thread.start()
    try:
        started.wait(5)
        time.sleep(0.3)
        assert native_id[0] in thread_ids([os.getpid()])
        totals = thread_cpu_seconds([os.getpid()])
        (key,) = [key for key in totals if key.endswith("/kvpush-tspin")]
        assert 0 < totals[key] <= cpu_seconds(os.getpid())
    finally:
        stop.set()
        thread.join()


def test_a_gone_process_counts_nothing():
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    assert cpu_seconds(gone.pid) == 0.0
    assert thread_cpu_seconds([gone.pid]) == {}
    assert thread_ids([gone.pid]) == []
    assert thread_runqueue_wait_seconds([gone.pid]) == {}


SPIN_S = 0.6


def test_runqueue_wait_of_two_processes_sharing_one_core():
    """Two spinning processes pinned to one CPU take turns: each waits for the core while the other runs."""
    spin = (f"import os, time\nos.sched_setaffinity(0, {{0}})\nend = time.monotonic() + {SPIN_S}\nwhile time.monotonic() < end: pass\n"
            "print('spun', flush=True)\ntime.sleep(30)")
    children = [subprocess.Popen([sys.executable, "-c", spin], stdout=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        for child in children:
            ready, _, _ = select.select([child.stdout], [], [], 20)
            assert ready and child.stdout.readline().strip() == "spun"
        waited = [sum(thread_runqueue_wait_seconds([c.pid]).values()) for c in children]
        # Each spins SPIN_S of wall time on a core it shares with the other spinner: a good part of it is spent waiting.
        assert all(w > SPIN_S * 0.2 for w in waited), waited
        (key,) = thread_runqueue_wait_seconds([children[0].pid])
        assert key.startswith("python")
    finally:
        for child in children:
            child.kill()
            child.wait()
