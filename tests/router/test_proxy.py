# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""The router's HTTP behaviour against fake engines (in-process aiohttp) and a real in-process control plane.

What each leg receives (bodies, kv_transfer_params, W3C headers), the spans
the router emits, and every failure path: which leg is named, which status
the client gets, that the transfer attempt is cancelled at the broker, the
other leg abandoned, and that nothing waits past its bound.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from opentelemetry.trace import SpanKind

from kvpush.client import BrokerClient, ClientConfig
from kvpush.dev.localstack.process import free_port
from kvpush.rendezvous.v1 import rendezvous_service_pb2 as rv_pb
from kvpush.rendezvous.v1 import transfer_pb2
from kvpush.services import control_plane
from kvpush.services.common.config import ServerConfig
from kvpush.services.common.tokens import ROUTER_IDENTITY, IdentityTokens
from kvpush.services.router.config import RouterConfig
from kvpush.services.router.core import Endpoint
from kvpush.sse import DONE, sse_payloads
from tests.router.fake_engines import DECODE_WORDS, FakeEngine, decode_stream_text
from tests.router.router_harness import RouterUnderTest

TOKEN = "router-test-token"
BODY = {"model": "tiny", "prompt": "hello there", "max_tokens": 4, "temperature": 0.0}
INCOMING_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
INCOMING_TRACEPARENT = f"00-{INCOMING_TRACE_ID}-00f067aa0ba902b7-01"


@pytest.fixture
async def plane():
    """A real control plane (registrar + broker) on 127.0.0.1:0."""
    async with control_plane.running(ServerConfig(listen="127.0.0.1:0"), tokens=IdentityTokens({ROUTER_IDENTITY: TOKEN})) as started:
        yield started




def make_config(plane, prefills, decodes, **overrides) -> RouterConfig:
    settings = {
        "prefill": tuple(Endpoint(e.url, e.engine_id) for e in prefills),
        "decode": tuple(Endpoint(e.url, e.engine_id) for e in decodes),
        "control_plane": f"127.0.0.1:{plane.port}" if plane is not None else "",
        "token": TOKEN,
        "prefill_timeout_s": 5.0,
        "first_token_timeout_s": 5.0,
        "request_timeout_s": 10.0,
        "transfer_timeout_ms": 5000,
        **overrides,
    }
    return RouterConfig(**settings)


async def started(*engines: FakeEngine) -> list[FakeEngine]:
    return [await engine.start() for engine in engines]


async def stop(*engines: FakeEngine) -> None:
    for engine in engines:
        await engine.stop()


async def transfer_state(plane, transfer_id: str, attempt: int) -> int:
    async with BrokerClient(ClientConfig(target=f"127.0.0.1:{plane.port}", token=TOKEN)) as broker:
        return (await broker.get_transfer(rv_pb.GetTransferRequest(transfer_id=transfer_id, attempt=attempt))).transfer.state


def sse_texts(body: bytes) -> tuple[list[str], list[dict]]:
    """Texts of a completions stream's chunks, and any error events."""
    texts, errors = [], []
    for event in sse_payloads(body.splitlines(keepends=True)):
        if event == DONE:
            continue
        if "error" in event:
            errors.append(event["error"])
        else:
            texts.append(event["choices"][0]["text"])
    return texts, errors


