# SPDX-License-Identifier: Apache-2.0
"""Transfer plans: the byte segments one producer rank writes to one consumer rank.

A plan maps a token range of the prompt, for a range of global KV heads, from
the producer's blocks to the consumer's blocks in every (layer, plane). Token
runs break where either side's block ends, so P and D may use different block
sizes. Elementary chunks are then merged wherever they are contiguous on both
sides: with equal layouts and consecutive block ids a whole layer collapses
into one descriptor, which is what keeps NIXL's per-descriptor cost off the
data path.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvpush.layout.geometry import Plane


@dataclass(frozen=True)
class Side:
    """One side of a transfer: its planes and its view of the request."""

    planes: list[Plane]
    element: int  # bytes per element
    head_size: int  # elements per (token, head)
    block_size: int
    first_local_head: int  # global index of the side's local head 0
    block_ids: np.ndarray  # block ids in token order, block 0 holding token first_token
    first_token: int  # token held at offset 0 of block_ids[0]; a multiple of block_size
    num_local_heads: int = 0  # heads the side holds; 0 = unknown (no whole-page copies)

    @property
    def row(self) -> int:
        return self.head_size * self.element


@dataclass(frozen=True)
class Plan:
    """Merged segments: src[i] → dst[i], lengths[i] bytes."""

    src: np.ndarray
    dst: np.ndarray
    lengths: np.ndarray
    unmerged_count: int

    @property
    def total_bytes(self) -> int:
        return int(self.lengths.sum())

    def __len__(self) -> int:
        return int(self.src.shape[0])


def _token_runs(src: Side, dst: Side, t0: int, t1: int) -> tuple[np.ndarray, ...]:
    """Split [t0, t1) where a block of either side ends.

    Returns per run: start token, length, src block id, src offset, dst block
    id, dst offset.
    """
    cuts = {t0, t1}
    for side in (src, dst):
        first = (t0 // side.block_size + 1) * side.block_size
        cuts.update(range(first, t1, side.block_size))
    starts = np.array(sorted(cuts), dtype=np.int64)
    lengths = np.diff(starts)
    starts = starts[:-1]
    out = [starts, lengths]
    for side in (src, dst):
        index = (starts - side.first_token) // side.block_size
        out.append(side.block_ids[index].astype(np.int64))
        out.append(starts % side.block_size)
    return tuple(out)


def _strides(planes: list[Plane]) -> tuple[np.ndarray, ...]:
    return tuple(
        np.array([getattr(p, f) for p in planes], dtype=np.int64)
        for f in ("base", "block_stride", "head_stride", "token_stride", "channel_stride")
    )


def build_plan(src: Side, dst: Side, token_range: tuple[int, int], head_range: tuple[int, int]) -> Plan:
    """Segments moving tokens [t0, t1) of global heads [h0, h1) from src to dst."""
    t0, t1 = token_range
    h0, h1 = head_range
    empty = np.zeros(0, dtype=np.int64)
    if t1 <= t0 or h1 <= h0:
        return merge(empty, empty, empty)
    if src.row != dst.row or src.element != dst.element:
        raise ValueError(f"element layout differs: {src.head_size}x{src.element} vs {dst.head_size}x{dst.element} bytes")
    if [(p.layer_index, p.plane) for p in src.planes] != [(p.layer_index, p.plane) for p in dst.planes]:
        raise ValueError("producer and consumer hold different (layer, plane) regions")
    for side in (src, dst):
        last = -(-(t1 - side.first_token) // side.block_size)
        if t0 < side.first_token or last > side.block_ids.size:
            raise ValueError(
                f"token range [{t0}, {t1}) is not covered by {side.block_ids.size} blocks of "
                f"{side.block_size} from token {side.first_token}"
            )
    heads = np.arange(h0, h1, dtype=np.int64)
    parts = []
    general = [(t0, t1)]
    pages = page_geometry(src, dst, h0, h1)
    if pages is not None:
        # Blocks laid out identically on both sides move as whole pages, the
        # last, partly filled one too (as upstream vLLM moves whole blocks):
        # the destination overwrites its slots past the prompt before it ever
        # reads them, and one page beats a descriptor per head and channel.
        bs = src.block_size
        full0, full1 = -(-t0 // bs) * bs, -(-t1 // bs) * bs
        if full1 > full0:
            parts.append(_page_chunks(src, dst, pages, full0, full1))
            general = [(t0, full0)]
    for a, b in general:
        if b > a:
            parts.extend(_token_chunks(src, dst, _token_runs(src, dst, a, b), heads))
    src_addr = np.concatenate([p[0] for p in parts])
    dst_addr = np.concatenate([p[1] for p in parts])
    lengths = np.concatenate([p[2] for p in parts])
    return merge(src_addr, dst_addr, lengths)


def _token_chunks(src: Side, dst: Side, runs, heads) -> list[tuple[np.ndarray, ...]]:
    # Planes whose channels are contiguous move token rows; channel-major
    # planes (the CPU backend's keys) move one token run per channel.
    groups: dict[tuple[bool, bool], list[int]] = {}
    for i, (s, d) in enumerate(zip(src.planes, dst.planes)):
        groups.setdefault((s.channel_stride == src.element, d.channel_stride == dst.element), []).append(i)
    parts = []
    for (src_rows, dst_rows), index in groups.items():
        if src_rows != dst_rows:
            raise ValueError("a plane is channel-major on one side and token-major on the other")
        sp, dp = [src.planes[i] for i in index], [dst.planes[i] for i in index]
        chunk = _row_chunks if src_rows else _channel_chunks
        parts.append(chunk(src, dst, _strides(sp), _strides(dp), runs, heads))
    return parts


def layer_pages(side: Side) -> tuple[np.ndarray, np.ndarray, np.ndarray, tuple] | None:
    """Per layer: where a block's page starts, its size and the block stride, when the layer's planes tile the page.

    A page is every (plane, head, token) of one block of one layer. Returns
    (page starts, page sizes, block strides, within-page signature) or None.
    """
    layers: dict[int, list[Plane]] = {}
    for plane in side.planes:
        layers.setdefault(plane.layer_index, []).append(plane)
    starts, sizes, strides, signature = [], [], [], []
    for _, planes in sorted(layers.items()):
        stride = planes[0].block_stride
        page = side.num_local_heads * side.block_size * side.row * len(planes)
        start = min(p.base for p in planes)
        end = max(
            p.base + (side.num_local_heads - 1) * p.head_stride + (side.block_size - 1) * p.token_stride
            + (side.head_size - 1) * p.channel_stride + side.element
            for p in planes
        )
        # The planes hold exactly page bytes and span exactly page bytes: they tile it.
        if any(p.block_stride != stride for p in planes) or end - start != page or stride < page:
            return None
        starts.append(start)
        sizes.append(page)
        strides.append(stride)
        signature.append(tuple((p.plane, p.base - start, p.head_stride, p.token_stride, p.channel_stride) for p in planes))
    return (np.array(starts, dtype=np.int64), np.array(sizes, dtype=np.int64), np.array(strides, dtype=np.int64),
            tuple(signature))


def page_geometry(src: Side, dst: Side, h0: int, h1: int) -> tuple | None:
    """Page geometry of both sides, if whole-page copies are exact for this route."""
    if src.block_size != dst.block_size or not (src.num_local_heads and dst.num_local_heads):
        return None
    for side in (src, dst):
        if (h0, h1) != (side.first_local_head, side.first_local_head + side.num_local_heads):
            return None
    src_pages, dst_pages = layer_pages(src), layer_pages(dst)
    if src_pages is None or dst_pages is None or src_pages[3] != dst_pages[3]:
        return None
    return src_pages, dst_pages


def _page_chunks(src: Side, dst: Side, pages, t0: int, t1: int) -> tuple[np.ndarray, ...]:
    """One chunk per (layer, block) for the blocks of [t0, t1) (block-aligned)."""
    (src_starts, sizes, src_strides, _), (dst_starts, _, dst_strides, _) = pages
    bs = src.block_size
    blocks = np.arange(t0 // bs, t1 // bs, dtype=np.int64)
    src_blocks = src.block_ids[blocks - src.first_token // bs].astype(np.int64)
    dst_blocks = dst.block_ids[blocks - dst.first_token // bs].astype(np.int64)
    src_addr = src_starts[:, None] + src_blocks[None, :] * src_strides[:, None]
    dst_addr = dst_starts[:, None] + dst_blocks[None, :] * dst_strides[:, None]
    length = np.broadcast_to(sizes[:, None], src_addr.shape)
    return src_addr.ravel(), dst_addr.ravel(), np.ascontiguousarray(length).ravel()


# Broadcast axes: (plane, run, head).
_P = (slice(None), None, None)
_R = (None, slice(None), None)
_H = (None, None, slice(None))


def _base_addresses(side: Side, strides, blocks, offsets, heads) -> np.ndarray:
    base, block_stride, head_stride, token_stride, _ = strides
    return base[_P] + blocks[_R] * block_stride[_P] + (heads[_H] - side.first_local_head) * head_stride[_P] + offsets[_R] * token_stride[_P]


def _expand_tokens(addr: np.ndarray, token_stride: np.ndarray, run_lengths: np.ndarray) -> np.ndarray:
    """(plane, run, head, ...) → one address per token of each run, flattened."""
    tok = np.arange(int(run_lengths.max()), dtype=np.int64)
    valid = tok[None, :] < run_lengths[:, None]  # (run, token)
    shape = (slice(None),) + (None,) * (addr.ndim - 1) + (None,)
    expanded = addr[..., None] + tok * token_stride[shape]
    mask = np.broadcast_to(valid.reshape((1, valid.shape[0]) + (1,) * (addr.ndim - 2) + (valid.shape[1],)), expanded.shape)
    return expanded[mask]


def _row_chunks(src: Side, dst: Side, ss, ds, runs, heads) -> tuple[np.ndarray, ...]:
    """Chunks of planes whose channels are contiguous: whole token rows."""
    _, run_lengths, sblk, soff, dblk, doff = runs
    row = src.row
    src_addr = _base_addresses(src, ss, sblk, soff, heads)
    dst_addr = _base_addresses(dst, ds, dblk, doff, heads)
    if np.all(ss[3] == row) and np.all(ds[3] == row):  # a head's tokens are contiguous
        length = np.broadcast_to((run_lengths * row)[_R], src_addr.shape)
        return src_addr.ravel(), dst_addr.ravel(), np.ascontiguousarray(length).ravel()
    if np.all(ss[2] == row) and np.all(ds[2] == row):  # a token's heads are contiguous
        src_addr = _expand_tokens(src_addr[:, :, :1], ss[3], run_lengths)
        dst_addr = _expand_tokens(dst_addr[:, :, :1], ds[3], run_lengths)
        return src_addr, dst_addr, np.full(src_addr.shape, len(heads) * row, dtype=np.int64)
    src_addr = _expand_tokens(src_addr, ss[3], run_lengths)
    dst_addr = _expand_tokens(dst_addr, ds[3], run_lengths)
    return src_addr, dst_addr, np.full(src_addr.shape, row, dtype=np.int64)


def _channel_chunks(src: Side, dst: Side, ss, ds, runs, heads) -> tuple[np.ndarray, ...]:
    """Chunks of channel-major planes: each channel's token run is contiguous."""
    _, run_lengths, sblk, soff, dblk, doff = runs
    if not (np.all(ss[3] == src.element) and np.all(ds[3] == dst.element)):
        raise ValueError("channel-major planes must keep each channel's tokens contiguous")
    channels = np.arange(src.head_size, dtype=np.int64)
    src_addr = _base_addresses(src, ss, sblk, soff, heads)[..., None] + channels * ss[4][:, None, None, None]
    dst_addr = _base_addresses(dst, ds, dblk, doff, heads)[..., None] + channels * ds[4][:, None, None, None]
    length = np.broadcast_to((run_lengths * src.element)[None, :, None, None], src_addr.shape)
    return src_addr.ravel(), dst_addr.ravel(), np.ascontiguousarray(length).ravel()


