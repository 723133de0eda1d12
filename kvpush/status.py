# SPDX-License-Identifier: Apache-2.0
"""Conversions between kvpush.errors and gRPC statuses with ErrorInfo details."""

from __future__ import annotations

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from kvpush import errors
from kvpush.rendezvous.v1 import rendezvous_service_pb2 as rv_pb


def to_status(err: errors.KvpushError) -> grpc.Status:
    """Builds the rich status a servicer aborts with."""
    info = error_details_pb2.ErrorInfo(reason=err.reason, domain=errors.ERROR_DOMAIN, metadata=err.metadata)
    detail = any_pb2.Any()
    detail.Pack(info)
    status = status_pb2.Status(code=code_pb2.Code.Value(err.code), message=err.message, details=[detail])
    return rpc_status.to_status(status)


def error_info(call: grpc.Call) -> error_details_pb2.ErrorInfo | None:
    """Returns the ErrorInfo detail of a failed call, if it has one."""
    status = rpc_status.from_call(call)
    if status is None:
        return None
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            return info
    return None


def from_rpc_error(exc: grpc.RpcError) -> errors.KvpushError:
    """Turns a failed call into the matching kvpush.errors exception."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    message = exc.details() if hasattr(exc, "details") else str(exc)
    info = None
    try:
        info = error_info(exc)
    except Exception:  # a status without parseable details still maps by code
        info = None
    cls = errors.ERRORS_BY_CODE.get(code.name, errors.KvpushError)
    reason = info.reason if info is not None else code.name
    metadata = dict(info.metadata) if info is not None else {}
    err = cls(message or code.name, reason=reason, field=metadata.get("field", ""), metadata=metadata)
    if cls is errors.KvpushError:
        err.code = code.name
    return err


def to_item_error(err: errors.KvpushError, item: rv_pb.ItemError) -> None:
    """Fills an EngineReports item's ItemError with what a unary call's status would carry."""
    item.code, item.message, item.reason = err.code, err.message, err.reason
    item.metadata.update(err.metadata)


def from_item_error(item: rv_pb.ItemError) -> errors.KvpushError:
    """The kvpush.errors exception an EngineReports item's ItemError stands for."""
    cls = errors.ERRORS_BY_CODE.get(item.code, errors.KvpushError)
    err = cls(item.message or item.code, reason=item.reason or item.code, field=item.metadata.get("field", ""), metadata=dict(item.metadata))
    if cls is errors.KvpushError:
        err.code = item.code or "UNKNOWN"
    return err
