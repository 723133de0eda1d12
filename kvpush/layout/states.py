# SPDX-License-Identifier: Apache-2.0
"""Which prefill rank writes which bytes of a state-space layer's state to which decode rank.

A state (Mamba2's conv state [kernel - 1, x|B|C channels], its SSM state
[heads, head dim, state size]) is split over TP ranks along one dimension,
made of segments that split on their own: x by Mamba heads, B and C by
groups. A segment's units spread over ranks exactly like KV heads (a
contiguous share each, or one unit repeated when ranks outnumber units:
vLLM repeats Mamba2's single group on every rank), so which producer rank
writes which units to which consumer rank is `heads.routes` per segment.
A route's bytes are, for each index of the dimensions before the split
one, one run of its units' elements times the inner dimensions.

When both sides split alike (equal TP sizes), every run of a rank lands in
the same place at its peer and the runs merge into the whole state.
"""

from __future__ import annotations

from math import prod

from kvpush.engine.v1 import engine_pb2
from kvpush.layout import heads

Run = tuple[int, int, int]  # (source offset, destination offset, bytes) within a state block


def splittable(group: engine_pb2.KvCacheGroup) -> bool:
    """Whether the group says how its states split over TP ranks (else they move only between equal TP sizes)."""
    return len(group.state_tensors) > 0


def signature(group: engine_pb2.KvCacheGroup) -> str:
    """What P and D of any TP sizes must share about a state group's split: every state's dtype size, segments and
    the dimensions that do not split."""
    return "; ".join(tensor_signature(t) for t in group.state_tensors)


def tensor_signature(tensor: engine_pb2.StateTensor) -> str:
    """One state's dtype size, unsplit dimensions and segments (its split dimension as "*")."""
    shape = "x".join("*" if i == tensor.split_dim else str(d) for i, d in enumerate(tensor.shape))
    return f"{tensor.element_bytes}B split {tensor.split_dim} of {shape} as " + ",".join(f"{s.units}x{s.unit_size}" for s in tensor.segments)


def segment_routes(segment: engine_pb2.StateSegment, p_tp: int, d_tp: int) -> list[heads.HeadRoute]:
    """Which producer writes which of the segment's units to which consumer."""
    return heads.routes(heads.even_split(segment.units, p_tp), heads.even_split(segment.units, d_tp))


def routes(layout: engine_pb2.KvLayout, p_tp: int, d_tp: int) -> list[heads.HeadRoute]:
    """Every (producer, consumer, units) write of the layout's splittable state groups."""
    out = []
    for group in layout.groups:
        for tensor in group.state_tensors:
            for segment in tensor.segments:
                out += segment_routes(segment, p_tp, d_tp)
    return out


def runs(src: engine_pb2.StateTensor, dst: engine_pb2.StateTensor, p_rank: int, p_tp: int, d_rank: int, d_tp: int) -> list[Run]:
    """The byte runs of one state that producer p_rank writes to consumer d_rank, within a state block."""
    k = src.split_dim
    if (k != dst.split_dim or src.element_bytes != dst.element_bytes or len(src.shape) != len(dst.shape)
            or [(s.units, s.unit_size) for s in src.segments] != [(s.units, s.unit_size) for s in dst.segments]
            or any(a != b for i, (a, b) in enumerate(zip(src.shape, dst.shape)) if i != k)):
        raise ValueError(f"the states differ in more than their split: {tensor_signature(src)} here, {tensor_signature(dst)} at the peer")
    outer = prod(src.shape[:k])
    inner = prod(src.shape[k + 1:]) * src.element_bytes
    out: list[Run] = []
    src_base = dst_base = 0  # where the segment starts along the split dimension, on each side
    for segment in src.segments:
        producers = heads.even_split(segment.units, p_tp)
        consumers = heads.even_split(segment.units, d_tp)
        mine, theirs = producers[p_rank], consumers[d_rank]
        for route in heads.routes(producers, consumers):
            if route.producer != p_rank or route.consumer != d_rank:
                continue
            src_at = src_base + (route.first_head - mine.first_head) * segment.unit_size
            dst_at = dst_base + (route.first_head - theirs.first_head) * segment.unit_size
            length = (route.stop - route.first_head) * segment.unit_size * inner
            out += [(src.offset_bytes + (o * src.shape[k] + src_at) * inner, dst.offset_bytes + (o * dst.shape[k] + dst_at) * inner, length)
                    for o in range(outer)]
        src_base += mine.num_heads * segment.unit_size
        dst_base += theirs.num_heads * segment.unit_size
    if src_base != src.shape[k] or dst_base != dst.shape[k]:
        raise ValueError(f"the segments {tensor_signature(src)} do not tile this rank's split dimension ({src.shape[k]} here, "
                         f"{dst.shape[k]} at the peer)")
    return out


def group_runs(src: engine_pb2.KvCacheGroup, dst: engine_pb2.KvCacheGroup, p_rank: int, p_tp: int, d_rank: int, d_tp: int) -> list[Run]:
    """The byte runs of every state of a group's layer that producer p_rank writes to consumer d_rank."""
    if len(src.state_tensors) != len(dst.state_tensors):
        raise ValueError(f"group {src.group_index} has {len(src.state_tensors)} states here and {len(dst.state_tensors)} at the peer")
    return [run for a, b in zip(src.state_tensors, dst.state_tensors) for run in runs(a, b, p_rank, p_tp, d_rank, d_tp)]

