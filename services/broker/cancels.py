# SPDX-License-Identifier: Apache-2.0
"""Who may cancel a transfer, and as whom: the router any attempt, an engine only its own.

An engine cancels as the role it registered with (prefill or decode), and
only attempts whose engine of that role it is; a caller that is neither
the router nor a registered engine may cancel nothing.
"""

from __future__ import annotations

import enum

from kvpush.engine.v1 import engine_pb2
from kvpush.errors import Reason, Unavailable
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
        # The caller's token names an engine: this member's directory lacks it only while it catches up (it just
        # restarted) or while the engine registers again. Either way the engine should retry, not give up.
        raise Unavailable(f"engine {caller_engine_id!r} is not in this broker member's engine directory yet; retry",
                          reason=Reason.ENGINE_NOT_FOUND)
    return Actor.PREFILL if engine.role == engine_pb2.ENGINE_ROLE_PREFILL else Actor.DECODE


def authorize(att: Attempt, actor: Actor, caller_engine_id: str) -> None:
    """An engine actor must be the attempt's engine of its role (as its own side, or the other side, named it)."""
    if actor is Actor.ROUTER:
        return
    if actor is Actor.PREFILL:
        named = att.p_engine_id or (att.dest.prefill_engine_id if att.dest is not None else "")
    else:
        named = att.d_engine_id or (att.src.decode_engine_id if att.src is not None else "")
    if not named:
        # Only the other side reached this member yet (a restarted member learns an attempt from whichever side
        # speaks first) and it named no engine of the caller's role: the caller's own message may still come.
        raise Unavailable(f"attempt {att.key.attempt} of transfer {att.key.transfer_id!r} names no {actor.name.lower()} engine yet; retry",
                          reason=Reason.TRANSFER_NOT_FOUND)
    if named != caller_engine_id:
        raise identity_mismatch("key", named, caller_engine_id)
