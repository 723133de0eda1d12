# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""kvpush.processes against this test process: its group, its threads and their CPU."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

from kvpush.processes import cpu_seconds, group_members, name_os_thread, thread_cpu_seconds, thread_ids


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
