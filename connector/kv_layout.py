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
    state_tensors: tuple[engine_pb2.StateTensor, ...] = ()  # how a state group's states split over TP ranks (none: they do not)


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
                          sliding_window=group.sliding_window, state_format=group.state_format, state_tensors=group.state_tensors,
                          kernel_block_size=kernel_block_size(group, [layer.tensor for layer in layers if layer.group_index == index]))
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
        kernel = layout.groups[layer.group_index].kernel_block_size or group.block_size
        ratio = group.block_size // kernel
        for plane in () if group.kind == engine_pb2.KV_CACHE_GROUP_KIND_STATE else describe_layer(backend, tuple(tensor.shape), tuple(tensor.stride()), tensor.data_ptr(), tensor.element_size(),
                                    num_blocks=group.num_blocks * ratio, block_size=kernel,
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


def kernel_block_size(group: GroupSpec, tensors: Sequence[Any]) -> int:
    """The attention kernel's block size when vLLM hands the group's layers over in kernel blocks, 0 when it does not.

    vLLM splits each block into block_size / kernel block size kernel blocks
    when the attention backend takes no block as large (a hybrid's logical
    block is sized to its state pages); the tensors then hold that many
    times the group's block count, each of kernel block size tokens.
    """
    if group.kind == engine_pb2.KV_CACHE_GROUP_KIND_STATE or not tensors or tensors[0].shape[0] == group.num_blocks:
        return 0
    ratios = {t.shape[0] // group.num_blocks for t in tensors if t.shape[0] % group.num_blocks == 0}
    if len(ratios) != 1 or group.block_size % next(iter(ratios)):
        shapes = sorted({tuple(t.shape) for t in tensors})
        raise ValueError(f"kvpush: KV tensors {shapes} do not split the group's {group.num_blocks} blocks of {group.block_size} tokens "
                         "into equal kernel blocks")
    return group.block_size // ratios.pop()


def sliding_window_of(spec: Any) -> int:
    """The window of a vLLM SlidingWindowSpec, 0 for any other spec.

    A FullAttentionSpec may carry a sliding_window too (vLLM's hybrid KV
    cache manager off): it keeps every block, so every block moves.
    """
    return (spec.sliding_window or 0) if type(spec).__name__ == "SlidingWindowSpec" else 0


# The Mamba2 config fields that name its group count, by model family (NemotronH and Mamba2; Granite 4 and Falcon-H1; Zamba2).
MAMBA2_GROUP_FIELDS = ("n_groups", "mamba_n_groups", "mamba_ngroups")


def mamba2_state_tensors(spec: Any, hf_config: Any, tp_size: int, conv_dim_first: bool) -> tuple[engine_pb2.StateTensor, ...]:
    """How a Mamba2 layer's conv and SSM states split over TP ranks, read off vLLM's MambaSpec (this rank's shapes).

    The SSM state [heads, head dim, state size] splits by heads; the conv
    state's channels are this rank's x (its heads' channels), then its B
    and C (its groups' state-size channels each), the way vLLM's Mamba2
    weight loader cuts them. () when the spec is not a plain Mamba2 one or
    its shapes do not add up: the states then move only between equal TP
    sizes.
    """
    groups = next((getattr(hf_config, name) for name in MAMBA2_GROUP_FIELDS if isinstance(getattr(hf_config, name, None), int)), None)
    if "MAMBA2" not in str(getattr(spec, "mamba_type", "")).upper() or len(spec.shapes) != 2 or not groups:
        return ()
    (conv_shape, ssm_shape), (conv_dtype, ssm_dtype) = spec.shapes, spec.dtypes
    if len(conv_shape) != 2 or len(ssm_shape) != 3:
        return ()
    local_heads, head_dim, state_size = ssm_shape
    num_heads = local_heads * tp_size
    local_groups = 1 if groups < tp_size else groups // tp_size  # vLLM repeats a single group on every rank
    channel_dim = 0 if conv_dim_first else 1
    if conv_shape[channel_dim] != local_heads * head_dim + 2 * local_groups * state_size:
        return ()
    group_segment = engine_pb2.StateSegment(units=groups, unit_size=state_size)
    return (
        engine_pb2.StateTensor(offset_bytes=0, shape=conv_shape, element_bytes=conv_dtype.itemsize, split_dim=channel_dim,
                               segments=[engine_pb2.StateSegment(units=num_heads, unit_size=head_dim), group_segment, group_segment]),
        engine_pb2.StateTensor(offset_bytes=conv_dtype.itemsize * conv_shape[0] * conv_shape[1], shape=ssm_shape,
                               element_bytes=ssm_dtype.itemsize, split_dim=0, segments=[engine_pb2.StateSegment(units=num_heads, unit_size=1)]),
    )
