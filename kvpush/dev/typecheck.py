# SPDX-License-Identifier: Apache-2.0
"""Runs mypy over kvpush/, services/ and connector/ as the one installed package `kvpush`.

`python -m mypy kvpush services connector` cannot see that services/ is kvpush.services and connector/ is
kvpush.connector (pyproject.toml's package-dir, which the editable install maps with an import hook mypy does not
follow), so every import between them would be missing. This builds that package as a tree of symlinks under
build/typecheck/, runs `mypy -p kvpush` there with pyproject.toml's [tool.mypy], and reports its errors against the
repository's own paths. Exit status: mypy's; tests/test_lint.py fails on any error.

    python -m kvpush.dev.typecheck                   # mypy's report
"""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]  # kvpush/dev/typecheck.py
TREE = REPO_ROOT / "build" / "typecheck"
# pyproject.toml's package-dir: the folders installed inside kvpush.
MAPPED = {"services": REPO_ROOT / "services", "connector": REPO_ROOT / "connector"}


def build_tree(tree: pathlib.Path = TREE) -> pathlib.Path:
    """tree/kvpush: a symlink to each entry of kvpush/, and services/ and connector/ beside them."""
    package = tree / "kvpush"
    package.mkdir(parents=True, exist_ok=True)
    for stale in package.iterdir():
        stale.unlink()
    targets = {entry.name: entry for entry in (REPO_ROOT / "kvpush").iterdir() if entry.name != "__pycache__"}
    for name, target in {**targets, **MAPPED}.items():
        (package / name).symlink_to(target)
    return tree


def repository_paths(output: str) -> str:
    """mypy's report with tree paths (kvpush/services/x.py) as the repository's (services/x.py)."""
    return re.sub(rf"^kvpush/({'|'.join(MAPPED)})/", r"\1/", output, flags=re.MULTILINE)


def run(extra: list[str] | None = None, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    tree = build_tree()
    command = [sys.executable, "-m", "mypy", "--config-file", str(REPO_ROOT / "pyproject.toml"),
               "--cache-dir", str(REPO_ROOT / ".mypy_cache"), "-p", "kvpush", *(extra or [])]
    result = subprocess.run(command, cwd=tree, capture_output=True, text=True, timeout=timeout)
    result.stdout, result.stderr = repository_paths(result.stdout), repository_paths(result.stderr)
    return result


def main() -> int:
    result = run(sys.argv[1:])
    sys.stdout.write(result.stdout)
    sys.stderr.write(result.stderr)
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
