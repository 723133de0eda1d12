# SPDX-License-Identifier: Apache-2.0
"""The one error model of kvpush, shared by services and clients.

Cores raise these; servicers turn them into gRPC status codes with a
google.rpc.ErrorInfo detail (reason, domain, metadata["field"]); clients turn
such statuses back into the same classes.
"""

from __future__ import annotations

ERROR_DOMAIN = "kvpush.dev"


class Reason:
    """ErrorInfo reasons (UPPER_SNAKE, stable: clients branch on them)."""

    FIELD_REQUIRED = "FIELD_REQUIRED"
    FIELD_INVALID = "FIELD_INVALID"
    FIELD_OUT_OF_RANGE = "FIELD_OUT_OF_RANGE"
    BLOCK_ID_OUT_OF_RANGE = "BLOCK_ID_OUT_OF_RANGE"
    ENGINE_NOT_FOUND = "ENGINE_NOT_FOUND"
    TRANSFER_NOT_FOUND = "TRANSFER_NOT_FOUND"
    LEASE_NOT_FOUND = "LEASE_NOT_FOUND"
    CONFLICTING_DUPLICATE = "CONFLICTING_DUPLICATE"
    ENGINE_ROLE_MISMATCH = "ENGINE_ROLE_MISMATCH"
    ENGINE_NOT_READY = "ENGINE_NOT_READY"
    INCOMPATIBLE_LAYOUT = "INCOMPATIBLE_LAYOUT"
    TOKEN_COUNT_MISMATCH = "TOKEN_COUNT_MISMATCH"
    INCARNATION_MISMATCH = "INCARNATION_MISMATCH"
    TRANSFER_ENDED = "TRANSFER_ENDED"
    TRANSFER_SUPERSEDED = "TRANSFER_SUPERSEDED"
    DEADLINE_PASSED = "DEADLINE_PASSED"
    MISSING_CREDENTIALS = "MISSING_CREDENTIALS"
    BAD_TOKEN = "BAD_TOKEN"
    ENGINE_IDENTITY_MISMATCH = "ENGINE_IDENTITY_MISMATCH"
    TOO_MANY_TRANSFERS = "TOO_MANY_TRANSFERS"
    TOO_MANY_ENGINES = "TOO_MANY_ENGINES"
    TOO_MANY_WATCHES = "TOO_MANY_WATCHES"
    UNAVAILABLE = "UNAVAILABLE"
    # A broker shard refused a transfer it does not own; metadata names the
    # owner (owner_member_id, owner_address) so the caller resends there.
    NOT_SHARD_OWNER = "NOT_SHARD_OWNER"
    # The broker shard that owned the transfer is gone (died, or lost its
    # membership lease).
    BROKER_SHARD_LOST = "BROKER_SHARD_LOST"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    INTERNAL = "INTERNAL"


class KvpushError(Exception):
    """Base class; `code` is the gRPC status code name (e.g. "NOT_FOUND")."""

    code = "UNKNOWN"

    def __init__(self, message: str, *, reason: str = Reason.INTERNAL, field: str = "", metadata: dict[str, str] | None = None):
        super().__init__(message)
        self.message = message
        self.reason = reason
        self.field = field
        self.metadata = dict(metadata or {})
        if field:
            self.metadata.setdefault("field", field)

    def __str__(self) -> str:
        where = f" [{self.field}]" if self.field else ""
        return f"{self.code} {self.reason}{where}: {self.message}"


class InvalidArgument(KvpushError):
    code = "INVALID_ARGUMENT"


class NotFound(KvpushError):
    code = "NOT_FOUND"


class AlreadyExists(KvpushError):
    code = "ALREADY_EXISTS"


class FailedPrecondition(KvpushError):
    code = "FAILED_PRECONDITION"


class Aborted(KvpushError):
    code = "ABORTED"


class Unauthenticated(KvpushError):
    code = "UNAUTHENTICATED"


class PermissionDenied(KvpushError):
    code = "PERMISSION_DENIED"


class ResourceExhausted(KvpushError):
    code = "RESOURCE_EXHAUSTED"


class Unavailable(KvpushError):
    code = "UNAVAILABLE"


class DeadlineExceeded(KvpushError):
    code = "DEADLINE_EXCEEDED"


class Internal(KvpushError):
    code = "INTERNAL"


ERRORS_BY_CODE: dict[str, type[KvpushError]] = {
    cls.code: cls
    for cls in (
        InvalidArgument,
        NotFound,
        AlreadyExists,
        FailedPrecondition,
        Aborted,
        Unauthenticated,
        PermissionDenied,
        ResourceExhausted,
        Unavailable,
        DeadlineExceeded,
        Internal,
    )
}


def required(value, field: str) -> None:
    """Raises InvalidArgument(FIELD_REQUIRED) when value is empty."""
    if not value:
        raise InvalidArgument(f"{field} is required", reason=Reason.FIELD_REQUIRED, field=field)
