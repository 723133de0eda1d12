# SPDX-License-Identifier: Apache-2.0
"""State-space (Mamba) layers: a request's state block moves whole beside the attention KV; a state that does not say how it splits
moves between equal TP sizes only."""

from __future__ import annotations

import pytest
import torch

from kvpush import errors
from kvpush.connector.handoff import SourceReady
from kvpush.connector.kv_layout import GroupSpec, LayerTensor, build_layout
from kvpush.connector.write_plans import LocalLayout, Peer, PeerRank, build_write_plans
from kvpush.dev import sample_engines as sample
from kvpush.engine.v1 import engine_pb2
from kvpush.layout.geometry import layout_mismatch
from kvpush.rendezvous.v1 import transfer_pb2
from tests.unit.broker_harness import Harness, expect
from tests.unit.write_copies import apply

STATE, FULL = engine_pb2.KV_CACHE_GROUP_KIND_STATE, engine_pb2.KV_CACHE_GROUP_KIND_FULL_ATTENTION
BLOCKS, BLOCK, HEADS, HEAD_SIZE = 12, 16, 2, 8
PAGE, STATE_BYTES = HEADS * BLOCK * 2 * HEAD_SIZE * 4, 700  # vLLM pads the state page to the attention page
FORMAT = "conv float32, ssm float32, conv layout SD"


def state_rank(fill: bool):
    """Layer 0 a Mamba layer (vLLM's raw int8 pages), layer 1 attention, over one buffer as vLLM-CPU lays them out."""
    buffer = torch.randint(-128, 127, (BLOCKS * PAGE,), dtype=torch.int8) if fill else torch.zeros(BLOCKS * PAGE, dtype=torch.int8)
    state = buffer.view(BLOCKS, 1, 1, PAGE)[..., :STATE_BYTES]
    attention = buffer.view(torch.float32).view(BLOCKS, HEADS, BLOCK, 2 * HEAD_SIZE)
    layers = [LayerTensor(0, "model.layers.0.mixer", 0, state), LayerTensor(1, "model.layers.1.mixer.attn", 1, attention)]
    groups = [GroupSpec(4096, BLOCKS, STATE, state_format=FORMAT), GroupSpec(BLOCK, BLOCKS, FULL)]
    layout, ranges, _ = build_layout("CPU_ATTN", layers, groups, dtype="torch.float32", head_size=HEAD_SIZE, total_kv_heads=HEADS,
                                     num_local_heads=HEADS)
    assert len(ranges) == 1  # one buffer, registered once
    return buffer, layout


def test_a_state_layer_is_one_state_plane_of_its_bytes_per_block():
    buffer, layout = state_rank(fill=False)
    region = layout.regions[0]
    assert (region.plane, region.base_address, region.block_stride_bytes, region.state_bytes) == (
        engine_pb2.KV_PLANE_STATE, buffer.data_ptr(), PAGE, STATE_BYTES)
    assert layout.groups[0].state_format == FORMAT


def test_the_state_block_moves_whole_and_the_attention_blocks_beside_it():
    (p_buffer, p_layout), (d_buffer, d_layout) = state_rank(fill=True), state_rank(fill=False)
    num_tokens = 3 * BLOCK - 5  # P stopped one token short: its state is the one after these tokens
    order = transfer_pb2.WriteOrder(decode_tp_ranks=[0])
    order.destination.num_tokens = num_tokens
    order.destination.blocks.add(group_index=0, block_ids=[9])
    order.destination.blocks.add(group_index=1, block_ids=[2, 3, 4])
    ready = SourceReady("r", "t", 1, "c", "decode-0", ((5,), (6, 7, 8)), num_tokens, 5.0, "", 0, 0, b"")
    local, peer_rank = LocalLayout(p_layout, 0, 1, 0), PeerRank("d0", d_layout)
    (plan,) = build_write_plans(local, ready, order, Peer("inc", {0: peer_rank}))
    assert apply(plan, local, peer_rank) == STATE_BYTES + 3 * PAGE
    pages = p_buffer.view(BLOCKS, PAGE), d_buffer.view(BLOCKS, PAGE)
    assert torch.equal(pages[1][9, :STATE_BYTES], pages[0][5, :STATE_BYTES])
    assert not pages[1][9, STATE_BYTES:].any()  # the page's padding is not the state's
    for p_block, d_block in zip((6, 7, 8), (2, 3, 4)):
        assert torch.equal(pages[1][d_block], pages[0][p_block])
    assert not any(pages[1][b].any() for b in set(range(BLOCKS)) - {9, 2, 3, 4})


def state_engine(engine_id: str, role: int, tp_size: int, state_format: str = FORMAT, **kwargs) -> list:
    requests = sample.engine_requests(engine_id, role, tp_size=tp_size, **kwargs)
    for request in requests:
        request.layout.groups.add(group_index=1, kind=STATE, block_size=4096, num_blocks=1000, state_format=state_format)
        request.layout.regions.add(layer_name="model.layers.2.mixer", layer_index=1, group_index=1, plane=engine_pb2.KV_PLANE_STATE,
                                   base_address=0x90000000, block_stride_bytes=4096, state_bytes=700)
        del request.layout.regions[2:4]  # layer 1 is the state layer here
    return requests


@pytest.mark.parametrize("p_tp, d_tp", [(1, 2), (2, 1)])
def test_the_broker_refuses_unsplittable_state_layers_between_unequal_tp_sizes_naming_both(p_tp, d_tp):
    h = Harness(subscribe=False)
    for request in state_engine("prefill-s", sample.PREFILL, p_tp) + state_engine("decode-s", sample.DECODE, d_tp):
        h.registrar.register(request)
    request = sample.destination_request("t-s", decode_engine_id="decode-s", prefill_engine_id="prefill-s")
    request.destination.blocks.add(group_index=1, block_ids=[7])
    error = expect(errors.FailedPrecondition, errors.Reason.INCOMPATIBLE_LAYOUT, "prefill_engine_id", h.broker.register_destination,
                   request, "decode-s")
    assert f"prefill TP {p_tp}, decode TP {d_tp}" in str(error) and "do not say how they split" in str(error)


def test_another_state_layout_is_named_in_the_mismatch():
    p, d = state_engine("p", sample.PREFILL, 1)[0].layout, state_engine("d", sample.DECODE, 1, FORMAT.replace("SD", "DS"))[0].layout
    assert "conv layout SD" in layout_mismatch(p, d) and "conv layout DS" in layout_mismatch(p, d)
