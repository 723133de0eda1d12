# SPDX-License-Identifier: Apache-2.0
"""The simulated deployment's fixed shape: its two engines, the model's block size and layers (and their pipeline stages), the prompts clients send, no tracing."""

from __future__ import annotations

from kvpush.connector.handoff import packed_prompt
from kvpush.connector.segment_recorder import SegmentRecorder

P_ENGINE, D_ENGINE = "prefill-0", "decode-0"
BLOCK_SIZE = 16
# Layers of the simulated model: a layer-progressive prefill engine posts them in parts.
LAYERS = frozenset(range(3))


# A hybrid model's sliding-window group (group 1): layer 0 attends to the last WINDOW tokens, a query's own
# included; the other layers are full attention (group 0). 26 puts a 40-token prompt's window start on a
# block's last token, where an off-by-one in the window's start shows.
WINDOW = 26
SLIDING_LAYERS = frozenset({0})


def groups_of(hybrid: bool) -> list[tuple[int, frozenset[int], int]]:
    """(group index, its layers, its sliding window or 0) of the simulated model."""
    if not hybrid:
        return [(0, LAYERS, 0)]
    return [(0, LAYERS - SLIDING_LAYERS, 0), (1, SLIDING_LAYERS, WINDOW)]


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
    """Spans that record no span; the segments for metrics are recorded, as in an engine."""

    enabled = False

    def __init__(self) -> None:
        self.segments = SegmentRecorder()

    def emit(self, *args, **kwargs) -> None:
        pass
