# SPDX-License-Identifier: Apache-2.0
"""Pipeline-parallel prefill: each P stage writes its layers into the same layers of D's all-layer cache, and D counts every stage."""

from __future__ import annotations

import pytest
import torch

from kvpush import errors
from kvpush.connector.handoff import SourceReady
from kvpush.connector.kv_layout import GroupSpec, LayerTensor, build_layout
from kvpush.connector.notification import notification, parse_notification
from kvpush.connector.write_plans import LocalLayout, Peer, PeerRank, build_write_plans, page_table_of
from kvpush.dev import sample_engines as sample
from kvpush.layout import heads
from kvpush.rendezvous.v1 import transfer_pb2
from tests.unit.broker_harness import COMPLETED, REVOKED, D, Harness, expect
from tests.unit.write_copies import apply

BLOCK, BLOCKS, HEADS, HEAD_SIZE = 16, 24, 2, 8
LAYERS = 3
STAGES = ({0, 1}, {2})  # vLLM gives the later stage fewer layers when they do not split evenly


def rank_cache(layers, tp_rank: int, tp_size: int, fill: bool):
    """One rank's CPU-backend cache of the given layers ([blocks, local heads, block, 2 * head size]) and its layout."""
    local_heads = HEADS // tp_size
    tensors = {layer: (torch.randn if fill else torch.zeros)(BLOCKS, local_heads, BLOCK, 2 * HEAD_SIZE) for layer in sorted(layers)}
    described = [LayerTensor(layer, f"model.layers.{layer}.self_attn.attn", 0, t) for layer, t in tensors.items()]
    layout, _, _ = build_layout("CPU_ATTN", described, [GroupSpec(BLOCK, BLOCKS)], dtype="torch.float32", head_size=HEAD_SIZE,
                                total_kv_heads=HEADS, num_local_heads=local_heads, num_layers=LAYERS, tp_rank=tp_rank, tp_size=tp_size)
    return tensors, layout


