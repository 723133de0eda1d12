import datetime

from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from kvpush.rendezvous.v1 import transfer_pb2 as _transfer_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RegisterDestinationRequest(_message.Message):
    __slots__ = ("key", "client_request_id", "prefill_engine_id", "destination", "timeout", "deadline", "hold_margin", "trace_context")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    KEY_FIELD_NUMBER: _ClassVar[int]
    CLIENT_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_FIELD_NUMBER: _ClassVar[int]
    HOLD_MARGIN_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    key: _transfer_pb2.TransferKey
    client_request_id: str
    prefill_engine_id: str
    destination: _transfer_pb2.Destination
    timeout: _duration_pb2.Duration
    deadline: _timestamp_pb2.Timestamp
    hold_margin: _duration_pb2.Duration
    trace_context: _containers.ScalarMap[str, str]
    def __init__(self, key: _Optional[_Union[_transfer_pb2.TransferKey, _Mapping]] = ..., client_request_id: _Optional[str] = ..., prefill_engine_id: _Optional[str] = ..., destination: _Optional[_Union[_transfer_pb2.Destination, _Mapping]] = ..., timeout: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., deadline: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., hold_margin: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., trace_context: _Optional[_Mapping[str, str]] = ...) -> None: ...

class RegisterDestinationResponse(_message.Message):
    __slots__ = ("state", "first_arrival", "deadline", "expected_notifications", "fenced")
    STATE_FIELD_NUMBER: _ClassVar[int]
    FIRST_ARRIVAL_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_NOTIFICATIONS_FIELD_NUMBER: _ClassVar[int]
    FENCED_FIELD_NUMBER: _ClassVar[int]
    state: _transfer_pb2.TransferState
    first_arrival: _transfer_pb2.TransferSide
    deadline: _timestamp_pb2.Timestamp
    expected_notifications: _containers.RepeatedScalarFieldContainer[int]
    fenced: bool
    def __init__(self, state: _Optional[_Union[_transfer_pb2.TransferState, str]] = ..., first_arrival: _Optional[_Union[_transfer_pb2.TransferSide, str]] = ..., deadline: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., expected_notifications: _Optional[_Iterable[int]] = ..., fenced: _Optional[bool] = ...) -> None: ...

class ReportPrefillDoneRequest(_message.Message):
    __slots__ = ("key", "client_request_id", "decode_engine_id", "source", "timeout", "trace_context")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    KEY_FIELD_NUMBER: _ClassVar[int]
    CLIENT_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DECODE_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    key: _transfer_pb2.TransferKey
    client_request_id: str
    decode_engine_id: str
    source: _transfer_pb2.Source
    timeout: _duration_pb2.Duration
    trace_context: _containers.ScalarMap[str, str]
    def __init__(self, key: _Optional[_Union[_transfer_pb2.TransferKey, _Mapping]] = ..., client_request_id: _Optional[str] = ..., decode_engine_id: _Optional[str] = ..., source: _Optional[_Union[_transfer_pb2.Source, _Mapping]] = ..., timeout: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., trace_context: _Optional[_Mapping[str, str]] = ...) -> None: ...

