# SPDX-License-Identifier: Apache-2.0
"""Probe (not a test): two Python spinners pinned to CPU 1 for 3 s each; prints each one's loop turns.

B spins plainly, as a normal thread or at SCHED_IDLE; A spins plainly or
on sched_yield, as vLLM's queue readers do while they wait. Run as root
on an otherwise quiet machine: python sched-idle-probe.py
"""

import os
import subprocess
import sys

SPIN = "import time\nt = time.monotonic() + 3\nn = 0\nwhile time.monotonic() < t:\n    n += 1\nprint(n)"
YIELD = "import os, time\nt = time.monotonic() + 3\nn = 0\nwhile time.monotonic() < t:\n    n += 1\n    os.sched_yield()\nprint(n)"


def spinner(code: str) -> subprocess.Popen:
    return subprocess.Popen(["taskset", "-c", "1", sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)


def run(a_code: str, b_idle: bool) -> None:
    b = spinner(SPIN)
    if b_idle:
        os.sched_setscheduler(b.pid, os.SCHED_IDLE, os.sched_param(0))
    a = spinner(a_code)
    a_turns, b_turns = a.communicate()[0].strip(), b.communicate()[0].strip()
    print("A", "yields" if a_code is YIELD else "spins", "B", "idle" if b_idle else "normal", "A iters", a_turns, "B iters", b_turns)


if __name__ == "__main__":
    print("alone", spinner(SPIN).communicate()[0].strip())
    for code in (SPIN, YIELD):
        for idle in (False, True):
            run(code, idle)
