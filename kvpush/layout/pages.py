# SPDX-License-Identifier: Apache-2.0
"""Page tables: a KV cache as one entry per (layer, block), or per block when block-major, for NIXL's prepared lists.

When P and D lay out a block of a layer identically (plan.page_geometry: the
same block size, the same heads, the same order within a page), a WRITE is
a list of page indices on each side. NIXL prepares each side's list once per
peer and merges entries that are contiguous on both sides when the WRITE is
made, so a request on consecutive blocks still moves as one region per
layer (or one region in all, block-major), and no descriptor list is built
per request.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvpush.layout.plan import Side, layer_pages, page_geometry


@dataclass(frozen=True)
class PageTable:
    """One side's pages: entry row * num_blocks + block is layer `layers[row]`'s page of that block."""

    starts: np.ndarray  # per row: the page of block 0
    sizes: np.ndarray  # per row: page bytes
    strides: np.ndarray  # per row: bytes from one block's page to the next
    num_blocks: int
    layers: tuple[int, ...]  # layer index of each row; block-major: the layers of its one row
    block_major: bool  # a block's pages of all layers lie side by side: one row, an entry per block holds every layer

    def rows(self, device: int) -> np.ndarray:
        """NIXL's strided descriptor rows (address, length, device, stride, count), one per layer."""
        n = self.starts.size
        return np.stack([self.starts, self.sizes, np.full(n, device), self.strides, np.full(n, self.num_blocks)], axis=1).astype(np.uint64)

    def entries(self, blocks: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """Entry indices of these blocks' pages in these rows, row by row."""
        return (rows[:, None] * self.num_blocks + blocks[None, :]).ravel().astype(np.int32)

    def rows_of(self, layers: frozenset[int] | None) -> np.ndarray | None:
        """The rows holding exactly these layers (all when None), or None if they cannot be picked out."""
        if layers is None or set(self.layers) <= layers:
            return np.arange(self.starts.size, dtype=np.int64)
        if self.block_major:
            return None  # one row holds every layer
        return np.array([i for i, layer in enumerate(self.layers) if layer in layers], dtype=np.int64)

    def addresses(self, entries: np.ndarray) -> np.ndarray:
        rows, blocks = np.divmod(entries.astype(np.int64), self.num_blocks)
        return self.starts[rows] + blocks * self.strides[rows]


def page_table(side: Side, num_blocks: int) -> PageTable | None:
    """The side's page table, or None when its layers' planes do not tile whole pages."""
    pages = layer_pages(side)
    if pages is None:
        return None
    starts, sizes, strides, _ = pages
    layers = tuple(sorted({p.layer_index for p in side.planes}))
    ends = starts + sizes
    if np.all(strides == sizes.sum()) and np.all(starts[1:] == ends[:-1]):
        # Block-major: one entry per block, every layer's page in it; the lists stay layers-times shorter.
        return PageTable(starts[:1], sizes.sum(keepdims=True), strides[:1], num_blocks, layers, True)
    return PageTable(starts, sizes, strides, num_blocks, layers, False)


@dataclass(frozen=True)
class PageWrite:
    """One WRITE as page entries: local[i] → remote[i]."""

    local: np.ndarray
    remote: np.ndarray
    bytes: int

    def __len__(self) -> int:
        return int(self.local.size)


def pages_match(src: Side, dst: Side, src_table: PageTable, dst_table: PageTable, head_range: tuple[int, int]) -> bool:
    """Whether whole pages carry this route (heads [h0, h1)) from src to dst.

    It walks every plane of both sides: decide it once per peer rank and
    route, not per WRITE.
    """
    return (page_geometry(src, dst, *head_range) is not None and src_table.layers == dst_table.layers
            and src_table.block_major == dst_table.block_major)


def page_write(src: Side, dst: Side, src_table: PageTable, dst_table: PageTable, token_range: tuple[int, int],
               layers: frozenset[int] | None = None) -> PageWrite | None:
    """Tokens [t0, t1) as whole pages (the last partly filled block too), on a route pages_match accepted.

    None if the range starts mid-block or the layers cannot be picked out of the table's rows.
    """
    t0, t1 = token_range
    bs = src.block_size
    rows = src_table.rows_of(layers)
    if t0 % bs or src.first_token % bs or dst.first_token % bs or rows is None:
        return None
    positions = np.arange(t0 // bs, -(-t1 // bs), dtype=np.int64)
    src_blocks = src.block_ids[positions - src.first_token // bs].astype(np.int64)
    dst_blocks = dst.block_ids[positions - dst.first_token // bs].astype(np.int64)
    return PageWrite(src_table.entries(src_blocks, rows), dst_table.entries(dst_blocks, rows),
                     int(src_table.sizes[rows].sum()) * int(positions.size))


def merged_count(write: PageWrite, src_table: PageTable, dst_table: PageTable) -> int:
    """How many regions NIXL moves after merging list neighbours contiguous on both sides."""
    if not len(write):
        return 0
    src, dst = src_table.addresses(write.local), dst_table.addresses(write.remote)
    size = src_table.sizes[write.local.astype(np.int64) // src_table.num_blocks]
    joins = (src[1:] == src[:-1] + size[:-1]) & (dst[1:] == dst[:-1] + size[:-1])
    return 1 + int(np.count_nonzero(~joins))
