# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""Deterministic prompts of token ids for the tiny model (no tokenizer round trip)."""

from __future__ import annotations

import random
from collections.abc import Sequence

# Token ids below this are the tokenizer's special tokens (see kvpush.dev.tinymodel).
FIRST_ORDINARY_TOKEN = 3


def prompt_token_ids(num_tokens: int, seed: int, vocab_size: int = 4096) -> list[int]:
    """A deterministic prompt of `num_tokens` ordinary (non-special) token ids."""
    rng = random.Random(seed)
    return [rng.randrange(FIRST_ORDINARY_TOKEN, vocab_size) for _ in range(num_tokens)]


def control_prompt(prompt: Sequence[int], seed: int = 1_000_003, vocab_size: int = 4096) -> list[int]:
    """`prompt` with its first half replaced by other tokens (to check outputs depend on it)."""
    half = len(prompt) // 2
    rng = random.Random(seed)
    head = [rng.randrange(FIRST_ORDINARY_TOKEN, vocab_size) for _ in range(half)]
    return head + list(prompt[half:])
