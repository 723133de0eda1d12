# SPDX-License-Identifier: Apache-2.0
"""Blocks that vLLM splits into smaller attention-kernel blocks, on either side or both.

A hybrid's logical block is sized to its state pages and can be larger than
the attention kernel takes; vLLM then hands the connector each layer in
kernel blocks (block b is kernel blocks b * ratio .. b * ratio + ratio - 1).
The tensors here are vLLM's own views (`create_kv_cache_views`) over one
backing buffer, with and without a kernel block size; block ids stay the
scheduler's. Every token of every head must land where D's kernel reads it.
"""

from __future__ import annotations

import pytest
import torch
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheTensor, create_kv_cache_views
from vllm.v1.kv_cache_layout import KVCacheLayout

from kvpush.connector.handoff import SourceReady
from kvpush.connector.kv_layout import GroupSpec, LayerTensor, build_layout
from kvpush.connector.write_plans import LocalLayout, Peer, PeerRank, build_write_plans, page_table_of
from kvpush.layout import heads
from kvpush.rendezvous.v1 import transfer_pb2
from tests.unit.write_copies import apply

BLOCK, BLOCKS, HEADS, HEAD_SIZE, LAYERS = 64, 6, 2, 8, 2
SPEC = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_SIZE, dtype=torch.float32)


def rank(kernel: int | None, tp_rank: int = 0, tp_size: int = 1, fill: bool = False):
    """vLLM's per-layer views of one rank's cache (in kernel blocks when `kernel` is given) and kvpush's layout of them."""
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS // tp_size, head_size=HEAD_SIZE, dtype=torch.float32)
    page = spec.page_size_bytes
    tensor = KVCacheTensor(size=page * BLOCKS * LAYERS, layers=[f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)],
                           layer_stride=page * BLOCKS, block_stride=page)
    raw = torch.randint(-128, 127, (tensor.size,), dtype=torch.int8) if fill else torch.zeros(tensor.size, dtype=torch.int8)
    views = create_kv_cache_views(raw, spec, BLOCKS, KVCacheLayout.LBHNC, tensor, kernel_block_size=kernel)
    layers = [LayerTensor(i, name, 0, view) for i, (name, view) in enumerate(zip(tensor.layers, views))]
    layout, _, _ = build_layout("FLASH_ATTN", layers, [GroupSpec(BLOCK, BLOCKS)], dtype="torch.float32", head_size=HEAD_SIZE,
                                total_kv_heads=HEADS, num_local_heads=HEADS // tp_size, tp_rank=tp_rank, tp_size=tp_size)
    return raw, views, layout


def token(view: torch.Tensor, block: int, t: int, head: int) -> torch.Tensor:
    """Token t of a block, one head's keys and values, where the kernel reads them."""
    kernel = view.shape[2]
    ratio = view.shape[0] // BLOCKS
    return view[block * ratio + t // kernel, head, t % kernel].view(torch.int32)  # bits: random bytes make NaNs


@pytest.mark.parametrize("p_kernel, d_kernel", [(16, None), (None, 16), (16, 32), (16, 16)])
@pytest.mark.parametrize("pages", [False, True], ids=["segments", "pages"])
def test_every_token_lands_where_the_decode_kernel_reads_it(p_kernel, d_kernel, pages):
    (_, p_views, p_layout), (d_raw, d_views, d_layout) = rank(p_kernel, fill=True), rank(d_kernel)
    assert p_layout.groups[0].kernel_block_size == (p_kernel or 0)
    num_tokens, src_ids, dst_ids = 2 * BLOCK + 22, (3, 0, 5), (1, 4, 2)
    order = transfer_pb2.WriteOrder(decode_tp_ranks=[0])
    order.destination.num_tokens = num_tokens
    order.destination.blocks.add(group_index=0, block_ids=dst_ids)
    ready = SourceReady("r", "t", 1, "c", "decode-0", (src_ids,), num_tokens + 1, 5.0, "", 0, 0, b"")
    local = LocalLayout(p_layout, 0, 1, 0)
    peer_rank = PeerRank("d0", d_layout, page_table_of(d_layout))
    if pages:
        peer_rank.prepared = object()  # NIXL's prepared list stands here: apply() addresses the page tables directly
    (plan,) = build_write_plans(local, ready, order, Peer("inc", {0: peer_rank}))
    assert (plan.pages is not None) == (pages and p_kernel == d_kernel)  # whole pages only where both split blocks alike
    apply(plan, local, peer_rank)
    for layer in range(LAYERS):
        for t in range(num_tokens):
            for head in range(HEADS):
                src = token(p_views[layer], src_ids[t // BLOCK], t % BLOCK, head)
                assert torch.equal(token(d_views[layer], dst_ids[t // BLOCK], t % BLOCK, head), src), (layer, t, head)
    untouched = [b for b in range(BLOCKS) if b not in dst_ids]
    assert not any(token(d_views[layer], b, t, h).any() for layer in range(LAYERS) for b in untouched for t in range(BLOCK) for h in range(HEADS))
    assert d_raw.any()


def test_kernel_blocks_between_tp_sizes_carry_each_decode_rank_its_heads():
    (_, p_views, p_layout) = rank(16, fill=True)
    decode = [rank(32, tp_rank=r, tp_size=2) for r in range(2)]
    num_tokens, src_ids, dst_ids = BLOCK + 5, (2, 4), (0, 3)
    local = LocalLayout(p_layout, 0, 1, 0)
    peer = Peer("inc", {r: PeerRank(f"d{r}", layout) for r, (_, _, layout) in enumerate(decode)})
    order = transfer_pb2.WriteOrder(decode_tp_ranks=heads.consumers_of(0, heads.routes(heads.even_split(HEADS, 1), heads.even_split(HEADS, 2))))
    order.destination.num_tokens = num_tokens
    order.destination.blocks.add(group_index=0, block_ids=dst_ids)
    ready = SourceReady("r", "t", 1, "c", "decode-0", (src_ids,), num_tokens + 1, 5.0, "", 0, 0, b"")
    for plan in build_write_plans(local, ready, order, peer):
        apply(plan, local, peer.ranks[plan.d_rank])
    for d_rank, (_, d_views, _) in enumerate(decode):
        for layer in range(LAYERS):
            for t in range(num_tokens):
                src = token(p_views[layer], src_ids[t // BLOCK], t % BLOCK, d_rank)
                assert torch.equal(token(d_views[layer], dst_ids[t // BLOCK], t % BLOCK, 0), src), (d_rank, layer, t)


def test_tensors_that_do_not_split_blocks_evenly_are_refused_naming_their_shapes():
    _, views, _ = rank(16)
    with pytest.raises(ValueError, match=r"do not split the group's 5 blocks of 64 tokens"):
        build_layout("FLASH_ATTN", [LayerTensor(0, "l0", 0, views[0])], [GroupSpec(BLOCK, BLOCKS - 1)], dtype="torch.float32",
                     head_size=HEAD_SIZE, total_kv_heads=HEADS, num_local_heads=HEADS)
