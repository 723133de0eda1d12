# SPDX-License-Identifier: Apache-2.0
"""MLA latent caches: described as one plane per layer, moved byte for byte between any TP sizes, refused against dense KV."""

from __future__ import annotations

import pytest
import torch

from kvpush import errors
from kvpush.connector.handoff import SourceReady
from kvpush.connector.kv_layout import GroupSpec, LayerTensor, build_layout
from kvpush.connector.write_plans import LocalLayout, Peer, PeerRank, build_write_plans, page_table_of
from kvpush.dev import sample_engines as sample
from kvpush.engine.v1 import engine_pb2
from kvpush.layout import heads
from kvpush.layout.geometry import describe_layer, layout_mismatch
from kvpush.rendezvous.v1 import transfer_pb2
from tests.unit.broker_harness import D, Harness, P, expect
from tests.unit.write_copies import apply

MLA = engine_pb2.KV_CACHE_GROUP_KIND_MLA
LATENT = 576  # kv_lora_rank 512 + qk_rope_head_dim 64
BLOCK = 16
BLOCKS = 48
LAYERS = 2


def mla_rank(tp_rank: int, tp_size: int, fill: bool, cpu_view: bool = True) -> tuple[list[torch.Tensor], engine_pb2.KvLayout]:
    """One rank's MLA cache as vLLM-CPU hands it ([B, 1, N, C]; cpu_view=False: [B, N, C] as GPU backends do)."""
    shape = (BLOCKS, 1, BLOCK, LATENT) if cpu_view else (BLOCKS, BLOCK, LATENT)
    tensors = [torch.randn(shape) if fill else torch.zeros(shape) for _ in range(LAYERS)]
    layers = [LayerTensor(i, f"model.layers.{i}.self_attn.attn", 0, t) for i, t in enumerate(tensors)]
    layout, ranges, _ = build_layout("CPU_MLA", layers, [GroupSpec(BLOCK, BLOCKS, MLA)], dtype="torch.float32", head_size=LATENT,
                                     total_kv_heads=1, num_local_heads=1, tp_rank=tp_rank, tp_size=tp_size)
    assert len(ranges) == LAYERS
    return tensors, layout


@pytest.mark.parametrize("cpu_view", [True, False], ids=["[B,1,N,C] (CPU)", "[B,N,C]"])
def test_an_mla_layer_is_one_latent_plane_with_every_rank_holding_it(cpu_view):
    tensors, layout = mla_rank(1, 2, fill=False, cpu_view=cpu_view)
    assert [g.kind for g in layout.groups] == [MLA]
    assert (layout.total_kv_heads, layout.num_local_heads, layout.first_head, layout.head_size) == (1, 1, 0, LATENT)
    assert [(r.layer_index, r.plane) for r in layout.regions] == [(0, engine_pb2.KV_PLANE_LATENT), (1, engine_pb2.KV_PLANE_LATENT)]
    region = layout.regions[1]
    assert region.base_address == tensors[1].data_ptr()
    assert (region.block_stride_bytes, region.token_stride_bytes) == (BLOCK * LATENT * 4, LATENT * 4)


@pytest.mark.parametrize("shape, message", [
    ((BLOCKS, 2, BLOCK, LATENT), "MLA"),  # two heads: not a latent
    ((BLOCKS, BLOCK, LATENT + 64), "latent=576"),
    ((BLOCKS * 2, BLOCK, LATENT), "blocks of its group"),
])
def test_a_latent_tensor_of_another_shape_is_refused(shape, message):
    with pytest.raises(ValueError, match=message):
        describe_layer("CPU_MLA", shape, torch.zeros(shape).stride(), 0, 4, num_blocks=BLOCKS, block_size=BLOCK, num_local_heads=1,
                       head_size=LATENT, layer_index=0, latent=True)


