# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""Where an engine worker's main thread waits, per sweep run: `python -m bench.offcpu <results-dir>`.

`bench.sweep --offcpu` records, during each run's load, with Linux perf
(scheduler tracepoints: root, or perf_event_paranoid allowing them):

* `offcpu/<run>-main.data`: every context switch of the run's P and D worker
  main threads (vLLM's `VLLM::Worker`, TP 1), each with 2 KiB of its user
  stack, so that a wait can be told by what it waited in;
* `offcpu/<run>-cpus.data`: every context switch on the machine, without
  stacks: who had a main thread's core while it waited;
* `offcpu/<run>-processes.json`: each stack process's and thread's id and name.

The report gives per run and engine the main thread's time off its core
per request, by kind of wait:

    runqueue   runnable, but another thread had its core (preempted)
    gil        waiting for the GIL (take_gil on its stack): another thread of the process held it
    ipc        waiting in zmq_poll / poll: vLLM's message queue (the engine's next step)
    lock       a Python lock or event wait (a connector's own wait, e.g. kvpush's idle wait)
    yield      sched_yield (vLLM's queue spin)
    other      anything else

the same within the steps that ran the model (bench.sweep --step-timeline:
to_forward and the whole step, per step), and who ran on the core during
its run-queue and GIL waits, and during its run-queue waits within model
steps (the engine's own threads by name, other processes by stack, role
and name).
"""

from __future__ import annotations

import argparse
import bisect
import json
import re
import shutil
import signal
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from bench.pyspy import thread_names
from bench.step_timeline import engine_processes, forward_steps_spans

STACK_BYTES = 2048
STOP_TIMEOUT_S = 30.0
WORKER_COMM = "VLLM::Worker"
KINDS = ("runqueue", "gil", "ipc", "lock", "yield", "other")
MISSING = "needs Linux perf with the right to record sched:sched_switch (root, or a low kernel.perf_event_paranoid)"
SWITCH = re.compile(
    r"\[(\d+)\]\s+(\d+\.\d+):\s+sched:sched_switch:.*prev_comm=(.*) prev_pid=(\d+) .*prev_state=(\S+) ==> next_comm=(.*) next_pid=(\d+)"
)


def perf_usable() -> bool:
    """Whether perf is here and may record scheduler switches."""
    perf = shutil.which("perf")
    if perf is None:
        return False
    probe = subprocess.run([perf, "record", "-q", "-e", "sched:sched_switch", "-o", "/dev/null", "true"], capture_output=True)
    return probe.returncode == 0


# ---- recording ------------------------------------------------------------------------------


def _main_thread(engine: Any) -> int | None:
    """The engine's worker process (its main thread's id is the process id)."""
    for pid in engine.pids():
        try:
            if Path(f"/proc/{pid}/comm").read_text().strip() == WORKER_COMM:
                return pid
        except OSError:
            continue
    return None


def _names(stacks: list) -> dict[str, str]:
    """Thread id -> "<mode> <engine or part> <process name> / <thread name>" of every stack process."""
    names = {}
    for stack in stacks:
        processes = [(role, pid) for role, engine in (("P", stack.prefill), ("D", stack.decode)) for pid in engine.pids()]
        processes.append(("router", stack.stack.router.process.pid))
        if stack.control_plane is not None:
            processes.append(("control-plane", stack.control_plane.process.pid))
        for role, pid in processes:
            threads = thread_names(pid)
            process = threads.get(str(pid), "?")
            names.update({tid: f"{stack.mode} {role} {process} / {thread}" for tid, thread in threads.items()})
    return names


def start_offcpu(stacks: list, stack: Any, out: Path, label: str) -> tuple[list[subprocess.Popen], Path] | None:
    """Starts both recordings of one run (until stop_offcpu); None when a worker is not found."""
    workers = {role: _main_thread(engine) for role, engine in (("P", stack.prefill), ("D", stack.decode))}
    if None in workers.values():
        return None
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{label}-processes.json").write_text(json.dumps({"workers": workers, "names": _names(stacks)}, indent=1))
    only = " || ".join(f"prev_pid == {pid} || next_pid == {pid}" for pid in workers.values())
    common = ["perf", "record", "-q", "-k", "CLOCK_MONOTONIC", "-a", "-e", "sched:sched_switch"]
    recorders = [
        subprocess.Popen(common + ["--filter", only, "--call-graph", f"dwarf,{STACK_BYTES}", "-o", str(out / f"{label}-main.data")],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL),
        subprocess.Popen(common + ["-o", str(out / f"{label}-cpus.data")], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL),
    ]
    return recorders, out


def stop_offcpu(recording: tuple[list[subprocess.Popen], Path] | None) -> None:
    """Ends both recordings as Ctrl-C would (perf then writes its file); bounded."""
    if recording is None:
        return
    for recorder in recording[0]:
        recorder.send_signal(signal.SIGINT)
    for recorder in recording[0]:
        try:
            recorder.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            recorder.kill()
            recorder.wait()


# ---- reading ---------------------------------------------------------------------------------

Switch = tuple[float, int, int, str, int, str, list[str]]  # (time, cpu, prev tid, prev state, next tid, next comm, prev's stack)


def read_switches(path: Path, *, stacks: bool) -> list[Switch]:
    fields = "cpu,time,event,trace" + (",ip,sym" if stacks else "")
    text = subprocess.run(["perf", "script", "--no-inline", "-F", fields, "-i", str(path)], capture_output=True, text=True, check=True).stdout
    switches: list[Switch] = []
    frames: list[str] = []
    for line in text.splitlines():
        match = SWITCH.search(line)
        if match:
            frames = []
            switches.append((float(match[2]), int(match[1]), int(match[4]), match[5], int(match[7]), match[6].strip(), frames))
        elif stacks and switches and line.strip():
            parts = line.split(maxsplit=1)
            if len(parts) == 2:
                frames.append(parts[1])
    return switches


def wait_kind(state: str, frames: list[str]) -> str:
    """What a switched-out thread waits for, from its state and stack."""
    if state.startswith("R"):
        return "runqueue"
    stack = " ".join(frames)
    if "take_gil" in stack:
        return "gil"
    if "sched_yield" in stack:
        return "yield"
    if "zmq_poll" in stack or "poll" in stack:
        return "ipc"
    if "PyThread_acquire_lock" in stack:
        return "lock"
    return "other"


def off_cpu(switches: list[Switch], tid: int) -> list[tuple[float, float, str, int]]:
    """The thread's waits: (switched out, back in, kind, cpu)."""
    waits, out = [], None
    for time, cpu, prev, state, nxt, _, frames in switches:
        if prev == tid:
            out = (time, wait_kind(state, frames), cpu)
        elif nxt == tid and out is not None:
            waits.append((out[0], time, out[1], out[2]))
            out = None
    return waits


