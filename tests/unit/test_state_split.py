# SPDX-License-Identifier: Apache-2.0
"""Mamba2 states between prefill and decode engines of different TP sizes.

A model-wide conv state [kernel - 1, x|B|C channels] and SSM state [heads,
head dim, state size] are cut into TP ranks' shares the way vLLM's Mamba2
weight loader cuts them (x and heads in contiguous shares, B and C by group,
a single group repeated on every rank), packed into vLLM's raw state pages,
and pushed with the plans kvpush builds. Every decode rank must end up with
exactly the share vLLM would give it at its own TP size, hearing from the
producer ranks the broker tells it to count.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator

from kvpush import errors
from kvpush.connector.handoff import SourceReady
from kvpush.connector.kv_layout import GroupSpec, LayerTensor, build_layout, mamba2_state_tensors
from kvpush.connector.write_plans import LocalLayout, Peer, PeerRank, build_write_plans
from kvpush.dev import sample_engines as sample
from kvpush.engine.v1 import engine_pb2
from kvpush.layout import heads, states
from kvpush.rendezvous.v1 import transfer_pb2
from tests.unit.broker_harness import Harness, expect
from tests.unit.test_state_layers import state_engine
from tests.unit.write_copies import apply

STATE, FULL = engine_pb2.KV_CACHE_GROUP_KIND_STATE, engine_pb2.KV_CACHE_GROUP_KIND_FULL_ATTENTION
MAMBA_HEADS, HEAD_DIM, STATE_SIZE, KERNEL = 8, 4, 6, 4
KV_HEADS, HEAD_SIZE, BLOCK, BLOCKS = 1, 8, 16, 6  # one KV head: the states' routes, not the KV's, pair the most ranks
PAGE = 4096  # vLLM pads a state page to the attention page; any size past the states will do here


def global_states(groups: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The model-wide states: conv [kernel - 1, x|B|C] and SSM [heads, head dim, state]."""
    generator = torch.Generator().manual_seed(seed)
    conv = torch.randn(KERNEL - 1, MAMBA_HEADS * HEAD_DIM + 2 * groups * STATE_SIZE, generator=generator)
    return conv, torch.randn(MAMBA_HEADS, HEAD_DIM, STATE_SIZE, generator=generator)


