# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""The proto contract under buf: format, lint (STANDARD) and breaking changes (FILE) against v1 and git."""

from __future__ import annotations

import io
import os
import pathlib
import shutil
import subprocess
import sys
import tarfile

import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
BASELINE_IMAGE = pathlib.Path(__file__).resolve().parent / "baseline.binpb"
BREAKING_AGAINST_ENV = "KVPUSH_BREAKING_AGAINST"


def buf_binary() -> str:
    # The buf-bin wheel puts buf beside the interpreter; PATH may not name that venv.
    beside_python = pathlib.Path(sys.executable).with_name("buf")
    if beside_python.exists():
        return str(beside_python)
    found = shutil.which("buf")
    if found is None:
        pytest.fail("buf not found: install the dev extra (pip install -e '.[dev]')")
    return found


def buf(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([buf_binary(), *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)


def assert_clean(result: subprocess.CompletedProcess[str]) -> None:
    assert result.returncode == 0, f"{' '.join(result.args[1:])} failed:\n{result.stdout}{result.stderr}"


def test_protos_are_formatted():
    assert_clean(buf("format", "-d", "--exit-code"))


def test_protos_pass_lint():
    assert_clean(buf("lint"))


def test_no_breaking_change_against_the_v1_baseline():
    assert_clean(buf("breaking", "--against", str(BASELINE_IMAGE)))


@pytest.mark.skipif(not os.environ.get(BREAKING_AGAINST_ENV), reason=f"{BREAKING_AGAINST_ENV} names no git ref")
def test_no_breaking_change_against_git_ref(tmp_path):
    ref = os.environ[BREAKING_AGAINST_ENV]
    archive = subprocess.run(["git", "archive", "--format=tar", ref, "buf.yaml", "protos"], cwd=REPO_ROOT, capture_output=True, timeout=60)
    assert archive.returncode == 0, f"git archive {ref} failed: {archive.stderr.decode()}"
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(tmp_path, filter="data")
    assert_clean(buf("breaking", "--against", str(tmp_path)))


def test_breaking_check_catches_a_breaking_change(tmp_path):
    # Guards the guard: a renumbered field must fail against the baseline.
    shutil.copy(REPO_ROOT / "buf.yaml", tmp_path / "buf.yaml")
    shutil.copytree(REPO_ROOT / "protos", tmp_path / "protos")
    transfer_proto = tmp_path / "protos/kvpush/rendezvous/v1/transfer.proto"
    text = transfer_proto.read_text()
    assert "uint32 attempt = 2;" in text
    transfer_proto.write_text(text.replace("uint32 attempt = 2;", "uint32 attempt = 20;", 1))
    result = subprocess.run([buf_binary(), "breaking", str(tmp_path), "--against", str(BASELINE_IMAGE)], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "TransferKey" in result.stdout + result.stderr
