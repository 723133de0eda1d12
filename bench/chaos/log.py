# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""Timestamped progress lines of a chaos run."""

from __future__ import annotations

import threading
import time
from pathlib import Path


class Log:
    """Timestamped progress lines on stdout and in the run's chaos.log."""

    def __init__(self, path: Path | None, quiet: bool = False):
        self.started = time.monotonic()
        self.path = path
        self.quiet = quiet
        self._lock = threading.Lock()

    def __call__(self, message: str) -> None:
        line = f"[{time.monotonic() - self.started:7.1f}s] {message}"
        with self._lock:
            if not self.quiet:
                print(line, flush=True)
            if self.path is not None:
                with self.path.open("a", encoding="utf-8") as handle:
                    handle.write(line + "\n")
