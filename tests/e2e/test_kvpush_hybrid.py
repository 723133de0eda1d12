# SPDX-License-Identifier: Apache-2.0
"""A hybrid model (a sliding-window and a full-attention KV cache group) between real vLLM CPU engines, with any TP sizes.

The tiny Gemma-3-style model's layer 0 attends to the last 64 tokens, layer
1 to all; vLLM-CPU gives both groups 128-token blocks from one pool and
gives back the sliding group's blocks below the window. D registers, per
group, what its first decode step reads: every block of the full group,
only the window's blocks of the sliding group; P writes those, so the
sliding group's bytes stay flat as prompts grow. Outputs are compared with
a single plain engine (token ids equal, logprobs within 1e-3), in both
arrival orders. The 191-token prompt puts the window's first token on the
last slot of a block that vLLM frees when P's request finishes: P holds it
until its WRITE is done.
"""

from __future__ import annotations

import pytest

from kvpush.dev.localstack.engines import reference_run
from kvpush.dev.localstack.prompts import prompt_token_ids
from kvpush.dev.tinymodel import build_tiny_model, default_model_dir
from kvpush.dev.tinymodel.architectures import GEMMA3_SLIDING_WINDOW
from kvpush.layout.geometry import window_first_token
from tests.e2e.pd_pair import MAX_TOKENS, checked_transfers, pd_pair

pytestmark = pytest.mark.engine

PROMPT_LENGTHS = (9, 191, 300, 1000)
BLOCK_SIZE = 128  # vLLM-CPU's default, both groups
LAYER_BYTES_PER_TOKEN = 2 * 2 * 64 * 4  # planes x KV heads x head size x float32, one layer per group


@pytest.fixture(scope="module")
def hybrid_model():
    return build_tiny_model(default_model_dir("gemma3"), arch="gemma3")


@pytest.fixture(scope="module")
def reference(tmp_path_factory, hybrid_model):
    prompts = [prompt_token_ids(n, seed=n) for n in PROMPT_LENGTHS]
    return prompts, reference_run(hybrid_model, prompts, MAX_TOKENS, log_path=tmp_path_factory.mktemp("ref") / "reference.log")


def expected_bytes(prompt_len: int, whole_pages: bool) -> tuple[int, int]:
    """(full group, sliding group) bytes: tokens [0, N-1) and the window's [w, N-1), whole blocks when P and D split heads alike."""
    end = prompt_len - 1
    window = window_first_token(0, end, BLOCK_SIZE, GEMMA3_SLIDING_WINDOW)
    if whole_pages:
        blocks = -(-end // BLOCK_SIZE)
        return blocks * BLOCK_SIZE * LAYER_BYTES_PER_TOKEN, (blocks - window // BLOCK_SIZE) * BLOCK_SIZE * LAYER_BYTES_PER_TOKEN
    return end * LAYER_BYTES_PER_TOKEN, (end - window) * LAYER_BYTES_PER_TOKEN


@pytest.mark.parametrize("p_tp, d_tp, progressive", [(1, 1, "off"), (1, 2, "off"), (2, 1, "off"), (1, 2, "on")],
                         ids=["P-tp1_to_D-tp1", "P-tp1_to_D-tp2", "P-tp2_to_D-tp1", "P-tp1_to_D-tp2-layer-by-layer"])
def test_the_full_group_moves_whole_and_the_sliding_group_its_window(tmp_path, hybrid_model, reference, p_tp, d_tp, progressive):
    prompts, expected = reference
    ids = ("prefill-h", "decode-h")
    with pd_pair(tmp_path, hybrid_model, ids, ["--tensor-parallel-size", str(p_tp)], ["--tensor-parallel-size", str(d_tp)],
                 progressive_push=progressive) as (cp, prefill, decode):
        sliding_bytes = []
        for prompt, transfer in checked_transfers(cp, prefill, decode, ids, prompts, expected, both_orders_at=2):
            full, sliding = expected_bytes(len(prompt), whole_pages=p_tp == d_tp)
            assert transfer.bytes_written == full + sliding, (len(prompt), transfer.bytes_written, full, sliding)
            sliding_bytes.append(sliding)
        # The window's bytes do not grow with the prompt: at most two blocks' worth whatever its length.
        assert max(sliding_bytes) <= 2 * BLOCK_SIZE * LAYER_BYTES_PER_TOKEN


# ---- a state-space hybrid: a Mamba2 layer beside an attention layer -----------------------------------------

STATE_PROMPTS = (9, 300, 1000)
STATE_BYTES = (3 * 512 + 8 * 32 * 64) * 4  # conv (kernel - 1, conv dim) and SSM (heads, head dim, state) float32, over all TP ranks


@pytest.fixture(scope="module")
def mamba_model():
    return build_tiny_model(default_model_dir("nemotron_h"), arch="nemotron_h")


@pytest.fixture(scope="module")
def mamba_reference(tmp_path_factory, mamba_model):
    prompts = [prompt_token_ids(n, seed=n) for n in STATE_PROMPTS]
    return prompts, reference_run(mamba_model, prompts, MAX_TOKENS, log_path=tmp_path_factory.mktemp("ref") / "reference.log")


@pytest.mark.parametrize("p_tp, d_tp, progressive", [(1, 1, "off"), (2, 2, "off"), (1, 2, "off"), (2, 1, "off"), (2, 1, "on")],
                         ids=["P-tp1_to_D-tp1", "P-tp2_to_D-tp2", "P-tp1_to_D-tp2", "P-tp2_to_D-tp1", "P-tp2_to_D-tp1-layer-by-layer"])
def test_the_mamba_state_after_all_but_the_last_token_moves_with_the_attention_blocks(tmp_path, mamba_model, mamba_reference, p_tp, d_tp,
                                                                                       progressive):
    """P stops one token short (a state cannot be stepped back) and writes its state and the attention KV; D computes the last token.

    Between TP sizes the states are cut the way vLLM cuts them (the conv
    state's x, B and C channels and the SSM heads), so every decode rank gets
    its share from the prefill ranks that hold it.
    """
    prompts, expected = mamba_reference
    ids = ("prefill-m", "decode-m")
    with pd_pair(tmp_path, mamba_model, ids, ["--tensor-parallel-size", str(p_tp)], ["--tensor-parallel-size", str(d_tp)],
                 progressive_push=progressive) as (control_plane, prefill, decode):
        for prompt, transfer in checked_transfers(control_plane, prefill, decode, ids, prompts, expected, both_orders_at=1):
            # The attention layer's first N - 1 tokens (whole blocks where both sides split heads alike), and all of the state.
            tokens = -(-(len(prompt) - 1) // BLOCK_SIZE) * BLOCK_SIZE if p_tp == d_tp else len(prompt) - 1
            assert transfer.bytes_written == tokens * LAYER_BYTES_PER_TOKEN + STATE_BYTES, (len(prompt), transfer.bytes_written)
