# SPDX-License-Identifier: Apache-2.0
"""Checks on registrar requests: every field of a rank registration (each refusal names its reason and path), its agreement with the engine's other ranks, and role filters."""

from __future__ import annotations

from math import prod

from kvpush.engine.v1 import engine_pb2
from kvpush.errors import AlreadyExists, FailedPrecondition, InvalidArgument, PermissionDenied, Reason
from kvpush.layout import heads
from kvpush.registrar.v1 import registrar_service_pb2 as reg_pb
from kvpush.services.common import validation
from kvpush.services.registrar.config import RegistrarConfig

_ROLES = frozenset(engine_pb2.EngineRole.values()) - {0}
_DTYPES = frozenset(engine_pb2.KvDtype.values()) - {0}
_MEMORY_KINDS = frozenset(engine_pb2.MemoryKind.values()) - {0}
_PLANES = frozenset(engine_pb2.KvPlane.values()) - {0}
_GROUP_KINDS = frozenset(engine_pb2.KvCacheGroupKind.values()) - {0}


def out_of_range(message: str, field: str) -> InvalidArgument:
    return InvalidArgument(message, reason=Reason.FIELD_OUT_OF_RANGE, field=field)


def required(message: str, field: str) -> InvalidArgument:
    return InvalidArgument(message, reason=Reason.FIELD_REQUIRED, field=field)


def check_role_filter(role: int) -> None:
    """A role to filter engines by: 0 (every role) or a known role."""
    if role and role not in _ROLES:
        raise InvalidArgument(f"role has unknown value {role}", reason=Reason.FIELD_INVALID, field="role")


def check_lease_holder(holder_engine_id: str | None, caller_engine_id: str, field: str) -> None:
    """A known lease (holder_engine_id: its engine) may be used only by the engine that holds it; an unknown one (None) is no one's."""
    if holder_engine_id is not None and holder_engine_id != caller_engine_id:
        raise PermissionDenied(f"{caller_engine_id!r} may not act for engine {holder_engine_id!r}", reason=Reason.ENGINE_IDENTITY_MISMATCH, field=field)


def check_same_rank(registered: reg_pb.RegisteredRank, request: reg_pb.RegisterEngineRankRequest) -> None:
    """A rank registered again must repeat its metadata exactly (then the registration is idempotent)."""
    rank = request.rank
    if registered.rank != rank or registered.nixl != request.nixl or registered.layout != request.layout:
        raise AlreadyExists(
            f"rank (tp {rank.tp_rank}, pp {rank.pp_rank}) of {rank.engine_id} incarnation {rank.incarnation} is already registered with different metadata",
            reason=Reason.CONFLICTING_DUPLICATE,
            field="rank",
        )


def check_same_engine(record, request: reg_pb.RegisterEngineRankRequest) -> None:
    """A rank of an engine incarnation already registered must agree with its other ranks.

    record: that engine (a directory record or a stored Engine message: both
    have its engine_id, incarnation, role, sizes and compatibility_hash).
    """
    rank = request.rank
    if rank.role != record.role:
        raise FailedPrecondition(
            f"{record.engine_id} incarnation {record.incarnation} registered as {engine_pb2.EngineRole.Name(record.role)}",
            reason=Reason.ENGINE_ROLE_MISMATCH,
            field="rank.role",
        )
    for name, value, expected in (("tp_size", rank.tp_size, record.tp_size), ("pp_size", rank.pp_size, record.pp_size)):
        if value != expected:
            raise FailedPrecondition(
                f"other ranks of {record.engine_id} registered {name} {expected}, not {value}",
                reason=Reason.INCOMPATIBLE_LAYOUT,
                field=f"rank.{name}",
            )
    if request.compatibility_hash != record.compatibility_hash:
        raise FailedPrecondition(
            f"other ranks of {record.engine_id} registered compatibility_hash {record.compatibility_hash!r}",
            reason=Reason.INCOMPATIBLE_LAYOUT,
            field="compatibility_hash",
        )


