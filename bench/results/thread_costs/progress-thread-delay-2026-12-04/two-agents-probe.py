# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""NIXL's progress-thread delay between two KvAgents: what a WRITE waits for, and what an idle agent costs.

P on CPU 0, D on CPU 1, each a kvpush KvAgent over 4 MiB of host memory with
NIXL's progress thread at each delay. First both sit idle (each process's CPU
per second), then P posts a 512 KiB WRITE with a notification every 250 ms
and polls it every 0.5 ms while D fetches its notifications every D_POLL ms.
Printed per delay: post -> P saw DONE, post -> D saw the notification (one
CLOCK_MONOTONIC), idle CPU per second and CPU per WRITE period.

    python two-agents-probe.py DELAYS_MS D_POLLS_MS     # e.g. 5,100 5,2
"""

from __future__ import annotations

import multiprocessing
import os
import statistics
import sys
import time

import numpy as np

from kvpush.connector.nixl_agent import KvAgent, MemoryRange

WRITES = 40
GAP_S = 0.25
IDLE_S = 2.0
SIZE = 512 << 10


def cpu_s() -> float:
    times = os.times()
    return times.user + times.system


def agent(name: str, delay_ms: int, buffer: np.ndarray) -> KvAgent:
    kv = KvAgent(name, ["UCX"], "DRAM", delay_ms)
    kv.register([MemoryRange(buffer.ctypes.data, buffer.nbytes, 0)])
    return kv


def decode_side(delay_ms: int, poll_s: float, conn) -> None:
    os.sched_setaffinity(0, {1})
    buffer = np.zeros(4 << 20, dtype=np.uint8)
    kv = agent(f"d{delay_ms}-{os.getpid()}", delay_ms, buffer)
    conn.send((kv.metadata(), buffer.ctypes.data))
    kv.add_peer(conn.recv())
    start = cpu_s()
    time.sleep(IDLE_S)
    conn.send((cpu_s() - start) / IDLE_S)
    seen, start = [], cpu_s()
    while len(seen) < WRITES:
        for messages in kv.notifications().values():
            seen += [time.monotonic() for m in messages if m.startswith(b"w")]
        time.sleep(poll_s)
    conn.send((seen, (cpu_s() - start) / WRITES))


def quantiles(values: list[float]) -> str:
    return f"p50 {statistics.median(values):.3f} p90 {sorted(values)[int(0.9 * len(values))]:.3f}"


def run(delay_ms: int, poll_s: float) -> None:
    mine, theirs = multiprocessing.Pipe()
    decode = multiprocessing.get_context("spawn").Process(target=decode_side, args=(delay_ms, poll_s, theirs))
    decode.start()
    os.sched_setaffinity(0, {0})
    buffer = np.ones(4 << 20, dtype=np.uint8)
    kv = agent(f"p{delay_ms}-{os.getpid()}", delay_ms, buffer)
    metadata, remote = mine.recv()
    mine.send(kv.metadata())
    peer = kv.add_peer(metadata)
    kv.warm_up(peer)
    start = cpu_s()
    time.sleep(IDLE_S)
    p_idle, d_idle = (cpu_s() - start) / IDLE_S, mine.recv()
    posted, done, start = [], [], cpu_s()
    for i in range(WRITES):
        time.sleep(GAP_S)
        write = kv.make_write(peer, np.array([buffer.ctypes.data], dtype=np.uint64), np.array([remote], dtype=np.uint64),
                              np.array([SIZE], dtype=np.uint64), 0, 0, b"w%d" % i)
        posted.append(time.monotonic())
        kv.start(write)
        while kv.poll(write) == "PROC":
            time.sleep(0.0005)
        done.append(time.monotonic())
        kv.release(write)
    p_cpu = (cpu_s() - start) / WRITES
    seen, d_cpu = mine.recv()
    decode.join(10)
    p_done = [1000 * (d - p) for d, p in zip(done, posted, strict=True)]
    d_notified = [1000 * (s - p) for s, p in zip(seen, posted, strict=True)]
    print(f"D polls every {poll_s * 1000:g} ms, delay {delay_ms:>4} ms: P done {quantiles(p_done)} ms; D notified {quantiles(d_notified)} ms; "
          f"idle CPU ms/s P {1000 * p_idle:.2f} D {1000 * d_idle:.2f}; CPU ms per WRITE period P {1000 * p_cpu:.2f} D {1000 * d_cpu:.2f}",
          flush=True)


if __name__ == "__main__":
    for poll_ms in sys.argv[2].split(","):
        for delay in sys.argv[1].split(","):
            run(int(delay), float(poll_ms) / 1000)