class CoreUse:
    """Who ran on each CPU when, from the machine-wide recording."""

    def __init__(self, switches: list[Switch]):
        self.runs: dict[int, list[tuple[float, int, str]]] = defaultdict(list)  # cpu -> (from, tid, comm)
        for time, cpu, _, _, nxt, comm, _ in switches:
            self.runs[cpu].append((time, nxt, comm))
        self.starts = {cpu: [r[0] for r in runs] for cpu, runs in self.runs.items()}

    def during(self, cpu: int, start: float, end: float) -> Counter:
        """Seconds each (tid, comm) ran on cpu within [start, end]."""
        used: Counter = Counter()
        runs, starts = self.runs.get(cpu, []), self.starts.get(cpu, [])
        i = max(bisect.bisect_right(starts, start) - 1, 0)
        while i < len(runs) and runs[i][0] < end:
            until = runs[i + 1][0] if i + 1 < len(runs) else end
            overlap = min(until, end) - max(runs[i][0], start)
            if overlap > 0:
                used[runs[i][1:]] += overlap
            i += 1
        return used


def _who(tid: int, comm: str, worker: int, names: dict[str, str]) -> str:
    if tid == 0:
        return "idle"
    name = names.get(str(tid))
    if name is None:
        return f"unknown process: {comm}"
    if tid == worker:
        return "itself"
    return name


