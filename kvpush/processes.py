# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""Process groups on Linux: the demo, the tests and the benchmarks stop and pin whole engines by group."""

from __future__ import annotations

import os
from pathlib import Path


def group_members(group: int) -> list[int]:
    """Live (not zombie) processes of a process group, sorted: an engine's API server, engine core and workers share one."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        # Fields after the parenthesised command name: state ppid pgrp ...
        state, _, pgrp = stat[stat.rfind(")") + 2 :].split()[:3]
        if int(pgrp) == group and state != "Z":
            members.append(int(entry))
    return sorted(members)
