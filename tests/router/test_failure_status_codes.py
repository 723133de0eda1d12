# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""What a client of the push-mode router sees when a kvpush transfer fails, per end reason, against a real control plane."""

from __future__ import annotations

import asyncio
import json

import pytest

from kvpush.dev.localstack.process import free_port
from kvpush.rendezvous.v1 import transfer_pb2 as tr_pb
from kvpush.services.router.attempt_times import ATTEMPTS_KEPT
from tests.router.fake_engines import DECODE_WORDS
from tests.router.transfer_failure_harness import (
    BODY,
    ScriptedEngine,
    decode_like_vllm,
    error_of,
    just,
    key_of,
    prefill_like_vllm,
    router_under_test,
    serve,
    stop,
)
from tests.waiting import eventually

# ---- what the client sees, per end reason ------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_a_failed_write_answers_502_with_the_brokers_reason(plane, spans, stream):
    prefill_at, decode_at = plane.engines["prefill-0"], plane.engines["decode-0"]
    prefill, decode = await serve(
        ScriptedEngine("prefill", "prefill-0", prefill_like_vllm(prefill_at, write=tr_pb.WRITE_OUTCOME_FAILED, error_message="NIXL_ERR_REMOTE_DISCONNECT")),
        ScriptedEngine("decode", "decode-0", decode_like_vllm(decode_at)),
    )
    try:
        async with router_under_test(plane.port, [prefill], [decode], spans[0]) as router:
            status, body, _ = await router.post("/v1/completions", {**BODY, "stream": stream}, {"X-Request-Id": "client-7"})
            metrics = await router.metrics()
    finally:
        await stop(prefill, decode)
    transfer_id, attempt = key_of(decode)
    error = error_of(body)
    assert status == 502 and error["code"] == 502 and error["type"] == "BadGatewayError"
    assert (error["reason"], error["transfer_id"], error["attempt"]) == ("WRITE_FAILED", transfer_id, 1)
    assert f"transfer {transfer_id} attempt 1 ended FAILED with WRITE_FAILED" in error["message"]
    assert "NIXL_ERR_REMOTE_DISCONNECT" in error["message"]
    assert (error["leg"], error["engine_id"]) == ("prefill", "prefill-0")
    assert len(prefill.received) == 1, "no other prefill engine: no retry"
    assert (await plane.transfer(transfer_id, attempt)).end_reason == tr_pb.END_REASON_WRITE_FAILED
    assert 'kvpush_router_failed_requests_total{reason="WRITE_FAILED"} 1.0' in metrics
    assert 'kvpush_router_failed_requests_total{reason="PREFILL_ENGINE_LOST"} 0.0' in metrics


@pytest.mark.parametrize("side", ["prefill", "decode"])
async def test_a_lost_engine_answers_503(plane, spans, side):
    prefill_at, decode_at = plane.engines["prefill-0"], plane.engines["decode-0"]

    async def lose_prefill_after_answering(params: dict) -> str:
        await prefill_at.report_prefill_done(params)
        asyncio.get_running_loop().call_later(0.1, prefill_at.lose)  # P dies once its leg answered
        return "ok"

    async def lose_decode(params: dict) -> str:
        decode_at.lose()
        return "hang"

    if side == "prefill":
        scripts = (lose_prefill_after_answering, decode_like_vllm(decode_at))
    else:
        # D loses the control plane after registering and goes on waiting (its own deadline would end it).
        scripts = (prefill_like_vllm(prefill_at, write=None), decode_like_vllm(decode_at, after_registering=lose_decode))
    prefill, decode = await serve(ScriptedEngine("prefill", "prefill-0", scripts[0]), ScriptedEngine("decode", "decode-0", scripts[1]))
    try:
        async with router_under_test(plane.port, [prefill], [decode], spans[0]) as router:
            status, body, elapsed = await router.post("/v1/completions", BODY)
    finally:
        await stop(prefill, decode)
    reason = f"{side.upper()}_ENGINE_LOST"
    error = error_of(body)
    assert status == 503 and error["type"] == "ServiceUnavailableError"
    assert (error["reason"], error["leg"], error["engine_id"], error["attempt"]) == (reason, side, f"{side}-0", 1)
    assert f"ended FAILED with {reason}: {side} engine {side}-0 lost" in error["message"] and "LEASE_EXPIRED" in error["message"]
    assert elapsed < 3.0, "answered when the broker ended the attempt, long before the 5 s transfer deadline"


