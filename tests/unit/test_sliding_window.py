# SPDX-License-Identifier: Apache-2.0
"""Sliding-window groups beside full attention: only the window D's first decode step reads moves, checked by the broker."""

from __future__ import annotations

import pytest
import torch

from kvpush import errors
from kvpush.connector.handoff import SourceReady
from kvpush.connector.kv_layout import GroupSpec, LayerTensor, build_layout
from kvpush.connector.write_plans import LocalLayout, Peer, PeerRank, build_write_plans
from kvpush.dev import sample_engines as sample
from kvpush.engine.v1 import engine_pb2
from kvpush.layout.geometry import window_first_token
from kvpush.rendezvous.v1 import transfer_pb2
from tests.unit.broker_harness import D, Harness, expect
from tests.unit.write_copies import apply

BLOCK, BLOCKS, HEADS, HEAD_SIZE, WINDOW = 16, 40, 2, 8, 64
SLIDING, FULL = engine_pb2.KV_CACHE_GROUP_KIND_SLIDING_WINDOW, engine_pb2.KV_CACHE_GROUP_KIND_FULL_ATTENTION


@pytest.mark.parametrize("first, end, want", [
    (0, 199, 128),  # the first decode step computes token 199 and reads [136, 199): from block 8 on
    (0, 40, 0),  # the prompt is shorter than the window: every block
    (160, 199, 160),  # D's prefix hit already covers the window's start
    (0, 192, 128),  # [129, 192) starts in block 8
])
def test_a_sliding_window_group_starts_at_the_block_of_the_windows_first_token(first, end, want):
    assert window_first_token(first, end, BLOCK, WINDOW) == want
    assert window_first_token(first, end, BLOCK, 0) == first


def hybrid_rank(fill: bool, block: int = BLOCK):
    """Layer 0 in a sliding-window group, layer 1 in a full-attention group, as vLLM groups a Gemma-3-style model."""
    tensors = [(torch.randn if fill else torch.zeros)(BLOCKS, HEADS, block, 2 * HEAD_SIZE) for _ in range(2)]
    layers = [LayerTensor(i, f"model.layers.{i}.self_attn.attn", i, t) for i, t in enumerate(tensors)]
    groups = [GroupSpec(block, BLOCKS, SLIDING, WINDOW), GroupSpec(block, BLOCKS, FULL)]
    layout, _, _ = build_layout("CPU_ATTN", layers, groups, dtype="torch.float32", head_size=HEAD_SIZE, total_kv_heads=HEADS,
                                num_local_heads=HEADS)
    return tensors, layout


