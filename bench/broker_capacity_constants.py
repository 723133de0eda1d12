# SPDX-License-Identifier: Apache-2.0
"""What the broker benchmark's modules share: a rendezvous's size and transfer timeout, the timeouts, the server's CPU under --pin."""

from __future__ import annotations

CALL_TIMEOUT_S = 5.0
START_TIMEOUT_S = 20.0  # for the order streams to open
SERVER_CPU = 0  # --pin: the control plane's CPU
BARRIER_TIMEOUT_S = 120.0  # one phase with its drain, or the load processes' start
TOKENS = 256
TRANSFER_TIMEOUT_S = 300.0  # by default no attempt expires while the benchmark runs