def registration_ttl(request: reg_pb.RegisterEngineRankRequest, cfg: RegistrarConfig) -> float:
    """Checks every field of a registration; returns the lease TTL to grant, in seconds."""
    if not request.HasField("rank"):
        raise required("rank is required", "rank")
    rank = request.rank
    validation.check_id(rank.engine_id, "rank.engine_id")
    validation.check_text(rank.incarnation, "rank.incarnation", cfg.max_text_length)
    validation.check_enum(rank.role, _ROLES, "rank.role")
    if rank.tp_size == 0:
        raise required("rank.tp_size must be at least 1", "rank.tp_size")
    if rank.pp_size == 0:
        raise required("rank.pp_size must be at least 1", "rank.pp_size")
    if rank.tp_size * rank.pp_size > cfg.max_ranks_per_engine:
        raise out_of_range(f"an engine may have at most {cfg.max_ranks_per_engine} ranks", "rank.tp_size")
    if rank.tp_rank >= rank.tp_size:
        raise out_of_range(f"rank.tp_rank {rank.tp_rank} is not below tp_size {rank.tp_size}", "rank.tp_rank")
    if rank.pp_rank >= rank.pp_size:
        raise out_of_range(f"rank.pp_rank {rank.pp_rank} is not below pp_size {rank.pp_size}", "rank.pp_rank")

    if not request.HasField("nixl"):
        raise required("nixl is required", "nixl")
    nixl = request.nixl
    validation.check_text(nixl.agent_name, "nixl.agent_name", cfg.max_text_length)
    if not nixl.agent_metadata:
        raise required("nixl.agent_metadata is required", "nixl.agent_metadata")
    if len(nixl.agent_metadata) > cfg.max_agent_metadata_bytes:
        raise out_of_range(f"nixl.agent_metadata exceeds {cfg.max_agent_metadata_bytes} bytes", "nixl.agent_metadata")
    if len(nixl.backends) > cfg.max_backends:
        raise out_of_range(f"nixl.backends lists more than {cfg.max_backends} backends", "nixl.backends")
    for i, backend in enumerate(nixl.backends):
        validation.check_text(backend, f"nixl.backends[{i}]", cfg.max_text_length)

    if not request.HasField("layout"):
        raise required("layout is required", "layout")
    _check_layout(request.layout, cfg)
    _check_state_tensors(request.layout, request.rank.tp_rank, request.rank.tp_size)
    validation.check_text(request.compatibility_hash, "compatibility_hash", cfg.max_text_length)

    if not request.HasField("lease_ttl"):
        return cfg.default_lease_ttl_s
    requested = request.lease_ttl.seconds + request.lease_ttl.nanos * 1e-9
    if requested < 0:
        raise out_of_range("lease_ttl must not be negative", "lease_ttl")
    if requested == 0:
        return cfg.default_lease_ttl_s
    return min(max(requested, cfg.min_lease_ttl_s), cfg.max_lease_ttl_s)

def _check_state_tensors(layout: engine_pb2.KvLayout, tp_rank: int, tp_size: int) -> None:
    """A state group's split must be one a peer of any TP size can plan with: its states inside every state block, each
    split dimension tiled by this rank's share of its segments."""
    state_bytes = {r.group_index: r.state_bytes for r in layout.regions if r.plane == engine_pb2.KV_PLANE_STATE}
    for i, group in enumerate(layout.groups):
        for j, tensor in enumerate(group.state_tensors):
            where = f"layout.groups[{i}].state_tensors[{j}]"
            if group.kind != engine_pb2.KV_CACHE_GROUP_KIND_STATE:
                raise InvalidArgument("only a KV_CACHE_GROUP_KIND_STATE group has state tensors", reason=Reason.FIELD_INVALID, field=where)
            if tensor.element_bytes == 0:
                raise required(f"{where}.element_bytes must be positive", f"{where}.element_bytes")
            if tensor.split_dim >= len(tensor.shape) or 0 in tensor.shape:
                raise out_of_range(f"{where}.split_dim {tensor.split_dim} must name one of the positive dimensions of shape "
                                   f"{list(tensor.shape)}", f"{where}.split_dim")
            end = tensor.offset_bytes + prod(tensor.shape) * tensor.element_bytes
            if end > state_bytes.get(group.group_index, 0):
                raise out_of_range(f"the state ends at byte {end}, past its layers' state_bytes {state_bytes.get(group.group_index, 0)}",
                                   f"{where}.offset_bytes")
            share = 0
            for k, segment in enumerate(tensor.segments):
                if segment.units == 0 or segment.unit_size == 0:
                    raise required(f"{where}.segments[{k}] needs positive units and unit_size", f"{where}.segments[{k}]")
                try:
                    share += heads.even_split(segment.units, tp_size)[tp_rank].num_heads * segment.unit_size
                except ValueError as exc:
                    raise out_of_range(f"{where}.segments[{k}]: {exc}", f"{where}.segments[{k}].units") from None
            if share != tensor.shape[tensor.split_dim]:
                raise out_of_range(f"this rank's share of the segments is {share} elements, not the split dimension's "
                                   f"{tensor.shape[tensor.split_dim]}", f"{where}.segments")


