# SPDX-License-Identifier: Apache-2.0
"""Fixtures shared by the engine tests."""

from __future__ import annotations

import pytest

from kvpush.dev.tinymodel import build_tiny_model, default_model_dir


@pytest.fixture(scope="session")
def model_dir():
    """The deterministic tiny model, built once (skipped when already current)."""
    return build_tiny_model(default_model_dir())
