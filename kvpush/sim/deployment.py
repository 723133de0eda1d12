# SPDX-License-Identifier: Apache-2.0
"""The simulated deployment's fixed shape: its two engines, the model's block size and layers (and their pipeline stages), the prompts clients send, no tracing."""

from __future__ import annotations

from kvpush.connector.handoff import packed_prompt

P_ENGINE, D_ENGINE = "prefill-0", "decode-0"
BLOCK_SIZE = 16
# Layers of the simulated model: a layer-progressive prefill engine posts them in parts.
LAYERS = frozenset(range(3))


def stage_layers(pp_rank: int, pp_size: int) -> frozenset[int]:
    """The layers a pipeline stage of the prefill engine holds: a contiguous share, as vLLM splits them."""
    n = len(LAYERS)
    return frozenset(range(pp_rank * n // pp_size, (pp_rank + 1) * n // pp_size))


def prompt_of(prompt_id: int, num_tokens: int) -> bytes:
    """A client request's prompt (packed): its first token names it, so two requests' prompts differ in every prefix."""
    return packed_prompt([prompt_id, *range(1, num_tokens)])


def prompt_id_of(packed: bytes) -> int:
    return int.from_bytes(packed[:4], "little")


class NoSpans:
    enabled = False

    def emit(self, *args, **kwargs) -> None:
        pass
