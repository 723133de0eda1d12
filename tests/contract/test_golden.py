# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""Wire compatibility with the v1 contract: golden bytes decode to, and encode from, their frozen field values."""

from __future__ import annotations

import importlib
import json
import pathlib

import pytest
from google.protobuf import json_format

GOLDEN_DIR = pathlib.Path(__file__).resolve().parent / "golden"
EXPECTED = json.loads((GOLDEN_DIR / "expected.json").read_text())


def differences(expected, actual, path: str = "") -> list[str]:
    """Lists where actual differs from expected, one 'path: expected X, got Y' line each."""
    if isinstance(expected, dict) and isinstance(actual, dict):
        found = []
        for key in sorted(expected.keys() | actual.keys()):
            where = f"{path}.{key}" if path else key
            if key not in actual:
                found.append(f"{where}: expected {expected[key]!r}, missing (field renumbered, retyped or renamed?)")
            elif key not in expected:
                found.append(f"{where}: unexpected {actual[key]!r}")
            else:
                found.extend(differences(expected[key], actual[key], where))
        return found
    if isinstance(expected, list) and isinstance(actual, list) and len(expected) == len(actual):
        return [line for index, (e, a) in enumerate(zip(expected, actual)) for line in differences(e, a, f"{path}[{index}]")]
    return [] if expected == actual else [f"{path}: expected {expected!r}, got {actual!r}"]


def message_class(entry: dict):
    # Importing by module checks that the message still lives in its file:
    # moving it breaks Python imports even when the wire stays the same.
    return getattr(importlib.import_module(entry["module"]), entry["message"])


def test_every_golden_file_has_expected_values():
    assert sorted(path.name for path in GOLDEN_DIR.glob("*.binpb")) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_golden_bytes_decode_to_the_expected_fields(name):
    entry = EXPECTED[name]
    message = message_class(entry).FromString((GOLDEN_DIR / name).read_bytes())
    decoded = json_format.MessageToDict(message, preserving_proto_field_name=True)
    assert differences(entry["fields"], decoded) == []


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_expected_fields_encode_to_the_golden_bytes(name):
    entry = EXPECTED[name]
    message = json_format.ParseDict(entry["fields"], message_class(entry)())
    assert message.SerializeToString(deterministic=True) == (GOLDEN_DIR / name).read_bytes()


def test_differences_reports_paths():
    assert differences({"a": {"b": [1, 2]}, "c": 1}, {"a": {"b": [1, 3]}}) == [
        "a.b[1]: expected 2, got 3",
        "c: expected 1, missing (field renumbered, retyped or renamed?)",
    ]