async def test_a_lost_decode_engine_is_retried_on_another_and_answers_only_if_retries_run_out(plane, spans):
    prefill_at, lost_at, good_at = plane.engines["prefill-0"], plane.engines["decode-0"], plane.engines["decode-1"]

    async def lose(params: dict) -> str:
        lost_at.lose()
        return "hang"  # lost the broker: it would wait for its own deadline

    write_to_live_decode = prefill_like_vllm(prefill_at)

    async def prefill_script(params: dict) -> str:
        if params["decode_engine_id"] == "decode-0":
            # The WRITE to a dying engine never completes: P holds it until the broker revokes it.
            return await prefill_like_vllm(prefill_at, write=None)(params)
        return await write_to_live_decode(params)

    prefill, lost, good = await serve(
        ScriptedEngine("prefill", "prefill-0", prefill_script),
        ScriptedEngine("decode", "decode-0", decode_like_vllm(lost_at, after_registering=lose)),
        ScriptedEngine("decode", "decode-1", decode_like_vllm(good_at)),
    )
    try:
        async with router_under_test(plane.port, [prefill], [lost, good], spans[0]) as router:
            status, body, _ = await router.post("/v1/completions", BODY)
    finally:
        await stop(prefill, lost, good)
    assert status == 200 and json.loads(body)["choices"][0]["text"] == " ".join(DECODE_WORDS)
    transfer_id, _ = key_of(lost)
    assert key_of(good) == (transfer_id, 2)
    assert (await plane.transfer(transfer_id, 1)).end_reason == tr_pb.END_REASON_DECODE_ENGINE_LOST
    assert (await plane.transfer(transfer_id, 2)).state == tr_pb.TRANSFER_STATE_DONE
    await eventually(lambda: lost.disconnected == 1)
    assert lost.disconnected == 1, "the failed attempt's decode leg was closed"


@pytest.mark.parametrize("reason", ["REGISTRATION_DEADLINE_EXCEEDED", "PREFILL_DEADLINE_EXCEEDED"])
async def test_a_broker_deadline_answers_504(plane, spans, reason):
    prefill_at, decode_at = plane.engines["prefill-0"], plane.engines["decode-0"]
    if reason == "REGISTRATION_DEADLINE_EXCEEDED":
        # D registered; P served the request without reporting it (as when it refuses the transfer).
        scripts = (just("ok"), decode_like_vllm(decode_at))
    else:
        # P reported; D never got to allocate blocks and register (queued), nor answers.
        scripts = (prefill_like_vllm(prefill_at, write=None), just("hang"))
    prefill, decode = await serve(ScriptedEngine("prefill", "prefill-0", scripts[0]), ScriptedEngine("decode", "decode-0", scripts[1]))
    try:
        async with router_under_test(plane.port, [prefill], [decode], spans[0], transfer_timeout_ms=1000) as router:
            status, body, elapsed = await router.post("/v1/completions", BODY)
    finally:
        await stop(prefill, decode)
    error = error_of(body)
    assert status == 504 and error["type"] == "GatewayTimeoutError"
    assert error["reason"] == reason and f"ended FAILED with {reason}" in error["message"] and "deadline passed" in error["message"]
    assert 1.0 <= elapsed < 1.5, "the broker's deadline, before the router's own (1 s + 0.5 s slack)"
    if reason == "PREFILL_DEADLINE_EXCEEDED":
        await eventually(lambda: decode.disconnected == 1)
        assert decode.disconnected == 1, "the silent decode leg was closed"


