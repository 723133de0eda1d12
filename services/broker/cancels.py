# SPDX-License-Identifier: Apache-2.0
"""Who may cancel a transfer, and as whom: the router any attempt, an engine only its own.

An engine cancels as the role it registered with (prefill or decode), and
only attempts whose engine of that role it is; a caller that is neither
the router nor a registered engine may cancel nothing.
"""

from __future__ import annotations

import enum

from kvpush.engine.v1 import engine_pb2
from kvpush.errors import PermissionDenied, Reason
from kvpush.rendezvous.v1 import transfer_pb2 as tr_pb
from kvpush.services.broker.attempts import Attempt
from kvpush.services.broker.checks import identity_mismatch
from kvpush.services.broker.plans import EngineDirectory


class Actor(enum.Enum):
    """Who cancels a transfer; the value is the EndReason it ends with."""

    ROUTER = tr_pb.END_REASON_CANCELLED_BY_ROUTER
    PREFILL = tr_pb.END_REASON_CANCELLED_BY_PREFILL
    DECODE = tr_pb.END_REASON_CANCELLED_BY_DECODE


def actor_of(directory: EngineDirectory, caller_engine_id: str | None) -> Actor:
    """The router (caller_engine_id None), or the role the calling engine registered with."""
    if caller_engine_id is None:
        return Actor.ROUTER
    engine = directory.get_engine(caller_engine_id)
    if engine is None:
        raise PermissionDenied(f"{caller_engine_id!r} is neither the router nor a registered engine", reason=Reason.ENGINE_IDENTITY_MISMATCH)
    return Actor.PREFILL if engine.role == engine_pb2.ENGINE_ROLE_PREFILL else Actor.DECODE


def authorize(att: Attempt, actor: Actor, caller_engine_id: str) -> None:
    """An engine actor must be the attempt's engine of its role."""
    named = att.p_engine_id if actor is Actor.PREFILL else att.d_engine_id if actor is Actor.DECODE else ""
    if actor is not Actor.ROUTER and named != caller_engine_id:
        raise identity_mismatch("key", named or "(none)", caller_engine_id)
