# SPDX-License-Identifier: Apache-2.0
"""Direct calls to kvpush engines running `--middleware kvpush.connector.middleware.KvpushErrors`, no router in front.

One stack for every case: the control plane, P and D with the middleware,
and a plain decode engine R (the kvpush connector, no middleware) for the
answers that must stay byte-identical. Each failure kind is answered with
its status, reason and transfer key by its deadline + 1 s; afterwards the
engines serve and have every KV block back. P is killed last.
"""

from __future__ import annotations

import json
import time

import pytest

from kvpush.dev.localstack.completions import completion_body, completions, request
from kvpush.dev.localstack.control_plane import kvpush_transfer_config, start_control_plane
from kvpush.dev.localstack.engines import start_vllm_servers
from kvpush.dev.localstack.prompts import prompt_token_ids
from kvpush.dev.localstack.transfers import cancel_transfer, dispatch, new_transfer_id, transfer_params
from kvpush.rendezvous.v1 import transfer_pb2
from kvpush.sse import DONE
from tests.e2e.engine_faults import (
    assert_free_blocks_return,
    background,
    engine_core,
    paused,
    settled_free_blocks,
    transfer_or_none,
)
from tests.waiting import wait_for

pytestmark = pytest.mark.engine

MIDDLEWARE = ["--middleware", "kvpush.connector.middleware.KvpushErrors"]
IDS = ("prefill-mw", "decode-mw", "decode-plain")
PROMPT = prompt_token_ids(300, seed=300)
MAX_TOKENS = 6


class Stack:
    def __init__(self, control_plane, prefill, decode, plain):
        self.control_plane, self.prefill, self.decode, self.plain = control_plane, prefill, decode, plain
        self.free_blocks: tuple[int, int] = (0, 0)


@pytest.fixture(scope="module")
def stack(tmp_path_factory, model_dir):
    tmp = tmp_path_factory.mktemp("middleware")
    control_plane = start_control_plane(tmp / "control-plane", engine_ids=IDS)
    servers = []
    try:
        spawns = [dict(name=name, kv_transfer_config=kvpush_transfer_config(role, engine_id, control_plane), extra_args=args, cpu_list=cpu,
                       log_path=tmp / f"{name}.log")
                  for name, role, engine_id, args, cpu in (("prefill", "prefill", IDS[0], MIDDLEWARE, "0"), ("decode", "decode", IDS[1], MIDDLEWARE, "1"),
                                                           ("plain", "decode", IDS[2], [], "1"))]
        servers = start_vllm_servers(spawns, model_dir)
        s = Stack(control_plane, *servers)
        first = dispatch(s.prefill.url, IDS[0], s.decode.url, IDS[1], PROMPT, MAX_TOKENS)  # the one-time costs; a transfer works
        assert not isinstance(first.decode, Exception), first.decode
        s.free_blocks = (settled_free_blocks(s.prefill), settled_free_blocks(s.decode))
        yield s
    finally:
        for server in servers:
            server.stop()
        control_plane.stop()


def post(url: str, body: dict, timeout: float = 120.0) -> tuple[int, bytes, float]:
    t0 = time.monotonic()
    status, data = request("POST", url + "/v1/completions", body, timeout=timeout)
    return status, data, time.monotonic() - t0


def leg(stack: Stack, role: str, transfer_id: str, *, attempt: int = 1, timeout_ms: int | None = None, stream: bool = False,
        max_tokens: int = MAX_TOKENS) -> dict:
    peer = IDS[1] if role == "prefill" else IDS[0]
    params = transfer_params(role, transfer_id, peer, attempt=attempt, timeout_ms=timeout_ms)
    return completion_body(PROMPT, 1 if role == "prefill" else max_tokens, kv_transfer_params=params, stream=stream)


# The broker's deadline reasons: which one depends on which side it still waited for.
DEADLINE = ("REGISTRATION_DEADLINE_EXCEEDED", "PREFILL_DEADLINE_EXCEEDED")


def assert_error(data: bytes, status: int, reason: str | tuple[str, ...], transfer_id: str | None = None, attempt: int = 1) -> dict:
    error = json.loads(data)["error"]
    assert set(error) >= {"message", "type", "param", "code", "reason"}, error
    assert error["code"] == status and error["reason"] in ((reason,) if isinstance(reason, str) else reason), error
    if transfer_id is not None:
        assert (error["transfer_id"], error["attempt"]) == (transfer_id, attempt), error
    return error


