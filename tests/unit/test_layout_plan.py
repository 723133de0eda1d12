# SPDX-License-Identifier: Apache-2.0
"""Transfer plans move exactly the right bytes, across block sizes, TP splits and layouts."""

from __future__ import annotations

import numpy as np
import pytest

from kvpush.engine.v1 import engine_pb2
from kvpush.layout import heads as heads_mod
from kvpush.layout.geometry import Plane, describe_layer
from kvpush.layout.plan import Side, build_plan, merge, unmerged_plan

ELEMENT = 2  # bytes per element
HEAD_SIZE = 4  # elements per (token, head)
ROW = ELEMENT * HEAD_SIZE


def make_planes(kind: str, layers: int, num_blocks: int, block_size: int, local_heads: int) -> tuple[list[Plane], int]:
    """Planes laid out in one buffer starting at offset 0; returns (planes, buffer size)."""
    page = local_heads * block_size * 2 * ROW  # one block of one layer, K and V
    layer_bytes = num_blocks * page
    planes = []
    for layer in range(layers):
        base = layer * layer_bytes
        if kind == "cpu":  # per (block, head): keys channel-major [C, N], then values [N, C]
            bs, hs = page, 2 * block_size * ROW
            planes.append(Plane(layer, engine_pb2.KV_PLANE_KEY, base, bs, hs, ELEMENT, block_size * ELEMENT))
            planes.append(Plane(layer, engine_pb2.KV_PLANE_VALUE, base + block_size * ROW, bs, hs, ROW, ELEMENT))
        elif kind == "nhd":  # [B, N, H, K|V]
            bs, ts, hs = page, local_heads * 2 * ROW, 2 * ROW
            planes.append(Plane(layer, engine_pb2.KV_PLANE_KEY, base, bs, hs, ts, ELEMENT))
            planes.append(Plane(layer, engine_pb2.KV_PLANE_VALUE, base + ROW, bs, hs, ts, ELEMENT))
        elif kind == "hnd":  # [B, H, N, K|V]
            bs, hs, ts = page, block_size * 2 * ROW, 2 * ROW
            planes.append(Plane(layer, engine_pb2.KV_PLANE_KEY, base, bs, hs, ts, ELEMENT))
            planes.append(Plane(layer, engine_pb2.KV_PLANE_VALUE, base + ROW, bs, hs, ts, ELEMENT))
        elif kind == "block_major":  # [B, L, H, N, K|V]: every layer's page of a block side by side
            base, bs, hs, ts = layer * page, layers * page, block_size * 2 * ROW, 2 * ROW
            planes.append(Plane(layer, engine_pb2.KV_PLANE_KEY, base, bs, hs, ts, ELEMENT))
            planes.append(Plane(layer, engine_pb2.KV_PLANE_VALUE, base + ROW, bs, hs, ts, ELEMENT))
    return planes, layers * layer_bytes