def _check_layout(layout: engine_pb2.KvLayout, cfg: RegistrarConfig) -> None:
    validation.check_enum(layout.dtype, _DTYPES, "layout.dtype")
    if layout.head_size == 0:
        raise required("layout.head_size must be positive", "layout.head_size")
    if layout.total_kv_heads == 0:
        raise required("layout.total_kv_heads must be positive", "layout.total_kv_heads")
    if layout.num_local_heads == 0:
        raise required("layout.num_local_heads must be positive", "layout.num_local_heads")
    if layout.first_head + layout.num_local_heads > layout.total_kv_heads:
        raise out_of_range(
            f"heads [{layout.first_head}, {layout.first_head + layout.num_local_heads}) exceed total_kv_heads {layout.total_kv_heads}",
            "layout.first_head",
        )
    if layout.num_layers == 0:
        raise required("layout.num_layers must be positive", "layout.num_layers")
    validation.check_enum(layout.memory_kind, _MEMORY_KINDS, "layout.memory_kind")

    if not layout.groups:
        raise required("layout.groups needs at least one group", "layout.groups")
    if len(layout.groups) > cfg.max_groups:
        raise out_of_range(f"layout.groups lists more than {cfg.max_groups} groups", "layout.groups")
    group_indexes: set[int] = set()
    for i, group in enumerate(layout.groups):
        where = f"layout.groups[{i}]"
        if group.group_index in group_indexes:
            raise InvalidArgument(f"group_index {group.group_index} is listed twice", reason=Reason.FIELD_INVALID, field=f"{where}.group_index")
        group_indexes.add(group.group_index)
        validation.check_enum(group.kind, _GROUP_KINDS, f"{where}.kind")
        if group.block_size == 0:
            raise required(f"{where}.block_size must be positive", f"{where}.block_size")
        if group.num_blocks == 0:
            raise required(f"{where}.num_blocks must be positive", f"{where}.num_blocks")
        if group.kernel_block_size and group.block_size % group.kernel_block_size:
            raise out_of_range(f"{where}.kernel_block_size {group.kernel_block_size} must divide block_size {group.block_size}",
                               f"{where}.kernel_block_size")

    if not layout.regions:
        raise required("layout.regions needs at least one region", "layout.regions")
    if len(layout.regions) > cfg.max_regions:
        raise out_of_range(f"layout.regions lists more than {cfg.max_regions} regions", "layout.regions")
    seen: set[tuple[int, int]] = set()
    for i, region in enumerate(layout.regions):
        where = f"layout.regions[{i}]"
        validation.check_text(region.layer_name, f"{where}.layer_name", cfg.max_text_length)
        if region.layer_index >= layout.num_layers:
            raise out_of_range(f"layer_index {region.layer_index} is not below num_layers {layout.num_layers}", f"{where}.layer_index")
        if region.group_index not in group_indexes:
            raise InvalidArgument(f"group_index {region.group_index} names no group", reason=Reason.FIELD_INVALID, field=f"{where}.group_index")
        validation.check_enum(region.plane, _PLANES, f"{where}.plane")
        if (region.layer_index, region.plane) in seen:
            raise InvalidArgument("this (layer_index, plane) is described twice", reason=Reason.FIELD_INVALID, field=f"{where}.plane")
        seen.add((region.layer_index, region.plane))
        if region.base_address == 0:
            raise required(f"{where}.base_address is required", f"{where}.base_address")
        if region.block_stride_bytes == 0:
            raise required(f"{where}.block_stride_bytes must be positive", f"{where}.block_stride_bytes")
        if region.plane == engine_pb2.KV_PLANE_STATE:
            if region.state_bytes == 0 or region.state_bytes > region.block_stride_bytes:
                raise out_of_range(f"{where}.state_bytes must be positive and at most block_stride_bytes", f"{where}.state_bytes")
            continue
        if region.token_stride_bytes == 0:
            raise required(f"{where}.token_stride_bytes must be positive", f"{where}.token_stride_bytes")
        if region.head_stride_bytes == 0 and layout.num_local_heads > 1:
            raise required(f"{where}.head_stride_bytes must be positive with several local heads", f"{where}.head_stride_bytes")
