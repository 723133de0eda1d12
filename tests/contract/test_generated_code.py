# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""The checked-in generated code is exactly what kvpush.dev.codegen makes from protos/ now."""

from __future__ import annotations

import pathlib
import subprocess
import sys

from kvpush.dev import codegen


def test_generated_code_is_fresh(tmp_path):
    # protoc runs in its own process: in-process it can crash once grpc and torch are loaded.
    run = subprocess.run([sys.executable, "-m", "kvpush.dev.codegen", "--out", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    generated = {pathlib.Path(line): (tmp_path / line).read_bytes() for line in run.stdout.split()}
    assert generated, "codegen produced nothing"
    stale = [str(rel) for rel, content in generated.items() if not (codegen.REPO_ROOT / rel).is_file() or (codegen.REPO_ROOT / rel).read_bytes() != content]
    assert stale == [], f"regenerate with `python -m kvpush.dev.codegen`: out of date: {stale}"


def test_no_generated_file_without_a_proto():
    expected = {
        pathlib.Path(str(proto.relative_to(codegen.PROTO_ROOT).with_suffix("")) + suffix)
        for proto in codegen.proto_files()
        for suffix in codegen.GENERATED_SUFFIXES
    }
    checked_in = {
        path.relative_to(codegen.REPO_ROOT)
        for suffix in codegen.GENERATED_SUFFIXES
        for path in (codegen.REPO_ROOT / "kvpush").rglob(f"*{suffix}")
    }
    assert checked_in - expected == set(), "generated files whose proto is gone; delete them"
