# SPDX-License-Identifier: Apache-2.0
"""What a prefill rank's transfer core keeps per transfer key: held sources, orders, computing sources and jobs, and the answers it gives."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from kvpush.connector.handoff import Key, SourceReady
from kvpush.connector.nixl_agent import NixlWrite
from kvpush.rendezvous.v1 import transfer_pb2

WRITTEN, FAILED, REVOKED = transfer_pb2.WRITE_OUTCOME_WRITTEN, transfer_pb2.WRITE_OUTCOME_FAILED, transfer_pb2.WRITE_OUTCOME_REVOKED


class DeviceEvent(Protocol):
    """A CUDA event (torch.cuda.Event, not imported here): the transfer thread waits on it before reading blocks."""

    def synchronize(self) -> None: ...


@dataclass
class Source:
    ready: SourceReady
    hold_until: float
    ready_ns: int  # when its forward ended (wall clock): the hand-off segment starts here
    ready_event: DeviceEvent | None = None  # CUDA event to wait on before reading the blocks


@dataclass
class Order:
    order: transfer_pb2.WriteOrder
    stream: int  # the stream generation it came on
    post_by: float  # monotonic: no WRITE for it after this
    received_ns: int
    sent_ns: int


@dataclass
class MadeWrites:
    """The WRITEs of one order for a source whose forward is running, made ahead: posted at its end while the order and peer are the same."""

    order: Order
    peer: object  # the Peer they write to (write_plans.Peer)
    plans: list  # their WritePlans, posted in this order
    writes: list[NixlWrite | None]  # made, not posted, one per plan (the post sets each posted one to None)


@dataclass
class Computing:
    """A source whose forward is running: its layers computed so far (layer-progressive push), or its whole WRITE made ahead."""

    ready: SourceReady
    whole: bool = False  # its KV is written whole at the forward's end: the WRITE may be made while the forward runs
    done: set[int] = field(default_factory=set)
    event: DeviceEvent | None = None  # CUDA event recorded after the newest computed layer
    made: MadeWrites | None = None
    announce_at: float = float("-inf")  # when to tell its decode ranks a WRITE is due (monotonic: near the forward's predicted end)
    announced: bool = False  # they were told


@dataclass
class Job:
    key: Key
    source: Source
    order: Order
    writes: list[NixlWrite] = field(default_factory=list)
    post_ns: int = 0  # the first part's post (wall clock)
    abort_at: float = 0.0
    failed: str = ""
    parts: int = 0  # WRITEs posted per decode rank (layer-progressive push posts several)
    more_parts: bool = False  # the last part is still to come (with the source)
    posted_layers: frozenset[int] = frozenset()
