# SPDX-License-Identifier: Apache-2.0
"""What the scheduler hands a worker's transfer thread about one request (no vLLM imports: the simulation uses these too)."""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

assert array("I").itemsize == 4, "a token id is packed as a uint32"

Key = tuple[str, int]  # a transfer attempt: (transfer_id, attempt)


def packed_prompt(token_ids: Sequence[int]) -> bytes:
    """The prompt's token ids as little-endian uint32s: any prefix's digest can be taken from it."""
    packed = array("I", token_ids)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def prompt_digest(packed: bytes, num_tokens: int) -> bytes:
    """Destination.prompt_digest of the first num_tokens tokens of a packed prompt (BLAKE2b-128)."""
    return hashlib.blake2b(memoryview(packed)[: 4 * num_tokens], digest_size=16).digest()


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
    # The prompt (packed_prompt): an order is written only if its destination's
    # prompt_digest matches (empty: a prompt given as embeddings, not checked).
    prompt: bytes = b""


@dataclass(frozen=True)
class DestinationReady:
    """D: a request waits for KV of this transfer attempt, for tokens [first_token, first_token + num_tokens)."""

    req_id: str
    transfer_id: str
    attempt: int
    first_token: int
    num_tokens: int
    alloc_ns: int  # when its blocks were allocated (wall clock)
    traceparent: str
