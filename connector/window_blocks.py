# SPDX-License-Identifier: Apache-2.0
"""Which blocks of each KV cache group a transfer involves, sliding windows considered, for the schedulers (scheduler.py).

Decode side: the blocks D registers as a destination. Prefill side: the
window blocks P holds past vLLM's free of a finished request, and the
windows vLLM already gave back (nothing left to transfer).
"""

from __future__ import annotations

from typing import Any

from kvpush.connector.kv_layout import sliding_window_of
from kvpush.layout.geometry import window_first_token


def add_destination_blocks(destination: Any, kv_cache_groups: Any, table: Any, first_token: int, end_token: int) -> None:
    """Adds to the destination each group's blocks (block table `table`) of tokens [first_token, end_token)."""
    for group, spec_group in enumerate(kv_cache_groups):
        block_size = spec_group.kv_cache_spec.block_size
        # A sliding-window group needs only the window its first decode step reads (vLLM keeps no block before it).
        group_first = window_first_token(first_token, end_token, block_size, sliding_window_of(spec_group.kv_cache_spec))
        start = group_first // block_size
        count = -(-end_token // block_size) - start
        destination.blocks.add(group_index=group, block_ids=table[group][start : start + count],
                               first_token=group_first if group_first > first_token else 0)


def window_blocks_to_hold(kv_cache_groups: Any, kv_cache_manager: Any, request: Any) -> list:
    """The blocks of the windows D may ask for that vLLM gives back when the request finishes.

    D's first decode step computes the prompt's last token N - 1 and
    reads the window's keys from N - W on; vLLM frees a finished
    request's blocks wholly before N - W + 1 (the next token's window).
    When N - W ends a block, that block would be reused while a WRITE
    reads it: a reference keeps it until every rank has sent.
    """
    n = request.num_prompt_tokens
    blocks = None
    holds = []
    for group, spec_group in enumerate(kv_cache_groups):
        window, block_size = sliding_window_of(spec_group.kv_cache_spec), spec_group.kv_cache_spec.block_size
        first = max(n - window, 0) // block_size
        freed = max(n - window + 1, 0) // block_size
        if window and first < freed:
            blocks = blocks or kv_cache_manager.get_blocks(request.request_id).blocks
            holds += [b for b in blocks[group][first:freed] if not b.is_null]
    return holds


def windows_given_back(kv_cache_groups: Any, block_ids: tuple[list[int], ...], num_tokens: int) -> list[int]:
    """The sliding-window groups whose window vLLM already gave back (a request that went on past its prompt)."""
    gone = []
    for group, spec_group in enumerate(kv_cache_groups):
        window, block_size = sliding_window_of(spec_group.kv_cache_spec), spec_group.kv_cache_spec.block_size
        if window and 0 in block_ids[group][max(num_tokens - window, 0) // block_size : -(-(num_tokens - 1) // block_size)]:
            gone.append(group)  # vLLM's null block (id 0) stands where a block was given back
    return gone
