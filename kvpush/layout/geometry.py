# SPDX-License-Identifier: Apache-2.0
"""Byte geometry of a worker's KV cache, as carried in KvLayout.

Every full-attention layer is described by two planes (keys, values), every
MLA layer by one (its latent, as one head of head_size elements). Four byte
strides place blocks, heads, tokens and channels (the head_size elements of
one token of one head) within a plane. That is enough for a peer to address
any (layer, plane, block, head, token, channel), whatever the attention
backend's tensor shape, and to move KV between sides whose block sizes or
tensor-parallel splits differ.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpush.engine.v1 import engine_pb2
from kvpush.layout import states

DTYPE_SIZES = {
    engine_pb2.KV_DTYPE_FLOAT32: 4,
    engine_pb2.KV_DTYPE_FLOAT16: 2,
    engine_pb2.KV_DTYPE_BFLOAT16: 2,
    engine_pb2.KV_DTYPE_FP8_E4M3: 1,
    engine_pb2.KV_DTYPE_FP8_E5M2: 1,
}

TORCH_DTYPES = {
    "torch.float32": engine_pb2.KV_DTYPE_FLOAT32,
    "torch.float16": engine_pb2.KV_DTYPE_FLOAT16,
    "torch.bfloat16": engine_pb2.KV_DTYPE_BFLOAT16,
    "torch.float8_e4m3fn": engine_pb2.KV_DTYPE_FP8_E4M3,
    "torch.float8_e5m2": engine_pb2.KV_DTYPE_FP8_E5M2,
    "torch.uint8": engine_pb2.KV_DTYPE_FP8_E4M3,
}


@dataclass(frozen=True)
class Plane:
    """One (layer, plane) region: where channel c of token t of local head h of block b lives."""

    layer_index: int
    plane: int  # engine_pb2.KvPlane
    base: int
    block_stride: int
    head_stride: int
    token_stride: int
    channel_stride: int  # the element size when channels are contiguous

    def address(self, block: int, head: int, token: int, channel: int = 0) -> int:
        return self.base + block * self.block_stride + head * self.head_stride + token * self.token_stride + channel * self.channel_stride


def describe_layer(
    backend_name: str,
    shape: tuple[int, ...],
    strides_elems: tuple[int, ...],
    data_ptr: int,
    element_size: int,
    *,
    num_blocks: int,
    block_size: int,
    num_local_heads: int,
    head_size: int,
    layer_index: int,
    latent: bool = False,
) -> tuple[Plane, ...]:
    """The planes of one layer's vLLM KV cache tensor: key and value, or an MLA layer's latent.

    An MLA layer's (`latent`) cache is [B, N, C] (C = head_size, the latent
    and the rope key of one token), [B, 1, N, C] on the CPU model runner.
    vLLM 0.32+ hands every other attention layer as a logical [B, H, N, C]
    tensor (C = key channels then value channels). Most backends store token n's key
    in C[:head_size] and its value in C[head_size:]. The CPU backend
    reinterprets each (block, head) page as keys transposed ([head_size,
    block_size], channel-major) followed by values ([block_size, head_size]).
    """
    if latent:
        if len(shape) == 4 and shape[1] == 1:  # the one head of a [B, 1, N, C] view
            shape, strides_elems = (shape[0], *shape[2:]), (strides_elems[0], *strides_elems[2:])
        if len(shape) != 3:
            raise ValueError(f"expected an MLA [blocks, tokens, latent] KV tensor, got shape {shape}")
        return (_latent_plane(shape, strides_elems, data_ptr, element_size, num_blocks=num_blocks, block_size=block_size,
                              head_size=head_size, layer_index=layer_index),)
    if len(shape) != 4:
        raise ValueError(f"expected a [blocks, heads, tokens, channels] KV tensor, got shape {shape}")
    blocks, heads, tokens, channels = shape
    if blocks != num_blocks:
        raise ValueError(f"KV tensor has {blocks} blocks, not the {num_blocks} (kernel) blocks of its group")
    if heads != num_local_heads or channels != 2 * head_size or tokens != block_size:
        raise ValueError(
            f"KV tensor shape {shape} does not match blocks={num_blocks} heads={num_local_heads} "
            f"block_size={block_size} head_size={head_size} (keys and values of equal size)"
        )
    s_block, s_head, s_token, s_chan = (s * element_size for s in strides_elems)
    if s_chan != element_size:
        raise ValueError(f"KV tensor channels are not contiguous (strides {strides_elems})")
    row = head_size * element_size
    if backend_name == "CPU_ATTN":
        if s_token != 2 * row or s_head != block_size * 2 * row:
            raise ValueError(f"CPU_ATTN KV pages must be contiguous per (block, head); strides {strides_elems}")
        es = element_size
        key = Plane(layer_index, engine_pb2.KV_PLANE_KEY, data_ptr, s_block, s_head, es, block_size * es)
        value = Plane(layer_index, engine_pb2.KV_PLANE_VALUE, data_ptr + block_size * row, s_block, s_head, row, es)
        return key, value
    key = Plane(layer_index, engine_pb2.KV_PLANE_KEY, data_ptr, s_block, s_head, s_token, element_size)
    value = Plane(layer_index, engine_pb2.KV_PLANE_VALUE, data_ptr + row, s_block, s_head, s_token, element_size)
    return key, value


def _latent_plane(shape: tuple[int, ...], strides_elems: tuple[int, ...], data_ptr: int, element_size: int, *, num_blocks: int,
                  block_size: int, head_size: int, layer_index: int) -> Plane:
    """The one plane of an MLA layer's [blocks, tokens, latent] cache."""
    blocks, tokens, channels = shape
    if blocks != num_blocks:
        raise ValueError(f"MLA KV tensor has {blocks} blocks, not the {num_blocks} (kernel) blocks of its group")
    if tokens != block_size or channels != head_size:
        raise ValueError(f"MLA KV tensor shape {shape} does not match blocks={num_blocks} block_size={block_size} latent={head_size}")
    s_block, s_token, s_chan = (s * element_size for s in strides_elems)
    if s_chan != element_size or s_token != head_size * element_size:
        raise ValueError(f"MLA KV tensor tokens must be contiguous rows of the latent (strides {strides_elems})")
    # One head: its stride is never used to step, so it is the page (every token of the block).
    return Plane(layer_index, engine_pb2.KV_PLANE_LATENT, data_ptr, s_block, block_size * s_token, s_token, element_size)