def vllm_share(conv: torch.Tensor, ssm: torch.Tensor, groups: int, rank: int, tp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s share at TP `tp`, as vLLM's Mamba2 weight loader cuts the channels (one group: every rank holds it)."""
    x_size, b_size = MAMBA_HEADS * HEAD_DIM, groups * STATE_SIZE
    x = conv[:, rank * x_size // tp:(rank + 1) * x_size // tp]
    group_rank, group_share = (0, b_size) if groups == 1 else (rank, b_size // tp)
    b = conv[:, x_size + group_rank * group_share:x_size + (group_rank + 1) * group_share]
    c = conv[:, x_size + b_size + group_rank * group_share:x_size + b_size + (group_rank + 1) * group_share]
    heads_per_rank = MAMBA_HEADS // tp
    return torch.cat([x, b, c], dim=1), ssm[rank * heads_per_rank:(rank + 1) * heads_per_rank]


def mamba_spec(groups: int, tp: int, dim_first: bool) -> SimpleNamespace:
    """This rank's MambaSpec fields, from vLLM's own shape calculator."""
    conv_shape, ssm_shape = MambaStateShapeCalculator.mamba2_state_shape(
        tp_world_size=tp, intermediate_size=MAMBA_HEADS * HEAD_DIM, n_groups=groups, num_heads=MAMBA_HEADS, head_dim=HEAD_DIM,
        state_size=STATE_SIZE, conv_kernel=KERNEL)
    if dim_first != (conv_shape[0] != KERNEL - 1):
        conv_shape = conv_shape[::-1]
    return SimpleNamespace(shapes=(tuple(conv_shape), tuple(ssm_shape)), dtypes=(torch.float32, torch.float32), mamba_type="MAMBA2")


def rank(groups: int, tp: int, tp_rank: int, dim_first: bool, states_of=None):
    """One rank: layer 0 Mamba2 (raw int8 pages), layer 1 attention; its state block 2 holds its share of states_of (if given)."""
    spec = mamba_spec(groups, tp, dim_first)
    buffer = torch.zeros(BLOCKS * PAGE, dtype=torch.int8)
    pages = buffer.view(BLOCKS, 1, 1, PAGE)
    local_heads = max(1, KV_HEADS // tp)  # one KV head: every rank holds it
    attention = torch.zeros(BLOCKS, local_heads, BLOCK, 2 * HEAD_SIZE)
    tensors = mamba2_state_tensors(spec, SimpleNamespace(n_groups=groups), tp, dim_first)
    assert tensors, "a Mamba2 spec splits"
    if states_of is not None:
        conv, ssm = vllm_share(*states_of, groups, tp_rank, tp)
        packed = torch.cat([(conv.T if dim_first else conv).contiguous().view(-1), ssm.contiguous().view(-1)]).view(torch.int8)
        pages[2, 0, 0, :packed.numel()] = packed
    layers = [LayerTensor(0, "model.layers.0.mixer", 0, pages), LayerTensor(1, "model.layers.1.mixer.attn", 1, attention)]
    groups_spec = [GroupSpec(4096, BLOCKS, STATE, state_format="conv float32, ssm float32", state_tensors=tensors),
                   GroupSpec(BLOCK, BLOCKS, FULL)]
    layout, _, _ = build_layout("CPU_ATTN", layers, groups_spec, dtype="torch.float32", head_size=HEAD_SIZE, total_kv_heads=KV_HEADS,
                                num_local_heads=local_heads, tp_rank=tp_rank, tp_size=tp)
    return pages, layout, attention  # the caller keeps the attention tensor alive: the layout addresses it


def unpack(page: torch.Tensor, groups: int, tp: int, dim_first: bool) -> tuple[torch.Tensor, torch.Tensor]:
    conv_shape, ssm_shape = mamba_spec(groups, tp, dim_first).shapes
    values = page.view(-1).view(torch.float32)
    conv_n = conv_shape[0] * conv_shape[1]
    conv = values[:conv_n].view(*conv_shape)
    return (conv.T if dim_first else conv), values[conv_n:conv_n + ssm_shape[0] * ssm_shape[1] * ssm_shape[2]].view(*ssm_shape)


@pytest.mark.parametrize("groups", [1, 4], ids=["one-group", "four-groups"])  # vLLM takes one group or a multiple of TP
@pytest.mark.parametrize("dim_first", [False, True], ids=["SD", "DS"])
@pytest.mark.parametrize("p_tp, d_tp", [(1, 2), (2, 1), (1, 4), (4, 2), (2, 4), (2, 2)])
def test_every_decode_rank_gets_the_share_vllm_gives_it_at_its_tp_size(p_tp, d_tp, groups, dim_first):
    global_conv, global_ssm = global_states(groups, seed=p_tp * 10 + d_tp)
    producers = [rank(groups, p_tp, r, dim_first, (global_conv, global_ssm)) for r in range(p_tp)]
    consumers = [rank(groups, d_tp, r, dim_first) for r in range(d_tp)]
    peer = Peer("inc", {r: PeerRank(f"d{r}", layout) for r, (_, layout, _) in enumerate(consumers)})
    # The broker's routes: KV heads and the states' units; a decode rank counts every producer that writes to it.
    routes = (heads.routes(heads.even_split(KV_HEADS, p_tp), heads.even_split(KV_HEADS, d_tp))
              + states.routes(producers[0][1], p_tp, d_tp))
    heard: dict[int, set[int]] = {}
    for p_rank, (_, layout, _) in enumerate(producers):
        order = transfer_pb2.WriteOrder(decode_tp_ranks=heads.consumers_of(p_rank, routes))
        order.destination.num_tokens = 2 * BLOCK - 3
        order.destination.blocks.add(group_index=0, block_ids=[4])
        order.destination.blocks.add(group_index=1, block_ids=[0, 1])
        ready = SourceReady("r", "t", 1, "c", "decode-0", ((2,), (3, 5)), 2 * BLOCK - 3, 5.0, "", 0, 0, b"")
        local = LocalLayout(layout, p_rank, p_tp, 0)
        for plan in build_write_plans(local, ready, order, peer):
            assert plan.expected == heads.expected_notifications(plan.d_rank, routes)
            apply(plan, local, peer.ranks[plan.d_rank])
            heard.setdefault(plan.d_rank, set()).add(p_rank)
    for d_rank, (pages, _, _) in enumerate(consumers):
        want_conv, want_ssm = vllm_share(global_conv, global_ssm, groups, d_rank, d_tp)
        got_conv, got_ssm = unpack(pages[4], groups, d_tp, dim_first)
        assert torch.equal(got_conv, want_conv) and torch.equal(got_ssm, want_ssm), d_rank
        assert len(heard[d_rank]) == heads.expected_notifications(d_rank, routes)
        assert not pages[[0, 1, 2, 3, 5]].any()  # only D's state block was written


def test_equal_tp_sizes_move_each_rank_share_as_one_contiguous_write():
    global_conv, global_ssm = global_states(2, seed=1)
    (_, p_layout, _), (_, d_layout, _) = rank(2, 2, 1, False, (global_conv, global_ssm)), rank(2, 2, 1, False)
    runs = states.group_runs(p_layout.groups[0], d_layout.groups[0], 1, 2, 1, 2)
    assert [(src, dst) for src, dst, _ in runs] == [(src, src) for src, _, _ in runs]  # same place on both sides: NIXL merges them
    conv, ssm = vllm_share(global_conv, global_ssm, 2, 1, 2)
    assert sum(length for _, _, length in runs) == 4 * (conv.numel() + ssm.numel())


def test_a_spec_kvpush_cannot_split_says_nothing_and_moves_only_between_equal_tp_sizes():
    spec = mamba_spec(2, 2, False)
    assert mamba2_state_tensors(SimpleNamespace(**{**vars(spec), "mamba_type": "MAMBA1"}), SimpleNamespace(n_groups=2), 2, False) == ()
    assert mamba2_state_tensors(spec, SimpleNamespace(), 2, False) == ()  # no group count in the config
    assert mamba2_state_tensors(spec, SimpleNamespace(n_groups=4), 2, False) == ()  # shapes do not add up


def split_engine(engine_id: str, role: int, tp_size: int) -> list:
    """Sample engine ranks with one KV head (every rank holds it) whose state group says how it splits (an x-like segment)."""
    requests = state_engine(engine_id, role, tp_size, total_kv_heads=1)
    for request in requests:
        request.layout.groups[1].state_tensors.add(offset_bytes=0, shape=[KERNEL - 1, MAMBA_HEADS // tp_size * HEAD_DIM], element_bytes=4,
                                                   split_dim=1, segments=[engine_pb2.StateSegment(units=MAMBA_HEADS, unit_size=HEAD_DIM)])
    return requests


@pytest.mark.parametrize("p_tp, d_tp, expected", [(1, 2, [1, 1]), (2, 1, [2])])
def test_the_broker_counts_the_producers_of_the_states_as_well_as_of_the_kv_heads(p_tp, d_tp, expected):
    """With one KV head, prefill rank 0 alone would write D's KV; rank 1 holds half the Mamba heads, so it writes too."""
    h = Harness(subscribe=False)
    for request in split_engine("prefill-s", sample.PREFILL, p_tp) + split_engine("decode-s", sample.DECODE, d_tp):
        h.registrar.register(request)
    request = sample.destination_request("t-s", decode_engine_id="decode-s", prefill_engine_id="prefill-s")
    request.destination.blocks.add(group_index=1, block_ids=[7])
    assert list(h.broker.register_destination(request, "decode-s").expected_notifications) == expected


def test_the_registrar_refuses_a_split_this_rank_does_not_hold_naming_the_field():
    h = Harness(subscribe=False)
    request = split_engine("prefill-s", sample.PREFILL, 2)[0]
    request.layout.groups[1].state_tensors[0].shape[1] += 1
    error = expect(errors.InvalidArgument, errors.Reason.FIELD_OUT_OF_RANGE, "layout.groups[1].state_tensors[0].segments", h.registrar.register,
                   request)
    assert "share of the segments" in str(error)