def test_only_the_window_of_the_sliding_group_moves_and_every_block_of_the_full_group():
    num_tokens = 199  # a 200-token prompt: D computes its last token
    (p_tensors, p_layout), (d_tensors, d_layout) = hybrid_rank(fill=True), hybrid_rank(fill=False)
    assert [(g.kind, g.sliding_window) for g in p_layout.groups] == [(SLIDING, WINDOW), (FULL, 0)]
    # P's sliding group gave back its blocks before the window (vLLM's null block 0 stands in the table).
    p_sliding = [0] * 8 + [20, 21, 22, 23, 24]
    p_full = list(range(1, 14))
    window = window_first_token(0, num_tokens, BLOCK, WINDOW)
    d_sliding, d_full = [30, 31, 32, 33, 34], list(range(14, 27))
    order = transfer_pb2.WriteOrder(decode_tp_ranks=[0])
    order.destination.num_tokens = num_tokens
    order.destination.blocks.add(group_index=0, block_ids=d_sliding, first_token=window)
    order.destination.blocks.add(group_index=1, block_ids=d_full)
    ready = SourceReady("r", "t", 1, "c", D, (tuple(p_sliding), tuple(p_full)), num_tokens + 1, 5.0, "", 0, 0, b"")
    local, peer_rank = LocalLayout(p_layout, 0, 1, 0), PeerRank("d0", d_layout)
    (plan,) = build_write_plans(local, ready, order, Peer("inc", {0: peer_rank}))
    assert plan.pages is None and plan.expected == 1  # two groups: byte segments, one WRITE and one notification
    page = HEADS * BLOCK * 2 * HEAD_SIZE * 4
    assert apply(plan, local, peer_rank) == (len(d_sliding) + len(d_full)) * page  # whole pages: the window's 5 blocks, all 13 of the full group
    for position in range(13):
        assert torch.equal(d_tensors[1][d_full[position]], p_tensors[1][p_full[position]])
        if position >= window // BLOCK:
            assert torch.equal(d_tensors[0][d_sliding[position - window // BLOCK]], p_tensors[0][p_sliding[position]])
    # Nothing reached P's null block's twin on D or any block D did not name.
    untouched = set(range(BLOCKS)) - set(d_sliding)
    assert not any(d_tensors[0][b].any() for b in untouched)


HP, HD = "prefill-h", "decode-h"


def hybrid_rank_request(engine_id: str, role: int):
    """A sample rank whose layer 0 is in a sliding-window group 0 and layer 1 in a full-attention group 1."""
    request = sample.rank_request(engine_id, role, block_size=BLOCK)
    layout = request.layout
    del layout.groups[:]
    layout.groups.add(group_index=0, kind=SLIDING, block_size=BLOCK, num_blocks=1000, sliding_window=WINDOW)
    layout.groups.add(group_index=1, kind=FULL, block_size=BLOCK, num_blocks=1000)
    for region in layout.regions:
        region.group_index = region.layer_index
    return request


def registration(sliding_first: int, sliding_blocks: int):
    request = sample.destination_request("t-h", decode_engine_id=HD, prefill_engine_id=HP, num_tokens=199, block_size=BLOCK)
    del request.destination.blocks[:]
    request.destination.blocks.add(group_index=0, block_ids=range(100, 100 + sliding_blocks), first_token=sliding_first)
    request.destination.blocks.add(group_index=1, block_ids=range(200, 213))
    return request


@pytest.fixture
def hybrid_harness():
    h = Harness(subscribe=False)
    for engine_id, role in ((HP, sample.PREFILL), (HD, sample.DECODE)):
        h.registrar.register(hybrid_rank_request(engine_id, role))
    return h


def test_the_broker_takes_a_sliding_group_that_starts_at_its_window(hybrid_harness):
    answer = hybrid_harness.broker.register_destination(registration(128, 5), HD)
    assert answer.state == transfer_pb2.TRANSFER_STATE_WAITING_FOR_PREFILL


@pytest.mark.parametrize("first, blocks, field, message", [
    (144, 4, "destination.blocks[0].first_token", "may start at token 128 at the latest"),  # skips a token the window reads
    (128, 6, "destination.blocks[0].block_ids", "need 5 block ids, not 6"),
])
def test_the_broker_refuses_a_sliding_group_that_misses_its_window(hybrid_harness, first, blocks, field, message):
    error = expect(errors.InvalidArgument, errors.Reason.FIELD_INVALID, field, hybrid_harness.broker.register_destination,
                   registration(first, blocks), HD)
    assert message in str(error)


def test_the_broker_refuses_a_full_attention_group_that_starts_late(hybrid_harness):
    request = registration(128, 5)
    request.destination.blocks[1].first_token = 128
    del request.destination.blocks[1].block_ids[:8]
    error = expect(errors.InvalidArgument, errors.Reason.FIELD_INVALID, "destination.blocks[1].first_token",
                   hybrid_harness.broker.register_destination, request, HD)
    assert "not a sliding-window group" in str(error)


@pytest.mark.parametrize("d_block", [BLOCK, BLOCK // 2], ids=["same blocks (pages)", "D's blocks half as large (token rows)"])
def test_layer_by_layer_parts_each_move_their_groups_share(d_block):
    """A layer-progressive part of one layer touches only that layer's group; the parts add up to the whole WRITE."""
    num_tokens = 199
    (_, p_layout), (_, d_layout) = hybrid_rank(fill=True), hybrid_rank(fill=False, block=d_block)
    window = window_first_token(0, num_tokens, d_block, WINDOW)
    d_blocks = -(-num_tokens // d_block)
    order = transfer_pb2.WriteOrder(decode_tp_ranks=[0])
    order.destination.num_tokens = num_tokens
    order.destination.blocks.add(group_index=0, block_ids=range(d_blocks - window // d_block), first_token=window)
    order.destination.blocks.add(group_index=1, block_ids=range(d_blocks))
    ready = SourceReady("r", "t", 1, "c", D, (tuple(range(13)), tuple(range(13, 26))), num_tokens + 1, 5.0, "", 0, 0, b"")
    local, peer = LocalLayout(p_layout, 0, 1, 0), Peer("inc", {0: PeerRank("d0", d_layout)})
    whole = build_write_plans(local, ready, order, peer)[0].plan.total_bytes
    parts = [build_write_plans(local, ready, order, peer, frozenset({layer}))[0].plan.total_bytes for layer in (0, 1)]
    row = HEADS * 2 * HEAD_SIZE * 4
    assert sum(parts) == whole
    if d_block == BLOCK:
        assert parts == [(13 - window // BLOCK) * BLOCK * row, 13 * BLOCK * row]  # whole pages
    else:
        assert parts == [(num_tokens - window) * row, num_tokens * row]  # the window's tokens, every token


@pytest.mark.parametrize("prompt_len, held", [(191, 1), (300, 0), (1000, 0)])
def test_p_holds_the_window_block_vllm_frees_when_its_request_finishes(prompt_len, held):
    """vLLM's own KV cache manager: with N - W on a block's last token, that block outlives the request until every rank sent."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec
    from vllm.v1.request import Request

    from kvpush.connector.config import ConnectorConfig
    from kvpush.connector.params import TransferParams
    from kvpush.connector.scheduler import PrefillScheduler, PrefillTrack

    block, window = 128, 64  # vLLM-CPU's blocks, the tiny Gemma-3-style model's window
    groups = [KVCacheGroupSpec(["model.layers.0.self_attn.attn"], SlidingWindowSpec(block_size=block, num_kv_heads=2, head_size=64,
                                                                                     dtype=torch.float32, sliding_window=window)),
              KVCacheGroupSpec(["model.layers.1.self_attn.attn"], FullAttentionSpec(block_size=block, num_kv_heads=2, head_size=64,
                                                                                     dtype=torch.float32))]
    config = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups)
    manager = KVCacheManager(config, max_model_len=2048, scheduler_block_size=block, hash_block_size=block, enable_caching=False)
    scheduler = PrefillScheduler(ConnectorConfig(engine_id="prefill-0", role="prefill", control_plane="127.0.0.1:1", token="t"), None, config)
    scheduler.kv_cache_manager = manager
    request = Request("p", list(range(1, prompt_len + 1)), SamplingParams(max_tokens=1), None)
    manager.allocate_slots(request, prompt_len)  # the prefill step, one chunk
    window_start = max(prompt_len - window, 0) // block
    source_block = manager.get_blocks("p").blocks[0][window_start]
    track = PrefillTrack(TransferParams("prefill", "t", 1, "decode-0", None, "", "c"), request)
    scheduler._hold_windows(track)
    assert len(track.window_holds) == held
    # The request finishes: vLLM gives back the blocks before the next token's window, then all of the request's.
    request.num_computed_tokens = prompt_len
    manager.remove_skipped_blocks("p", prompt_len)
    manager.free(request)
    assert source_block.ref_cnt == held  # a WRITE may still read it: not free while held
    scheduler._tracks["p"] = track
    scheduler._forget("p")  # every rank has sent
    assert source_block.ref_cnt == 0
