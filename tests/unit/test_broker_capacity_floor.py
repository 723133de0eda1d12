# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""bench/broker_capacity.py's transport floor: a bare grpc.aio server answers and streams every message, and its CPU is counted per message."""

from __future__ import annotations

import pytest

from bench.broker_capacity_ceilings import transport_floor


def test_the_bare_server_answers_every_message_and_its_cpu_is_counted():
    figures = transport_floor(2_000, pin=False)  # raises unless every message was answered and streamed
    for name in ("answered_message_us_1_in_flight", "answered_message_us_16_in_flight", "streamed_message_us"):
        assert 0 < figures[name] < 100_000, (name, figures)
    best = min(figures["answered_message_us_1_in_flight"], figures["answered_message_us_16_in_flight"])
    assert figures["rendezvous_us"] == 2 * best + figures["streamed_message_us"]
    assert figures["rendezvous_per_s"] * figures["rendezvous_us"] == pytest.approx(1e6)