def cell(plane: Plane, blocks: np.ndarray, block_size: int, first_token: int, first_head: int, token: int, head: int, channel: int) -> int:
    b = blocks[(token - first_token) // block_size]
    return plane.address(int(b), head - first_head, token % block_size, channel)


@pytest.mark.parametrize("src_kind,dst_kind", [("cpu", "cpu"), ("nhd", "nhd"), ("hnd", "hnd"), ("nhd", "hnd"), ("block_major", "block_major"), ("block_major", "hnd")])
@pytest.mark.parametrize("src_bs,dst_bs", [(32, 32), (32, 64), (64, 32)])
@pytest.mark.parametrize("src_tp,dst_tp", [(1, 1), (1, 2), (2, 1)])
def test_plan_moves_exactly_the_routed_cells(src_kind, dst_kind, src_bs, dst_bs, src_tp, dst_tp):
    rng = np.random.default_rng(7)
    layers, total_heads, num_tokens = 2, 4, 110
    first_token = dst_bs  # the decode side already holds its first block locally
    src_ranks, dst_ranks = heads_mod.even_split(total_heads, src_tp), heads_mod.even_split(total_heads, dst_tp)
    moved = {d.tp_rank: set() for d in dst_ranks}
    dst_bufs = {}
    for route in heads_mod.routes(src_ranks, dst_ranks):
        p, d = src_ranks[route.producer], dst_ranks[route.consumer]
        sp, ssize = make_planes(src_kind, layers, 20, src_bs, p.num_heads)
        dp, dsize = make_planes(dst_kind, layers, 20, dst_bs, d.num_heads)
        src_buf = rng.integers(0, 255, ssize, dtype=np.uint8)
        dst_buf = dst_bufs.setdefault(d.tp_rank, np.zeros(dsize, dtype=np.uint8))
        sblocks = rng.permutation(20)[: -(-num_tokens // src_bs)]
        dblocks = rng.permutation(20)[: -(-(num_tokens - first_token) // dst_bs)]
        src = Side(sp, ELEMENT, HEAD_SIZE, src_bs, p.first_head, sblocks, 0, p.num_heads)
        dst = Side(dp, ELEMENT, HEAD_SIZE, dst_bs, d.first_head, dblocks, first_token, d.num_heads)
        plan = build_plan(src, dst, (first_token, num_tokens), (route.first_head, route.stop))
        # Matching block sizes and whole ranks move whole pages, the last partly filled one too.
        page_format = {"cpu": "cpu", "nhd": "nhd", "hnd": "hnd", "block_major": "hnd"}
        whole_pages = src_bs == dst_bs and src_tp == dst_tp and page_format[src_kind] == page_format[dst_kind]
        moved_tokens = (-(-num_tokens // src_bs) * src_bs if whole_pages else num_tokens) - first_token
        assert plan.total_bytes == moved_tokens * (route.stop - route.first_head) * ROW * 2 * layers
        for s, t, n in zip(plan.src.tolist(), plan.dst.tolist(), plan.lengths.tolist()):
            dst_buf[t : t + n] = src_buf[s : s + n]
        for sp_i, dp_i in zip(sp, dp):
            for token in range(first_token, num_tokens):
                for head in range(route.first_head, route.stop):
                    for channel in range(HEAD_SIZE):
                        a = cell(sp_i, sblocks, src_bs, 0, p.first_head, token, head, channel)
                        b = cell(dp_i, dblocks, dst_bs, first_token, d.first_head, token, head, channel)
                        assert np.array_equal(dst_buf[b : b + ELEMENT], src_buf[a : a + ELEMENT]), (sp_i, token, head, channel)
                    moved[d.tp_rank].add((sp_i.layer_index, sp_i.plane, token, head))
    for d in dst_ranks:  # every cell each consumer needs was written exactly by its routes
        assert len(moved[d.tp_rank]) == layers * 2 * (num_tokens - first_token) * d.num_heads


def test_equal_layouts_with_consecutive_blocks_merge_to_one_descriptor_per_layer():
    planes, _ = make_planes("cpu", 3, 64, 32, 2)
    blocks = np.arange(10, 18)
    side = Side(planes, ELEMENT, HEAD_SIZE, 32, 0, blocks, 0, 2)
    other = Side(planes, ELEMENT, HEAD_SIZE, 32, 0, np.arange(40, 48), 0, 2)
    plan = build_plan(side, other, (0, 8 * 32), (0, 2))
    assert len(plan) == 3
    assert plan.unmerged_count == 3 * 8  # whole pages: one chunk per (layer, block)
    token_by_token = build_plan(Side(planes, ELEMENT, HEAD_SIZE, 32, 0, blocks, 0), Side(planes, ELEMENT, HEAD_SIZE, 32, 0, np.arange(40, 48), 0), (0, 8 * 32), (0, 2))
    assert len(token_by_token) == 3 and token_by_token.unmerged_count == 3 * 8 * 2 * (HEAD_SIZE + 1)
    split = unmerged_plan(plan.src, plan.dst, plan.lengths, 32 * ROW)
    assert len(split) == 3 * 8 * 2 * 2 and split.total_bytes == plan.total_bytes  # one per (layer, block, head, plane)


def test_block_major_cache_moves_a_request_as_one_descriptor():
    planes, _ = make_planes("block_major", 4, 64, 32, 2)
    plan = build_plan(Side(planes, ELEMENT, HEAD_SIZE, 32, 0, np.arange(3, 9), 0, 2),
                      Side(planes, ELEMENT, HEAD_SIZE, 32, 0, np.arange(20, 26), 0, 2), (0, 6 * 32), (0, 2))
    assert len(plan) == 1 and plan.total_bytes == 4 * 6 * 32 * 2 * 2 * ROW


def test_merge_keeps_noncontiguous_chunks_apart():
    plan = merge(np.array([0, 8, 100]), np.array([50, 58, 66]), np.array([8, 8, 8]))
    assert plan.src.tolist() == [0, 100] and plan.lengths.tolist() == [16, 8]


def test_plan_refuses_tokens_outside_the_blocks():
    planes, _ = make_planes("cpu", 1, 8, 32, 1)
    side = Side(planes, ELEMENT, HEAD_SIZE, 32, 0, np.arange(2), 0)
    with pytest.raises(ValueError, match="not covered"):
        build_plan(side, side, (0, 65), (0, 1))


def test_describe_cpu_layer_matches_the_cpu_kernel_view():
    import torch
    import vllm._custom_ops as ops

    blocks, heads, bs, hd, tokens = 3, 2, 32, 32, 40
    t = torch.zeros(blocks, heads, bs, 2 * hd)
    key_plane, value_plane = describe_layer("CPU_ATTN", tuple(t.shape), tuple(t.stride()), t.data_ptr(), 4, num_blocks=blocks,
                                            block_size=bs, num_local_heads=heads, head_size=hd, layer_index=0)
    # Let the CPU kernel itself write the cache, then find every value where the planes say it is.
    key = torch.randn(tokens, heads, hd)
    value = torch.randn(tokens, heads, hd)
    slots = torch.tensor([(2 if i < bs else 0) * bs + i % bs for i in range(tokens)], dtype=torch.int64)
    key_cache, value_cache = t.view(blocks, heads, 2 * bs, hd).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, "vec")
    flat = t.view(-1)
    for i in (0, 5, 31, 32, 39):
        block = 2 if i < bs else 0
        for h in range(heads):
            for c in (0, 1, hd - 1):
                k = (key_plane.address(block, h, i % bs, c) - t.data_ptr()) // 4
                v = (value_plane.address(block, h, i % bs, c) - t.data_ptr()) // 4
                assert flat[k].item() == key[i, h, c].item() and flat[v].item() == value[i, h, c].item()
