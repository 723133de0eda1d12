# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""A serving process's garbage collector: its start frozen, full collections 10x rarer (in a child process, not pytest's)."""

from __future__ import annotations

import json
import subprocess
import sys

from kvpush.services.common.server import FULL_COLLECTION_EVERY

PROBE = """
import gc, json
from kvpush.services.common.server import settle_garbage_collector
before = {"threshold": gc.get_threshold(), "frozen": gc.get_freeze_count()}
settle_garbage_collector()
print(json.dumps({"before": before, "after": {"threshold": gc.get_threshold(), "frozen": gc.get_freeze_count()}}))
"""


def test_a_serving_process_freezes_its_start_and_collects_everything_less_often():
    probe = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60, check=True)
    result = json.loads(probe.stdout.strip().splitlines()[-1])
    young, middle, full = result["before"]["threshold"]
    assert result["before"]["frozen"] == 0
    assert result["after"]["threshold"] == [young, middle, FULL_COLLECTION_EVERY] and FULL_COLLECTION_EVERY > full
    assert result["after"]["frozen"] > 1000  # the imports (grpc, protobuf, OpenTelemetry) are out of every later walk
