# SPDX-License-Identifier: Apache-2.0
"""What the scheduler-side connector tells the workers each engine step."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)


@dataclass(frozen=True)
class SourceReady:
    """P: a request's KV is complete once this step's forward has run."""

    req_id: str
    transfer_id: str
    attempt: int
    client_request_id: str
    decode_engine_id: str
    blocks: tuple[tuple[int, ...], ...]  # per KV cache group, from token 0
    num_tokens: int
    hold_s: float  # how long the source may be held waiting for the decode side
    traceparent: str
    arrival_ns: int  # request arrival (wall clock), for the queue span
    scheduled_ns: int  # first scheduled (wall clock), for the prefill span


@dataclass(frozen=True)
class RecvExpected:
    """D: a request waits for KV of this transfer attempt."""

    req_id: str
    transfer_id: str
    attempt: int
    alloc_ns: int  # when its blocks were allocated (wall clock)
    traceparent: str


@dataclass
class KvpushMetadata(KVConnectorMetadata):
    """One step's instructions to every worker."""

    sources: list[SourceReady] = field(default_factory=list)
    cancels: list[tuple[str, int]] = field(default_factory=list)  # P rank 0 cancels these at the broker
    recvs: list[RecvExpected] = field(default_factory=list)
    fails: dict[str, str] = field(default_factory=dict)  # D: req_id -> reason; report as failed receive
    idle: bool = False  # no tokens scheduled: the worker may sleep until transfer progress


@dataclass
class KvpushHandshake(KVConnectorHandshakeMetadata):
    """Worker → scheduler at startup: the engine's credentials after registration."""

    engine_token: str
    incarnation: str


@dataclass
class KvpushWorkerMeta(KVConnectorWorkerMetadata):
    """Worker → scheduler during serving: the engine token after the rank registered again.

    A restarted control plane with a new key issues new engine tokens; the
    decode scheduler signs its registrations with the workers' latest one.
    """

    engine_token: str

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        return self
