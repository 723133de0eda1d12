# SPDX-License-Identifier: Apache-2.0
"""Request field checks shared by the cores; each raises InvalidArgument naming the field."""

from __future__ import annotations

import re

from google.protobuf import duration_pb2

from kvpush.errors import InvalidArgument, Reason

# engine_id and transfer_id share this alphabet (see engine.proto / transfer.proto).
ID_PATTERN = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def check_id(value: str, field: str) -> None:
    """Requires a 1..128 character [A-Za-z0-9._:-] identifier."""
    if not value:
        raise InvalidArgument(f"{field} is required", reason=Reason.FIELD_REQUIRED, field=field)
    if ID_PATTERN.fullmatch(value) is None:
        raise InvalidArgument(f"{field} must be 1 to 128 characters of [A-Za-z0-9._:-]", reason=Reason.FIELD_INVALID, field=field)


def check_text(value: str, field: str, max_length: int, *, required: bool = True) -> None:
    """Requires a non-empty (if required) string of at most max_length characters."""
    if not value:
        if required:
            raise InvalidArgument(f"{field} is required", reason=Reason.FIELD_REQUIRED, field=field)
        return
    if len(value) > max_length:
        raise InvalidArgument(f"{field} is longer than {max_length} characters", reason=Reason.FIELD_OUT_OF_RANGE, field=field)


def check_enum(value: int, valid: frozenset[int], field: str) -> None:
    """Requires a known, specified enum value (0 is always UNSPECIFIED)."""
    if value == 0:
        raise InvalidArgument(f"{field} must be specified", reason=Reason.FIELD_REQUIRED, field=field)
    if value not in valid:
        raise InvalidArgument(f"{field} has unknown value {value}", reason=Reason.FIELD_INVALID, field=field)


def positive_seconds(duration: duration_pb2.Duration, field: str, maximum: float) -> float:
    """Returns the duration in seconds; it must be set, positive and at most maximum."""
    seconds = duration.seconds + duration.nanos * 1e-9
    if seconds == 0:
        raise InvalidArgument(f"{field} is required", reason=Reason.FIELD_REQUIRED, field=field)
    if seconds < 0 or seconds > maximum:
        raise InvalidArgument(f"{field} must be in (0, {maximum:g}] seconds, got {seconds:g}", reason=Reason.FIELD_OUT_OF_RANGE, field=field)
    return seconds


def non_negative_seconds(duration: duration_pb2.Duration, field: str, maximum: float) -> float:
    """Returns the duration in seconds; it must be in [0, maximum]."""
    seconds = duration.seconds + duration.nanos * 1e-9
    if seconds < 0 or seconds > maximum:
        raise InvalidArgument(f"{field} must be in [0, {maximum:g}] seconds, got {seconds:g}", reason=Reason.FIELD_OUT_OF_RANGE, field=field)
    return seconds


