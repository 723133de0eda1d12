# SPDX-License-Identifier: Apache-2.0
"""A grpc.aio server interceptor that counts every RPC into Prometheus: started, handled by code, handling time, stream messages.

The names and labels are grpc-prometheus's (`grpc_server_started_total`,
`grpc_server_handled_total`, `grpc_server_handling_seconds`,
`grpc_server_msg_{received,sent}_total`; `grpc_type`, `grpc_service`,
`grpc_method`, `grpc_code`), not `kvpush_*`: they describe gRPC rather
than kvpush, `grpc_service` already says `kvpush.…`, and the gRPC
dashboards and alerts written for grpc-prometheus (Go, Java, py-grpc-
prometheus) then read them unchanged. Two departures: the histogram
covers unary calls only and has a `grpc_code` label (a stream lasts as
long as its peer, so its duration says nothing about the server), and
`grpc_code` is Python's name of the code (`INVALID_ARGUMENT`).

Health checks are not counted (probes would be most of the calls), as
they are not traced.

Cost per unary call, measured on a loaded 2-core box: about 4.5 µs of CPU
for the interceptor in a tight loop around a no-op handler (an uncontended
Counter.inc is 1 µs there, Histogram.observe 2 µs), against about 900 µs
of CPU for a whole ListEngines call over loopback (client and server), where
the difference with and without it stayed within the noise.
"""

from __future__ import annotations

import inspect
import time

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram

from kvpush.services.common.auth import HEALTH_METHOD_PREFIX
from kvpush.services.common.rpc import final_status_code

# Unary calls take from a fraction of a millisecond (a lookup) to the
# seconds of a long poll (GetTransfer waiting for an attempt's end).
_HANDLING_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


def _rpc_type(handler: grpc.RpcMethodHandler) -> str:
    """grpc-prometheus's grpc_type of a handler."""
    if handler.request_streaming:
        return "bidi_stream" if handler.response_streaming else "client_stream"
    return "server_stream" if handler.response_streaming else "unary"


class _Method:
    """One method's metric children, looked up once (labels() is slow); the code-labelled ones as codes appear."""

    __slots__ = ("_handled", "_handled_family", "_handling", "_handling_family", "_labels", "received", "sent", "source", "started", "wrapped")

    def __init__(self, metrics: RpcMetricsInterceptor, labels: tuple[str, str, str]):
        self._labels = labels
        self.source: grpc.RpcMethodHandler | None = None  # the handler wrapped last, and its wrapping
        self.wrapped: grpc.RpcMethodHandler | None = None
        self._handled_family = metrics.handled
        self._handling_family = metrics.handling
        self._handled: dict[grpc.StatusCode, Counter] = {}
        self._handling: dict[grpc.StatusCode, Histogram] = {}
        self.started = metrics.started.labels(*labels)
        # Message counters for streams only: a unary call is one message each way.
        streaming = labels[0] != "unary"
        self.received = metrics.received.labels(*labels) if streaming else None
        self.sent = metrics.sent.labels(*labels) if streaming else None

    def handled(self, code: grpc.StatusCode) -> None:
        child = self._handled.get(code)
        if child is None:
            child = self._handled[code] = self._handled_family.labels(*self._labels, code.name)
        child.inc()

    def handled_unary(self, code: grpc.StatusCode, seconds: float) -> None:
        self.handled(code)
        child = self._handling.get(code)
        if child is None:
            child = self._handling[code] = self._handling_family.labels(*self._labels, code.name)
        child.observe(seconds)


class _CountingContext:
    """The call's context as a stream handler sees it: each context.write() is counted as a message sent."""

    __slots__ = ("_context", "_sent")

    def __init__(self, context: grpc.aio.ServicerContext, sent: Counter):
        self._context = context
        self._sent = sent

    async def write(self, message) -> None:
        await self._context.write(message)
        self._sent.inc()

    def __getattr__(self, name: str):
        return getattr(self._context, name)


async def _counted(requests, received: Counter):
    async for request in requests:
        received.inc()
        yield request


class RpcMetricsInterceptor(grpc.aio.ServerInterceptor):
    """Counts each RPC the server handles into registry (the service's own, served at /metrics)."""

    def __init__(self, registry: CollectorRegistry):
        labels = ["grpc_type", "grpc_service", "grpc_method"]
        self.started = Counter("grpc_server_started", "RPCs started on the server", labels, registry=registry)
        self.handled = Counter("grpc_server_handled", "RPCs completed on the server, by status code", [*labels, "grpc_code"], registry=registry)
        self.handling = Histogram(
            "grpc_server_handling_seconds", "Unary RPCs' handling time on the server, by status code", [*labels, "grpc_code"],
            buckets=_HANDLING_BUCKETS, registry=registry,
        )
        self.received = Counter("grpc_server_msg_received", "Messages received on request streams", labels, registry=registry)
        self.sent = Counter("grpc_server_msg_sent", "Messages sent on response streams", labels, registry=registry)
        self._methods: dict[str, _Method] = {}

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(HEALTH_METHOD_PREFIX):
            return handler
        method = self._methods.get(handler_call_details.method)
        if method is None:
            service, _, name = handler_call_details.method.lstrip("/").rpartition("/")
            method = self._methods[handler_call_details.method] = _Method(self, (_rpc_type(handler), service, name))
        # A method's handler is the same object call after call unless an inner
        # interceptor makes a new one (a span, a refusal): wrap it once.
        if handler is not method.source:
            method.source, method.wrapped = handler, self._wrap(handler, method)
        return method.wrapped

    def _wrap(self, handler: grpc.RpcMethodHandler, method: _Method) -> grpc.RpcMethodHandler:
        if not handler.request_streaming and not handler.response_streaming:
            return handler._replace(unary_unary=self._unary(handler.unary_unary, method))
        field = {"bidi_stream": "stream_stream", "client_stream": "stream_unary", "server_stream": "unary_stream"}[_rpc_type(handler)]
        return handler._replace(**{field: self._stream(getattr(handler, field), method, handler.request_streaming)})

    @staticmethod
    def _unary(behavior, method: _Method):
        async def unary(request, context):
            method.started.inc()
            start = time.perf_counter()
            error = None
            try:
                return await behavior(request, context)
            except BaseException as exc:
                error = exc
                raise
            finally:
                method.handled_unary(final_status_code(context, error), time.perf_counter() - start)

        return unary

    @staticmethod
    def _stream(behavior, method: _Method, request_streaming: bool):
        if inspect.isasyncgenfunction(behavior):

            async def generated(request, context):
                method.started.inc()
                error = None
                try:
                    async for response in behavior(_counted(request, method.received) if request_streaming else request, context):
                        method.sent.inc()
                        yield response
                except BaseException as exc:
                    error = exc
                    raise
                finally:
                    method.handled(final_status_code(context, error))

            return generated

        async def written(request, context):
            method.started.inc()
            error = None
            try:
                return await behavior(_counted(request, method.received) if request_streaming else request, _CountingContext(context, method.sent))
            except BaseException as exc:
                error = exc
                raise
            finally:
                method.handled(final_status_code(context, error))

        return written
