import datetime

from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from kvpush.engine.v1 import engine_pb2 as _engine_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EngineState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ENGINE_STATE_UNSPECIFIED: _ClassVar[EngineState]
    ENGINE_STATE_PARTIAL: _ClassVar[EngineState]
    ENGINE_STATE_READY: _ClassVar[EngineState]
    ENGINE_STATE_GONE: _ClassVar[EngineState]

class EngineEventType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ENGINE_EVENT_TYPE_UNSPECIFIED: _ClassVar[EngineEventType]
    ENGINE_EVENT_TYPE_UPSERTED: _ClassVar[EngineEventType]
    ENGINE_EVENT_TYPE_REMOVED: _ClassVar[EngineEventType]
    ENGINE_EVENT_TYPE_SNAPSHOT_END: _ClassVar[EngineEventType]
ENGINE_STATE_UNSPECIFIED: EngineState
ENGINE_STATE_PARTIAL: EngineState
ENGINE_STATE_READY: EngineState
ENGINE_STATE_GONE: EngineState
ENGINE_EVENT_TYPE_UNSPECIFIED: EngineEventType
ENGINE_EVENT_TYPE_UPSERTED: EngineEventType
ENGINE_EVENT_TYPE_REMOVED: EngineEventType
ENGINE_EVENT_TYPE_SNAPSHOT_END: EngineEventType

class RegisteredRank(_message.Message):
    __slots__ = ("rank", "nixl", "layout", "expire_time")
    RANK_FIELD_NUMBER: _ClassVar[int]
    NIXL_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    EXPIRE_TIME_FIELD_NUMBER: _ClassVar[int]
    rank: _engine_pb2.EngineRank
    nixl: _engine_pb2.NixlAgent
    layout: _engine_pb2.KvLayout
    expire_time: _timestamp_pb2.Timestamp
    def __init__(self, rank: _Optional[_Union[_engine_pb2.EngineRank, _Mapping]] = ..., nixl: _Optional[_Union[_engine_pb2.NixlAgent, _Mapping]] = ..., layout: _Optional[_Union[_engine_pb2.KvLayout, _Mapping]] = ..., expire_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class Engine(_message.Message):
    __slots__ = ("engine_id", "incarnation", "role", "tp_size", "pp_size", "compatibility_hash", "state", "ranks", "register_time")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    PP_SIZE_FIELD_NUMBER: _ClassVar[int]
    COMPATIBILITY_HASH_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    REGISTER_TIME_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    incarnation: str
    role: _engine_pb2.EngineRole
    tp_size: int
    pp_size: int
    compatibility_hash: str
    state: EngineState
    ranks: _containers.RepeatedCompositeFieldContainer[RegisteredRank]
    register_time: _timestamp_pb2.Timestamp
    def __init__(self, engine_id: _Optional[str] = ..., incarnation: _Optional[str] = ..., role: _Optional[_Union[_engine_pb2.EngineRole, str]] = ..., tp_size: _Optional[int] = ..., pp_size: _Optional[int] = ..., compatibility_hash: _Optional[str] = ..., state: _Optional[_Union[EngineState, str]] = ..., ranks: _Optional[_Iterable[_Union[RegisteredRank, _Mapping]]] = ..., register_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class RegisterEngineRankRequest(_message.Message):
    __slots__ = ("rank", "nixl", "layout", "compatibility_hash", "lease_ttl")
    RANK_FIELD_NUMBER: _ClassVar[int]
    NIXL_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    COMPATIBILITY_HASH_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_FIELD_NUMBER: _ClassVar[int]
    rank: _engine_pb2.EngineRank
    nixl: _engine_pb2.NixlAgent
    layout: _engine_pb2.KvLayout
    compatibility_hash: str
    lease_ttl: _duration_pb2.Duration
    def __init__(self, rank: _Optional[_Union[_engine_pb2.EngineRank, _Mapping]] = ..., nixl: _Optional[_Union[_engine_pb2.NixlAgent, _Mapping]] = ..., layout: _Optional[_Union[_engine_pb2.KvLayout, _Mapping]] = ..., compatibility_hash: _Optional[str] = ..., lease_ttl: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class RegisterEngineRankResponse(_message.Message):
    __slots__ = ("lease_id", "lease_ttl", "expire_time", "engine_token")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_FIELD_NUMBER: _ClassVar[int]
    EXPIRE_TIME_FIELD_NUMBER: _ClassVar[int]
    ENGINE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    lease_ttl: _duration_pb2.Duration
    expire_time: _timestamp_pb2.Timestamp
    engine_token: str
    def __init__(self, lease_id: _Optional[str] = ..., lease_ttl: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., expire_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., engine_token: _Optional[str] = ...) -> None: ...

class KeepAliveRequest(_message.Message):
    __slots__ = ("lease_ids",)
    LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    lease_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, lease_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class KeepAliveResponse(_message.Message):
    __slots__ = ("expire_time", "unknown_lease_ids")
    EXPIRE_TIME_FIELD_NUMBER: _ClassVar[int]
    UNKNOWN_LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    expire_time: _timestamp_pb2.Timestamp
    unknown_lease_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, expire_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., unknown_lease_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class DeregisterEngineRankRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    def __init__(self, lease_id: _Optional[str] = ...) -> None: ...

class DeregisterEngineRankResponse(_message.Message):
    __slots__ = ("engine",)
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    engine: Engine
    def __init__(self, engine: _Optional[_Union[Engine, _Mapping]] = ...) -> None: ...

class GetEngineRequest(_message.Message):
    __slots__ = ("engine_id",)
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    def __init__(self, engine_id: _Optional[str] = ...) -> None: ...

class GetEngineResponse(_message.Message):
    __slots__ = ("engine",)
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    engine: Engine
    def __init__(self, engine: _Optional[_Union[Engine, _Mapping]] = ...) -> None: ...

class ListEnginesRequest(_message.Message):
    __slots__ = ("role",)
    ROLE_FIELD_NUMBER: _ClassVar[int]
    role: _engine_pb2.EngineRole
    def __init__(self, role: _Optional[_Union[_engine_pb2.EngineRole, str]] = ...) -> None: ...

class ListEnginesResponse(_message.Message):
    __slots__ = ("engines",)
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    engines: _containers.RepeatedCompositeFieldContainer[Engine]
    def __init__(self, engines: _Optional[_Iterable[_Union[Engine, _Mapping]]] = ...) -> None: ...

class WatchEnginesRequest(_message.Message):
    __slots__ = ("role", "start_revision")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    START_REVISION_FIELD_NUMBER: _ClassVar[int]
    role: _engine_pb2.EngineRole
    start_revision: int
    def __init__(self, role: _Optional[_Union[_engine_pb2.EngineRole, str]] = ..., start_revision: _Optional[int] = ...) -> None: ...

class WatchEnginesResponse(_message.Message):
    __slots__ = ("type", "engine", "reason", "revision")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    type: EngineEventType
    engine: Engine
    reason: str
    revision: int
    def __init__(self, type: _Optional[_Union[EngineEventType, str]] = ..., engine: _Optional[_Union[Engine, _Mapping]] = ..., reason: _Optional[str] = ..., revision: _Optional[int] = ...) -> None: ...
