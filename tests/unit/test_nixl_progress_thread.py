# SPDX-License-Identifier: Apache-2.0
"""KvAgent with NIXL's own progress thread (nixl_progress_thread_ms > 0): real UCX agents, host memory.

The thread must exist, sleep while nothing happens (NIXL 1.5.1's Python
agent would start it without a delay, busy-polling a core), and move a WRITE
and its notification like the agent without it.
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from kvpush.connector.nixl_agent import KvAgent, MemoryRange

SIZE = 256 * 1024
WAIT_S = 10.0


def thread_ids() -> set[int]:
    return {int(t) for t in os.listdir("/proc/self/task")}


def thread_state(tid: int) -> str:
    with open(f"/proc/self/task/{tid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0]


def agent_over(name: str, buffer: np.ndarray, progress_thread_ms: int) -> KvAgent:
    agent = KvAgent(name, ["UCX"], "DRAM", progress_thread_ms)
    agent.register([MemoryRange(buffer.ctypes.data, buffer.nbytes, 0)])
    return agent


def test_negative_delay_is_refused():
    with pytest.raises(ValueError, match="progress_thread_ms must be 0 or more"):
        KvAgent("bad", ["UCX"], "DRAM", -1)


def test_progress_thread_sleeps_and_moves_a_write_with_its_notification():
    source = np.arange(SIZE, dtype=np.uint8)
    target = np.zeros(SIZE, dtype=np.uint8)
    before = thread_ids()
    producer = agent_over("pt-producer", source, 5)
    consumer = agent_over("pt-consumer", target, 5)
    new_threads = thread_ids() - before
    try:
        assert len(new_threads) >= 2  # one progress thread per agent (UCX may add its own)
        # Idle: every thread NIXL/UCX started is asleep nearly all the time (a delay-less progress thread never is).
        samples = {tid: [thread_state(tid) for _ in range(5) if not time.sleep(0.02)] for tid in new_threads}
        assert all(states.count("R") <= 2 for states in samples.values()), samples
        peer = producer.add_peer(consumer.metadata())
        consumer.add_peer(producer.metadata())
        src, dst = np.array([source.ctypes.data], dtype=np.uint64), np.array([target.ctypes.data], dtype=np.uint64)
        lengths = np.array([SIZE], dtype=np.uint64)
        write, notes, deadline = None, [], time.monotonic() + WAIT_S
        while write is None and time.monotonic() < deadline:  # the connection is set up by the progress threads
            try:
                made = producer.make_write(peer, src, dst, lengths, 0, 0, b"kvpush-test|1")
                producer.start(made)  # a refused post frees it
                write = made
            except Exception:
                time.sleep(0.01)
        assert write is not None, "the WRITE could not be posted within 10 s"
        while producer.poll(write) == "PROC" and time.monotonic() < deadline:
            time.sleep(0.001)
        producer.release(write)
        while not notes and time.monotonic() < deadline:
            notes = consumer.notifications().get("pt-producer", [])
            time.sleep(0.001)
        assert notes == [b"kvpush-test|1"]
        assert np.array_equal(target, source)
    finally:
        producer.close()
        consumer.close()


def voluntary_switches(tids: set[int]) -> int:
    total = 0
    for tid in tids:
        with open(f"/proc/self/task/{tid}/status") as status:
            total += next(int(line.split()[1]) for line in status if line.startswith("voluntary_ctxt_switches"))
    return total


def test_a_producers_progress_thread_wakes_on_ucx_events_not_its_delay():
    # Why "auto" can give a prefill engine a long delay: its thread sleeps in poll() on UCX's events, so a WRITE's
    # completion wakes it at once; the delay only bounds its idle wake-ups. With 10 s, a wake-up within 0.3 s of the
    # post can only be an event.
    source = np.arange(SIZE, dtype=np.uint8)
    target = np.zeros(SIZE, dtype=np.uint8)
    before = thread_ids()
    producer = agent_over("pt-long-producer", source, 10_000)
    producer_threads = thread_ids() - before
    consumer = agent_over("pt-long-consumer", target, 5)
    try:
        peer = producer.add_peer(consumer.metadata())
        consumer.add_peer(producer.metadata())
        src, dst = np.array([source.ctypes.data], dtype=np.uint64), np.array([target.ctypes.data], dtype=np.uint64)
        lengths = np.array([SIZE], dtype=np.uint64)
        producer.warm_up(peer)
        notes, deadline = [], time.monotonic() + WAIT_S
        while not notes and time.monotonic() < deadline:  # the connection is up once the hello arrived
            notes = consumer.notifications().get("pt-long-producer", [])
            time.sleep(0.005)
        assert notes, "the hello did not arrive within 10 s"
        time.sleep(0.1)  # the set-up's own wake-ups are over
        write = producer.make_write(peer, src, dst, lengths, 0, 0, b"kvpush-test|2")
        switches = voluntary_switches(producer_threads)
        producer.start(write)
        time.sleep(0.3)  # nobody polls the producer meanwhile
        woke = voluntary_switches(producer_threads) - switches
        state = producer.poll(write)
        producer.release(write)
        notes = []
        while not notes and time.monotonic() < deadline:
            notes = consumer.notifications().get("pt-long-producer", [])
            time.sleep(0.001)
        assert woke >= 1, "the producer's progress thread slept through its WRITE's completion"
        assert state == "DONE"
        assert notes == [b"kvpush-test|2"]
        assert np.array_equal(target, source)
    finally:
        producer.close()
        consumer.close()
