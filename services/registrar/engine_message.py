# SPDX-License-Identifier: Apache-2.0
"""The one builder of the registrar's Engine message: a new Engine field is added here only."""

from __future__ import annotations

from collections.abc import Iterable

from kvpush.clock import timestamp
from kvpush.engine.v1 import engine_pb2
from kvpush.registrar.v1 import registrar_service_pb2 as reg_pb


def engine_message(rank: engine_pb2.EngineRank, compatibility_hash: str, register_wall: float, *,
                   ranks: Iterable[reg_pb.RegisteredRank] = (), state: reg_pb.EngineState = reg_pb.ENGINE_STATE_UNSPECIFIED) -> reg_pb.Engine:
    """An engine incarnation's Engine from one of its ranks' identity (its engine-wide fields), with the given ranks and state."""
    return reg_pb.Engine(
        engine_id=rank.engine_id,
        incarnation=rank.incarnation,
        role=rank.role,
        tp_size=rank.tp_size,
        pp_size=rank.pp_size,
        compatibility_hash=compatibility_hash,
        state=state,
        ranks=list(ranks),
        register_time=timestamp(register_wall),
    )
