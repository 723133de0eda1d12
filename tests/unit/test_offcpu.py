# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""bench.offcpu: a worker main thread's waits told apart from perf's context switches, and who had its core meanwhile."""

from __future__ import annotations

import pytest

from bench.offcpu import SWITCH, CoreUse, engine_report, off_cpu, wait_kind

WORKER, CONSUMER, ROUTER = 100, 101, 300
NAMES = {str(WORKER): "kvpush D VLLM::Worker / VLLM::Worker", str(CONSUMER): "kvpush D VLLM::Worker / kvpush-consumer",
         str(ROUTER): "kvpush router python / python"}
GIL_STACK = ["__schedule", "futex_wait", "pthread_cond_timedwait", "take_gil", "PyEval_RestoreThread"]
POLL_STACK = ["__schedule", "do_sys_poll", "__poll", "zmq_poll", "PyObject_Vectorcall"]
LOCK_STACK = ["__schedule", "futex_wait", "sem_clockwait", "PyThread_acquire_lock_timed", "lock_PyThread_acquire_lock"]


def test_perf_scripts_switch_lines_are_read():
    line = "[001] 53540.142897: sched:sched_switch: prev_comm=VLLM::Worker prev_pid=4256 prev_prio=120 prev_state=S ==> next_comm=swapper/1 next_pid=0 next_prio=120"
    match = SWITCH.search(line)
    assert (match[1], match[2], match[4], match[5], match[6], match[7]) == ("001", "53540.142897", "4256", "S", "swapper/1", "0")


@pytest.mark.parametrize(("state", "stack", "kind"), [
    ("R", GIL_STACK, "runqueue"),  # preempted: its stack does not matter
    ("R+", [], "runqueue"),
    ("S", GIL_STACK, "gil"),
    ("S", POLL_STACK, "ipc"),
    ("S", LOCK_STACK, "lock"),
    ("S", ["__schedule", "do_sched_yield", "sched_yield"], "yield"),
    ("D", ["__schedule", "io_schedule"], "other"),
])
def test_a_wait_is_told_by_the_threads_state_and_stack(state, stack, kind):
    assert wait_kind(state, stack) == kind


def switch(time, prev, state, nxt, comm="x", stack=()):
    return (time, 1, prev, state, nxt, comm, list(stack))


def test_waits_and_who_had_the_core_are_counted_per_request_and_per_model_step():
    main = [
        switch(10.000, WORKER, "S", 0, stack=GIL_STACK), switch(10.002, 0, "S", WORKER),  # 2 ms waiting for the GIL
        switch(10.010, WORKER, "R", ROUTER), switch(10.013, ROUTER, "S", WORKER),  # 3 ms preempted
        switch(10.020, WORKER, "S", 0, stack=POLL_STACK), switch(10.030, 0, "S", WORKER),  # 10 ms waiting for the next step
        switch(20.000, WORKER, "S", 0, stack=GIL_STACK), switch(20.005, 0, "S", WORKER),  # outside the run's window
    ]
    machine = [
        switch(10.000, WORKER, "S", CONSUMER, "kvpush-consumer"), switch(10.0015, CONSUMER, "S", 0, "swapper/1"),
        switch(10.002, 0, "S", WORKER, "VLLM::Worker"),
        switch(10.010, WORKER, "R", ROUTER, "python"), switch(10.013, ROUTER, "S", WORKER, "VLLM::Worker"),
        switch(10.020, WORKER, "S", 999, "stranger"), switch(10.030, 999, "S", WORKER, "VLLM::Worker"),
    ]
    assert off_cpu(main, WORKER)[:3] == [(10.000, 10.002, "gil", 1), (10.010, 10.013, "runqueue", 1), (10.020, 10.030, "ipc", 1)]
    steps = [(10.009, 10.012, 10.025)]  # one model step: to_forward 10.009-10.012, the whole step 10.009-10.025
    report = engine_report(main, CoreUse(machine), WORKER, NAMES, (9.0, 11.0), requests=2, steps=steps)
    assert report["off_cpu_ms_per_request"] == pytest.approx({"runqueue": 1.5, "gil": 1.0, "ipc": 5.0, "lock": 0.0, "yield": 0.0, "other": 0.0})
    assert report["on_core_during_waits_ms_per_request"] == {
        "runqueue": {"kvpush router python / python": pytest.approx(1.5)},
        "gil": {"kvpush D VLLM::Worker / kvpush-consumer": pytest.approx(0.75), "idle": pytest.approx(0.25)},
    }
    assert report["model_steps"] == 1
    assert report["model_step_runqueue_on_core_ms_per_step"] == {"kvpush router python / python": pytest.approx(3.0)}
    to_forward, step = report["off_cpu_ms_per_model_step"]["to_forward"], report["off_cpu_ms_per_model_step"]["step"]
    assert (to_forward["length"], to_forward["runqueue"], to_forward["ipc"]) == pytest.approx((3.0, 2.0, 0.0))
    assert (step["length"], step["runqueue"], step["ipc"], step["gil"]) == pytest.approx((16.0, 3.0, 5.0, 0.0))
