# SPDX-License-Identifier: Apache-2.0
"""kvpush.connector.middleware without vLLM: refused parameters, the broker's end reasons as statuses, what passes untouched.

The app behind the middleware is a few lines of ASGI that echo the request
or fail it the way vLLM does (a 500 JSON body, or a streamed error event);
the broker is a lookup returning a given record. The real thing, with
engines and the control plane: tests/e2e/test_engine_middleware.py.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from kvpush import errors
from kvpush.connector.config import ConnectorConfig
from kvpush.connector.middleware import KvpushErrors
from kvpush.http_errors import END_REASONS, AttemptRecord, end_reason_status

DECODE = ConnectorConfig(engine_id="decode-0", role="decode", control_plane="cp:1", token="t")
PREFILL = ConnectorConfig(engine_id="prefill-0", role="prefill", control_plane="cp:1", token="t")
VLLM_500 = b'{"error":{"message":"Internal server error","type":"InternalServerError","param":null,"code":500}}'


def record(state: str = "FAILED", reason: str = "PREFILL_ENGINE_LOST", **fields) -> AttemptRecord:
    values = dict(transfer_id="xfer-1", attempt=1, state=state, reason=reason, detail="why", client_request_id="",
                  prefill_engine_id="prefill-0", decode_engine_id="decode-0", registered=True, prefill_done=False)
    return AttemptRecord(**{**values, **fields})


def vllm_app(answer: str, seen: list):
    """Echoes the body (answer "echo"), or fails as vLLM does: "500" a JSON error, "stream" an SSE error event."""

    async def app(scope, receive, send):
        body, more = b"", True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        seen.append(body)
        if answer == "500":
            await send({"type": "http.response.start", "status": 500, "headers": [(b"content-type", b"application/json"),
                                                                                 (b"content-length", str(len(VLLM_500)).encode())]})
            await send({"type": "http.response.body", "body": VLLM_500})
            return
        headers = [(b"content-type", b"text/event-stream" if answer == "stream" else b"application/json")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        if answer == "stream":
            await send({"type": "http.response.body", "body": b'data: {"choices": []}\n\n', "more_body": True})
            await send({"type": "http.response.body", "body": b"data: " + VLLM_500 + b"\n\n", "more_body": True})
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
        else:
            await send({"type": "http.response.body", "body": b"echo:" + body})

    return app


def call(middleware: KvpushErrors, body: bytes, chunks: int = 1) -> tuple[int, bytes, list]:
    """Sends body in `chunks` request messages; returns the status, the whole answer and the messages sent."""
    size = -(-len(body) // chunks)
    incoming = [{"type": "http.request", "body": body[i * size:(i + 1) * size], "more_body": i < chunks - 1} for i in range(chunks)]
    sent: list = []

    async def receive():
        return incoming.pop(0) if incoming else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    asyncio.run(middleware({"type": "http", "method": "POST", "path": "/v1/completions"}, receive, send))
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:]), sent


def kvpush_body(role: str = "decode", stream: bool = False, **changes) -> bytes:
    peer = {"prefill_engine_id": "prefill-0"} if role == "decode" else {"decode_engine_id": "decode-0"}
    params = {"role": role, "transfer_id": "xfer-1", "attempt": 1, **peer, **changes}
    return json.dumps({"model": "tiny", "prompt": "hi", "stream": stream, "kv_transfer_params": {"kvpush": params}}).encode()


def lookup_of(result):
    async def lookup(transfer_id, attempt):
        if isinstance(result, Exception):
            raise result
        return result

    return lookup


@pytest.mark.parametrize("key,value", [("role", "x"), ("transfer_id", "a b"), ("attempt", 0), ("attempt", True), ("prefill_engine_id", ""),
                                       ("timeout_ms", -1), ("traceparent", 1), ("client_request_id", 2), ("control_plane", "nope"),
                                       ("control_plane", "other:1")])
def test_refused_parameters_are_400_naming_the_key_and_never_reach_vllm(key, value):
    seen: list = []
    status, answer, _ = call(KvpushErrors(vllm_app("echo", seen), config=DECODE), kvpush_body(**{key: value}))
    error = json.loads(answer)["error"]
    assert status == 400 and not seen
    assert (error["code"], error["type"], error["param"], error["reason"]) == (400, "BadRequestError", f"kv_transfer_params.kvpush.{key}", "INVALID_REQUEST")
    assert key in error["message"]


def test_a_leg_of_the_other_role_is_refused():
    status, answer, _ = call(KvpushErrors(vllm_app("echo", []), config=PREFILL), kvpush_body("decode"))
    assert status == 400 and json.loads(answer)["error"]["param"] == "kv_transfer_params.kvpush.role"


@pytest.mark.parametrize("body", [json.dumps({"model": "tiny", "prompt": "a \"kvpush\" b", "max_tokens": 3}).encode(),
                                  json.dumps({"prompt": "kvpush", "kv_transfer_params": {"other": 1}}).encode(),
                                  b"not json", b'["kvpush"]', b""])
def test_requests_without_kvpush_parameters_pass_untouched(body):
    seen: list = []
    lookups: list = []

    async def lookup(transfer_id, attempt):
        lookups.append(transfer_id)

    middleware = KvpushErrors(vllm_app("echo", seen), config=DECODE, lookup=lookup)
    plain: list = []
    for app in (middleware, vllm_app("echo", [])):
        plain.append(call(app, body, chunks=2 if body else 1)[2])
    assert plain[0] == plain[1] and seen == [body] and not lookups


def test_a_500_is_answered_with_the_end_reasons_status_and_the_key():
    for reason in END_REASONS:
        middleware = KvpushErrors(vllm_app("500", []), config=DECODE, lookup=lookup_of(record(reason=reason)))
        status, answer, sent = call(middleware, kvpush_body())
        error = json.loads(answer)["error"]
        assert status == error["code"] == end_reason_status(reason) and error["reason"] == reason
        assert (error["transfer_id"], error["attempt"], error["engine_id"], error["leg"]) == ("xfer-1", 1, "decode-0", "decode")
        assert dict(sent[0]["headers"])[b"content-length"] == str(len(answer)).encode()


@pytest.mark.parametrize("found,status,reason", [
    (errors.NotFound("no such attempt"), 502, "LEG_FAILED"),
    (errors.Unavailable("down"), 503, "CONTROL_PLANE_UNREACHABLE"),
    (record("WAITING_FOR_PREFILL", ""), 502, "LEG_FAILED"),
    (record("DONE", "COMPLETED"), 502, "LEG_FAILED"),
    (record(decode_engine_id="decode-9"), 409, "TRANSFER_CONFLICT"),
    (record(state="SUPERSEDED", reason="SUPERSEDED"), 409, "SUPERSEDED"),
])
def test_what_the_broker_says_decides_the_answer(found, status, reason):
    middleware = KvpushErrors(vllm_app("500", []), config=DECODE, lookup=lookup_of(found))
    got, answer, _ = call(middleware, kvpush_body())
    assert (got, json.loads(answer)["error"]["reason"]) == (status, reason)


def test_a_streamed_error_event_carries_the_reason_then_done():
    middleware = KvpushErrors(vllm_app("stream", []), config=DECODE, lookup=lookup_of(record(reason="PREFILL_DEADLINE_EXCEEDED")))
    status, answer, _ = call(middleware, kvpush_body(stream=True))
    events = answer.strip().split(b"\n\n")
    assert status == 200 and events[0] == b'data: {"choices": []}' and events[-1] == b"data: [DONE]"
    error = json.loads(events[1].removeprefix(b"data: "))["error"]
    assert (error["code"], error["reason"], error["transfer_id"], error["attempt"]) == (504, "PREFILL_DEADLINE_EXCEEDED", "xfer-1", 1)


def test_a_key_in_flight_on_this_engine_is_refused_409():
    middleware = KvpushErrors(vllm_app("echo", []), config=DECODE)
    middleware._in_flight.add(("xfer-1", 1))
    status, answer, _ = call(middleware, kvpush_body())
    error = json.loads(answer)["error"]
    assert (status, error["reason"], error["transfer_id"]) == (409, "TRANSFER_CONFLICT", "xfer-1")
    middleware._in_flight.clear()
    assert call(middleware, kvpush_body())[0] == 200 and not middleware._in_flight


def test_kvpush_router_takes_a_transfer_answer_as_a_failed_leg_not_an_engine_rejection():
    from kvpush.services.router.failures import _transfer_answer

    middleware = KvpushErrors(vllm_app("500", []), config=DECODE, lookup=lookup_of(record(state="SUPERSEDED", reason="SUPERSEDED")))
    assert _transfer_answer(json.loads(call(middleware, kvpush_body())[1])["error"])
    refused = call(KvpushErrors(vllm_app("echo", []), config=DECODE), kvpush_body(attempt=0))[1]
    assert not _transfer_answer(json.loads(refused)["error"])
    assert not _transfer_answer({"message": "a vLLM 4xx", "type": "BadRequestError", "param": None, "code": 400})