async def test_push_legs_carry_the_transfer_key_and_trace_context(plane, spans):
    provider, exporter = spans
    prefill, decode = await started(FakeEngine("prefill", "prefill-0"), FakeEngine("decode", "decode-0"))
    try:
        async with RouterUnderTest(make_config(plane, [prefill], [decode]), provider) as router:
            status, body, _ = await router.post("/v1/completions", BODY, {"X-Request-Id": "client-1", "traceparent": INCOMING_TRACEPARENT})
    finally:
        await stop(prefill, decode)
    assert status == 200
    assert json.loads(body)["choices"][0]["text"] == " ".join(DECODE_WORDS)
    (p_leg,), (d_leg,) = prefill.received, decode.received
    p_params, d_params = p_leg.body.pop("kv_transfer_params")["kvpush"], d_leg.body.pop("kv_transfer_params")["kvpush"]
    assert p_leg.body == {**BODY, "max_tokens": 1, "stream": False}
    assert d_leg.body == BODY
    assert (p_params["role"], p_params["decode_engine_id"], d_params["role"], d_params["prefill_engine_id"]) == ("prefill", "decode-0", "decode", "prefill-0")
    assert p_params["transfer_id"] == d_params["transfer_id"] and p_params["attempt"] == d_params["attempt"] == 1
    assert p_params["client_request_id"] == d_params["client_request_id"] == "client-1"
    assert p_params["timeout_ms"] == d_params["timeout_ms"] == 5000

    finished = {span.name: span for span in exporter.get_finished_spans()}
    request_span, p_span, d_span = finished["router.request"], finished["router.prefill_leg"], finished["router.decode_leg"]
    assert request_span.kind == SpanKind.SERVER
    assert format(request_span.context.trace_id, "032x") == INCOMING_TRACE_ID
    assert format(request_span.parent.span_id, "016x") == "00f067aa0ba902b7"
    for leg_span, received, params in ((p_span, p_leg, p_params), (d_span, d_leg, d_params)):
        assert leg_span.parent.span_id == request_span.context.span_id
        expected = f"00-{INCOMING_TRACE_ID}-{leg_span.context.span_id:016x}-01"
        assert received.headers["traceparent"] == params["traceparent"] == expected
        assert leg_span.attributes["kvpush.transfer_id"] == p_params["transfer_id"]
    assert request_span.attributes["kvpush.transfer_id"] == p_params["transfer_id"]
    assert request_span.attributes["http.response.status_code"] == 200


