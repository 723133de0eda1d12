# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""The push-mode router answers promptly: its transfer deadline guard, a hanging decode engine, long answers, long polls."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from kvpush.client import BrokerClient, ClientConfig
from kvpush.rendezvous.v1 import rendezvous_service_pb2 as rv_pb
from kvpush.rendezvous.v1 import transfer_pb2 as tr_pb
from kvpush.services.common.tokens import ROUTER_IDENTITY
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
    token_of,
)
from tests.waiting import eventually

# ---- answering promptly ------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_the_transfer_deadline_guard_answers_504_and_closes_the_decode_leg(plane, spans, stream):
    prefill, decode = await serve(ScriptedEngine("prefill", "prefill-0", just("ok")), ScriptedEngine("decode", "decode-0", just("hang")))
    try:
        async with router_under_test(plane.port, [prefill], [decode], spans[0], transfer_timeout_ms=1000, max_attempts=1) as router:
            status, body, elapsed = await router.post("/v1/completions", {**BODY, "stream": stream})
            await eventually(lambda: decode.disconnected == 1)
    finally:
        await stop(prefill, decode)
    transfer_id, attempt = key_of(decode)
    error = error_of(body)
    assert status == 504 and error["reason"] == "ROUTER_DEADLINE_EXCEEDED"
    assert "no first token before the transfer deadline (1000 ms + 0.5 s)" in error["message"]
    assert 1.5 <= elapsed < 1.0 + 0.5 + 0.5
    assert decode.disconnected == 1
    transfer = await plane.transfer(transfer_id, attempt)
    assert (transfer.state, transfer.end_reason) == (tr_pb.TRANSFER_STATE_CANCELLED, tr_pb.END_REASON_CANCELLED_BY_ROUTER)


async def test_an_attempt_failing_at_the_broker_is_answered_while_the_decode_engine_hangs(plane, spans):
    prefill_at, decode_at = plane.engines["prefill-0"], plane.engines["decode-0"]

    async def register_and_hang(params: dict) -> str:
        await decode_at.register_destination(params)
        return "hang"  # e.g. waiting for a fence that a silent producer rank holds up

    async def fail_the_write_later(params: dict) -> str:
        await prefill_at.report_prefill_done(params)

        async def fail() -> None:
            await asyncio.sleep(0.5)
            await prefill_at.report_write(params, tr_pb.WRITE_OUTCOME_FAILED, "NIXL_ERR_BACKEND")

        asyncio.get_running_loop().create_task(fail())
        return "ok"

    prefill, decode = await serve(ScriptedEngine("prefill", "prefill-0", fail_the_write_later), ScriptedEngine("decode", "decode-0", register_and_hang))
    provider, exporter = spans
    try:
        async with router_under_test(plane.port, [prefill], [decode], provider, transfer_timeout_ms=10_000) as router:
            status, body, elapsed = await router.post("/v1/completions", {**BODY, "stream": True})
            await eventually(lambda: decode.disconnected == 1)
    finally:
        await stop(prefill, decode)
    error = error_of(body)
    assert status == 502 and error["reason"] == "WRITE_FAILED" and "NIXL_ERR_BACKEND" in error["message"]
    assert 0.5 <= elapsed < 1.5, "answered when the write failed, not at the 10 s deadline"
    assert decode.disconnected == 1, "the decode leg was closed, not waited for"
    polls = [s for s in exporter.get_finished_spans() if s.name == "kvpush.rpc/GetTransfer"]
    assert polls, "the router long-polled the broker"


async def test_a_done_transfer_keeps_waiting_for_a_long_answer_past_the_deadline(plane, spans):
    prefill_at, decode_at = plane.engines["prefill-0"], plane.engines["decode-0"]
    prefill, decode = await serve(
        ScriptedEngine("prefill", "prefill-0", prefill_like_vllm(prefill_at)),
        ScriptedEngine("decode", "decode-0", decode_like_vllm(decode_at), delay_s=1.5),  # a long non-streamed generation
    )
    try:
        async with router_under_test(plane.port, [prefill], [decode], spans[0], transfer_timeout_ms=500) as router:
            status, body, elapsed = await router.post("/v1/completions", BODY)
    finally:
        await stop(prefill, decode)
    assert status == 200 and json.loads(body)["choices"][0]["text"] == " ".join(DECODE_WORDS)
    assert elapsed >= 1.5 and decode.disconnected == 0


async def test_a_successful_streamed_request_makes_no_get_transfer_call(plane, spans):
    provider, exporter = spans
    prefill_at, decode_at = plane.engines["prefill-0"], plane.engines["decode-0"]
    prefill, decode = await serve(
        ScriptedEngine("prefill", "prefill-0", prefill_like_vllm(prefill_at)), ScriptedEngine("decode", "decode-0", decode_like_vllm(decode_at))
    )
    try:
        async with router_under_test(plane.port, [prefill], [decode], provider) as router:
            status, body, _ = await router.post("/v1/completions", {**BODY, "stream": True})
    finally:
        await stop(prefill, decode)
    assert status == 200 and b"data: [DONE]" in body and b'"error"' not in body
    # The router's one shard map stream (WatchShards, opened at start) is not the request's.
    assert not [s.name for s in exporter.get_finished_spans() if s.name.startswith("kvpush.rpc/") and s.name != "kvpush.rpc/WatchShards"]


async def test_get_transfer_long_polls_within_a_deadline_beyond_its_wait(plane):
    params = {"transfer_id": "xfer-poll", "attempt": 1, "prefill_engine_id": "prefill-0", "timeout_ms": 30_000, "client_request_id": "r"}
    await plane.engines["decode-0"].register_destination(params)
    config = ClientConfig(target=f"127.0.0.1:{plane.port}", token=token_of(ROUTER_IDENTITY), default_timeout_s=0.2)
    async with BrokerClient(config) as broker:
        request = rv_pb.GetTransferRequest(transfer_id="xfer-poll", attempt=1)
        t0 = time.monotonic()
        live = (await broker.get_transfer(request, wait_s=0.5)).transfer  # the call's deadline is 0.5 + 0.2 s
        waited = time.monotonic() - t0
        assert live.state == tr_pb.TRANSFER_STATE_WAITING_FOR_PREFILL and 0.45 <= waited < 0.7
        assert not request.HasField("wait"), "the caller's request is left as it was"
        cancel = rv_pb.CancelTransferRequest(key=tr_pb.TransferKey(transfer_id="xfer-poll", attempt=1), detail="enough")
        asyncio.get_running_loop().call_later(0.2, lambda: asyncio.ensure_future(broker.cancel_transfer(cancel)))
        t0 = time.monotonic()
        ended = (await broker.get_transfer(request, wait_s=5.0)).transfer
        assert ended.state == tr_pb.TRANSFER_STATE_CANCELLED and time.monotonic() - t0 < 1.0, "answered when the attempt ended"
