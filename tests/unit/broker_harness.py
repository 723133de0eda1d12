# SPDX-License-Identifier: Apache-2.0
"""A BrokerCore over an in-process RegistrarCore on a ManualClock, with engines registered and subscribed."""

from __future__ import annotations

import pytest

from kvpush import errors
from kvpush.clock import ManualClock, duration, timestamp
from kvpush.dev import sample_engines as sample
from kvpush.rendezvous.v1 import rendezvous_service_pb2 as rv_pb
from kvpush.rendezvous.v1 import transfer_pb2 as tr_pb
from kvpush.services.broker.config import BrokerConfig
from kvpush.services.broker.core import BrokerCore, Subscription
from kvpush.services.registrar.config import RegistrarConfig
from kvpush.services.registrar.core import RegistrarCore

P = "prefill-0"
D = "decode-0"


class Harness:
    """prefill-0 (p_tp ranks in each of p_pp stages) and decode-0 (d_tp ranks), every P rank and D subscribed.

    Producer subscriptions are keyed by the rank's number among P's ranks, stage-major (pp * p_tp + tp).
    """

    def __init__(
        self,
        *,
        p_tp: int = 1,
        d_tp: int = 1,
        heads: int = 2,
        early: bool | list[bool] = False,
        config: BrokerConfig | None = None,
        tracer_provider=None,
        subscribe: bool = True,
        past_grace: bool = True,
        membership=None,
        mla: bool = False,
        p_pp: int = 1,
    ):
        self.clock = ManualClock()
        self.registrar = RegistrarCore(RegistrarConfig(default_lease_ttl_s=30.0), self.clock)
        self.config = config or BrokerConfig(retention_s=60.0)
        self.broker = BrokerCore(self.registrar, self.config, self.clock, tracer_provider=tracer_provider, membership=membership)
        if past_grace:
            # A new broker fences nothing during its startup grace (a predecessor's orders may live);
            # most tests are about a broker that has been up for a while.
            self.clock.advance(self.config.startup_grace_s)
        self.leases: dict[str, list[str]] = {}
        self.p_tp, self.d_tp = p_tp, d_tp
        for engine_id, role, tp, pp in ((P, sample.PREFILL, p_tp, p_pp), (D, sample.DECODE, d_tp, 1)):
            requests = sample.engine_requests(engine_id, role, tp_size=tp, pp_size=pp, total_kv_heads=heads, mla=mla)
            self.leases[engine_id] = [self.registrar.register(r).lease_id for r in requests]
        self.producers: dict[int, Subscription] = {}
        self.decode: Subscription | None = None
        if subscribe:
            flags = early if isinstance(early, list) else [early] * p_tp
            for pp in range(p_pp):
                for tp in range(p_tp):
                    self.subscribe_producer(tp, flags[tp], pp)
            self.decode = self.broker.subscribe_decode(rv_pb.StreamTransferEventsRequest(engine_id=D, incarnation="inc-1"), D)

    def subscribe_producer(self, tp: int, early: bool, pp: int = 0) -> Subscription:
        request = rv_pb.StreamWriteOrdersRequest(engine_id=P, incarnation="inc-1", tp_rank=tp, pp_rank=pp, early_orders=early)
        self.producers[pp * self.p_tp + tp] = self.broker.subscribe_producer(request, P)
        return self.producers[pp * self.p_tp + tp]

    def subscribe_decode(self) -> Subscription:
        self.decode = self.broker.subscribe_decode(rv_pb.StreamTransferEventsRequest(engine_id=D, incarnation="inc-1"), D)
        return self.decode

    def unsubscribe_producer(self, tp: int, pp: int = 0) -> None:
        """Producer rank (tp, pp)'s stream ends (the servicer's finally)."""
        self.broker.unsubscribe(self.producers[pp * self.p_tp + tp])

    # ----- calls -----

    def destination(
        self, transfer_id: str = "t1", attempt: int = 1, *, deadline_in: float | None = None, hold_margin: float | None = None, **kwargs
    ) -> rv_pb.RegisterDestinationRequest:
        """A registration; deadline_in sets request.deadline that many seconds after the (shared) wall clock's now."""
        request = sample.destination_request(transfer_id, attempt, **kwargs)
        if deadline_in is not None:
            request.deadline.CopyFrom(timestamp(self.clock.wall() + deadline_in))
        if hold_margin is not None:
            request.hold_margin.CopyFrom(duration(hold_margin))
        return request

    def register(self, transfer_id: str = "t1", attempt: int = 1, **kwargs) -> rv_pb.RegisterDestinationResponse:
        return self.broker.register_destination(self.destination(transfer_id, attempt, **kwargs), D)

    def prefill_done(self, transfer_id: str = "t1", attempt: int = 1, **kwargs) -> rv_pb.ReportPrefillDoneResponse:
        return self.broker.report_prefill_done(sample.prefill_done_request(transfer_id, attempt, **kwargs), P)

    def write(self, transfer_id: str = "t1", attempt: int = 1, tp: int = 0, outcome: int = tr_pb.WRITE_OUTCOME_WRITTEN, reason: int = 0,
              pp: int = 0) -> int:
        request = sample.write_result_request(transfer_id, attempt, tp_rank=tp, pp_rank=pp, outcome=outcome)
        request.reason = reason
        return self.broker.report_write_result(request, P).state

    def cancel(self, transfer_id: str = "t1", attempt: int = 1, caller: str | None = None, detail: str = "") -> rv_pb.CancelTransferResponse:
        """A cancel from caller (None: the router)."""
        return self.broker.cancel(tr_pb.TransferKey(transfer_id=transfer_id, attempt=attempt), caller, detail)

    def fenced(self, transfer_id: str = "t1", attempt: int = 1) -> bool:
        return self.broker.get_transfer(transfer_id, attempt).fenced

    def advance(self, seconds: float) -> float | None:
        """Moves the clock and runs the broker's tick (as its event loop would); returns tick()'s answer."""
        self.clock.advance(seconds)
        return self.broker.tick()

    def state(self, transfer_id: str = "t1", attempt: int = 1) -> int:
        return self.broker.get_transfer(transfer_id, attempt).state

    # ----- outputs -----

    def messages(self, tp: int = 0, pp: int = 0) -> list[rv_pb.StreamWriteOrdersResponse]:
        return self.producers[pp * self.p_tp + tp].outbox.drain()

    def kinds(self, tp: int = 0, pp: int = 0) -> list[tuple[str, str, int]]:
        """(kind, transfer_id, attempt) of every message queued for producer rank (tp, pp)."""
        out = []
        for message in self.messages(tp, pp):
            kind = message.WhichOneof("message")
            body = getattr(message, kind)
            out.append((kind, body.key.transfer_id, body.key.attempt))
        return out

    def events(self) -> list[tuple[str, int, int, int]]:
        """(transfer_id, attempt, type, reason) of every event queued for the decode engine."""
        return [(e.event.key.transfer_id, e.event.key.attempt, e.event.type, e.event.reason) for e in self.decode.outbox.drain()]


S = tr_pb  # state and reason names are long; S.TRANSFER_STATE_DONE reads fine
COMPLETED = tr_pb.TRANSFER_EVENT_TYPE_COMPLETED
ENDED = tr_pb.TRANSFER_EVENT_TYPE_ENDED
FAILED_EVENT = tr_pb.TRANSFER_EVENT_TYPE_FAILED  # ended, not fenced yet: the decode side keeps its blocks
WRITTEN = tr_pb.WRITE_OUTCOME_WRITTEN
REVOKED = tr_pb.WRITE_OUTCOME_REVOKED
FAILED = tr_pb.WRITE_OUTCOME_FAILED

# The harness's BrokerConfig defaults: the numbers the fencing bounds are made of.
SKEW, WRITE_TIMEOUT, STREAM_LEASE, FENCE_MARGIN = 0.25, 3.0, 3.0, 1.0


def expect(error_type: type[errors.KvpushError], reason: str, field: str, call, *args, **kwargs) -> errors.KvpushError:
    with pytest.raises(error_type) as info:
        call(*args, **kwargs)
    assert (info.value.reason, info.value.field) == (reason, field), str(info.value)
    return info.value


def seconds(duration) -> float:
    return duration.ToNanoseconds() / 1e9
