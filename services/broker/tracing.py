# SPDX-License-Identifier: Apache-2.0
"""The broker.rendezvous span: from an attempt's first arrival to its second (or its end).

The core tells this adapter what happened; it keeps the span and the W3C
carrier that travels in the attempt's write orders, so producers' spans join
the caller's trace even when no tracer provider is installed.
"""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from kvpush.rendezvous.v1 import transfer_pb2 as tr_pb

TRACER_NAME = "kvpush.broker"
_PROPAGATOR = TraceContextTextMapPropagator()


class _AttemptTrace:
    __slots__ = ("span", "carrier")

    def __init__(self) -> None:
        self.span: trace.Span | None = None
        self.carrier: dict[str, str] = {}


class RendezvousTracing:
    """Starts, links and ends broker.rendezvous spans; stores per-attempt state in attempt.trace."""

    def __init__(self, tracer_provider: trace.TracerProvider | None = None):
        self._tracer = trace.get_tracer(TRACER_NAME, tracer_provider=tracer_provider)
        # Whether spans record: a provider was given, or one is installed
        # globally (looked up at most once a second: the lookup is slow).
        self._recording = tracer_provider is not None
        self._checked_at = float("-inf")

    def carrier(self, att) -> dict[str, str]:
        """The W3C context write orders carry (empty without a caller context)."""
        return att.trace.carrier if att.trace is not None else {}

    def first_arrival(self, att, parent: Context | None, side: str, now: float) -> None:
        if not self._recording and now >= self._checked_at + 1.0:
            self._checked_at = now
            self._recording = not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)
        state = att.trace = _AttemptTrace()
        if not self._recording:
            # No tracer provider: the span would be a no-op. Forward the
            # caller's context, so the producer's spans still join its trace.
            if parent is not None:
                _PROPAGATOR.inject(state.carrier, context=parent)
            return
        links = []
        if parent is not None:
            caller = trace.get_current_span(parent).get_span_context()
            if caller.is_valid:
                links.append(trace.Link(caller, {"kvpush.side": side}))
        state.span = self._tracer.start_span(
            "broker.rendezvous",
            context=parent,
            links=links,
            attributes={"kvpush.transfer_id": att.transfer_id, "kvpush.attempt": att.number, "kvpush.first_arrival": side},
        )
        _PROPAGATOR.inject(state.carrier, context=trace.set_span_in_context(state.span))

    def matched(self, att, parent: Context | None) -> None:
        """The second side arrived: link it and end the span."""
        state = att.trace
        if state is None or state.span is None:
            return
        if parent is not None:
            caller = trace.get_current_span(parent).get_span_context()
            if caller.is_valid:
                side = "prefill" if att.first_arrival == tr_pb.TRANSFER_SIDE_DECODE else "decode"
                state.span.add_link(caller, {"kvpush.side": side})
        state.span.end()
        state.span = None

    def ended(self, att) -> None:
        """The attempt ended before (or without) its second arrival."""
        state = att.trace
        if state is None or state.span is None:
            return
        if att.end_reason != tr_pb.END_REASON_COMPLETED:
            state.span.set_attribute("kvpush.end_reason", tr_pb.EndReason.Name(att.end_reason))
        state.span.end()
        state.span = None