def engine_report(switches: list[Switch], cores: CoreUse, worker: int, names: dict[str, str], window: tuple[float, float],
                  requests: int, steps: list[tuple[float, float, float]]) -> dict[str, Any]:
    """One engine's main thread in one run: off-CPU ms per request by kind, per model step, and who had its core."""
    waits = [w for w in off_cpu(switches, worker) if window[0] <= w[0] <= window[1]]
    per_request = Counter()
    who: dict[str, Counter] = {"runqueue": Counter(), "gil": Counter()}
    for start, end, kind, cpu in waits:
        per_request[kind] += end - start
        if kind in who:
            for (tid, comm), seconds in cores.during(cpu, start, end).items():
                who[kind][_who(tid, comm, worker, names)] += seconds
    report: dict[str, Any] = {
        "off_cpu_ms_per_request": {k: round(per_request[k] * 1000 / max(requests, 1), 3) for k in KINDS},
        "on_core_during_waits_ms_per_request": {
            kind: {name: round(s * 1000 / max(requests, 1), 3) for name, s in counter.most_common(8)} for kind, counter in who.items()
        },
    }
    if steps:
        starts = [w[0] for w in waits]
        in_part: dict[str, Counter] = {"to_forward": Counter(), "step": Counter()}
        preempted_by: Counter = Counter()  # who had the core while the thread was runnable within model steps
        for step_start, forward_start, step_end in steps:
            for part, (a, b) in (("to_forward", (step_start, forward_start)), ("step", (step_start, step_end))):
                i = max(bisect.bisect_right(starts, a) - 1, 0)
                while i < len(waits) and waits[i][0] < b:
                    start, end, kind, cpu = waits[i]
                    overlap = min(end, b) - max(start, a)
                    if overlap > 0:
                        in_part[part][kind] += overlap
                        if part == "step" and kind == "runqueue":
                            for (tid, comm), seconds in cores.during(cpu, max(start, a), min(end, b)).items():
                                preempted_by[_who(tid, comm, worker, names)] += seconds
                    i += 1
        report["model_steps"] = len(steps)
        report["model_step_runqueue_on_core_ms_per_step"] = {name: round(s * 1000 / len(steps), 3) for name, s in preempted_by.most_common(10)}
        report["off_cpu_ms_per_model_step"] = {
            part: {"length": round(sum((f if part == "to_forward" else e) - s for s, f, e in steps) * 1000 / len(steps), 3),
                   **{k: round(counter[k] * 1000 / len(steps), 3) for k in KINDS}}
            for part, counter in in_part.items()
        }
    return report


def run_report(results_dir: Path, run: dict[str, Any]) -> dict[str, Any] | None:
    folder = results_dir / "offcpu"
    label = run["run"]
    if not (folder / f"{label}-main.data").exists():
        return None
    described = json.loads((folder / f"{label}-processes.json").read_text())
    main = read_switches(folder / f"{label}-main.data", stacks=True)
    cores = CoreUse(read_switches(folder / f"{label}-cpus.data", stacks=False))
    window = tuple(run["monotonic_window_s"])
    timeline = results_dir / "step-timeline"
    report = {}
    for role, worker in described["workers"].items():
        steps = []
        if timeline.is_dir():
            core, worker_calls = engine_processes(timeline, run["engine_groups"][role])
            steps = forward_steps_spans(core, worker_calls, window)
        report[role] = engine_report(main, cores, worker, described["names"], window, len(run["requests"]), steps)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.offcpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("results_dir", type=Path, help="a bench.sweep --offcpu results directory")
    args = parser.parse_args(argv)
    if not (args.results_dir / "offcpu").is_dir():
        parser.error(f"{args.results_dir / 'offcpu'} does not exist: run bench.sweep with --offcpu")
    table = {}
    for path in sorted(args.results_dir.glob("*.json")):
        run = json.loads(path.read_text())
        if "monotonic_window_s" in run and (report := run_report(args.results_dir, run)) is not None:
            table[run["run"]] = report
    if not table:
        parser.error(f"no run with an off-CPU recording in {args.results_dir}")
    for role in ("P", "D"):
        print(f"\n{role}'s worker main thread off its core, ms per request (per model step: within to_forward / the whole step; "
              "length = the part's mean)")
        print(f"{'run':<44}" + "".join(f"{k:>10}" for k in KINDS) + "   per model step")
        for name, report in table.items():
            row = report[role]
            cells = "".join(f"{row['off_cpu_ms_per_request'][k]:>10.2f}" for k in KINDS)
            steps = row.get("off_cpu_ms_per_model_step")
            per_step = "" if steps is None else "   " + "  ".join(
                f"{part} {v['length']:.2f}: rq {v['runqueue']:.2f} gil {v['gil']:.3f} other {v['other'] + v['lock'] + v['ipc'] + v['yield']:.2f}"
                for part, v in steps.items())
            print(f"{name:<44}{cells}{per_step}")
        for name, report in table.items():
            for kind, who in report[role]["on_core_during_waits_ms_per_request"].items():
                listed = ", ".join(f"{k} {v:.2f}" for k, v in who.items()) or "-"
                print(f"  {name} {role} {kind} waits, on its core (ms/request): {listed}")
            if "model_step_runqueue_on_core_ms_per_step" in report[role]:
                listed = ", ".join(f"{k} {v:.3f}" for k, v in report[role]["model_step_runqueue_on_core_ms_per_step"].items()) or "-"
                print(f"  {name} {role} run-queue waits within model steps, on its core (ms/step): {listed}")
    (args.results_dir / "offcpu.json").write_text(json.dumps(table, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