def sse_events(data: bytes) -> list:
    return [DONE if e == b"data: [DONE]" else json.loads(e.removeprefix(b"data: ")) for e in data.strip().split(b"\n\n")]


def assert_engines_well(stack: Stack) -> None:
    assert_free_blocks_return([stack.prefill, stack.decode], stack.free_blocks)
    result = dispatch(stack.prefill.url, IDS[0], stack.decode.url, IDS[1], PROMPT, MAX_TOKENS)
    assert not isinstance(result.decode, Exception), result.decode
    assert_free_blocks_return([stack.prefill, stack.decode], stack.free_blocks)


# (key, bad value) per leg; each must be answered 400 naming kv_transfer_params.kvpush.<key>.
BAD = [("role", "middle"), ("transfer_id", "no spaces allowed"), ("attempt", 0), ("attempt", "1"), ("timeout_ms", 0),
       ("timeout_ms", 3_600_001), ("traceparent", 7), ("client_request_id", ["x"]), ("control_plane", "no-port"),
       ("control_plane", "elsewhere:1")]


def test_malformed_parameters_are_refused_400_naming_the_key(stack):
    for role, url, peer_key in (("prefill", stack.prefill.url, "decode_engine_id"), ("decode", stack.decode.url, "prefill_engine_id")):
        cases = [*BAD, (peer_key, 5)] + ([(peer_key, "")] if role == "decode" else [])
        for key, value in cases:
            body = leg(stack, role, new_transfer_id())
            body["kv_transfer_params"]["kvpush"][key] = value
            status, data, _ = post(url, body)
            assert status == 400, (role, key, value, data)
            error = assert_error(data, 400, "INVALID_REQUEST")
            assert error["param"] == f"kv_transfer_params.kvpush.{key}", (role, key, error)
        # Not an object; and a leg of the other role.
        status, data, _ = post(url, {**leg(stack, role, new_transfer_id()), "kv_transfer_params": {"kvpush": "x"}})
        assert status == 400 and assert_error(data, 400, "INVALID_REQUEST")["param"] == "kv_transfer_params.kvpush", data
        other = leg(stack, "decode" if role == "prefill" else "prefill", new_transfer_id())
        status, data, _ = post(url, other)
        assert status == 400 and assert_error(data, 400, "INVALID_REQUEST")["param"] == "kv_transfer_params.kvpush.role", data
    assert_engines_well(stack)


def test_deadline_passed_and_duplicate_keys_on_both_engines(stack):
    """D waits for a P that never comes (its deadline passes); meanwhile the same key sent again to D, and to a paused P, is refused."""
    transfer_id = new_transfer_id()
    d_leg, d_out = background(lambda: post(stack.decode.url, leg(stack, "decode", transfer_id, timeout_ms=3000)))
    wait_for(lambda: transfer_or_none(stack, transfer_id) is not None or None, 20, what="D registered")
    status, data, _ = post(stack.decode.url, leg(stack, "decode", transfer_id, timeout_ms=3000))
    assert status == 409, data
    assert_error(data, 409, "TRANSFER_CONFLICT", transfer_id)
    # A streamed decode leg of its own key: its error event carries the reason.
    streamed_id = new_transfer_id()
    s_leg, s_out = background(lambda: post(stack.decode.url, leg(stack, "decode", streamed_id, timeout_ms=3000, stream=True)))
    other_id = new_transfer_id()
    with paused(engine_core(stack.prefill)):
        p_leg, p_out = background(lambda: post(stack.prefill.url, leg(stack, "prefill", other_id, timeout_ms=3000)))
        time.sleep(1.0)  # P's API server holds the first leg
        status, data, _ = post(stack.prefill.url, leg(stack, "prefill", other_id, timeout_ms=3000))
        assert status == 409, data
        assert_error(data, 409, "TRANSFER_CONFLICT", other_id)
    for thread in (d_leg, s_leg, p_leg):
        thread.join(timeout=60)
    status, data, seconds = d_out["result"]
    assert status == 504 and seconds < 3.0 + 1.0, (status, data, seconds)
    assert_error(data, 504, DEADLINE, transfer_id)
    status, data, seconds = s_out["result"]
    assert status == 200 and seconds < 3.0 + 1.0, (status, data, seconds)
    events = sse_events(data)
    assert events[-1] == DONE, events
    assert_error(json.dumps(events[-2]).encode(), 504, DEADLINE, streamed_id)
    assert p_out["result"][0] == 200, p_out  # P's leg is its one-token prefill: its transfer's fate is D's to answer
    assert_engines_well(stack)


