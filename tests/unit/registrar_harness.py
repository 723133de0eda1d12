# SPDX-License-Identifier: Apache-2.0
"""What the RegistrarCore tests share: event types, expect (an exact reason and field), a watch's events."""

from __future__ import annotations

import pytest

from kvpush import errors
from kvpush.registrar.v1 import registrar_service_pb2 as reg_pb

UPSERTED = reg_pb.ENGINE_EVENT_TYPE_UPSERTED
REMOVED = reg_pb.ENGINE_EVENT_TYPE_REMOVED
SNAPSHOT_END = reg_pb.ENGINE_EVENT_TYPE_SNAPSHOT_END


def expect(error_type: type[errors.KvpushError], reason: str, field: str, call, *args):
    with pytest.raises(error_type) as info:
        call(*args)
    assert (info.value.reason, info.value.field) == (reason, field), str(info.value)
    assert info.value.metadata.get("field", "") == field
    return info.value


def events(watch) -> list[tuple[int, str, int, str]]:
    return [(e.type, e.engine.engine_id, e.engine.state, e.reason) for e in watch.outbox.drain()]
