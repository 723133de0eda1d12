# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""The whole tree passes ruff with pyproject.toml's rules (pyflakes, import order, bugbear, pyupgrade), and the house rules ruff cannot check."""

from __future__ import annotations

import pathlib
import subprocess
import sys

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_ruff_check_is_clean():
    # The ruff wheel puts its binary beside the interpreter.
    ruff = pathlib.Path(sys.executable).with_name("ruff")
    result = subprocess.run([str(ruff), "check", "--no-cache", "."], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


# Other ways to take a percentile, each its own definition: every report and benchmark uses kvpush.report.percentiles.
OTHER_PERCENTILES = ("np.percentile(", "numpy.percentile(", "statistics.quantiles(", "np.quantile(", "def percentile(")


def test_every_percentile_comes_from_the_one_definition():
    found = []
    for path in sorted(REPO_ROOT.glob("*/**/*.py")):
        relative = path.relative_to(REPO_ROOT)
        if relative.parts[0] in ("tests", ".venv") or relative == pathlib.Path("kvpush/report/percentiles.py"):
            continue
        text = path.read_text()
        found += [f"{relative}: {pattern}" for pattern in OTHER_PERCENTILES if pattern in text]
    assert not found, f"percentiles defined apart from kvpush.report.percentiles: {found}"