async def test_streamed_answer_is_passed_through_and_ttft_recorded(plane, spans):
    provider, exporter = spans
    prefill, decode = await started(FakeEngine("prefill", "prefill-0"), FakeEngine("decode", "decode-0", delay_s=0.05))
    try:
        async with RouterUnderTest(make_config(plane, [prefill], [decode]), provider) as router:
            status, body, elapsed = await router.post("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True})
    finally:
        await stop(prefill, decode)
    assert status == 200
    texts, errors = sse_texts(body)
    assert "".join(texts) == decode_stream_text() and not errors
    assert body.endswith(b"data: [DONE]\n\n")
    assert prefill.received[0].body["max_completion_tokens"] == 1 and prefill.received[0].body["stream"] is False
    request_span = next(s for s in exporter.get_finished_spans() if s.name == "router.request")
    assert [event.name for event in request_span.events] == ["first_token"]
    assert 50 <= request_span.attributes["kvpush.ttft_ms"] <= elapsed * 1000


async def test_prefill_refusing_connections_is_retried_on_another_prefill_engine(plane, spans):
    provider, exporter = spans
    dead = FakeEngine("prefill", "prefill-dead")
    dead.url = f"http://127.0.0.1:{free_port()}"
    prefill, decode = await started(FakeEngine("prefill", "prefill-1"), FakeEngine("decode", "decode-0", delay_s=0.2))
    try:
        async with RouterUnderTest(make_config(plane, [dead, prefill], [decode]), provider) as router:
            status, body, _ = await router.post("/v1/completions", {**BODY, "stream": True})
            metrics = (await (await router.client.get(router.url + "/metrics")).read()).decode()
    finally:
        await stop(prefill, decode)
    assert status == 200
    texts, errors = sse_texts(body)
    assert "".join(texts) == decode_stream_text() and not errors
    # Attempt 1's decode leg may not have reached the engine before the
    # refused connection ended the attempt; if it did, it was abandoned.
    *abandoned, served = decode.received
    params = served.body["kv_transfer_params"]["kvpush"]
    assert (params["attempt"], params["prefill_engine_id"], params["traceparent"]) == (2, "prefill-1", served.headers["traceparent"])
    assert decode.disconnected == len(abandoned) <= 1
    assert all(leg.body["kv_transfer_params"]["kvpush"]["prefill_engine_id"] == "prefill-dead" for leg in abandoned)
    transfer_id = params["transfer_id"]
    assert await transfer_state(plane, transfer_id, 1) == transfer_pb2.TRANSFER_STATE_CANCELLED
    request_span = next(s for s in exporter.get_finished_spans() if s.name == "router.request")
    assert [e.name for e in request_span.events] == ["leg_failed", "retry", "first_token"]
    assert request_span.attributes["kvpush.attempt"] == 2
    assert 'kvpush_router_retries_total 1.0' in metrics
    assert 'kvpush_router_leg_failures_total{cause="connect",leg="prefill"} 1.0' in metrics
    # Segment histograms: the one prefill leg that answered, and what followed it (D answers 0.2 s late).
    assert 'kvpush_router_prefill_leg_seconds_count 1.0' in metrics
    assert 'kvpush_router_after_prefill_leg_seconds_count 1.0' in metrics


@pytest.mark.parametrize(("behaviour", "status", "cause"), [("error:500", 502, "HTTP 500"), ("hang", 504, "no answer within 1 s")])
async def test_failing_only_prefill_engine_gives_a_clear_error_within_its_bound(plane, spans, behaviour, status, cause):
    provider, _ = spans
    prefill, decode = await started(FakeEngine("prefill", "prefill-0", behaviour), FakeEngine("decode", "decode-0", "hang"))
    try:
        config = make_config(plane, [prefill], [decode], prefill_timeout_s=1.0)
        async with RouterUnderTest(config, provider) as router:
            answer, body, elapsed = await router.post("/v1/completions", {**BODY, "stream": True})
            await asyncio.sleep(0.1)  # the abandoned decode handler sees its client go
    finally:
        await stop(prefill, decode)
    assert answer == status
    error = json.loads(body)["error"]
    assert (error["leg"], error["engine_id"], error["code"]) == ("prefill", "prefill-0", status)
    assert error["message"].startswith("prefill leg to prefill-0") and cause in error["message"]
    assert elapsed < 3.0
    assert len(prefill.received) == 1, "no other prefill engine: no retry"
    assert decode.disconnected == 1
    transfer_id = decode.received[0].body["kv_transfer_params"]["kvpush"]["transfer_id"]
    assert await transfer_state(plane, transfer_id, 1) == transfer_pb2.TRANSFER_STATE_CANCELLED


async def test_decode_never_answering_times_out_naming_the_decode_leg(plane, spans):
    provider, _ = spans
    prefill, decode = await started(FakeEngine("prefill", "prefill-0"), FakeEngine("decode", "decode-0", "hang"))
    try:
        async with RouterUnderTest(make_config(plane, [prefill], [decode], first_token_timeout_s=1.0, max_attempts=1), provider) as router:
            status, body, elapsed = await router.post("/v1/completions", {**BODY, "stream": True})
    finally:
        await stop(prefill, decode)
    assert status == 504 and json.loads(body)["error"]["leg"] == "decode"
    assert 1.0 <= elapsed < 3.0


async def test_decode_rejecting_the_request_is_passed_through_without_retry(plane, spans):
    provider, _ = spans
    prefill, decode = await started(FakeEngine("prefill", "prefill-0"), FakeEngine("decode", "decode-0", "error:400"))
    try:
        async with RouterUnderTest(make_config(plane, [prefill], [decode]), provider) as router:
            status, body, _ = await router.post("/v1/completions", BODY)
    finally:
        await stop(prefill, decode)
    assert status == 400 and json.loads(body)["error"]["message"] == "decode-0 says no"
    assert len(decode.received) == 1


async def test_decode_breaking_off_after_output_ends_the_stream_with_an_error_event(plane, spans):
    provider, _ = spans
    prefill, decode = await started(FakeEngine("prefill", "prefill-0"), FakeEngine("decode", "decode-0", "break"))
    try:
        async with RouterUnderTest(make_config(plane, [prefill], [decode]), provider) as router:
            status, body, _ = await router.post("/v1/completions", {**BODY, "stream": True})
    finally:
        await stop(prefill, decode)
    assert status == 200
    texts, errors = sse_texts(body)
    assert texts == DECODE_WORDS[:1]
    assert len(errors) == 1 and errors[0]["leg"] == "decode" and "broke off after output started" in errors[0]["message"]
    assert body.endswith(b"data: [DONE]\n\n")
    assert len(decode.received) == 1, "output had reached the client: no retry"


async def test_client_going_away_mid_stream_aborts_the_decode_leg(plane, spans):
    provider, exporter = spans
    prefill, decode = await started(FakeEngine("prefill", "prefill-0"), FakeEngine("decode", "decode-0", chunk_delay_s=0.5))
    try:
        async with RouterUnderTest(make_config(plane, [prefill], [decode]), provider) as router:
            async with router.client.post(router.url + "/v1/completions", json={**BODY, "stream": True}) as response:
                first = await response.content.readline()
                response.close()  # the client hangs up after the first chunk
            for _ in range(50):
                if decode.disconnected:
                    break
                await asyncio.sleep(0.1)
    finally:
        await stop(prefill, decode)
    assert first.startswith(b"data: {")
    assert decode.disconnected == 1, "the decode engine's request was aborted"
    d_span = next(s for s in exporter.get_finished_spans() if s.name == "router.decode_leg")
    assert d_span.status.description == "client went away"


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_client_going_away_before_any_output_cancels_the_attempt_and_closes_both_legs(plane, spans, stream):
    provider, exporter = spans
    prefill, decode = await started(FakeEngine("prefill", "prefill-0", "hang"), FakeEngine("decode", "decode-0", "hang"))
    try:
        async with RouterUnderTest(make_config(plane, [prefill], [decode]), provider) as router:
            request = asyncio.create_task(router.post("/v1/completions", {**BODY, "stream": stream}))
            for _ in range(50):
                if prefill.received and decode.received:
                    break
                await asyncio.sleep(0.02)
            t0 = time.monotonic()
            request.cancel()  # the client hangs up while both legs are in flight
            await asyncio.gather(request, return_exceptions=True)
            for _ in range(50):
                if prefill.disconnected and decode.disconnected:
                    break
                await asyncio.sleep(0.02)
            noticed = time.monotonic() - t0
            for _ in range(50):  # the handler counts the request once the broker answered the cancel
                metrics = (await (await router.client.get(router.url + "/metrics")).read()).decode()
                if 'reason="CLIENT_GONE"} 1.0' in metrics:
                    break
                await asyncio.sleep(0.02)
    finally:
        await stop(prefill, decode)
    assert (prefill.disconnected, decode.disconnected) == (1, 1), "both legs were closed"
    assert noticed < 1.0, "well before any timeout (5 s)"
    transfer_id = decode.received[0].body["kv_transfer_params"]["kvpush"]["transfer_id"]
    async with BrokerClient(ClientConfig(target=f"127.0.0.1:{plane.port}", token=TOKEN)) as broker:
        transfer = (await broker.get_transfer(rv_pb.GetTransferRequest(transfer_id=transfer_id, attempt=1))).transfer
    assert (transfer.state, transfer.end_reason, transfer.detail) == (
        transfer_pb2.TRANSFER_STATE_CANCELLED, transfer_pb2.END_REASON_CANCELLED_BY_ROUTER, "client went away"
    )
    assert 'kvpush_router_failed_requests_total{reason="CLIENT_GONE"} 1.0' in metrics
    d_span = next(s for s in exporter.get_finished_spans() if s.name == "router.decode_leg")
    assert d_span.status.description == "client went away"


async def test_pull_mode_sends_the_decode_leg_what_prefill_returned(spans):
    provider, _ = spans
    prefill, decode = await started(FakeEngine("prefill", "prefill-0", delay_s=0.1), FakeEngine("decode", "decode-0"))
    try:
        async with RouterUnderTest(make_config(None, [prefill], [decode], mode="pull"), provider) as router:
            status, _, _ = await router.post("/v1/completions", BODY)
    finally:
        await stop(prefill, decode)
    assert status == 200
    (p_leg,), (d_leg,) = prefill.received, decode.received
    assert p_leg.body["kv_transfer_params"] == {
        "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None, "remote_block_ids": None, "remote_host": None, "remote_port": None,
    }
    assert d_leg.body["kv_transfer_params"] == {"do_remote_prefill": True, "remote_engine_id": "prefill-0", "remote_block_ids": [1, 2]}
    assert d_leg.at >= p_leg.at + 0.1, "the decode leg waits for the prefill answer"


async def test_upstream_push_mode_matches_legs_by_request_id(spans):
    provider, _ = spans
    prefill, decode = await started(FakeEngine("prefill", "prefill-engine-001"), FakeEngine("decode", "decode-0"))
    try:
        config = make_config(None, [prefill], [decode], mode="upstream-push", prefill_kv_host="10.1.2.3", prefill_side_channel_port=5601, prefill_tp_size=2)
        async with RouterUnderTest(config, provider) as router:
            status, _, _ = await router.post("/v1/completions", BODY)
    finally:
        await stop(prefill, decode)
    assert status == 200
    (p_leg,), (d_leg,) = prefill.received, decode.received
    assert p_leg.headers["x-request-id"] == d_leg.headers["x-request-id"]
    params = d_leg.body["kv_transfer_params"]
    assert (params["remote_engine_id"], params["remote_host"], params["remote_port"], params["tp_size"]) == ("prefill-engine-001", "10.1.2.3", 5601, 2)
    assert params["remote_request_id"] == d_leg.headers["x-request-id"]
    assert p_leg.body["kv_transfer_params"]["do_remote_decode"] is True
    assert p_leg.body["kv_transfer_params"]["transfer_id"] == params["transfer_id"]


@pytest.mark.parametrize("behaviour", ["error-event", "error-event-text"])
async def test_decode_error_event_names_the_engines_message_whether_object_or_text(spans, behaviour):
    provider, _ = spans
    prefill, decode = await started(FakeEngine("prefill", "prefill-0"), FakeEngine("decode", "decode-0", behaviour))
    try:
        config = make_config(None, [prefill], [decode], mode="upstream-push", prefill_kv_host="127.0.0.1", prefill_side_channel_port=5601)
        async with RouterUnderTest(config, provider) as router:
            status, body, _ = await router.post("/v1/completions", {**BODY, "stream": True})
            metrics = await router.metrics()
    finally:
        await stop(prefill, decode)
    error = json.loads(body)["error"]
    assert status == 502 and (error["leg"], error["engine_id"], error["reason"]) == ("decode", "decode-0", "LEG_FAILED")
    assert "the engine reported: decode-0 failed" in error["message"]
    assert 'kvpush_router_leg_failures_total{cause="engine_error",leg="decode"} 1.0' in metrics


async def test_health_models_metrics_and_bad_requests(plane, spans):
    provider, _ = spans
    dead = FakeEngine("prefill", "prefill-dead")
    dead.url = f"http://127.0.0.1:{free_port()}"
    prefill, decode = await started(FakeEngine("prefill", "prefill-0"), FakeEngine("decode", "decode-0"))
    try:
        async with RouterUnderTest(make_config(plane, [prefill, dead], [decode]), provider) as router:
            async with router.client.get(router.url + "/health") as response:
                healthy = (response.status, await response.json())
            async with router.client.get(router.url + "/v1/models") as response:
                models = (response.status, await response.json())
            bad = [await router.post("/v1/completions", body) for body in ({**BODY, "n": 2}, [1])]
            async with router.client.post(router.url + "/v1/completions", data=b"{not json") as response:
                bad.append((response.status, await response.read(), 0.0))
            await prefill.stop()
            async with router.client.get(router.url + "/health") as response:
                unhealthy = (response.status, await response.json())
            async with router.client.get(router.url + "/metrics") as response:
                metrics = (await response.read()).decode()
    finally:
        await stop(decode)
    assert healthy[0] == 200 and healthy[1]["status"] == "ok"
    assert [(e["engine_id"], e["healthy"]) for e in healthy[1]["prefill"]] == [("prefill-0", True), ("prefill-dead", False)]
    assert models == (200, {"object": "list", "data": [{"id": "tiny", "object": "model"}]})
    assert [status for status, _, _ in bad] == [400, 400, 400]
    assert all(json.loads(body)["error"]["type"] == "BadRequestError" for _, body, _ in bad)
    assert unhealthy[0] == 503 and unhealthy[1]["status"] == "unavailable"
    assert 'kvpush_router_requests_total{path="/v1/completions",status="400"} 3.0' in metrics
    assert 'kvpush_router_legs_in_flight{engine_id="decode-0",role="decode",url="' + decode.url + '"} 0.0' in metrics


@pytest.mark.parametrize(("router_keepalive_s", "expected"), [(0.2, [200, 200]), (5.0, [200, 502])])
async def test_an_idle_connection_is_not_reused_once_the_engine_may_be_closing_it(spans, router_keepalive_s, expected):
    """vLLM's server drops a request that comes on a connection as its keep-alive ends: the router's own keep-alive is shorter.

    The fake decode engine drops every request on a connection idle 0.4 s;
    the router may reuse an idle connection for engine_keepalive_s. Below
    the engine's keep-alive, the second request after a 0.6 s gap goes on a
    new connection; above it (aiohttp's default is 15 s), it is lost.
    """
    provider, _ = spans
    prefill, decode = await started(FakeEngine("prefill", "prefill-0"), FakeEngine("decode", "decode-0", keepalive_s=0.4))
    statuses, body = [], b""
    try:
        async with RouterUnderTest(make_config(None, [prefill], [decode], mode="pull", engine_keepalive_s=router_keepalive_s), provider) as router:
            for _ in range(2):
                status, body, _ = await router.post("/v1/completions", BODY)
                statuses.append(status)
                await asyncio.sleep(0.6)
    finally:
        await stop(prefill, decode)
    assert statuses == expected, body
    assert decode.dropped == expected.count(502)
    if 502 in expected:
        assert b"ServerDisconnectedError" in body
