# SPDX-License-Identifier: Apache-2.0
"""What one prefill rank writes to each decode rank for one order: page entries or byte segments.

When both sides lay out a block of a layer identically (the usual case:
same block size and TP split), a WRITE is a list of page entries into
descriptor lists NIXL prepared once per peer rank (kvpush.layout.pages).
Otherwise it is a byte-segment plan built for the request
(kvpush.layout.plan), merged where contiguous. Either can be restricted to
some layers, for layer-progressive push.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Protocol

import numpy as np

from kvpush.connector.handoff import SourceReady
from kvpush.engine.v1 import engine_pb2
from kvpush.layout import heads, states
from kvpush.layout.geometry import dtype_bytes, planes_from_layout
from kvpush.layout.pages import PageTable, PageWrite, page_table, page_write, pages_match
from kvpush.layout.plan import Plan, Side, build_plan, merge
from kvpush.rendezvous.v1 import transfer_pb2


@dataclass(frozen=True)
class LocalLayout:
    """This worker's KV cache as the plan builder needs it.

    A pipeline-parallel stage holds only its layers (their global indices);
    the decode rank it writes holds every layer, so each WRITE addresses the
    stage's layers within the peer's regions.
    """

    layout: engine_pb2.KvLayout
    tp_rank: int
    tp_size: int
    device: int
    pp_rank: int = 0
    pp_size: int = 1

    @cached_property
    def pages(self) -> PageTable | None:
        return page_table_of(self.layout)

    @cached_property
    def layers(self) -> frozenset[int]:
        return frozenset(r.layer_index for r in self.layout.regions)

    @cached_property
    def state_groups(self) -> frozenset[int]:
        """The KV cache groups holding state-space layers' states."""
        return frozenset(g.group_index for g in self.layout.groups if g.kind == engine_pb2.KV_CACHE_GROUP_KIND_STATE)

    @property
    def producer(self) -> int:
        """This rank's number among all of its engine's ranks, stage-major: what decode ranks count notifications by."""
        return self.pp_rank * self.tp_size + self.tp_rank


def side_of(layout: engine_pb2.KvLayout, group: int, block_ids, first_token: int, layers: frozenset[int] | None = None) -> Side:
    """One side of a transfer in one KV cache group, of the given layers only if named.

    Where vLLM splits the group's blocks into kernel blocks, the side is in
    kernel blocks: block b's are b * ratio .. b * ratio + ratio - 1.
    """
    spec = next(g for g in layout.groups if g.group_index == group)
    kernel, ratio = kernel_blocks(spec)
    ids = np.asarray(block_ids, dtype=np.int64)
    if ratio > 1:
        ids = (ids[:, None] * ratio + np.arange(ratio, dtype=np.int64)[None, :]).ravel()
    planes = [p for p in planes_from_layout(layout, group) if layers is None or p.layer_index in layers]
    return Side(planes, dtype_bytes(layout), layout.head_size, kernel, layout.first_head, ids, first_token, layout.num_local_heads)


def kernel_blocks(group: engine_pb2.KvCacheGroup) -> tuple[int, int]:
    """(the block size the group's regions are in, kernel blocks per group block)."""
    kernel = group.kernel_block_size or group.block_size
    return kernel, group.block_size // kernel


def page_table_of(layout: engine_pb2.KvLayout, layers: frozenset[int] | None = None) -> PageTable | None:
    """A rank's page table (of the given layers only, if named), for a KV cache of one group whose planes tile whole pages."""
    if len(layout.groups) != 1 or not layout.regions:
        return None
    group = layout.groups[0]
    return page_table(side_of(layout, group.group_index, [], 0, layers), group.num_blocks * kernel_blocks(group)[1])


def device_of(layout: engine_pb2.KvLayout) -> int:
    """The device a rank's KV cache lives on (its regions share one)."""
    return layout.regions[0].device_id if layout.regions else 0


@dataclass
class PeerRank:
    agent: str
    layout: engine_pb2.KvLayout
    pages: PageTable | None = None
    prepared: object = None  # its page table's descriptor list, prepared on this rank's agent
    page_routes: dict[tuple[int, int], bool] = field(default_factory=dict)  # head range -> whether pages carry it (decided once)


@dataclass
class Peer:
    incarnation: str
    ranks: dict[int, PeerRank]


class ByteSegments(Protocol):
    """A WRITE's byte segments as the transport takes them: a layout Plan (the simulation's transport takes its own)."""

    @property
    def src(self) -> Any: ...
    @property
    def dst(self) -> Any: ...
    @property
    def lengths(self) -> Any: ...
    def __len__(self) -> int: ...


@dataclass
class WritePlan:
    """One WRITE to one decode rank: page entries, or byte segments when pages cannot express it."""

    d_rank: int
    plan: ByteSegments | None
    expected: int
    pages: PageWrite | None = None

    @property
    def descriptors(self) -> int:
        if self.pages is not None:
            return len(self.pages)
        assert self.plan is not None, "a WritePlan holds pages or byte segments"
        return len(self.plan)


