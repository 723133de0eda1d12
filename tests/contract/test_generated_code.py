# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""The checked-in generated code is exactly what kvpush.codegen makes from protos/ now."""

from __future__ import annotations

import pathlib

from kvpush import codegen


def test_generated_code_is_fresh(tmp_path):
    generated = {path.relative_to(tmp_path): path.read_bytes() for path in codegen.generate(tmp_path)}
    assert generated, "codegen produced nothing"
    stale = [str(rel) for rel, content in generated.items() if not (codegen.REPO_ROOT / rel).is_file() or (codegen.REPO_ROOT / rel).read_bytes() != content]
    assert stale == [], f"regenerate with `python -m kvpush.codegen`: out of date: {stale}"


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
