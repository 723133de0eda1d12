# SPDX-License-Identifier: Apache-2.0
"""Describes KV cache tensors as a KvLayout plus the memory NIXL must register.

vLLM-free, so the data-path benchmark and the tests build layouts from plain
tensors the same way the worker does from vLLM's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvpush.connector.nixl_agent import MemoryRange
from kvpush.engine.v1 import engine_pb2
from kvpush.layout.geometry import TORCH_DTYPES, describe_layer


@dataclass(frozen=True)
class LayerTensor:
    """One attention layer's KV cache tensor ([blocks, heads, block_size, 2 * head_size], MLA: [blocks, block_size, head_size])."""

    layer_index: int
    name: str
    group_index: int
    tensor: Any  # torch.Tensor


@dataclass(frozen=True)
class GroupSpec:
    """One KV cache group: its block size, block count, attention kind (engine_pb2.KvCacheGroupKind) and sliding window."""

    block_size: int
    num_blocks: int
    kind: int = engine_pb2.KV_CACHE_GROUP_KIND_FULL_ATTENTION
    sliding_window: int = 0
    state_format: str = ""  # a state group's layout, which P and D must share


def first_head_of(tp_rank: int, tp_size: int, total_heads: int, local_heads: int) -> int:
    """The first global KV head a TP rank holds (heads replicate when TP exceeds their count)."""
    if tp_size >= total_heads:
        return tp_rank // (tp_size // total_heads)
    return tp_rank * local_heads


def build_layout(
    backend: str,
    layers: Sequence[LayerTensor],
    groups: Sequence[GroupSpec],
    *,
    dtype: str,
    head_size: int,
    total_kv_heads: int,
    num_local_heads: int,
    num_layers: int | None = None,
    tp_rank: int = 0,
    tp_size: int = 1,
) -> tuple[engine_pb2.KvLayout, list[MemoryRange], int]:
    """(layout, memory ranges to register, device index); num_layers: the model's (default: the layers given)."""
    kv_dtype = TORCH_DTYPES.get(dtype)
    if kv_dtype is None:
        raise ValueError(f"kvpush: KV cache dtype {dtype} is not supported")
    layout = engine_pb2.KvLayout(
        dtype=kv_dtype,
        head_size=head_size,
        total_kv_heads=total_kv_heads,
        num_local_heads=num_local_heads,
        first_head=first_head_of(tp_rank, tp_size, total_kv_heads, num_local_heads),
        num_layers=len(layers) if num_layers is None else num_layers,
        memory_kind=engine_pb2.MEMORY_KIND_DRAM,
    )
    for index, group in enumerate(groups):
        layout.groups.add(group_index=index, kind=group.kind, block_size=group.block_size, num_blocks=group.num_blocks,
                          sliding_window=group.sliding_window, state_format=group.state_format)
    ranges: list[MemoryRange] = []
    device = 0
    for layer in sorted(layers, key=lambda layer: layer.layer_index):
        tensor = layer.tensor
        if tensor.is_cuda:
            layout.memory_kind = engine_pb2.MEMORY_KIND_VRAM
            device = tensor.device.index or 0
        group = groups[layer.group_index]
        if group.kind == engine_pb2.KV_CACHE_GROUP_KIND_STATE:
            # vLLM hands a state layer over as its raw pages ([blocks, 1, 1, state bytes], int8), the state at each page's start.
            if tensor.element_size() != 1 or tensor.dim() != 4 or tuple(tensor.shape[1:3]) != (1, 1):
                raise ValueError(f"kvpush: state layer {layer.name} is {tuple(tensor.shape)} {tensor.dtype}; expected vLLM's raw pages "
                                 "[blocks, 1, 1, state bytes] of int8")
            layout.regions.add(layer_name=layer.name, layer_index=layer.layer_index, group_index=layer.group_index,
                               plane=engine_pb2.KV_PLANE_STATE, base_address=tensor.data_ptr(), block_stride_bytes=tensor.stride(0),
                               state_bytes=tensor.shape[3], device_id=device)
        for plane in () if group.kind == engine_pb2.KV_CACHE_GROUP_KIND_STATE else describe_layer(backend, tuple(tensor.shape), tuple(tensor.stride()), tensor.data_ptr(), tensor.element_size(),
                                    num_blocks=group.num_blocks, block_size=group.block_size,
                                    num_local_heads=num_local_heads, head_size=head_size, layer_index=layer.layer_index,
                                    latent=group.kind == engine_pb2.KV_CACHE_GROUP_KIND_MLA):
            layout.regions.add(layer_name=layer.name, layer_index=layer.layer_index, group_index=layer.group_index,
                               plane=plane.plane, base_address=plane.base, block_stride_bytes=plane.block_stride,
                               head_stride_bytes=plane.head_stride, token_stride_bytes=plane.token_stride,
                               channel_stride_bytes=plane.channel_stride, device_id=device)
        storage = tensor.untyped_storage()
        memory = MemoryRange(storage.data_ptr(), storage.nbytes(), device)
        if memory not in ranges:  # a hybrid's groups may share one tensor per layer pair (vLLM's KVCacheTensor.shared_by)
            ranges.append(memory)
    return layout, ranges, device


def sliding_window_of(spec: Any) -> int:
    """The window of a vLLM SlidingWindowSpec, 0 for any other spec.

    A FullAttentionSpec may carry a sliding_window too (vLLM's hybrid KV
    cache manager off): it keeps every block, so every block moves.
    """
    return (spec.sliding_window or 0) if type(spec).__name__ == "SlidingWindowSpec" else 0