def build_write_plans(local: LocalLayout, ready: SourceReady, order: transfer_pb2.WriteOrder, peer: Peer,
                      layers: frozenset[int] | None = None) -> list[WritePlan]:
    """What this rank writes to each of its decode ranks (of the given layers only, if named, else of all it holds).

    A decode rank hears from every stage's producers of its heads: the
    notification count per stage times the stages.
    """
    producers = heads.even_split(local.layout.total_kv_heads, local.tp_size)
    consumers = [heads.RankHeads(tp, r.layout.first_head, r.layout.num_local_heads) for tp, r in sorted(peer.ranks.items())]
    kv_routes = heads.routes(producers, consumers)
    # State-space layers' states split by their own units (Mamba heads, groups): their routes may pair other ranks.
    routes = kv_routes + states.routes(local.layout, local.tp_size, len(peer.ranks))
    destination = order.destination
    first_token = destination.first_token
    token_range = (first_token, first_token + destination.num_tokens)
    dst_blocks = {b.group_index: b.block_ids for b in destination.blocks}
    # A sliding-window group's destination starts at its window (its blocks before it are not D's to write).
    dst_first = {b.group_index: max(b.first_token, first_token) for b in destination.blocks}
    plans = []
    for d_rank in order.decode_tp_ranks:
        mine = [r for r in kv_routes if r.producer == local.tp_rank and r.consumer == d_rank]
        rank = peer.ranks[d_rank]
        expected = notifications_expected(local, d_rank, routes)
        if local.pages is not None and rank.pages is not None and rank.prepared is not None and len(mine) == 1:
            group = local.layout.groups[0].group_index
            src = side_of(local.layout, group, ready.blocks[0], 0)
            dst = side_of(rank.layout, group, dst_blocks[group], dst_first[group], local.layers)
            route = (mine[0].first_head, mine[0].stop)
            if route not in rank.page_routes:
                rank.page_routes[route] = pages_match(src, dst, local.pages, rank.pages, route)
            group_range = (dst_first[group], token_range[1])
            pages = page_write(src, dst, local.pages, rank.pages, group_range, layers) if rank.page_routes[route] else None
            if pages is not None:
                plans.append(WritePlan(d_rank, None, expected, pages))
                continue
        parts = []
        for group, src_ids in enumerate(ready.blocks):
            if group in local.state_groups:
                parts.append(state_plan(local, rank.layout, d_rank, len(peer.ranks), group, src_ids[0], dst_blocks[group][0], layers))
                continue
            src = side_of(local.layout, group, src_ids, 0, layers)
            if not src.planes:
                continue  # none of the layers asked for is in this group (a layer-progressive part)
            dst = side_of(rank.layout, group, dst_blocks[group], dst_first[group], local.layers if layers is None else layers)
            group_range = (dst_first[group], token_range[1])
            parts += [build_plan(src, dst, group_range, (r.first_head, r.stop)) for r in mine]
        plans.append(WritePlan(d_rank, _concat(parts), expected))
    return plans


def state_plan(local: LocalLayout, dst: engine_pb2.KvLayout, d_rank: int, d_tp: int, group: int, src_block: int, dst_block: int,
               layers: frozenset[int] | None) -> Plan:
    """A state group's WRITE to decode rank d_rank: each layer's share of the states that rank needs from this one.

    A group that does not say how its states split moves whole, rank i to
    rank i, between equal TP sizes only (the broker refuses other pairs).
    """
    src_group = next(g for g in local.layout.groups if g.group_index == group)
    dst_group = next(g for g in dst.groups if g.group_index == group)
    split = states.splittable(src_group) and states.splittable(dst_group)
    runs = states.group_runs(src_group, dst_group, local.tp_rank, local.tp_size, d_rank, d_tp) if split else []
    dst_regions = {r.layer_index: r for r in dst.regions if r.group_index == group and r.plane == engine_pb2.KV_PLANE_STATE}
    src_addr, dst_addr, lengths = [], [], []
    for region in local.layout.regions:
        if region.group_index != group or region.plane != engine_pb2.KV_PLANE_STATE or (layers is not None and region.layer_index not in layers):
            continue
        peer = dst_regions[region.layer_index]
        if not split and d_rank == local.tp_rank:
            if peer.state_bytes != region.state_bytes:
                raise ValueError(f"layer {region.layer_index}'s state is {region.state_bytes} bytes here and {peer.state_bytes} at the peer")
            runs = [(0, 0, region.state_bytes)]
        src_at = region.base_address + src_block * region.block_stride_bytes
        dst_at = peer.base_address + dst_block * peer.block_stride_bytes
        for src_off, dst_off, length in runs:
            src_addr.append(src_at + src_off)
            dst_addr.append(dst_at + dst_off)
            lengths.append(length)
    return merge(np.array(src_addr, dtype=np.int64), np.array(dst_addr, dtype=np.int64), np.array(lengths, dtype=np.int64))


def notifications_expected(local: LocalLayout, d_rank: int, routes: list[heads.HeadRoute]) -> int:
    """What decode rank d_rank counts before its KV is complete: one notification per (stage, rank) writing its heads."""
    return heads.expected_notifications(d_rank, routes) * local.pp_size


def _concat(plans: list[Plan]) -> Plan:
    if len(plans) == 1:
        return plans[0]
    if not plans:
        empty = np.zeros(0, dtype=np.int64)
        return merge(empty, empty, empty)
    return Plan(
        np.concatenate([p.src for p in plans]),
        np.concatenate([p.dst for p in plans]),
        np.concatenate([p.lengths for p in plans]),
        sum(p.unmerged_count for p in plans),
    )
