# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""bench.thread_costs: threads named by what py-spy saw them run, CPU per request by category, an older checkout's packages."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from bench import thread_costs
from bench.thread_costs import MAPPING_SHIM, THIS_CHECKOUT, category, cpu_during, identities, report, sampled_threads, thread_cpu

WORKER = "thread (101): MainThread;<module> (<string>:1);WorkerProc.worker_main (vllm/v1/executor/multiproc_executor.py:944);" \
         "WorkerProc.worker_busy_loop (vllm/v1/executor/multiproc_executor.py:1041);execute_model (vllm/x.py:5) {n}"
TRANSFER = "thread (102): kvpush-producer-0;Thread._bootstrap (threading.py:1002);Thread._bootstrap_inner (threading.py:1045);" \
           "Thread.run (threading.py:982);TransferThread._run (connector/transfer_thread.py:{line});KvAgent.poll (connector/nixl_agent.py:118) {n}"
CONTROL = "thread (103): Thread-3 (_run);Thread._bootstrap (threading.py:1002);Thread.run (threading.py:982);" \
          "LoopThread._run (kvpush/client/loop_thread.py:44);BaseEventLoop.run_forever (asyncio/base_events.py:607) {n}"


def test_a_thread_is_named_by_the_function_it_started_in_whatever_its_line():
    raw = "\n".join([WORKER.format(n=7), TRANSFER.format(line=61, n=3), TRANSFER.format(line=75, n=2), CONTROL.format(n=1), "garbage line"])
    seen = sampled_threads(raw)
    assert seen == {
        "101": ("MainThread", "WorkerProc.worker_busy_loop (vllm/v1/executor/multiproc_executor.py)", 7),
        "102": ("kvpush-producer-0", "TransferThread._run (connector/transfer_thread.py)", 5),
        "103": ("Thread-3 (_run)", "LoopThread._run (kvpush/client/loop_thread.py)", 1),
    }
    assert category("VLLM::Worker", seen["101"]) == "vLLM worker main thread"
    assert category("VLLM::Worker", seen["102"]) == "kvpush transfer thread"
    assert category("VLLM::EngineCor", seen["103"]) == "kvpush control loops (engine streams, calls)"
    # Never seen running Python: native, told by its kernel name.
    assert category("event_engine", None) == "gRPC event_engine threads (native)"
    assert category("VLLM::Worker", None) == "NIXL / UCX threads in the worker (native)"


def _recorded_run(folder: Path, label: str, requests: int, cpu: dict[str, dict[str, tuple[str, float]]], raws: dict[str, str]) -> None:
    """A run as record leaves it: py-spy's raw files, then the cpu document with what they saw."""
    for role, raw in raws.items():
        (folder / f"{label}-{role}-1.txt").write_text(raw)
    threads = {role: {tid: {"pid": 1, "comm": comm, "cpu_s": seconds} for tid, (comm, seconds) in rows.items()} for role, rows in cpu.items()}
    seen = {role: identities(folder, label, role) for role in cpu}
    (folder / f"{label}-cpu.json").write_text(json.dumps({"requests": requests, "elapsed_s": 1.0, "pids": {}, "threads": threads, "seen": seen}))