async def test_a_token_count_mismatch_answers_400(plane, spans):
    prefill_at, decode_at = plane.engines["prefill-0"], plane.engines["decode-0"]
    prefill, decode = await serve(
        ScriptedEngine("prefill", "prefill-0", prefill_like_vllm(prefill_at, num_tokens=30, write=None)),
        ScriptedEngine("decode", "decode-0", decode_like_vllm(decode_at)),
    )
    try:
        async with router_under_test(plane.port, [prefill], [decode], spans[0]) as router:
            status, body, _ = await router.post("/v1/completions", BODY)
    finally:
        await stop(prefill, decode)
    error = error_of(body)
    assert status == 400 and error["type"] == "BadRequestError"
    assert error["reason"] == "TOKEN_COUNT_MISMATCH"
    assert "ended FAILED with TOKEN_COUNT_MISMATCH: the prefill side computed 30 tokens; the destination needs 40" in error["message"]
    assert len(prefill.received) == len(decode.received) == 1, "the request's own fault: no retry"


async def test_a_colliding_transfer_id_answers_409_and_leaves_the_other_attempt_alone(plane, spans):
    decode_at, other_at = plane.engines["decode-0"], plane.engines["decode-1"]

    async def other_router_first(params: dict) -> str:
        # Another router's request took the same transfer key with its own decode engine a moment earlier.
        await other_at.register_destination(params, client_request_id="someone-else")
        return await decode_like_vllm(decode_at)(params)

    prefill, decode = await serve(ScriptedEngine("prefill", "prefill-0", just("ok")), ScriptedEngine("decode", "decode-0", other_router_first))
    try:
        async with router_under_test(plane.port, [prefill], [decode], spans[0]) as router:
            status, body, _ = await router.post("/v1/completions", BODY, {"X-Request-Id": "mine"})
    finally:
        await stop(prefill, decode)
    transfer_id, attempt = key_of(decode)
    error = error_of(body)
    assert status == 409 and error["type"] == "ConflictError"
    assert (error["reason"], error["transfer_id"], error["attempt"]) == ("TRANSFER_CONFLICT", transfer_id, 1)
    assert "'someone-else'" in error["message"] and "another router uses the same transfer id" in error["message"]
    assert len(decode.received) == 1, "retrying would supersede the other request's attempt"
    other = await plane.transfer(transfer_id, attempt)
    assert (other.state, other.client_request_id) == (tr_pb.TRANSFER_STATE_WAITING_FOR_PREFILL, "someone-else"), "not cancelled by this router"


async def test_an_unreachable_control_plane_answers_503(spans):
    prefill, decode = await serve(ScriptedEngine("prefill", "prefill-0", just("ok")), ScriptedEngine("decode", "decode-0", just("vllm-error")))
    try:
        async with router_under_test(free_port(), [prefill], [decode], spans[0], cancel_timeout_s=0.5) as router:
            status, body, elapsed = await router.post("/v1/completions", BODY)
    finally:
        await stop(prefill, decode)
    error = error_of(body)
    assert status == 503 and error["reason"] == "CONTROL_PLANE_UNREACHABLE"
    assert "HTTP 500: Internal server error" in error["message"] and "control plane could not say why" in error["message"]
    assert len(decode.received) == 1, "not an engine's fault: no retry"
    assert elapsed < 3.0


async def test_an_overlong_request_id_is_refused_with_400_before_any_leg(plane, spans):
    prefill, decode = await serve(ScriptedEngine("prefill", "prefill-0", just("ok")), ScriptedEngine("decode", "decode-0", just("ok")))
    try:
        async with router_under_test(plane.port, [prefill], [decode], spans[0]) as router:
            status, body, _ = await router.post("/v1/completions", BODY, {"X-Request-Id": "r" * 300})
            metrics = await router.metrics()
    finally:
        await stop(prefill, decode)
    error = error_of(body)
    assert status == 400 and error["reason"] == "INVALID_REQUEST" and "X-Request-Id" in error["message"]
    assert not prefill.received and not decode.received
    assert 'kvpush_router_failed_requests_total{reason="INVALID_REQUEST"} 1.0' in metrics


# ---- retries share the request's deadline ----------------------------------------------------


