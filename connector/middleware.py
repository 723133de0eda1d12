# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""kvpush's reasons in an engine's own HTTP answers: an ASGI middleware for vLLM's API server.

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KvpushConnector", ...}' \\
        --middleware kvpush.connector.middleware.KvpushErrors

vLLM lets a KV connector only fail a request, so a caller of an engine
(any router, a user's proxy) gets `500 Internal server error` whatever
went wrong. With this middleware:

* a request whose `kv_transfer_params["kvpush"]` the connector would
  refuse (`kvpush.connector.params.parse`, the one definition of valid;
  also a leg of the other role, or another control plane than the
  engine's) is answered `400` naming the field, before vLLM sees it;
* a request whose transfer key another request on this API server holds
  is answered `409 TRANSFER_CONFLICT`, before vLLM sees it;
* when vLLM fails a request that carries kvpush parameters (HTTP 5xx, or
  a streamed error event), the broker is asked how the attempt ended
  (`GetTransfer`, bounded by LOOKUP_TIMEOUT_S) and the answer carries its
  end reason, with the status `kvpush router` gives it
  (`kvpush.http_errors`), and the transfer key.

Everything else passes untouched: requests without kvpush parameters are
replayed to vLLM as received, and answers that are not failures are sent
as vLLM wrote them. vLLM instantiates the class as `KvpushErrors(app)`
(`app.add_middleware`); it reads the engine's settings from the API
server's `app.state.vllm_config` at the first POST and does nothing on an
engine without the kvpush connector.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from kvpush import errors
from kvpush.client import ClientConfig, LoopThread, ShardedBrokerClient
from kvpush.connector.config import ConnectorConfig
from kvpush.connector.params import ParamError, TransferParams, parse
from kvpush.connector.plugin import CONNECTOR_NAME
from kvpush.http_errors import (
    CONTROL_PLANE_UNREACHABLE,
    INVALID_REQUEST,
    LEG_FAILED,
    TRANSFER_CONFLICT,
    AttemptRecord,
    conflicting_owner,
    end_reason_status,
    error_body,
)
from kvpush.rendezvous.v1 import rendezvous_service_pb2 as rv_pb

logger = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
Lookup = Callable[[str, int], Awaitable[AttemptRecord]]

# How long the broker gets to say why an attempt failed; past it the answer is 503 CONTROL_PLANE_UNREACHABLE.
LOOKUP_TIMEOUT_S = 1.0
# Cheap test before any JSON parsing: a body without this cannot carry kv_transfer_params["kvpush"].
MARKER = b'"kvpush"'
SSE_ERROR = b'data: {"error"'


class BrokerLookup:
    """GetTransfer of one attempt, from a loop thread of its own (the API server's event loop never runs gRPC)."""

    def __init__(self, config: ConnectorConfig, timeout_s: float = LOOKUP_TIMEOUT_S):
        self._client_config = ClientConfig(target=config.control_plane, broker_target=config.broker, token=config.token,
                                           ca_cert_path=config.tls_ca, client_cert_path=config.tls_cert, client_key_path=config.tls_key,
                                           default_timeout_s=timeout_s)
        self._timeout_s = timeout_s
        self._loop: LoopThread | None = None
        self._broker: ShardedBrokerClient | None = None

    async def _get(self, transfer_id: str, attempt: int) -> AttemptRecord:
        if self._broker is None:
            self._broker = ShardedBrokerClient(self._client_config)
        request = rv_pb.GetTransferRequest(transfer_id=transfer_id, attempt=attempt)
        response = await self._broker.get_transfer(request, timeout_s=self._timeout_s)
        return AttemptRecord.from_transfer(response.transfer)

    async def __call__(self, transfer_id: str, attempt: int) -> AttemptRecord:
        if self._loop is None:
            self._loop = LoopThread("kvpush-middleware")
        future = self._loop.submit(self._get(transfer_id, attempt), log_errors=False)
        try:
            # A sharded broker may redirect once: two calls' worth, and a margin.
            async with asyncio.timeout(2 * self._timeout_s + 0.5):
                return await asyncio.wrap_future(future)
        except TimeoutError as exc:
            future.cancel()
            raise errors.DeadlineExceeded(f"the broker did not answer within {2 * self._timeout_s + 0.5:g} s") from exc


def param_error_body(exc: ParamError) -> dict[str, Any]:
    """The 400 answer to refused kvpush parameters: OpenAI's shape, `param` naming the key."""
    param = "kv_transfer_params.kvpush" + (f".{exc.field}" if exc.field else "")
    return error_body(400, str(exc), param=param, reason=INVALID_REQUEST)


def check_for_engine(params: TransferParams, config: ConnectorConfig) -> None:
    """What the connector would refuse beyond the parameters' own validity: a leg of the other role, another control plane."""
    if params.role != config.role:
        raise ParamError("role", f"is {params.role!r} but {config.engine_id} is a {config.role} engine")
    if params.control_plane and params.control_plane != config.control_plane:
        raise ParamError("control_plane", f"is {params.control_plane!r} but {config.engine_id} is registered with {config.control_plane!r}")


def explain_failure(record: AttemptRecord, params: TransferParams, config: ConnectorConfig, seen: str) -> tuple[int, str, str]:
    """(status, reason, message) for a request vLLM failed, from the broker's record of its attempt."""
    key = f"transfer {params.transfer_id} attempt {params.attempt}"
    seen = f"{config.role} engine {config.engine_id}: {seen}"
    if config.role == "decode":
        prefill_id, decode_id = params.peer_engine_id, config.engine_id
    else:
        prefill_id, decode_id = config.engine_id, params.peer_engine_id
    owner = conflicting_owner(record, params.client_request_id, prefill_id, decode_id)
    if owner:
        return 409, TRANSFER_CONFLICT, f"{key} is another request's at the broker ({owner}): another caller uses the same transfer id ({seen})"
    if record.ended and record.state != "DONE":
        reason = record.reason or record.state
        message = f"{key} ended {record.state} with {reason}" + (f": {record.detail}" if record.detail else "")
        return end_reason_status(reason), reason, f"{message} ({seen})"
    return 502, LEG_FAILED, f"{seen}; {key}: {record.describe()}"


class KvpushErrors:
    """The ASGI middleware (see the module's docstring); `config` and `lookup` are for use outside vLLM (tests, benchmarks)."""

    def __init__(self, app: ASGIApp, *, config: ConnectorConfig | None = None, lookup: Lookup | None = None):
        self.app = app
        self._config = config
        self._resolved = config is not None
        self._lookup = lookup
        self._in_flight: set[tuple[str, int]] = set()

    def _engine_config(self, scope: Scope) -> ConnectorConfig | None:
        if not self._resolved:
            self._resolved = True
            state = getattr(scope.get("app"), "state", None)
            kv = getattr(getattr(state, "vllm_config", None), "kv_transfer_config", None)
            if kv is not None and (kv.kv_connector == CONNECTOR_NAME or (kv.kv_connector_module_path or "").startswith("kvpush.connector")):
                try:
                    self._config = ConnectorConfig.from_kv_transfer_config(kv)
                except ValueError as exc:
                    logger.error("kvpush middleware off: %s", exc)
            else:
                logger.warning("kvpush middleware: this engine does not run the kvpush connector; every request passes untouched")
        return self._config

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        config = self._engine_config(scope)
        if config is None:
            return await self.app(scope, receive, send)
        received: list[Message] = []
        while True:
            message = await receive()
            received.append(message)
            if message["type"] != "http.request" or not message.get("more_body", False):
                break
        replay = _replaying(received, receive)
        body = b"".join(m.get("body", b"") for m in received)
        params = None
        if MARKER in body:
            try:
                kv = json.loads(body).get("kv_transfer_params")
            except (ValueError, AttributeError):
                kv = None  # vLLM answers a body that is not a JSON object itself
            if isinstance(kv, dict):
                try:
                    params = parse(kv)
                    if params is not None:
                        check_for_engine(params, config)
                except ParamError as exc:
                    return await _send_json(send, 400, param_error_body(exc))
        if params is None:
            return await self.app(scope, replay, send)
        if params.key in self._in_flight:
            held = (f"transfer {params.transfer_id} attempt {params.attempt}: another request on {config.role} engine "
                    f"{config.engine_id} holds this transfer key")
            return await _send_json(send, 409, error_body(409, held, reason=TRANSFER_CONFLICT, **_key_fields(params, config)))
        self._in_flight.add(params.key)
        try:
            await self.app(scope, replay, _Answer(send, self, params, config).send)
        finally:
            self._in_flight.discard(params.key)

    async def failure_body(self, params: TransferParams, config: ConnectorConfig, seen: str) -> dict[str, Any]:
        """The error a failed request with kvpush parameters is answered with; `seen` is vLLM's own status and message."""
        if self._lookup is None:
            self._lookup = BrokerLookup(config)
        try:
            record = await self._lookup(params.transfer_id, params.attempt)
        except errors.NotFound:
            status, reason = 502, LEG_FAILED
            message = (f"{config.role} engine {config.engine_id}: {seen}; the broker never heard of "
                       f"transfer {params.transfer_id} attempt {params.attempt}")
        except errors.KvpushError as exc:
            status, reason = 503, CONTROL_PLANE_UNREACHABLE
            message = f"{config.role} engine {config.engine_id}: {seen}; the broker could not be asked why: {exc}"
        else:
            status, reason, message = explain_failure(record, params, config, seen)
        logger.info("kvpush: answering %s %s for transfer %s attempt %d", status, reason, params.transfer_id, params.attempt)
        return error_body(status, message, reason=reason, **_key_fields(params, config))


def _key_fields(params: TransferParams, config: ConnectorConfig) -> dict[str, Any]:
    return {"leg": config.role, "engine_id": config.engine_id, "transfer_id": params.transfer_id, "attempt": params.attempt}


def _replaying(received: list[Message], receive: Receive) -> Receive:
    """A receive that gives the app the messages already read, then the client's own (a disconnect, later)."""
    pending = list(received)

    async def replay() -> Message:
        return pending.pop(0) if pending else await receive()

    return replay


async def _send_json(send: Send, status: int, body: dict[str, Any], headers: list[tuple[bytes, bytes]] | None = None) -> None:
    data = json.dumps(body).encode()
    kept = [(k, v) for k, v in headers or () if k.lower() not in (b"content-type", b"content-length")]
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()), *kept]})
    await send({"type": "http.response.body", "body": data})


