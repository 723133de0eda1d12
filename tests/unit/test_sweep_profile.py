# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""bench.sweep --profile: real py-spy recordings of a stand-in engine's processes, written when the run ends."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from bench.pyspy import start_profilers, stop_profilers

SPY = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
pytestmark = pytest.mark.skipif(not Path(SPY).exists(), reason="py-spy is installed by the [profile] extra")


@dataclass
class Engine:
    processes: list[int]

    def pids(self) -> list[int]:
        return self.processes


@dataclass
class Stack:
    prefill: Engine
    decode: Engine


def test_every_process_is_recorded_with_its_thread_names(tmp_path):
    busy = "import time\ndef spin_here():\n    while True: sum(range(1000))\nspin_here()"
    engines = [subprocess.Popen([sys.executable, "-c", busy]) for _ in range(2)]
    try:
        profilers = start_profilers(Stack(Engine([engines[0].pid]), Engine([engines[1].pid])), tmp_path, "run1")
        time.sleep(1.5)
        stop_profilers(profilers)
    finally:
        for engine in engines:
            engine.kill()
            engine.wait()
    assert all(p.returncode is not None for p in profilers)
    for role, engine in zip("PD", engines):
        raw = (tmp_path / f"run1-{role}-{engine.pid}.txt").read_text()
        assert "spin_here" in raw  # on-CPU samples of the busy frame
        samples = sum(int(line.rpartition(" ")[2]) for line in raw.splitlines() if line)
        assert samples >= 20  # ~100 Hz over well over 0.2 s
    names = json.loads((tmp_path / "run1-threads.json").read_text())
    assert set(names) == {"P", "D"}
    for role, engine in zip("PD", engines):
        assert names[role][str(engine.pid)][str(engine.pid)].startswith("python")  # the main thread's kernel name
    assert str(os.getpid()) not in names["D"]