@pytest.mark.parametrize("p_tp, d_tp", [(1, 1), (1, 2), (2, 1), (2, 2)])
@pytest.mark.parametrize("progressive", [False, True], ids=["whole", "layer by layer"])
def test_each_stage_writes_its_layers_into_the_same_layers_of_every_decode_rank(p_tp, d_tp, progressive):
    first_token, num_tokens = BLOCK, 4 * BLOCK  # after a one-block prefix hit on D
    stages = [[rank_cache(layers, tp, p_tp, fill=True) for tp in range(p_tp)] for layers in STAGES]
    d_ranks = [rank_cache(range(LAYERS), tp, d_tp, fill=False) for tp in range(d_tp)]
    src_blocks = [7, 3, 11, 30 % BLOCKS, 2, 9]
    dst_blocks = [5, 6, 1, 13]
    ready = SourceReady(req_id="r", transfer_id="t", attempt=1, client_request_id="c", decode_engine_id=D, blocks=(tuple(src_blocks),),
                        num_tokens=first_token + num_tokens + 1, hold_s=5.0, traceparent="", arrival_ns=0, scheduled_ns=0, prompt=b"")
    routes = heads.routes(heads.even_split(HEADS, p_tp), heads.even_split(HEADS, d_tp))
    heard: dict[int, set[int]] = {d: set() for d in range(d_tp)}  # decode rank -> producer numbers that wrote it
    expected: dict[int, set[int]] = {d: set() for d in range(d_tp)}
    for pp, stage in enumerate(stages):
        for tp, (_, layout) in enumerate(stage):
            local = LocalLayout(layout, tp, p_tp, 0, pp, len(STAGES))
            peer_ranks = {d: PeerRank(f"d{d}", d_layout, page_table_of(d_layout, local.layers)) for d, (_, d_layout) in enumerate(d_ranks)}
            for rank in peer_ranks.values():
                rank.prepared = object()  # NIXL's prepared list stands here: apply() addresses the page tables directly
            order = transfer_pb2.WriteOrder(decode_tp_ranks=heads.consumers_of(tp, routes))
            order.destination.first_token, order.destination.num_tokens = first_token, num_tokens
            order.destination.blocks.add(group_index=0, block_ids=dst_blocks)
            parts = [frozenset({layer}) for layer in sorted(local.layers)] if progressive else [None]
            for layers in parts:
                for plan in build_write_plans(local, ready, order, Peer("inc", peer_ranks), layers):
                    moved = apply(plan, local, peer_ranks[plan.d_rank])
                    routed = sum(r.stop - r.first_head for r in routes if (r.producer, r.consumer) == (tp, plan.d_rank))
                    assert moved == len(layers or local.layers) * num_tokens * routed * 2 * HEAD_SIZE * 4  # its layers only
                    heard[plan.d_rank].add(local.producer)
                    expected[plan.d_rank].add(plan.expected)
    # D rank d hears from every stage's producers of its heads, and is told to expect exactly that many.
    for d in range(d_tp):
        per_stage = heads.expected_notifications(d, routes)
        assert len(heard[d]) == per_stage * len(STAGES)
        assert expected[d] == {per_stage * len(STAGES)}
    # Every layer of every D rank holds P's KV of its heads: D's page (block, head) equals the P rank's holding that head.
    for d, (d_tensors, d_layout) in enumerate(d_ranks):
        for layer in range(LAYERS):
            pp = next(i for i, layers in enumerate(STAGES) if layer in layers)
            for position in range(first_token // BLOCK, (first_token + num_tokens) // BLOCK):
                for head in range(d_layout.first_head, d_layout.first_head + d_layout.num_local_heads):
                    tp = next(r.producer for r in routes if r.consumer == d and r.first_head <= head < r.stop)
                    p_tensors, p_layout = stages[pp][tp]
                    got = d_tensors[layer][dst_blocks[position - first_token // BLOCK], head - d_layout.first_head]
                    want = p_tensors[layer][src_blocks[position], head - p_layout.first_head]
                    assert torch.equal(got, want), (d, layer, position, head)
        untouched = set(range(BLOCKS)) - set(dst_blocks)
        assert all(not d_tensors[layer][b].any() for layer in range(LAYERS) for b in untouched)


def test_stages_write_whole_pages_when_both_sides_split_heads_alike():
    """The stage's layers are picked out of D's page table: a WRITE is page entries, as without pipeline parallelism."""
    (_, p_layout), (_, d_layout) = rank_cache(STAGES[1], 0, 1, fill=True), rank_cache(range(LAYERS), 0, 1, fill=False)
    local = LocalLayout(p_layout, 0, 1, 0, 1, 2)
    peer = Peer("inc", {0: PeerRank("d0", d_layout, page_table_of(d_layout, local.layers), prepared=object())})
    order = transfer_pb2.WriteOrder(decode_tp_ranks=[0])
    order.destination.num_tokens = 2 * BLOCK
    order.destination.blocks.add(group_index=0, block_ids=[4, 5])
    ready = SourceReady("r", "t", 1, "c", D, ((1, 2, 3),), 2 * BLOCK + 1, 5.0, "", 0, 0, b"")
    (plan,) = build_write_plans(local, ready, order, peer)
    assert plan.pages is not None and plan.pages.bytes == 2 * HEADS * BLOCK * 2 * HEAD_SIZE * 4  # one layer, two blocks
    assert (plan.expected, local.producer) == (2, 1)


def test_notifications_tell_stages_apart():
    """Two stages' rank 0 are two producers: D completes only when both have written."""
    notes = [parse_notification(notification("t", 1, LocalLayout(None, 0, 1, 0, pp, 2).producer, 2, 0, 16)) for pp in range(2)]
    assert [n.producer for n in notes] == [0, 1] and {n.needed for n in notes} == {2}


def test_the_broker_orders_every_stage_and_completes_when_every_stage_wrote():
    h = Harness(p_tp=2, d_tp=1, p_pp=2)
    assert list(h.register().expected_notifications) == [4]  # one per (stage, rank)
    h.prefill_done()
    for pp in range(2):
        for tp in range(2):
            (order,) = [m.order for m in h.messages(tp, pp)]
            assert list(order.decode_tp_ranks) == [0]
    for tp, pp in ((0, 0), (1, 0), (0, 1)):
        h.write(tp=tp, pp=pp)
    assert COMPLETED not in [e[2] for e in h.events()]  # stage 1's rank 1 has not answered
    h.write(tp=1, pp=1)
    assert COMPLETED in [e[2] for e in h.events()]


def test_a_failed_stage_fails_the_transfer_and_d_keeps_its_blocks_until_every_stage_answered():
    h = Harness(p_tp=1, d_tp=1, p_pp=2)
    h.register()
    h.prefill_done()
    h.write(tp=0, pp=1, outcome=transfer_pb2.WRITE_OUTCOME_FAILED)
    assert h.state() == transfer_pb2.TRANSFER_STATE_FAILED
    assert [k for k, _, _ in h.kinds(0, 0)] == ["order", "revocation", "closed"]
    assert not h.fenced()  # stage 0 may still be writing: D keeps its blocks
    h.write(tp=0, pp=0, outcome=REVOKED)
    assert h.fenced()


def test_a_pipeline_parallel_decode_engine_is_refused_naming_its_pp_size():
    h = Harness()
    for r in sample.engine_requests("decode-pp", sample.DECODE, pp_size=2):
        h.registrar.register(r)
    error = expect(errors.FailedPrecondition, errors.Reason.INCOMPATIBLE_LAYOUT, "destination.engine_id", h.broker.register_destination,
                   h.destination(decode_engine_id="decode-pp"), "decode-pp")
    assert "pp_size 2" in str(error)