class ReportPrefillDoneResponse(_message.Message):
    __slots__ = ("state", "first_arrival", "deadline")
    STATE_FIELD_NUMBER: _ClassVar[int]
    FIRST_ARRIVAL_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_FIELD_NUMBER: _ClassVar[int]
    state: _transfer_pb2.TransferState
    first_arrival: _transfer_pb2.TransferSide
    deadline: _timestamp_pb2.Timestamp
    def __init__(self, state: _Optional[_Union[_transfer_pb2.TransferState, str]] = ..., first_arrival: _Optional[_Union[_transfer_pb2.TransferSide, str]] = ..., deadline: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class ReportWriteResultRequest(_message.Message):
    __slots__ = ("key", "engine_id", "tp_rank", "pp_rank", "outcome", "bytes_written", "descriptor_count", "post_time", "transfer_duration", "error_message", "reason")
    KEY_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    PP_RANK_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    BYTES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTOR_COUNT_FIELD_NUMBER: _ClassVar[int]
    POST_TIME_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_DURATION_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    key: _transfer_pb2.TransferKey
    engine_id: str
    tp_rank: int
    pp_rank: int
    outcome: _transfer_pb2.WriteOutcome
    bytes_written: int
    descriptor_count: int
    post_time: _timestamp_pb2.Timestamp
    transfer_duration: _duration_pb2.Duration
    error_message: str
    reason: _transfer_pb2.EndReason
    def __init__(self, key: _Optional[_Union[_transfer_pb2.TransferKey, _Mapping]] = ..., engine_id: _Optional[str] = ..., tp_rank: _Optional[int] = ..., pp_rank: _Optional[int] = ..., outcome: _Optional[_Union[_transfer_pb2.WriteOutcome, str]] = ..., bytes_written: _Optional[int] = ..., descriptor_count: _Optional[int] = ..., post_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., transfer_duration: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., error_message: _Optional[str] = ..., reason: _Optional[_Union[_transfer_pb2.EndReason, str]] = ...) -> None: ...

class ReportWriteResultResponse(_message.Message):
    __slots__ = ("state",)
    STATE_FIELD_NUMBER: _ClassVar[int]
    state: _transfer_pb2.TransferState
    def __init__(self, state: _Optional[_Union[_transfer_pb2.TransferState, str]] = ...) -> None: ...

class CancelTransferRequest(_message.Message):
    __slots__ = ("key", "detail")
    KEY_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    key: _transfer_pb2.TransferKey
    detail: str
    def __init__(self, key: _Optional[_Union[_transfer_pb2.TransferKey, _Mapping]] = ..., detail: _Optional[str] = ...) -> None: ...

class CancelTransferResponse(_message.Message):
    __slots__ = ("state", "fenced")
    STATE_FIELD_NUMBER: _ClassVar[int]
    FENCED_FIELD_NUMBER: _ClassVar[int]
    state: _transfer_pb2.TransferState
    fenced: bool
    def __init__(self, state: _Optional[_Union[_transfer_pb2.TransferState, str]] = ..., fenced: _Optional[bool] = ...) -> None: ...

class GetTransferRequest(_message.Message):
    __slots__ = ("transfer_id", "attempt", "wait")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    WAIT_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    attempt: int
    wait: _duration_pb2.Duration
    def __init__(self, transfer_id: _Optional[str] = ..., attempt: _Optional[int] = ..., wait: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class GetTransferResponse(_message.Message):
    __slots__ = ("transfer",)
    TRANSFER_FIELD_NUMBER: _ClassVar[int]
    transfer: _transfer_pb2.Transfer
    def __init__(self, transfer: _Optional[_Union[_transfer_pb2.Transfer, _Mapping]] = ...) -> None: ...

class StreamWriteOrdersRequest(_message.Message):
    __slots__ = ("engine_id", "incarnation", "tp_rank", "pp_rank", "early_orders")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    PP_RANK_FIELD_NUMBER: _ClassVar[int]
    EARLY_ORDERS_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    incarnation: str
    tp_rank: int
    pp_rank: int
    early_orders: bool
    def __init__(self, engine_id: _Optional[str] = ..., incarnation: _Optional[str] = ..., tp_rank: _Optional[int] = ..., pp_rank: _Optional[int] = ..., early_orders: _Optional[bool] = ...) -> None: ...

class StreamWriteOrdersResponse(_message.Message):
    __slots__ = ("order", "revocation", "closed", "heartbeat", "send_time", "stream_lease")
    ORDER_FIELD_NUMBER: _ClassVar[int]
    REVOCATION_FIELD_NUMBER: _ClassVar[int]
    CLOSED_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    SEND_TIME_FIELD_NUMBER: _ClassVar[int]
    STREAM_LEASE_FIELD_NUMBER: _ClassVar[int]
    order: _transfer_pb2.WriteOrder
    revocation: _transfer_pb2.Revocation
    closed: _transfer_pb2.TransferClosed
    heartbeat: StreamHeartbeat
    send_time: _timestamp_pb2.Timestamp
    stream_lease: _duration_pb2.Duration
    def __init__(self, order: _Optional[_Union[_transfer_pb2.WriteOrder, _Mapping]] = ..., revocation: _Optional[_Union[_transfer_pb2.Revocation, _Mapping]] = ..., closed: _Optional[_Union[_transfer_pb2.TransferClosed, _Mapping]] = ..., heartbeat: _Optional[_Union[StreamHeartbeat, _Mapping]] = ..., send_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., stream_lease: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class StreamHeartbeat(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StreamTransferEventsRequest(_message.Message):
    __slots__ = ("engine_id", "incarnation", "event_types")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    EVENT_TYPES_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    incarnation: str
    event_types: _containers.RepeatedScalarFieldContainer[_transfer_pb2.TransferEventType]
    def __init__(self, engine_id: _Optional[str] = ..., incarnation: _Optional[str] = ..., event_types: _Optional[_Iterable[_Union[_transfer_pb2.TransferEventType, str]]] = ...) -> None: ...

class StreamTransferEventsResponse(_message.Message):
    __slots__ = ("event",)
    EVENT_FIELD_NUMBER: _ClassVar[int]
    event: _transfer_pb2.TransferEvent
    def __init__(self, event: _Optional[_Union[_transfer_pb2.TransferEvent, _Mapping]] = ...) -> None: ...

class EngineReportsRequest(_message.Message):
    __slots__ = ("engine_id", "registrations", "prefill_done", "write_results", "cancels")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    REGISTRATIONS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_DONE_FIELD_NUMBER: _ClassVar[int]
    WRITE_RESULTS_FIELD_NUMBER: _ClassVar[int]
    CANCELS_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    registrations: _containers.RepeatedCompositeFieldContainer[RegisterDestinationRequest]
    prefill_done: _containers.RepeatedCompositeFieldContainer[ReportPrefillDoneRequest]
    write_results: _containers.RepeatedCompositeFieldContainer[ReportWriteResultRequest]
    cancels: _containers.RepeatedCompositeFieldContainer[CancelTransferRequest]
    def __init__(self, engine_id: _Optional[str] = ..., registrations: _Optional[_Iterable[_Union[RegisterDestinationRequest, _Mapping]]] = ..., prefill_done: _Optional[_Iterable[_Union[ReportPrefillDoneRequest, _Mapping]]] = ..., write_results: _Optional[_Iterable[_Union[ReportWriteResultRequest, _Mapping]]] = ..., cancels: _Optional[_Iterable[_Union[CancelTransferRequest, _Mapping]]] = ...) -> None: ...

class EngineReportsResponse(_message.Message):
    __slots__ = ("registrations", "prefill_done", "write_results", "cancels")
    REGISTRATIONS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_DONE_FIELD_NUMBER: _ClassVar[int]
    WRITE_RESULTS_FIELD_NUMBER: _ClassVar[int]
    CANCELS_FIELD_NUMBER: _ClassVar[int]
    registrations: _containers.RepeatedCompositeFieldContainer[RegistrationAnswer]
    prefill_done: _containers.RepeatedCompositeFieldContainer[ReportAnswer]
    write_results: _containers.RepeatedCompositeFieldContainer[ReportAnswer]
    cancels: _containers.RepeatedCompositeFieldContainer[CancelAnswer]
    def __init__(self, registrations: _Optional[_Iterable[_Union[RegistrationAnswer, _Mapping]]] = ..., prefill_done: _Optional[_Iterable[_Union[ReportAnswer, _Mapping]]] = ..., write_results: _Optional[_Iterable[_Union[ReportAnswer, _Mapping]]] = ..., cancels: _Optional[_Iterable[_Union[CancelAnswer, _Mapping]]] = ...) -> None: ...

class RegistrationAnswer(_message.Message):
    __slots__ = ("key", "response", "error")
    KEY_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    key: _transfer_pb2.TransferKey
    response: RegisterDestinationResponse
    error: ItemError
    def __init__(self, key: _Optional[_Union[_transfer_pb2.TransferKey, _Mapping]] = ..., response: _Optional[_Union[RegisterDestinationResponse, _Mapping]] = ..., error: _Optional[_Union[ItemError, _Mapping]] = ...) -> None: ...

class ReportAnswer(_message.Message):
    __slots__ = ("key", "state", "error")
    KEY_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    key: _transfer_pb2.TransferKey
    state: _transfer_pb2.TransferState
    error: ItemError
    def __init__(self, key: _Optional[_Union[_transfer_pb2.TransferKey, _Mapping]] = ..., state: _Optional[_Union[_transfer_pb2.TransferState, str]] = ..., error: _Optional[_Union[ItemError, _Mapping]] = ...) -> None: ...

class CancelAnswer(_message.Message):
    __slots__ = ("key", "response", "error")
    KEY_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    key: _transfer_pb2.TransferKey
    response: CancelTransferResponse
    error: ItemError
    def __init__(self, key: _Optional[_Union[_transfer_pb2.TransferKey, _Mapping]] = ..., response: _Optional[_Union[CancelTransferResponse, _Mapping]] = ..., error: _Optional[_Union[ItemError, _Mapping]] = ...) -> None: ...

class ItemError(_message.Message):
    __slots__ = ("code", "message", "reason", "metadata")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    code: str
    message: str
    reason: str
    metadata: _containers.ScalarMap[str, str]
    def __init__(self, code: _Optional[str] = ..., message: _Optional[str] = ..., reason: _Optional[str] = ..., metadata: _Optional[_Mapping[str, str]] = ...) -> None: ...

class BrokerShard(_message.Message):
    __slots__ = ("member_id", "address", "engines_attached")
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ENGINES_ATTACHED_FIELD_NUMBER: _ClassVar[int]
    member_id: str
    address: str
    engines_attached: bool
    def __init__(self, member_id: _Optional[str] = ..., address: _Optional[str] = ..., engines_attached: _Optional[bool] = ...) -> None: ...

class WatchShardsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WatchShardsResponse(_message.Message):
    __slots__ = ("shards", "revision", "heartbeat_interval")
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    shards: _containers.RepeatedCompositeFieldContainer[BrokerShard]
    revision: int
    heartbeat_interval: _duration_pb2.Duration
    def __init__(self, shards: _Optional[_Iterable[_Union[BrokerShard, _Mapping]]] = ..., revision: _Optional[int] = ..., heartbeat_interval: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...
