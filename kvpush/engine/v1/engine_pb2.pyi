from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EngineRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ENGINE_ROLE_UNSPECIFIED: _ClassVar[EngineRole]
    ENGINE_ROLE_PREFILL: _ClassVar[EngineRole]
    ENGINE_ROLE_DECODE: _ClassVar[EngineRole]

class KvDtype(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_DTYPE_UNSPECIFIED: _ClassVar[KvDtype]
    KV_DTYPE_FLOAT32: _ClassVar[KvDtype]
    KV_DTYPE_FLOAT16: _ClassVar[KvDtype]
    KV_DTYPE_BFLOAT16: _ClassVar[KvDtype]
    KV_DTYPE_FP8_E4M3: _ClassVar[KvDtype]
    KV_DTYPE_FP8_E5M2: _ClassVar[KvDtype]

class MemoryKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MEMORY_KIND_UNSPECIFIED: _ClassVar[MemoryKind]
    MEMORY_KIND_DRAM: _ClassVar[MemoryKind]
    MEMORY_KIND_VRAM: _ClassVar[MemoryKind]

class KvPlane(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_PLANE_UNSPECIFIED: _ClassVar[KvPlane]
    KV_PLANE_KEY: _ClassVar[KvPlane]
    KV_PLANE_VALUE: _ClassVar[KvPlane]
    KV_PLANE_LATENT: _ClassVar[KvPlane]
    KV_PLANE_STATE: _ClassVar[KvPlane]

class KvCacheGroupKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_CACHE_GROUP_KIND_UNSPECIFIED: _ClassVar[KvCacheGroupKind]
    KV_CACHE_GROUP_KIND_FULL_ATTENTION: _ClassVar[KvCacheGroupKind]
    KV_CACHE_GROUP_KIND_MLA: _ClassVar[KvCacheGroupKind]
    KV_CACHE_GROUP_KIND_SLIDING_WINDOW: _ClassVar[KvCacheGroupKind]
    KV_CACHE_GROUP_KIND_STATE: _ClassVar[KvCacheGroupKind]
ENGINE_ROLE_UNSPECIFIED: EngineRole
ENGINE_ROLE_PREFILL: EngineRole
ENGINE_ROLE_DECODE: EngineRole
KV_DTYPE_UNSPECIFIED: KvDtype
KV_DTYPE_FLOAT32: KvDtype
KV_DTYPE_FLOAT16: KvDtype
KV_DTYPE_BFLOAT16: KvDtype
KV_DTYPE_FP8_E4M3: KvDtype
KV_DTYPE_FP8_E5M2: KvDtype
MEMORY_KIND_UNSPECIFIED: MemoryKind
MEMORY_KIND_DRAM: MemoryKind
MEMORY_KIND_VRAM: MemoryKind
KV_PLANE_UNSPECIFIED: KvPlane
KV_PLANE_KEY: KvPlane
KV_PLANE_VALUE: KvPlane
KV_PLANE_LATENT: KvPlane
KV_PLANE_STATE: KvPlane
KV_CACHE_GROUP_KIND_UNSPECIFIED: KvCacheGroupKind
KV_CACHE_GROUP_KIND_FULL_ATTENTION: KvCacheGroupKind
KV_CACHE_GROUP_KIND_MLA: KvCacheGroupKind
KV_CACHE_GROUP_KIND_SLIDING_WINDOW: KvCacheGroupKind
KV_CACHE_GROUP_KIND_STATE: KvCacheGroupKind

class EngineRank(_message.Message):
    __slots__ = ("engine_id", "incarnation", "role", "tp_rank", "tp_size", "pp_rank", "pp_size")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    PP_RANK_FIELD_NUMBER: _ClassVar[int]
    PP_SIZE_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    incarnation: str
    role: EngineRole
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    def __init__(self, engine_id: _Optional[str] = ..., incarnation: _Optional[str] = ..., role: _Optional[_Union[EngineRole, str]] = ..., tp_rank: _Optional[int] = ..., tp_size: _Optional[int] = ..., pp_rank: _Optional[int] = ..., pp_size: _Optional[int] = ...) -> None: ...

class NixlAgent(_message.Message):
    __slots__ = ("agent_name", "agent_metadata", "backends")
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    BACKENDS_FIELD_NUMBER: _ClassVar[int]
    agent_name: str
    agent_metadata: bytes
    backends: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, agent_name: _Optional[str] = ..., agent_metadata: _Optional[bytes] = ..., backends: _Optional[_Iterable[str]] = ...) -> None: ...

class KvRegion(_message.Message):
    __slots__ = ("layer_name", "layer_index", "group_index", "plane", "base_address", "block_stride_bytes", "head_stride_bytes", "token_stride_bytes", "device_id", "channel_stride_bytes", "state_bytes")
    LAYER_NAME_FIELD_NUMBER: _ClassVar[int]
    LAYER_INDEX_FIELD_NUMBER: _ClassVar[int]
    GROUP_INDEX_FIELD_NUMBER: _ClassVar[int]
    PLANE_FIELD_NUMBER: _ClassVar[int]
    BASE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_STRIDE_BYTES_FIELD_NUMBER: _ClassVar[int]
    HEAD_STRIDE_BYTES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_STRIDE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    CHANNEL_STRIDE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STATE_BYTES_FIELD_NUMBER: _ClassVar[int]
    layer_name: str
    layer_index: int
    group_index: int
    plane: KvPlane
    base_address: int
    block_stride_bytes: int
    head_stride_bytes: int
    token_stride_bytes: int
    device_id: int
    channel_stride_bytes: int
    state_bytes: int
    def __init__(self, layer_name: _Optional[str] = ..., layer_index: _Optional[int] = ..., group_index: _Optional[int] = ..., plane: _Optional[_Union[KvPlane, str]] = ..., base_address: _Optional[int] = ..., block_stride_bytes: _Optional[int] = ..., head_stride_bytes: _Optional[int] = ..., token_stride_bytes: _Optional[int] = ..., device_id: _Optional[int] = ..., channel_stride_bytes: _Optional[int] = ..., state_bytes: _Optional[int] = ...) -> None: ...

class KvCacheGroup(_message.Message):
    __slots__ = ("group_index", "kind", "block_size", "num_blocks", "sliding_window", "state_format", "state_tensors", "kernel_block_size")
    GROUP_INDEX_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SLIDING_WINDOW_FIELD_NUMBER: _ClassVar[int]
    STATE_FORMAT_FIELD_NUMBER: _ClassVar[int]
    STATE_TENSORS_FIELD_NUMBER: _ClassVar[int]
    KERNEL_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    group_index: int
    kind: KvCacheGroupKind
    block_size: int
    num_blocks: int
    sliding_window: int
    state_format: str
    state_tensors: _containers.RepeatedCompositeFieldContainer[StateTensor]
    kernel_block_size: int
    def __init__(self, group_index: _Optional[int] = ..., kind: _Optional[_Union[KvCacheGroupKind, str]] = ..., block_size: _Optional[int] = ..., num_blocks: _Optional[int] = ..., sliding_window: _Optional[int] = ..., state_format: _Optional[str] = ..., state_tensors: _Optional[_Iterable[_Union[StateTensor, _Mapping]]] = ..., kernel_block_size: _Optional[int] = ...) -> None: ...

class StateTensor(_message.Message):
    __slots__ = ("offset_bytes", "shape", "element_bytes", "split_dim", "segments")
    OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    ELEMENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    SPLIT_DIM_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    offset_bytes: int
    shape: _containers.RepeatedScalarFieldContainer[int]
    element_bytes: int
    split_dim: int
    segments: _containers.RepeatedCompositeFieldContainer[StateSegment]
    def __init__(self, offset_bytes: _Optional[int] = ..., shape: _Optional[_Iterable[int]] = ..., element_bytes: _Optional[int] = ..., split_dim: _Optional[int] = ..., segments: _Optional[_Iterable[_Union[StateSegment, _Mapping]]] = ...) -> None: ...

class StateSegment(_message.Message):
    __slots__ = ("units", "unit_size")
    UNITS_FIELD_NUMBER: _ClassVar[int]
    UNIT_SIZE_FIELD_NUMBER: _ClassVar[int]
    units: int
    unit_size: int
    def __init__(self, units: _Optional[int] = ..., unit_size: _Optional[int] = ...) -> None: ...

class KvLayout(_message.Message):
    __slots__ = ("dtype", "head_size", "total_kv_heads", "first_head", "num_local_heads", "num_layers", "memory_kind", "groups", "regions")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    HEAD_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    FIRST_HEAD_FIELD_NUMBER: _ClassVar[int]
    NUM_LOCAL_HEADS_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_KIND_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    dtype: KvDtype
    head_size: int
    total_kv_heads: int
    first_head: int
    num_local_heads: int
    num_layers: int
    memory_kind: MemoryKind
    groups: _containers.RepeatedCompositeFieldContainer[KvCacheGroup]
    regions: _containers.RepeatedCompositeFieldContainer[KvRegion]
    def __init__(self, dtype: _Optional[_Union[KvDtype, str]] = ..., head_size: _Optional[int] = ..., total_kv_heads: _Optional[int] = ..., first_head: _Optional[int] = ..., num_local_heads: _Optional[int] = ..., num_layers: _Optional[int] = ..., memory_kind: _Optional[_Union[MemoryKind, str]] = ..., groups: _Optional[_Iterable[_Union[KvCacheGroup, _Mapping]]] = ..., regions: _Optional[_Iterable[_Union[KvRegion, _Mapping]]] = ...) -> None: ...

class BlockList(_message.Message):
    __slots__ = ("group_index", "block_ids", "first_token")
    GROUP_INDEX_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    group_index: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    first_token: int
    def __init__(self, group_index: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ..., first_token: _Optional[int] = ...) -> None: ...