def merge(src: np.ndarray, dst: np.ndarray, lengths: np.ndarray) -> Plan:
    """Coalesce chunks that are contiguous on both sides (after sorting by source)."""
    n = int(src.size)
    if n == 0:
        empty = np.zeros(0, dtype=np.uint64)
        return Plan(empty, empty, empty, 0)
    order = np.argsort(src, kind="stable")
    src, dst, lengths = src[order], dst[order], lengths[order]
    joins = (src[1:] == src[:-1] + lengths[:-1]) & (dst[1:] == dst[:-1] + lengths[:-1])
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    merged_len = np.add.reduceat(lengths, starts)
    return Plan(src[starts].astype(np.uint64), dst[starts].astype(np.uint64), merged_len.astype(np.uint64), n)


def unmerged_plan(plan_src: np.ndarray, plan_dst: np.ndarray, lengths: np.ndarray, unit: int) -> Plan:
    """Splits a plan into `unit`-byte pieces (one per block row), for benchmarks without merging."""
    pieces = (lengths // unit).astype(np.int64)
    offsets = np.concatenate([np.arange(k, dtype=np.uint64) * unit for k in pieces]) if pieces.size else np.zeros(0, np.uint64)
    src = np.repeat(plan_src, pieces) + offsets
    dst = np.repeat(plan_dst, pieces) + offsets
    return Plan(src, dst, np.full(src.shape, unit, dtype=np.uint64), int(src.size))