@pytest.mark.parametrize("p_tp, d_tp", [(1, 1), (1, 2), (2, 1), (2, 2)])
@pytest.mark.parametrize("first_token", [0, 2 * BLOCK], ids=["whole prompt", "after a local prefix hit"])
def test_every_decode_rank_gets_the_whole_latent_from_one_prefill_rank(p_tp, d_tp, first_token):
    num_tokens = 5 * BLOCK + 7  # ends mid-block
    p_ranks = [mla_rank(r, p_tp, fill=True) for r in range(p_tp)]
    d_ranks = [mla_rank(r, d_tp, fill=False) for r in range(d_tp)]
    # Replicas of the latent are equal on every P rank, as vLLM computes them.
    for tensors, _ in p_ranks[1:]:
        for layer, tensor in enumerate(tensors):
            tensor.copy_(p_ranks[0][0][layer])
    src_blocks = [7, 3, 11, 30, 2, 40, 41, 17]
    dst_blocks = [5, 6, 1, 9, 12, 33]
    n_dst = -(-(first_token + num_tokens) // BLOCK) - first_token // BLOCK
    routes = heads.routes(heads.even_split(1, p_tp), heads.even_split(1, d_tp))
    ready = SourceReady(req_id="r", transfer_id="t", attempt=1, client_request_id="c", decode_engine_id=D, blocks=(tuple(src_blocks),),
                        num_tokens=first_token + num_tokens + 1, hold_s=5.0, traceparent="", arrival_ns=0, scheduled_ns=0, prompt=b"")
    peer_ranks = {r: PeerRank(f"d{r}", layout, page_table_of(layout)) for r, (_, layout) in enumerate(d_ranks)}
    for rank in peer_ranks.values():
        rank.prepared = object()  # NIXL's prepared list stands here: apply() addresses the page tables directly
    writers, notifications = {}, {}
    for p_rank, (_, layout) in enumerate(p_ranks):
        # The broker orders each P rank to write its consumers only.
        order = transfer_pb2.WriteOrder(decode_tp_ranks=heads.consumers_of(p_rank, routes))
        order.destination.first_token, order.destination.num_tokens = first_token, num_tokens
        order.destination.blocks.add(group_index=0, block_ids=dst_blocks[:n_dst])
        local = LocalLayout(layout, p_rank, p_tp, 0)
        for plan in build_write_plans(local, ready, order, Peer("inc", peer_ranks)):
            writers.setdefault(plan.d_rank, []).append(p_rank)
            notifications[plan.d_rank] = plan.expected
            moved = apply(plan, local, peer_ranks[plan.d_rank])
            assert moved == LAYERS * -(-num_tokens // BLOCK) * BLOCK * LATENT * 4  # whole pages of every layer
    # Exactly one P rank writes each D rank (rank d mod P's TP), and D counts one notification.
    assert writers == {d: [d % p_tp] for d in range(d_tp)}
    assert notifications == {d: 1 for d in range(d_tp)}
    for d_tensors, _ in d_ranks:
        for layer in range(LAYERS):
            for token in range(first_token, first_token + num_tokens):
                got = d_tensors[layer][dst_blocks[token // BLOCK - first_token // BLOCK], 0, token % BLOCK]
                want = p_ranks[0][0][layer][src_blocks[token // BLOCK], 0, token % BLOCK]
                assert torch.equal(got, want), (layer, token)
        untouched = set(range(BLOCKS)) - set(dst_blocks[:n_dst])
        assert all(not d_tensors[layer][b].any() for layer in range(LAYERS) for b in untouched)


def test_mla_routes_spread_the_latent_over_prefill_ranks():
    producers, consumers = heads.even_split(1, 2), heads.even_split(1, 4)
    assert [(r.producer, r.consumer) for r in heads.routes(producers, consumers)] == [(0, 0), (0, 2), (1, 1), (1, 3)]


def test_a_dense_and_an_mla_engine_are_told_apart_by_what_differs():
    mla, dense = sample.rank_request(P, sample.PREFILL, mla=True).layout, sample.rank_request(D, sample.DECODE).layout
    why = layout_mismatch(mla, dense)
    assert "MLA (a latent of 576 float16 elements per token, 2 layers)" in why
    assert "full attention (2 KV heads of 64 float16 elements, 2 layers)" in why
    assert layout_mismatch(dense, dense) == ""
    wider = sample.rank_request(P, sample.PREFILL, mla=True).layout
    wider.head_size = 640
    assert "latent of 640" in layout_mismatch(wider, mla)


def test_the_broker_refuses_an_mla_prefill_for_a_dense_decode_engine_naming_both():
    h = Harness()
    h.registrar.register(sample.rank_request("prefill-mla", sample.PREFILL, mla=True, compatibility_hash="tiny-deepseek"))
    request = sample.destination_request("t-mla", prefill_engine_id="prefill-mla")
    error = expect(errors.FailedPrecondition, errors.Reason.INCOMPATIBLE_LAYOUT, "prefill_engine_id", h.broker.register_destination, request, D)
    assert "prefill engine's KV cache is MLA" in str(error) and "decode engine's is full attention" in str(error)
    assert h.broker.live_attempts == 0
