# SPDX-License-Identifier: Apache-2.0
"""The broker's messages rendered from an attempt: write orders, revocations, closures, heartbeats, events and Transfer records.

Times inside the core are monotonic; every message carries wall time, so
each rendering converts with the clock's current offset.
"""

from __future__ import annotations

from kvpush.clock import Clock, duration, timestamp
from kvpush.rendezvous.v1 import rendezvous_service_pb2 as rv_pb
from kvpush.rendezvous.v1 import transfer_pb2 as tr_pb
from kvpush.services.broker.attempts import Attempt, RankKey
from kvpush.services.broker.config import BrokerConfig
from kvpush.services.broker.tracing import RendezvousTracing


class Messages:
    """Renders the protos the broker sends; reads the clock, never the attempt tables."""

    def __init__(self, config: BrokerConfig, clock: Clock, tracing: RendezvousTracing):
        self._clock = clock
        self._tracing = tracing
        self._max_clock_skew_s = config.max_clock_skew_s
        # The lease an order stream's message grants, shortened so the rank's clock cannot stretch it
        # (built once: every message carries the same).
        self._order_lease = duration(config.stream_lease_s - config.max_clock_skew_s)

    # ----- to producer ranks -----

    def order(self, att: Attempt, rank_key: RankKey, now: float, *, full: bool) -> rv_pb.StreamWriteOrdersResponse:
        """The WriteOrder for one producer rank (early: without the source, which the rank's own prefill provides)."""
        assert att.plan is not None and att.dest is not None, "orders go out once the decode side registered"
        consumers = next(c for r, c in att.plan.orders if r == rank_key)
        order = tr_pb.WriteOrder(
            key=att.key,
            client_request_id=att.client_request_id,
            destination=att.dest.destination,
            decode_tp_ranks=consumers,
            # Measured by the rank from send_time: the skew allowance keeps
            # its last post before the deadline whatever its clock says.
            write_budget=duration(att.orders[rank_key].budget_end - now - self._max_clock_skew_s),
            write_timeout=duration(att.write_timeout),
        )
        carrier = self._tracing.carrier(att)
        if carrier:  # a map passed to the constructor goes through Python's MutableMapping.update even when empty
            order.trace_context.update(carrier)
        if full:
            assert att.src is not None, "a full order goes out once both sides arrived"
            order.source.CopyFrom(att.src.source)
        return self._to_producer(order=order)

    def revocation(self, att: Attempt) -> rv_pb.StreamWriteOrdersResponse:
        return self._to_producer(revocation=tr_pb.Revocation(key=att.key, reason=att.end_reason))

    def closed(self, att: Attempt) -> rv_pb.StreamWriteOrdersResponse:
        return self._to_producer(closed=tr_pb.TransferClosed(key=att.key, state=att.state, reason=att.end_reason))

    def heartbeat(self) -> rv_pb.StreamWriteOrdersResponse:
        return self._to_producer(heartbeat=rv_pb.StreamHeartbeat())

    def _to_producer(self, **message) -> rv_pb.StreamWriteOrdersResponse:
        return rv_pb.StreamWriteOrdersResponse(**message, send_time=timestamp(self._clock.wall()), stream_lease=self._order_lease)

    # ----- to decode engines and callers -----

    def event(self, att: Attempt, event_type: tr_pb.TransferEventType) -> rv_pb.StreamTransferEventsResponse:
        return rv_pb.StreamTransferEventsResponse(
            event=tr_pb.TransferEvent(
                key=att.key,
                client_request_id=att.client_request_id,
                type=event_type,
                state=att.state,
                reason=att.end_reason,
                detail=att.detail,
                event_time=timestamp(self._clock.wall()),
            )
        )

    def put_deadline(self, response, att: Attempt) -> None:
        """Sets response.deadline to the attempt's (left unset while it has none)."""
        if att.deadline != float("inf"):
            response.deadline.CopyFrom(timestamp(att.deadline + self._clock.wall() - self._clock.now()))

    def transfer(self, att: Attempt) -> tr_pb.Transfer:
        """The attempt's record, timeline included (GetTransfer)."""
        wall_offset = self._clock.wall() - self._clock.now()
        transfer = tr_pb.Transfer(
            key=att.key,
            client_request_id=att.client_request_id,
            state=att.state,
            prefill_engine_id=att.p_engine_id,
            decode_engine_id=att.d_engine_id,
            first_arrival=att.first_arrival,
            end_reason=att.end_reason,
            detail=att.detail,
            fenced=att.fenced,
            bytes_written=att.bytes_written,
        )
        if att.deadline != float("inf"):
            transfer.deadline.CopyFrom(timestamp(att.deadline + wall_offset))
        for kind, when, detail in att.timeline:
            transfer.timeline.add(kind=kind, time=timestamp(when + wall_offset), detail=detail)
        return transfer