def _vllm_message(payload: bytes) -> str:
    try:
        return str(json.loads(payload)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return payload[:200].decode(errors="replace")


class _Answer:
    """The send of one request with kvpush parameters: a 5xx answer, or a 5xx error event in a stream, gets kvpush's reason."""

    def __init__(self, send: Send, middleware: KvpushErrors, params: TransferParams, config: ConnectorConfig):
        self._send, self._middleware, self._params, self._config = send, middleware, params, config
        self._held: list[Message] | None = None
        self._stream = False

    async def send(self, message: Message) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            if message["status"] >= 500:
                self._held = [message]
                return
            self._stream = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream") for k, v in message.get("headers", ()))
        elif kind == "http.response.body" and self._held is not None:
            self._held.append(message)
            if not message.get("more_body", False):
                await self._answer_held()
            return
        elif kind == "http.response.body" and self._stream and SSE_ERROR in message.get("body", b""):
            message = {**message, "body": await self._rewrite_events(message["body"])}
        await self._send(message)

    async def _answer_held(self) -> None:
        assert self._held is not None
        start, payload = self._held[0], b"".join(m.get("body", b"") for m in self._held[1:])
        body = await self._middleware.failure_body(self._params, self._config, f"HTTP {start['status']}: {_vllm_message(payload)}")
        await _send_json(self._send, body["error"]["code"], body, list(start.get("headers", ())))

    async def _rewrite_events(self, chunk: bytes) -> bytes:
        events = chunk.split(b"\n\n")
        for i, event in enumerate(events):
            if not event.startswith(SSE_ERROR):
                continue
            try:
                error = json.loads(event[len(b"data: "):])["error"]
                if int(error.get("code") or 500) < 500:
                    continue
            except (ValueError, KeyError, TypeError, AttributeError):
                continue
            body = await self._middleware.failure_body(self._params, self._config, f"error event {error.get('code')}: {error.get('message')}")
            events[i] = b"data: " + json.dumps(body).encode()
        return b"\n\n".join(events)
