# SPDX-License-Identifier: Apache-2.0
"""What the scheduler-side connector tells the workers each engine step."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorHandshakeMetadata, KVConnectorMetadata

from kvpush.connector.handoff import DestinationReady, SourceReady


@dataclass
class KvpushMetadata(KVConnectorMetadata):
    """One step's instructions to every worker."""

    sources: list[SourceReady] = field(default_factory=list)
    cancels: list[tuple[str, int]] = field(default_factory=list)  # P rank 0 cancels these at the broker
    recvs: list[DestinationReady] = field(default_factory=list)
    fails: dict[str, str] = field(default_factory=dict)  # D: req_id -> reason; report as failed receive
    idle: bool = False  # no tokens scheduled: the worker may sleep until transfer progress
    scheduled_tokens: int = 0  # P: tokens this step's forward computes (it predicts the forward's end)


@dataclass
class KvpushHandshake(KVConnectorHandshakeMetadata):
    """Worker → scheduler at startup: the engine incarnation its ranks registered."""

    incarnation: str