def planes_from_layout(layout: engine_pb2.KvLayout, group: int | None = None) -> list[Plane]:
    """The planes of a KvLayout (of one KV cache group if given), ordered by (layer_index, plane)."""
    element = DTYPE_SIZES[layout.dtype]
    planes = [
        Plane(r.layer_index, r.plane, r.base_address, r.block_stride_bytes, r.head_stride_bytes, r.token_stride_bytes,
              r.channel_stride_bytes or element)
        for r in layout.regions
        if (group is None or r.group_index == group) and r.plane != engine_pb2.KV_PLANE_STATE
    ]
    planes.sort(key=lambda p: (p.layer_index, p.plane))
    return planes


def dtype_bytes(layout: engine_pb2.KvLayout) -> int:
    return DTYPE_SIZES[layout.dtype]


def describe_kv(layout: engine_pb2.KvLayout) -> str:
    """A worker's KV cache in words, naming what P and D must agree on."""
    kinds = {g.kind for g in layout.groups}
    dtype = engine_pb2.KvDtype.Name(layout.dtype).removeprefix("KV_DTYPE_").lower()
    if kinds == {engine_pb2.KV_CACHE_GROUP_KIND_MLA}:
        what = f"MLA (a latent of {layout.head_size} {dtype} elements per token"
    else:
        what = f"full attention ({layout.total_kv_heads} KV heads of {layout.head_size} {dtype} elements"
    states = [g.state_format for g in layout.groups if g.kind == engine_pb2.KV_CACHE_GROUP_KIND_STATE]
    return f"{what}, {layout.num_layers} layers" + "".join(f"; state {f}" for f in states) + ")"


def layout_mismatch(prefill: engine_pb2.KvLayout, decode: engine_pb2.KvLayout) -> str:
    """Why two workers' KV caches cannot exchange bytes ("" when what must match does)."""
    if compatibility_fields(prefill) == compatibility_fields(decode):
        return ""
    return f"the prefill engine's KV cache is {describe_kv(prefill)} and the decode engine's is {describe_kv(decode)}"


def compatibility_fields(layout: engine_pb2.KvLayout) -> tuple:
    """What must match between P and D for bytes to mean the same thing.

    Block size, block count and tensor-parallel split may differ; the
    per-token per-head element layout and how states split may not.
    """
    return (layout.dtype, layout.head_size, layout.total_kv_heads, layout.num_layers, tuple(sorted({g.kind for g in layout.groups})),
            tuple(sorted(g.state_format for g in layout.groups if g.state_format)),
            tuple(sorted(states.signature(g) for g in layout.groups if states.splittable(g))))


def window_first_token(first_token: int, end_token: int, block_size: int, sliding_window: int) -> int:
    """The first token of [first_token, end_token) a sliding-window group moves, block-aligned (first_token itself without a window).

    D's first decode step computes token end_token (the prompt's last) and
    reads the window's tokens before it, [end_token + 1 - sliding_window,
    end_token); vLLM gives back the blocks wholly before them, on P too.
    """
    if not sliding_window:
        return first_token
    return max(first_token, max(end_token + 1 - sliding_window, 0) // block_size * block_size)