def test_the_report_divides_procs_cpu_not_samples_by_the_requests_per_category(tmp_path):
    before, after = tmp_path / "before", tmp_path / "after"
    before.mkdir(), after.mkdir()
    # py-spy saw the transfer thread often (it counts a blocked queue get); its CPU is /proc's.
    _recorded_run(before, "kvpush_qps4_in256_out16_iter1", 100,
                  {"P": {"101": ("VLLM::Worker", 2.0), "102": ("VLLM::Worker", 0.5), "9": ("event_engine", 0.1), "8": ("ZMQbg/IO/0", 0.0)},
                   "D": {"201": ("VLLM::Worker", 3.0)}},
                  {"P": "\n".join([WORKER.format(n=50), TRANSFER.format(line=61, n=900)]),
                   "D": WORKER.format(n=80).replace("(101)", "(201)")})
    _recorded_run(after, "kvpush_qps4_in256_out16_iter1", 50,
                  {"P": {"101": ("VLLM::Worker", 1.0), "102": ("kvpush-producer", 0.05), "7": ("VLLM::Worker", 0.05), "8": ("ZMQbg/IO/0", 0.0)},
                   "D": {"201": ("VLLM::Worker", 1.5)}},
                  {"P": "\n".join([WORKER.format(n=50), TRANSFER.format(line=61, n=900)]),
                   "D": WORKER.format(n=80).replace("(101)", "(201)")})
    _recorded_run(after, "kvpush_qps1_in256_out16_iter1", 10, {"P": {"101": ("VLLM::Worker", 9.0)}, "D": {}}, {"P": WORKER.format(n=1)})
    lines = report([before, after], "kvpush_qps4_*").splitlines()
    tables: dict[str, dict[str, list[float]]] = {}
    for line in lines:
        if not line.startswith("  "):
            role = line[0]
            tables[role] = {}
        else:
            tables[role][line[:48].strip()] = [float(v) for v in line[48:].split()]
    assert lines[0] == "P: ms of CPU per request | before (100 requests) | after (50 requests)"
    assert tables["P"] == {
        "vLLM worker main thread": [20.0, 20.0],
        "kvpush transfer thread": [5.0, 1.0],
        "gRPC event_engine threads (native)": [1.0, 0.0],
        "NIXL / UCX threads in the worker (native)": [0.0, 1.0],
        "all threads": [26.0, 22.0],
    }  # ZeroMQ's thread used nothing in either: no row
    assert tables["D"] == {"vLLM worker main thread": [30.0, 30.0], "all threads": [30.0, 30.0]}
    with pytest.raises(ValueError, match="no recorded run matching 'kvpush_qps8_\\*'"):
        report([before, after], "kvpush_qps8_*")


def test_thread_cpu_reads_each_thread_of_a_process_and_counts_only_what_it_used_since():
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            sum(range(1000))

    before = thread_cpu([os.getpid()])
    spinner = threading.Thread(target=spin, name="spinner")
    spinner.start()
    try:
        time.sleep(0.3)
        after = thread_cpu([os.getpid()])
    finally:
        stop.set()
        spinner.join(5)
    during = cpu_during(before, after)
    spun = during[str(spinner.native_id)]
    assert spun["pid"] == os.getpid()
    assert spun["cpu_s"] >= 0.05  # it started after `before`: all of its CPU counts
    assert during[str(threading.main_thread().native_id)]["cpu_s"] < after[str(threading.main_thread().native_id)]["cpu_s"]


def test_the_mapping_sitecustomize_runs_an_older_checkouts_packages(tmp_path):
    checkout = tmp_path / "older"
    for package in ("kvpush", "services", "connector"):
        (checkout / package).mkdir(parents=True)
        (checkout / package / "__init__.py").write_text(f"WHICH = 'older {package}'\n")
    (tmp_path / "shim").mkdir()
    (tmp_path / "shim" / "sitecustomize.py").write_text(MAPPING_SHIM.format(this=str(THIS_CHECKOUT), checkout=str(checkout), hooks=""))
    probe = textwrap.dedent("""
        import kvpush, kvpush.connector, kvpush.services
        print(kvpush.WHICH, '|', kvpush.connector.WHICH, '|', kvpush.services.WHICH)
    """)
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "shim"))
    result = subprocess.run([sys.executable, "-c", probe], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60, check=True)
    assert result.stdout.strip() == "older kvpush | older connector | older services"
    # Without it, this checkout's.
    plain = subprocess.run([sys.executable, "-c", "import kvpush; print(kvpush.__file__)"], cwd=tmp_path, capture_output=True, text=True,
                           timeout=60, check=True)
    assert plain.stdout.strip() == str(THIS_CHECKOUT / "kvpush" / "__init__.py")


def test_record_refuses_a_folder_that_is_not_a_kvpush_checkout(tmp_path, capsys):
    if thread_costs._load_this_checkouts("pyspy").pyspy_binary() is None:
        pytest.skip("py-spy is not installed")
    assert thread_costs.main(["record", "--checkout", str(tmp_path), "--out", str(tmp_path / "out"), "--", "--modes", "kvpush"]) == 2
    assert f"{tmp_path} has no bench.sweep" in capsys.readouterr().err


def test_record_wants_the_sweeps_arguments(tmp_path, capsys):
    with pytest.raises(SystemExit) as stopped:
        thread_costs.main(["record", "--out", str(tmp_path / "out")])
    assert stopped.value.code == 2
    assert "record needs the sweep's arguments after --" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
