# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""W3C trace-context carriers and the kvpush span attribute names."""

from __future__ import annotations

from collections.abc import Mapping

from opentelemetry import propagate
from opentelemetry.context import Context
from opentelemetry.sdk.trace.sampling import TraceIdRatioBased

ATTR_TRANSFER_ID = "kvpush.transfer_id"
ATTR_ATTEMPT = "kvpush.attempt"
ATTR_ENGINE_ID = "kvpush.engine_id"
ATTR_CLIENT_REQUEST_ID = "kvpush.client_request_id"
# The router's span events that mark TTFT's last instants (kvpush.report.breakdown reads them).
FIRST_OUTPUT_EVENT = "first_output"  # on router.decode_leg: the router read D's first output
FIRST_TOKEN_EVENT = "first_token"  # on router.request: the router sent the client its first chunk


def inject_traceparent(context: Context | None = None) -> dict[str, str]:
    """Returns the W3C carrier ("traceparent", and "tracestate"/"baggage" when set) of context.

    context defaults to the current one. The keys are lowercase, so the dict
    can go into gRPC metadata, a WriteOrder's trace_context or
    kv_transfer_params as is. It is empty when there is no valid span.
    """
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=context)
    return carrier


def extract_context(carrier: Mapping[str, str]) -> Context:
    """Returns a context whose parent span is the one carrier names (the current context if none)."""
    return propagate.extract(dict(carrier))


def trace_id_ratio_sampled(trace_id: str, ratio: float) -> bool:
    """Whether the SDK's TraceIdRatioBased(ratio) samples the trace with this 32-hex-digit id.

    It decides on the id alone (its low 64 bits against a bound), so every
    process configured with the same ratio keeps the same traces, a parent
    or not; an id that cannot be read counts as sampled (nothing is lost).
    """
    try:
        return int(trace_id[16:32], 16) < TraceIdRatioBased.get_bound_for_rate(ratio)
    except ValueError:
        return True


def span_attributes(
    transfer_id: str,
    attempt: int,
    *,
    engine_id: str = "",
    client_request_id: str = "",
) -> dict[str, str | int]:
    """Returns the kvpush attributes of a transfer span; empty optional values are left out."""
    attributes: dict[str, str | int] = {ATTR_TRANSFER_ID: transfer_id, ATTR_ATTEMPT: int(attempt)}
    if engine_id:
        attributes[ATTR_ENGINE_ID] = engine_id
    if client_request_id:
        attributes[ATTR_CLIENT_REQUEST_ID] = client_request_id
    return attributes