async def test_a_retry_gets_what_is_left_of_the_transfer_deadline_so_the_answer_keeps_it(plane, spans):
    prefill_at, decode_at = plane.engines["prefill-1"], plane.engines["decode-0"]
    # prefill-0 never answers (its leg times out, an engine's fault: retried); prefill-1 reports and never WRITEs.
    hung, silent, decode = await serve(
        ScriptedEngine("prefill", "prefill-0", just("hang")),
        ScriptedEngine("prefill", "prefill-1", prefill_like_vllm(prefill_at, write=None)),
        ScriptedEngine("decode", "decode-0", decode_like_vllm(decode_at)),
    )
    try:
        async with router_under_test(plane.port, [hung, silent], [decode], spans[0], transfer_timeout_ms=3000, prefill_timeout_s=1.5) as router:
            status, body, elapsed = await router.post("/v1/completions", BODY)
    finally:
        await stop(hung, silent, decode)
    first, retry = (engine.received[0].body["kv_transfer_params"]["kvpush"] for engine in (hung, silent))
    assert (first["attempt"], first["timeout_ms"]) == (1, 3000)
    assert retry["attempt"] == 2 and 1000 <= retry["timeout_ms"] <= 1500, f"attempt 2 carries what is left of the 3 s: {retry['timeout_ms']} ms"
    error = error_of(body)
    assert status == 504 and error["attempt"] == 2, error
    assert elapsed < 3.0 + 0.5 + 0.5, f"answered {elapsed:.2f} s after arrival: the transfer deadline (3 s) + slack (0.5 s), not a second full deadline"


async def test_no_retry_is_made_with_less_than_its_minimum_left(plane, spans):
    hung, spare, decode = await serve(
        ScriptedEngine("prefill", "prefill-0", just("hang")),
        ScriptedEngine("prefill", "prefill-1", just("ok")),
        ScriptedEngine("decode", "decode-0", just("hang")),
    )
    try:
        # The prefill leg's timeout leaves less than RETRY_MIN_LEFT_S of the transfer deadline.
        async with router_under_test(plane.port, [hung, spare], [decode], spans[0], transfer_timeout_ms=1000, prefill_timeout_s=0.95) as router:
            status, body, _ = await router.post("/v1/completions", BODY)
            metrics = await router.metrics()
    finally:
        await stop(hung, spare, decode)
    error = error_of(body)
    assert status == 504 and (error["reason"], error["leg"], error["engine_id"], error["attempt"]) == ("LEG_TIMEOUT", "prefill", "prefill-0", 1), error
    assert not spare.received, "a retry with < 0.1 s left could only miss the deadline: the first failure is answered"
    retry_events = [e for s in spans[1].get_finished_spans() for e in s.events if e.name == "retry_skipped"]
    assert len(retry_events) == 1 and retry_events[0].attributes["kvpush.left_s"] < 0.1
    assert "kvpush_router_retries_skipped_total 1.0" in metrics and "kvpush_router_retries_total 0.0" in metrics


async def test_no_retry_is_started_with_less_left_than_attempts_take_to_their_first_output(plane, spans):
    hung, spare, decode = await serve(
        ScriptedEngine("prefill", "prefill-0", just("hang")),
        ScriptedEngine("prefill", "prefill-1", just("ok")),
        ScriptedEngine("decode", "decode-0", just("hang")),
    )
    try:
        # The prefill leg's timeout leaves ~0.3 s of the transfer deadline; recent attempts took 0.5 s to their output.
        async with router_under_test(plane.port, [hung, spare], [decode], spans[0], transfer_timeout_ms=1000, prefill_timeout_s=0.7) as router:
            for _ in range(ATTEMPTS_KEPT):
                router.router.attempt_times.observe(0.5)
            status, body, elapsed = await router.post("/v1/completions", BODY)
    finally:
        await stop(hung, spare, decode)
    error = error_of(body)
    assert status == 504 and (error["reason"], error["leg"], error["attempt"]) == ("LEG_TIMEOUT", "prefill", 1), error
    assert not spare.received, "a retry with 0.3 s left cannot get output when attempts take 0.5 s: the first failure is answered"
    assert elapsed < 1.0, f"answered {elapsed:.2f} s after arrival: at once, not at the transfer deadline"
    (event,) = [e for s in spans[1].get_finished_spans() for e in s.events if e.name == "retry_skipped"]
    assert 0.1 < event.attributes["kvpush.left_s"] < 0.5 and event.attributes["kvpush.needed_s"] == 0.5
