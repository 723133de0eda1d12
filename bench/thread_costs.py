# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""CPU per request of every thread of P's and D's engines, each named by what it runs, at this checkout or an older one.

The same measurement of two commits is what a before/after profile needs
(P and D before and after a change, showing where each saved millisecond
came from). `record` runs a checkout's own `bench.sweep` with
each run's load wrapped: every thread's CPU time in P's and D's processes
is read from /proc before and after it (exact, in clock ticks), and py-spy
records on-CPU samples of every thread meanwhile (100 Hz, the engines not
paused). py-spy's samples only name the threads: its Python thread name and
the function it started in (a transfer thread, a control loop, the span
exporter, vLLM's worker loop); the CPU is /proc's, because py-spy also
counts a thread blocked in a C-level wait (a queue's `get(timeout=...)`, an
event loop's poll) as running. Kernel thread names cannot do this for older
commits, whose threads kept their process's name. Threads py-spy never saw
run Python are native: gRPC's, NIXL's and UCX's, gloo's, ZeroMQ's.

Each run's `<run>-cpu.json` holds both: every thread's CPU and what py-spy
saw it run. `report` prints the ms of CPU per request of each category, one
column per recorded directory.

An older commit's checkout (`git worktree add DIR COMMIT`) runs with its own
packages: the editable install maps kvpush, kvpush.connector and
kvpush.services to this checkout, so `record --checkout DIR` starts the sweep
with a `sitecustomize` on PYTHONPATH that maps them to DIR, in the sweep and
in every process it starts. `--vllm-spin-ms` cuts vLLM's queue spin
through bench/engine_hooks for sweeps older than their own flag.

    python -m bench.thread_costs record --checkout /tmp/before --out runs/tc-before -- --modes kvpush --one-stack-at-a-time \\
        --input-lens 256 --qps 4 --output-lens 16 --iterations 1 --duration 40 --seed 7 --vllm-spin-ms 5
    python -m bench.thread_costs report runs/tc-before runs/tc-after --runs 'kvpush_qps4_in256*'
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

THIS_CHECKOUT = Path(__file__).resolve().parents[1]
ENGINE_HOOKS = THIS_CHECKOUT / "bench" / "engine_hooks" / "sitecustomize.py"
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
SAMPLE = re.compile(r"thread \((\d+)\): ([^;]*);(.*) (\d+)$")
CHILD = "_record_in_checkout"  # record's own child: the sweep of the checkout, with the load wrapped

# The sitecustomize a recorded checkout runs under (kept in a temp folder for the run).
MAPPING_SHIM = """\
import runpy, sys
for _name, _module in list(sys.modules.items()):
    if _name.startswith("__editable__") and isinstance(getattr(_module, "MAPPING", None), dict):
        for _package, _path in list(_module.MAPPING.items()):
            if _path.startswith({this!r}):
                _module.MAPPING[_package] = {checkout!r} + _path[len({this!r}):]
if {hooks!r}:
    runpy.run_path({hooks!r}, run_name="kvpush_engine_hooks")
"""


# ----- record -----

def thread_cpu(pids: list[int]) -> dict[str, dict[str, Any]]:
    """Thread id -> its process, kernel name and user + system CPU seconds, over the given processes.

    Not kvpush.processes.thread_cpu_seconds: that one adds threads up by kernel name, which an older commit's threads
    share, and in record's child `kvpush` is the recorded checkout's, which may not have it.
    """
    rows = {}
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue  # gone
        for tid in tids:
            try:
                comm = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
                fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            rows[tid] = {"pid": pid, "comm": comm, "cpu_s": (int(fields[11]) + int(fields[12])) / CLOCK_TICKS}
    return rows


def cpu_during(before: dict[str, dict[str, Any]], after: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each thread alive at the end with the CPU it used since `before` (all of it for a thread started meanwhile)."""
    return {tid: row | {"cpu_s": row["cpu_s"] - before.get(tid, {"cpu_s": 0.0})["cpu_s"]} for tid, row in after.items()}


def _load_this_checkouts(module: str):
    """A module of this checkout's bench by path: `bench` itself may be the recorded checkout's."""
    spec = importlib.util.spec_from_file_location(f"thread_costs_{module}", THIS_CHECKOUT / "bench" / f"{module}.py")
    loaded = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loaded)
    return loaded


def _record_in_checkout(checkout: Path, out: Path, sweep_args: list[str]) -> int:
    """Runs the checkout's bench.sweep with its run_load wrapped (this process runs under the mapping sitecustomize)."""
    pyspy = _load_this_checkouts("pyspy")
    sys.path.insert(0, str(checkout))
    os.chdir(checkout)
    import bench.sweep as sweep  # the checkout's
    try:
        import bench.sweep.runs as runs  # the sweep as a package (2026-12-01 on)
        from bench.sweep.__main__ import main
    except ImportError:  # the sweep as one module
        runs, main = sweep, sweep.main
    original = runs.run_load

    def run_load(*args, **kwargs):
        # Called from the sweep's run_point, whose locals name the stack and the run.
        caller = sys._getframe(1).f_locals
        stack, label = caller["stack"], caller["point"].run_name(caller["mode"])
        pids = {"P": stack.prefill.pids(), "D": stack.decode.pids()}

        async def measured():
            before = {role: thread_cpu(p) for role, p in pids.items()}
            profilers = pyspy.start_profilers(stack, out, label)
            started = time.monotonic()
            try:
                records, wall = await original(*args, **kwargs)
            finally:
                elapsed = time.monotonic() - started
                pyspy.stop_profilers(profilers)
                after = {role: thread_cpu(p) for role, p in pids.items()}
            document = {"requests": sum(1 for r in records if r.ok), "elapsed_s": elapsed, "pids": pids,
                        "threads": {role: cpu_during(before[role], after[role]) for role in pids},
                        "seen": {role: identities(out, label, role) for role in pids}}
            (out / f"{label}-cpu.json").write_text(json.dumps(document, indent=1))
            return records, wall

        return measured()

    runs.run_load = run_load
    return main(sweep_args)


def record(checkout: Path, out: Path, vllm_spin_ms: float | None, sweep_args: list[str]) -> int:
    """Runs the checkout's sweep in a child process under the mapping sitecustomize; returns its exit code."""
    if _load_this_checkouts("pyspy").pyspy_binary() is None:
        print("thread_costs record needs py-spy (pip install py-spy, or the [profile] extra)", file=sys.stderr)
        return 2
    if not (checkout / "bench" / "sweep").exists() and not (checkout / "bench" / "sweep.py").exists():
        print(f"thread_costs record: {checkout} has no bench.sweep (not a kvpush checkout?)", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="thread-costs-") as shim:
        hooks = str(ENGINE_HOOKS) if vllm_spin_ms is not None else ""
        Path(shim, "sitecustomize.py").write_text(MAPPING_SHIM.format(this=str(THIS_CHECKOUT), checkout=str(checkout), hooks=hooks))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (shim, os.environ.get("PYTHONPATH")) if p))
        if vllm_spin_ms is not None:
            env["KVPUSH_VLLM_SPIN_MS"] = f"{vllm_spin_ms:g}"
        command = [sys.executable, str(Path(__file__).resolve()), CHILD, str(checkout), str(out), "--", *sweep_args]
        return subprocess.run(command, env=env, check=False).returncode


# ----- report -----

def sampled_threads(raw: str) -> dict[str, tuple[str, str, int]]:
    """Thread id -> (Python thread name, the function it started in, samples) from a py-spy raw record with --threads."""
    names: dict[str, str] = {}
    starts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for line in raw.splitlines():
        match = SAMPLE.match(line)
        if match is None:
            continue
        tid, name, frames, count = match[1], match[2], match[3].split(";"), int(match[4])
        names[tid] = name
        starts[tid][_started_in(frames)] += count
    return {tid: (names[tid], starts[tid].most_common(1)[0][0], sum(starts[tid].values())) for tid in names}


def identities(folder: Path, label: str, role: str) -> dict[str, tuple[str, str, int]]:
    """What py-spy saw each thread of one engine run in one recorded run (its raw files `<label>-<role>-<pid>.txt`)."""
    seen: dict[str, tuple[str, str, int]] = {}
    for raw in sorted(folder.glob(f"{label}-{role}-*.txt")):
        seen |= sampled_threads(raw.read_text())
    return seen


def _started_in(frames: list[str]) -> str:
    """The function a thread runs: the frame after threading's Thread.run; for a main thread vLLM's worker loop if it is in
    the stack (a worker process), else its seventh frame (under the interpreter's and multiprocessing's start-up frames)."""
    for i, frame in enumerate(frames[:-1]):
        if frame.startswith("Thread.run (threading.py"):
            return re.sub(r":\d+\)$", ")", frames[i + 1])
    start = next((f for f in frames if "worker_busy_loop" in f), frames[min(len(frames), 7) - 1])
    return re.sub(r":\d+\)$", ")", start)


# A native thread by the start of its kernel name; a Python thread by the function it started in.
NATIVE = (("event_engine", "gRPC event_engine threads (native)"), ("gloo_tcp_loop", "gloo TCP loop (native)"),
          ("ZMQbg", "ZeroMQ I/O (native)"), ("VLLM::Worker", "NIXL / UCX threads in the worker (native)"))
STARTED_IN = (("TransferThread._run", "kvpush transfer thread"), ("LoopThread._run", "kvpush control loops (engine streams, calls)"),
              ("BatchProcessor.worker", "kvpush tracing (spans, their export)"), ("Spans._run", "kvpush tracing (spans, their export)"),
              ("process_input_sockets", "vLLM engine core I/O threads"), ("process_output_sockets", "vLLM engine core I/O threads"))


def category(comm: str, thread: tuple[str, str, int] | list | None) -> str:
    """What a thread is, from its kernel name and (when py-spy saw it run Python) its Python name and start."""
    if thread is None:
        return next((what for prefix, what in NATIVE if comm.startswith(prefix)), "other native threads")
    name, started_in, _ = thread
    known = next((what for function, what in STARTED_IN if function in started_in), None)
    if known is not None:
        return known
    if name != "MainThread":
        return "other Python threads"
    if "worker_busy_loop" in started_in:
        return "vLLM worker main thread"
    return "vLLM engine core main thread" if comm.startswith("VLLM::EngineCor") else "vLLM API server main thread"


def run_costs(directory: Path, pattern: str = "*") -> tuple[dict[str, collections.Counter], int]:
    """CPU seconds by category for P and D, summed over the directory's recorded runs matching pattern, and their requests."""
    costs = {"P": collections.Counter(), "D": collections.Counter()}
    requests = 0
    for cpu_file in sorted(directory.glob(f"{pattern}-cpu.json")):
        document = json.loads(cpu_file.read_text())
        requests += document["requests"]
        for role in ("P", "D"):
            seen = document["seen"][role]
            for tid, row in document["threads"][role].items():
                costs[role][category(row["comm"], seen.get(tid))] += row["cpu_s"]
    return costs, requests


def report(directories: list[Path], pattern: str) -> str:
    """One table per engine: ms of CPU per request by category, a column per directory."""
    columns = [(d, *run_costs(d, pattern)) for d in directories]
    missing = [str(d) for d, _, requests in columns if requests == 0]
    if missing:
        raise ValueError(f"no recorded run matching {pattern!r} with completed requests in {', '.join(missing)}")
    lines = []
    for role in ("P", "D"):
        total = {d: sum(costs[role].values()) for d, costs, _ in columns}
        names = sorted((c for c in set().union(*(costs[role] for _, costs, _ in columns)) if any(costs[role][c] * 1000 / n >= 0.005 for _, costs, n in columns)),
                       key=lambda c: -sum(costs[role][c] / n for _, costs, n in columns))
        lines.append(f"{role}: ms of CPU per request | " + " | ".join(f"{d.name} ({n} requests)" for d, _, n in columns))
        for name in names + ["all threads"]:
            values = [(total[d] if name == "all threads" else costs[role][name]) * 1000 / n for d, costs, n in columns]
            lines.append(f"  {name:<46}" + "".join(f"{v:10.2f}" for v in values))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == [CHILD]:
        checkout, out, rest = Path(argv[1]), Path(argv[2]), argv[argv.index("--") + 1:]
        return _record_in_checkout(checkout, out, rest)
    parser = argparse.ArgumentParser(prog="python -m bench.thread_costs", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="run a checkout's bench.sweep with every run's threads measured; sweep arguments after --")
    rec.add_argument("--checkout", type=Path, default=THIS_CHECKOUT, help="the kvpush checkout whose sweep and packages run (default: this one)")
    rec.add_argument("--out", type=Path, required=True, help="folder for each run's <run>-cpu.json and py-spy records")
    rec.add_argument("--vllm-spin-ms", type=float, default=None,
                     help="cut vLLM's queue spin in every engine through bench/engine_hooks (for sweeps without the flag)")
    rec.add_argument("sweep_args", nargs=argparse.REMAINDER, help="-- then the sweep's arguments")
    rep = sub.add_parser("report", help="ms of CPU per request by thread, side by side")
    rep.add_argument("directories", type=Path, nargs="+")
    rep.add_argument("--runs", default="*", help="which runs of each folder, a glob on the run name (default: all)")
    args = parser.parse_args(argv)
    if args.command == "record":
        sweep_args = args.sweep_args[1:] if args.sweep_args[:1] == ["--"] else args.sweep_args
        if not sweep_args:  # the sweep's defaults are its whole grid in every mode: hours, never what a profile wants
            parser.error("record needs the sweep's arguments after -- (its modes and points, e.g. -- --modes kvpush --input-lens 256 --qps 4)")
        if not any(a == "--results-dir" or a.startswith("--results-dir=") for a in sweep_args):
            sweep_args = [*sweep_args, "--results-dir", str(args.out.resolve() / "sweep")]
        return record(args.checkout.resolve(), args.out.resolve(), args.vllm_spin_ms, sweep_args)
    try:
        print(report(args.directories, args.runs))
    except ValueError as error:
        print(f"thread_costs report: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
