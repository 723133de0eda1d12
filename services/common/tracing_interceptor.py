# SPDX-License-Identifier: Apache-2.0
"""A grpc.aio server interceptor that traces every RPC as a SERVER span `kvpush.rpc/<Method>`.

The caller's W3C context comes from the call metadata. Only server-fault
status codes mark the span ERROR (client faults such as INVALID_ARGUMENT
are the caller's problem, not the server's), and health checks are not
traced.

Not opentelemetry-instrumentation-grpc's aio_server_interceptor: it runs
every response-streaming handler with `async for`, and ours are coroutines
that write with context.write(), so each stream fails with TypeError
(open-telemetry/opentelemetry-python-contrib#3066, still so in 0.66b2).
"""

from __future__ import annotations

import contextlib
import inspect

import grpc
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from kvpush.services.common.auth import HEALTH_METHOD_PREFIX
from kvpush.services.common.rpc import final_status_code

TRACER_NAME = "kvpush.services.rpc"
_PROPAGATOR = TraceContextTextMapPropagator()
SERVER_FAULT_CODES = frozenset(
    (
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DATA_LOSS,
    )
)


def _carrier(metadata) -> dict[str, str]:
    return {key: value for key, value in metadata or () if key in ("traceparent", "tracestate") and isinstance(value, str)}


def _finish(span: trace.Span, context: grpc.aio.ServicerContext, error: BaseException | None) -> None:
    code = final_status_code(context, error)
    span.set_attribute("rpc.grpc.status_code", code.value[0])
    if code in SERVER_FAULT_CODES:
        span.set_status(Status(StatusCode.ERROR, f"{code.name}: {context.details() or ''}"))


@contextlib.contextmanager
def _attached(parent: otel_context.Context):
    token = otel_context.attach(parent)
    try:
        yield
    finally:
        otel_context.detach(token)


class TracingInterceptor(grpc.aio.ServerInterceptor):
    """Opens a SERVER span around each RPC, parented on the caller's traceparent.

    With no tracer provider configured (neither passed nor installed
    globally when the interceptor is built) no span is made: the caller's
    context is only made current, so what the servicer forwards (the
    broker's write orders) still carries it.
    """

    def __init__(self, tracer_provider: trace.TracerProvider | None = None):
        self._recording = tracer_provider is not None or not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)
        self._tracer = trace.get_tracer(TRACER_NAME, tracer_provider=tracer_provider)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(HEALTH_METHOD_PREFIX):
            return handler
        carrier = _carrier(handler_call_details.invocation_metadata)
        if not self._recording and not carrier:
            return handler

        if handler.request_streaming and handler.response_streaming:
            behavior, field = handler.stream_stream, "stream_stream"
        elif handler.request_streaming:
            behavior, field = handler.stream_unary, "stream_unary"
        elif handler.response_streaming:
            behavior, field = handler.unary_stream, "unary_stream"
        else:
            behavior, field = handler.unary_unary, "unary_unary"

        if self._recording:
            service, _, name = method.lstrip("/").rpartition("/")
            tracer = self._tracer
            attributes = {"rpc.system": "grpc", "rpc.service": service, "rpc.method": name}

            def scope(context: grpc.aio.ServicerContext):
                return _server_span(tracer, f"kvpush.rpc/{name}", _PROPAGATOR.extract(carrier), attributes, context)

        else:

            def scope(context: grpc.aio.ServicerContext):
                return _attached(_PROPAGATOR.extract(carrier))

        if inspect.isasyncgenfunction(behavior):

            async def wrapped_stream(request, context):
                with scope(context):
                    async for response in behavior(request, context):
                        yield response

            return handler._replace(**{field: wrapped_stream})

        async def wrapped(request, context):
            with scope(context):
                return await behavior(request, context)

        return handler._replace(**{field: wrapped})


@contextlib.contextmanager
def _server_span(tracer: trace.Tracer, name: str, parent: otel_context.Context, attributes: dict, context: grpc.aio.ServicerContext):
    with tracer.start_as_current_span(
        name, context=parent, kind=SpanKind.SERVER, attributes=attributes, record_exception=False, set_status_on_exception=False
    ) as span:
        error = None
        try:
            yield span
        except BaseException as exc:
            error = exc
            raise
        finally:
            _finish(span, context, error)
