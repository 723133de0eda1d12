# SPDX-License-Identifier: Apache-2.0
"""Page tables and page WRITEs (kvpush.layout.pages): the entries name exactly the bytes a byte-segment plan moves."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bench.gpu_common import Geometry, allocate_cache, cache_planes
from kvpush.layout.pages import merged_count, page_write, pages_match
from kvpush.layout.plan import build_plan

LAYERS, HEADS, HEAD_SIZE, BLOCK_SIZE, NUM_BLOCKS = 3, 2, 8, 4, 10


def sides(block_major: bool, src_ids, dst_ids):
    geometry = Geometry(LAYERS, HEADS, HEAD_SIZE, BLOCK_SIZE, NUM_BLOCKS, block_major=block_major)
    src_cache, dst_cache = allocate_cache(geometry, torch.device("cpu")), allocate_cache(geometry, torch.device("cpu"))
    src_planes, dst_planes = cache_planes(src_cache, geometry), cache_planes(dst_cache, geometry)
    src, dst = geometry.side(src_planes, np.array(src_ids)), geometry.side(dst_planes, np.array(dst_ids))
    return geometry, src, dst, geometry.pages(src_planes), geometry.pages(dst_planes)


def covered(addresses, sizes) -> set[int]:
    return {int(a) + i for a, n in zip(addresses, sizes) for i in range(0, int(n), 2)}


@pytest.mark.parametrize("block_major", [False, True], ids=["layer-major", "block-major"])
@pytest.mark.parametrize("ids", [((1, 2, 3), (1, 2, 3)), ((7, 2, 5), (3, 9, 4))], ids=["consecutive", "random"])
def test_page_entries_move_the_bytes_a_segment_plan_moves(block_major, ids):
    geometry, src, dst, src_table, dst_table = sides(block_major, *ids)
    tokens = 10  # the last block partly filled: pages move it whole, as the plan's page path does
    assert pages_match(src, dst, src_table, dst_table, (0, HEADS))
    write = page_write(src, dst, src_table, dst_table, (0, tokens))
    plan = build_plan(src, dst, (0, tokens), (0, HEADS))
    assert write.bytes == plan.total_bytes == geometry.transfer_bytes(tokens)
    sizes = src_table.sizes[write.local.astype(np.int64) // NUM_BLOCKS]
    assert covered(src_table.addresses(write.local), sizes) == covered(plan.src, plan.lengths)
    assert covered(dst_table.addresses(write.remote), sizes) == covered(plan.dst, plan.lengths)
    assert merged_count(write, src_table, dst_table) == len(plan)  # what NIXL moves after merging neighbours = the merged plan
    assert len(write) == (3 if block_major else 3 * LAYERS)  # block-major: one entry per block, holding every layer


def test_a_layer_subset_is_its_rows_and_block_major_tables_cannot_pick_layers():
    _, src, dst, src_table, dst_table = sides(False, (1, 2), (4, 5))
    write = page_write(src, dst, src_table, dst_table, (0, 8), frozenset({1}))
    assert sorted(write.local // NUM_BLOCKS) == [1, 1] and write.bytes == 2 * src_table.sizes[1]
    _, src, dst, src_table, dst_table = sides(True, (1, 2), (4, 5))
    assert page_write(src, dst, src_table, dst_table, (0, 8), frozenset({1})) is None
    assert page_write(src, dst, src_table, dst_table, (0, 8), frozenset(range(LAYERS))) is not None


def test_pages_do_not_express_a_head_split_or_another_block_size():
    _, src, dst, src_table, dst_table = sides(False, (1, 2), (4, 5))
    assert not pages_match(src, dst, src_table, dst_table, (0, 1))  # one of two heads
    assert page_write(src, dst, src_table, dst_table, (2, 8)) is None  # starts mid-block
    _, src, dst64, src_table, _ = sides(False, (1, 2), (4, 5))
    other = Geometry(LAYERS, HEADS, HEAD_SIZE, 2 * BLOCK_SIZE, NUM_BLOCKS)
    planes = cache_planes(allocate_cache(other, torch.device("cpu")), other)
    assert not pages_match(src, other.side(planes, np.array([4])), src_table, other.pages(planes), (0, HEADS))  # another block size