def test_a_superseded_attempt_and_a_cancelled_one(stack):
    transfer_id = new_transfer_id()
    first, first_out = background(lambda: post(stack.decode.url, leg(stack, "decode", transfer_id, attempt=1, timeout_ms=10_000)))
    wait_for(lambda: transfer_or_none(stack, transfer_id) is not None or None, 20, what="attempt 1 registered")
    second, second_out = background(lambda: post(stack.decode.url, leg(stack, "decode", transfer_id, attempt=2, timeout_ms=10_000)))
    first.join(timeout=30)
    status, data, seconds = first_out["result"]
    assert status == 409 and seconds < 10.0 + 1.0, (status, data)
    assert_error(data, 409, "SUPERSEDED", transfer_id, 1)
    # Attempt 2 is cancelled as a router would; then a stale attempt 1 comes again.
    wait_for(lambda: getattr(transfer_or_none(stack, transfer_id), "key", None) is not None
             and transfer_or_none(stack, transfer_id).key.attempt == 2 or None, 20, what="attempt 2 registered")
    cancel_transfer(stack.control_plane, transfer_id, 2)
    second.join(timeout=30)
    status, data, seconds = second_out["result"]
    assert status == 502 and seconds < 10.0 + 1.0, (status, data)
    assert_error(data, 502, "CANCELLED_BY_ROUTER", transfer_id, 2)
    status, data, seconds = post(stack.decode.url, leg(stack, "decode", transfer_id, attempt=1, timeout_ms=3000))
    assert status == 409 and seconds < 3.0 + 1.0, (status, data)
    assert_error(data, 409, "SUPERSEDED", transfer_id, 1)
    assert_engines_well(stack)


def test_without_kvpush_parameters_the_answer_is_byte_identical(stack):
    """D (middleware) and R (none) answer the same greedy requests: bodies equal but for vLLM's random id and its clock."""
    def normal(data: bytes, stream: bool) -> list:
        chunks = sse_events(data) if stream else [json.loads(data)]
        for chunk in chunks:
            if isinstance(chunk, dict):
                chunk.pop("id", None), chunk.pop("created", None)
        return chunks

    for stream in (False, True):
        body = completion_body(PROMPT, MAX_TOKENS, stream=stream)
        answers = [post(url, body) for url in (stack.decode.url, stack.plain.url)]
        assert answers[0][0] == answers[1][0] == 200
        assert normal(answers[0][1], stream) == normal(answers[1][1], stream)
        assert len(answers[0][1]) == len(answers[1][1])
    # The same failure without the middleware: vLLM's bare 500.
    status, data, _ = post(stack.plain.url, leg(stack, "decode", new_transfer_id(), timeout_ms=2000))
    assert status == 500 and json.loads(data)["error"]["message"] == "Internal server error", data


def test_prefill_killed_mid_transfer_is_answered_engine_lost(stack):
    """Last: it kills P. D's 60 s deadline must not be what ends the request."""
    transfer_id = new_transfer_id()
    with paused(engine_core(stack.prefill)):
        d_leg, d_out = background(lambda: post(stack.decode.url, leg(stack, "decode", transfer_id, timeout_ms=60_000)))
        background(lambda: post(stack.prefill.url, leg(stack, "prefill", transfer_id, timeout_ms=60_000)))
        wait_for(lambda: getattr(transfer_or_none(stack, transfer_id), "state", None) == transfer_pb2.TRANSFER_STATE_WAITING_FOR_PREFILL or None,
                 30, what="D waiting for P")
        time.sleep(1.0)
        stack.prefill.kill()
    d_leg.join(timeout=60)
    status, data, _ = d_out["result"]
    assert status == 503, data
    assert_error(data, 503, "PREFILL_ENGINE_LOST", transfer_id)
    assert_free_blocks_return([stack.decode], stack.free_blocks[1:])
    assert len(completions(stack.decode.url, PROMPT, MAX_TOKENS).token_ids) == MAX_TOKENS
