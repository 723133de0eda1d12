# SPDX-License-Identifier: Apache-2.0
"""What the scheduler hands a worker's transfer thread about one request (no vLLM imports: the simulation uses these too)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SourceReady:
    """P: a request's KV is complete once this step's forward has run."""

    req_id: str
    transfer_id: str
    attempt: int
    client_request_id: str
    decode_engine_id: str
    blocks: tuple[tuple[int, ...], ...]  # per KV cache group, from token 0
    num_tokens: int
    hold_s: float  # how long the source may be held waiting for the decode side
    traceparent: str
    arrival_ns: int  # request arrival (wall clock), for the queue span
    scheduled_ns: int  # first scheduled (wall clock), for the prefill span


@dataclass(frozen=True)
class RecvExpected:
    """D: a request waits for KV of this transfer attempt, for tokens [first_token, first_token + num_tokens)."""

    req_id: str
    transfer_id: str
    attempt: int
    first_token: int
    num_tokens: int
    alloc_ns: int  # when its blocks were allocated (wall clock)
    traceparent: str
