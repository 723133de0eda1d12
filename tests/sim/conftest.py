# SPDX-License-Identifier: Apache-2.0
"""The simulation tests run thousands of schedules; the cores' refusal logs would drown them."""

import logging

import pytest


@pytest.fixture(autouse=True)
def quiet_cores():
    """The cores log every refusal they make; a simulation makes thousands."""
    logging.disable(logging.CRITICAL)
    yield
    logging.disable(logging.NOTSET)
