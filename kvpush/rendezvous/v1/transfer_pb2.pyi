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

class TransferState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRANSFER_STATE_UNSPECIFIED: _ClassVar[TransferState]
    TRANSFER_STATE_WAITING_FOR_PREFILL: _ClassVar[TransferState]
    TRANSFER_STATE_WAITING_FOR_REGISTRATION: _ClassVar[TransferState]
    TRANSFER_STATE_MATCHED: _ClassVar[TransferState]
    TRANSFER_STATE_WRITING: _ClassVar[TransferState]
    TRANSFER_STATE_DONE: _ClassVar[TransferState]
    TRANSFER_STATE_FAILED: _ClassVar[TransferState]
    TRANSFER_STATE_CANCELLED: _ClassVar[TransferState]
    TRANSFER_STATE_SUPERSEDED: _ClassVar[TransferState]

class TransferSide(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRANSFER_SIDE_UNSPECIFIED: _ClassVar[TransferSide]
    TRANSFER_SIDE_PREFILL: _ClassVar[TransferSide]
    TRANSFER_SIDE_DECODE: _ClassVar[TransferSide]

class EndReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    END_REASON_UNSPECIFIED: _ClassVar[EndReason]
    END_REASON_COMPLETED: _ClassVar[EndReason]
    END_REASON_CANCELLED_BY_ROUTER: _ClassVar[EndReason]
    END_REASON_CANCELLED_BY_PREFILL: _ClassVar[EndReason]
    END_REASON_CANCELLED_BY_DECODE: _ClassVar[EndReason]
    END_REASON_SUPERSEDED: _ClassVar[EndReason]
    END_REASON_REGISTRATION_DEADLINE_EXCEEDED: _ClassVar[EndReason]
    END_REASON_PREFILL_DEADLINE_EXCEEDED: _ClassVar[EndReason]
    END_REASON_PREFILL_ENGINE_LOST: _ClassVar[EndReason]
    END_REASON_DECODE_ENGINE_LOST: _ClassVar[EndReason]
    END_REASON_WRITE_FAILED: _ClassVar[EndReason]
    END_REASON_TOKEN_COUNT_MISMATCH: _ClassVar[EndReason]
    END_REASON_REGISTRATION_REFUSED: _ClassVar[EndReason]
    END_REASON_PROMPT_MISMATCH: _ClassVar[EndReason]
    END_REASON_BROKER_SHARD_LOST: _ClassVar[EndReason]
    END_REASON_BROKER_SHARD_MOVED: _ClassVar[EndReason]

class WriteOutcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WRITE_OUTCOME_UNSPECIFIED: _ClassVar[WriteOutcome]
    WRITE_OUTCOME_WRITTEN: _ClassVar[WriteOutcome]
    WRITE_OUTCOME_FAILED: _ClassVar[WriteOutcome]
    WRITE_OUTCOME_REVOKED: _ClassVar[WriteOutcome]

class TransferEventType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRANSFER_EVENT_TYPE_UNSPECIFIED: _ClassVar[TransferEventType]
    TRANSFER_EVENT_TYPE_COMPLETED: _ClassVar[TransferEventType]
    TRANSFER_EVENT_TYPE_ENDED: _ClassVar[TransferEventType]
    TRANSFER_EVENT_TYPE_FAILED: _ClassVar[TransferEventType]

class TimelineEntryKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIMELINE_ENTRY_KIND_UNSPECIFIED: _ClassVar[TimelineEntryKind]
    TIMELINE_ENTRY_KIND_REGISTERED: _ClassVar[TimelineEntryKind]
    TIMELINE_ENTRY_KIND_PREFILL_DONE: _ClassVar[TimelineEntryKind]
    TIMELINE_ENTRY_KIND_ORDER_SENT: _ClassVar[TimelineEntryKind]
    TIMELINE_ENTRY_KIND_WRITE_RESULT: _ClassVar[TimelineEntryKind]
    TIMELINE_ENTRY_KIND_REVOKED: _ClassVar[TimelineEntryKind]
    TIMELINE_ENTRY_KIND_ENDED: _ClassVar[TimelineEntryKind]
    TIMELINE_ENTRY_KIND_FENCED: _ClassVar[TimelineEntryKind]
TRANSFER_STATE_UNSPECIFIED: TransferState
TRANSFER_STATE_WAITING_FOR_PREFILL: TransferState
TRANSFER_STATE_WAITING_FOR_REGISTRATION: TransferState
TRANSFER_STATE_MATCHED: TransferState
TRANSFER_STATE_WRITING: TransferState
TRANSFER_STATE_DONE: TransferState
TRANSFER_STATE_FAILED: TransferState
TRANSFER_STATE_CANCELLED: TransferState
TRANSFER_STATE_SUPERSEDED: TransferState
TRANSFER_SIDE_UNSPECIFIED: TransferSide
TRANSFER_SIDE_PREFILL: TransferSide
TRANSFER_SIDE_DECODE: TransferSide
END_REASON_UNSPECIFIED: EndReason
END_REASON_COMPLETED: EndReason
END_REASON_CANCELLED_BY_ROUTER: EndReason
END_REASON_CANCELLED_BY_PREFILL: EndReason
END_REASON_CANCELLED_BY_DECODE: EndReason
END_REASON_SUPERSEDED: EndReason
END_REASON_REGISTRATION_DEADLINE_EXCEEDED: EndReason
END_REASON_PREFILL_DEADLINE_EXCEEDED: EndReason
END_REASON_PREFILL_ENGINE_LOST: EndReason
END_REASON_DECODE_ENGINE_LOST: EndReason
END_REASON_WRITE_FAILED: EndReason
END_REASON_TOKEN_COUNT_MISMATCH: EndReason
END_REASON_REGISTRATION_REFUSED: EndReason
END_REASON_PROMPT_MISMATCH: EndReason
END_REASON_BROKER_SHARD_LOST: EndReason
END_REASON_BROKER_SHARD_MOVED: EndReason
WRITE_OUTCOME_UNSPECIFIED: WriteOutcome
WRITE_OUTCOME_WRITTEN: WriteOutcome
WRITE_OUTCOME_FAILED: WriteOutcome
WRITE_OUTCOME_REVOKED: WriteOutcome
TRANSFER_EVENT_TYPE_UNSPECIFIED: TransferEventType
TRANSFER_EVENT_TYPE_COMPLETED: TransferEventType
TRANSFER_EVENT_TYPE_ENDED: TransferEventType
TRANSFER_EVENT_TYPE_FAILED: TransferEventType
TIMELINE_ENTRY_KIND_UNSPECIFIED: TimelineEntryKind
TIMELINE_ENTRY_KIND_REGISTERED: TimelineEntryKind
TIMELINE_ENTRY_KIND_PREFILL_DONE: TimelineEntryKind
TIMELINE_ENTRY_KIND_ORDER_SENT: TimelineEntryKind
TIMELINE_ENTRY_KIND_WRITE_RESULT: TimelineEntryKind
TIMELINE_ENTRY_KIND_REVOKED: TimelineEntryKind
TIMELINE_ENTRY_KIND_ENDED: TimelineEntryKind
TIMELINE_ENTRY_KIND_FENCED: TimelineEntryKind

class TransferKey(_message.Message):
    __slots__ = ("transfer_id", "attempt")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    attempt: int
    def __init__(self, transfer_id: _Optional[str] = ..., attempt: _Optional[int] = ...) -> None: ...

class Destination(_message.Message):
    __slots__ = ("engine_id", "incarnation", "blocks", "first_token", "num_tokens", "prompt_digest")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_DIGEST_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    incarnation: str
    blocks: _containers.RepeatedCompositeFieldContainer[_engine_pb2.BlockList]
    first_token: int
    num_tokens: int
    prompt_digest: bytes
    def __init__(self, engine_id: _Optional[str] = ..., incarnation: _Optional[str] = ..., blocks: _Optional[_Iterable[_Union[_engine_pb2.BlockList, _Mapping]]] = ..., first_token: _Optional[int] = ..., num_tokens: _Optional[int] = ..., prompt_digest: _Optional[bytes] = ...) -> None: ...

class Source(_message.Message):
    __slots__ = ("engine_id", "incarnation", "blocks", "num_tokens")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    incarnation: str
    blocks: _containers.RepeatedCompositeFieldContainer[_engine_pb2.BlockList]
    num_tokens: int
    def __init__(self, engine_id: _Optional[str] = ..., incarnation: _Optional[str] = ..., blocks: _Optional[_Iterable[_Union[_engine_pb2.BlockList, _Mapping]]] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class WriteOrder(_message.Message):
    __slots__ = ("key", "client_request_id", "source", "destination", "decode_tp_ranks", "write_budget", "trace_context", "write_timeout")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    KEY_FIELD_NUMBER: _ClassVar[int]
    CLIENT_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_FIELD_NUMBER: _ClassVar[int]
    DECODE_TP_RANKS_FIELD_NUMBER: _ClassVar[int]
    WRITE_BUDGET_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    WRITE_TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    key: TransferKey
    client_request_id: str
    source: Source
    destination: Destination
    decode_tp_ranks: _containers.RepeatedScalarFieldContainer[int]
    write_budget: _duration_pb2.Duration
    trace_context: _containers.ScalarMap[str, str]
    write_timeout: _duration_pb2.Duration
    def __init__(self, key: _Optional[_Union[TransferKey, _Mapping]] = ..., client_request_id: _Optional[str] = ..., source: _Optional[_Union[Source, _Mapping]] = ..., destination: _Optional[_Union[Destination, _Mapping]] = ..., decode_tp_ranks: _Optional[_Iterable[int]] = ..., write_budget: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., trace_context: _Optional[_Mapping[str, str]] = ..., write_timeout: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class Revocation(_message.Message):
    __slots__ = ("key", "reason")
    KEY_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    key: TransferKey
    reason: EndReason
    def __init__(self, key: _Optional[_Union[TransferKey, _Mapping]] = ..., reason: _Optional[_Union[EndReason, str]] = ...) -> None: ...

class TransferClosed(_message.Message):
    __slots__ = ("key", "state", "reason")
    KEY_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    key: TransferKey
    state: TransferState
    reason: EndReason
    def __init__(self, key: _Optional[_Union[TransferKey, _Mapping]] = ..., state: _Optional[_Union[TransferState, str]] = ..., reason: _Optional[_Union[EndReason, str]] = ...) -> None: ...

class TransferEvent(_message.Message):
    __slots__ = ("key", "client_request_id", "type", "state", "reason", "detail", "event_time")
    KEY_FIELD_NUMBER: _ClassVar[int]
    CLIENT_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    EVENT_TIME_FIELD_NUMBER: _ClassVar[int]
    key: TransferKey
    client_request_id: str
    type: TransferEventType
    state: TransferState
    reason: EndReason
    detail: str
    event_time: _timestamp_pb2.Timestamp
    def __init__(self, key: _Optional[_Union[TransferKey, _Mapping]] = ..., client_request_id: _Optional[str] = ..., type: _Optional[_Union[TransferEventType, str]] = ..., state: _Optional[_Union[TransferState, str]] = ..., reason: _Optional[_Union[EndReason, str]] = ..., detail: _Optional[str] = ..., event_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class TimelineEntry(_message.Message):
    __slots__ = ("kind", "time", "detail")
    KIND_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    kind: TimelineEntryKind
    time: _timestamp_pb2.Timestamp
    detail: str
    def __init__(self, kind: _Optional[_Union[TimelineEntryKind, str]] = ..., time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., detail: _Optional[str] = ...) -> None: ...

class Transfer(_message.Message):
    __slots__ = ("key", "client_request_id", "state", "prefill_engine_id", "decode_engine_id", "first_arrival", "end_reason", "detail", "fenced", "deadline", "timeline", "bytes_written")
    KEY_FIELD_NUMBER: _ClassVar[int]
    CLIENT_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    DECODE_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_ARRIVAL_FIELD_NUMBER: _ClassVar[int]
    END_REASON_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    FENCED_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_FIELD_NUMBER: _ClassVar[int]
    TIMELINE_FIELD_NUMBER: _ClassVar[int]
    BYTES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    key: TransferKey
    client_request_id: str
    state: TransferState
    prefill_engine_id: str
    decode_engine_id: str
    first_arrival: TransferSide
    end_reason: EndReason
    detail: str
    fenced: bool
    deadline: _timestamp_pb2.Timestamp
    timeline: _containers.RepeatedCompositeFieldContainer[TimelineEntry]
    bytes_written: int
    def __init__(self, key: _Optional[_Union[TransferKey, _Mapping]] = ..., client_request_id: _Optional[str] = ..., state: _Optional[_Union[TransferState, str]] = ..., prefill_engine_id: _Optional[str] = ..., decode_engine_id: _Optional[str] = ..., first_arrival: _Optional[_Union[TransferSide, str]] = ..., end_reason: _Optional[_Union[EndReason, str]] = ..., detail: _Optional[str] = ..., fenced: _Optional[bool] = ..., deadline: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., timeline: _Optional[_Iterable[_Union[TimelineEntry, _Mapping]]] = ..., bytes_written: _Optional[int] = ...) -> None: ...
