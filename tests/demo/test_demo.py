# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""`kvpush demo` end to end on this machine: its printout, its report folder, and that it stops everything it started."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvpush.processes import group_members
from kvpush.report.breakdown import SEGMENTS

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parents[2]
DEMO_TIMEOUT_S = 400


def gone(pid: int) -> bool:
    """True when no live process of the group `pid` led is left."""
    return not group_members(pid)


def stopped_pids(output: str) -> dict[str, int]:
    return {name: int(pid) for name, pid in re.findall(r"stopping ([\w-]+) \(pid (\d+)\)", output)}


def test_demo_runs_the_stack_reports_and_cleans_up(tmp_path):
    run_dir = tmp_path / "demo"
    result = subprocess.run([sys.executable, "-m", "kvpush.cli", "demo", "--run-dir", str(run_dir), "--max-tokens", "8"], cwd=ROOT,
                            capture_output=True, text=True, timeout=DEMO_TIMEOUT_S, start_new_session=True)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    for segment in SEGMENTS:
        assert segment.label in out
    assert "TTFT" in out and "hand-off overhead" in out
    for name in ("traces.jsonl", "report.html", "breakdown.png", "requests.json", "outputs.json", "summary.txt"):
        assert (run_dir / name).stat().st_size > 0, name
    for name in ("control-plane", "prefill", "decode", "router"):
        assert (run_dir / "logs" / f"{name}.log").exists(), name
    assert (run_dir / "breakdown.png").read_bytes()[:4] == b"\x89PNG"
    answers = {a["request_id"]: a for a in json.loads((run_dir / "outputs.json").read_text())}
    assert all(a["status"] == 200 and a["text"] for a in answers.values())
    # The same prompt gives the same greedy output alone, again, in a concurrent batch and streamed live.
    assert len({answers[r]["text"] for r in ("demo-seq-0-2", "demo-seq-1-2", "demo-batch-2", "demo-live")}) == 1
    requests = json.loads((run_dir / "requests.json").read_text())
    assert len(requests) == len(answers)
    streamed = [r for r in requests if r["ttft_ms"] is not None]
    assert len(streamed) == sum(a["ttft_ms"] is not None for a in answers.values())
    assert all(sum(r["segments"].values()) == pytest.approx(r["ttft_ms"]) for r in streamed)
    pids = stopped_pids(out)
    assert set(pids) == {"control-plane", "prefill", "decode", "router"}
    assert all(gone(pid) for pid in pids.values())


def test_demo_interrupted_while_engines_start_stops_everything(tmp_path):
    run_dir = tmp_path / "demo"
    demo = subprocess.Popen([sys.executable, "-m", "kvpush.cli", "demo", "--run-dir", str(run_dir)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        lines = []
        while time.monotonic() < deadline:
            line = demo.stdout.readline()
            lines.append(line)
            if "starting the prefill engine" in line:
                break
        else:
            pytest.fail("the demo never started its engines:\n" + "".join(lines))
        time.sleep(3)  # the engines are loading
        demo.send_signal(signal.SIGINT)
        rest, _ = demo.communicate(timeout=90)
    finally:
        if demo.poll() is None:
            os.killpg(demo.pid, signal.SIGKILL)
            demo.wait()
    output = "".join(lines) + rest
    assert demo.returncode == 130, output
    pids = stopped_pids(output)
    assert {"control-plane", "prefill", "decode"} <= set(pids), output
    assert all(gone(pid) for pid in pids.values())
