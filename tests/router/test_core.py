# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""The router's HTTP-free core: engine choice, leg bodies, transfer parameters, and its configuration."""

from __future__ import annotations

import argparse

import pytest

from kvpush.connector.params import parse
from kvpush.rendezvous.v1 import transfer_pb2 as tr_pb
from kvpush.services.router.config import RouterConfig, parse_endpoint
from kvpush.services.router.core import (
    BROKER_SIDE,
    CHAT_COMPLETIONS_PATH,
    COMPLETIONS_PATH,
    END_REASONS,
    FAILURE_REASONS,
    PULL_PREFILL_PARAMS,
    ROUTER_REASONS,
    AttemptRecord,
    BadRequest,
    Endpoint,
    EnginePool,
    check_client_request_id,
    check_routable,
    deadline_side,
    decode_body,
    end_reason_status,
    explain_attempt,
    kvpush_params,
    prefill_body,
    upstream_push_decode_params,
)

A, B, C = (Endpoint(f"http://127.0.0.1:{port}", f"e{port}") for port in (1, 2, 3))


def test_round_robin_cycles_through_every_engine():
    pool = EnginePool("prefill", [A, B, C], "round_robin")
    assert [pool.pick() for _ in range(6)] == [A, B, C, A, B, C]


def test_round_robin_skips_excluded_engines_and_reports_exhaustion():
    pool = EnginePool("prefill", [A, B, C], "round_robin")
    assert {pool.pick(exclude={B}) for _ in range(6)} == {A, C}
    assert pool.pick(exclude={A, B, C}) is None


def test_least_loaded_takes_the_engine_with_fewest_legs():
    pool = EnginePool("decode", [A, B, C], "least_loaded")
    pool.acquire(A)
    pool.acquire(A)
    pool.acquire(B)
    assert [pool.pick() for _ in range(3)] == [C, C, C]
    pool.acquire(C)
    pool.acquire(C)
    assert pool.pick() == B
    pool.release(A)
    pool.release(A)
    assert pool.pick() == A
    assert pool.pick(exclude={A}) == B


def test_least_loaded_spreads_ties_round_robin():
    pool = EnginePool("decode", [A, B, C], "least_loaded")
    assert [pool.pick() for _ in range(3)] == [A, B, C]


def test_pool_rejects_unknown_policy_and_empty_pool():
    with pytest.raises(ValueError, match="policy"):
        EnginePool("prefill", [A], "random")
    with pytest.raises(ValueError, match="at least one"):
        EnginePool("prefill", [], "round_robin")


def test_prefill_body_generates_one_unstreamed_token_and_keeps_the_rest():
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 64, "stream": True, "stream_options": {"include_usage": True}, "min_tokens": 4, "temperature": 0.0}
    params = kvpush_params("prefill", "t1", 1, "decode-0")
    leg = prefill_body(body, COMPLETIONS_PATH, params)
    assert leg == {"model": "tiny", "prompt": "hi", "max_tokens": 1, "stream": False, "temperature": 0.0, "kv_transfer_params": params}
    assert body["max_tokens"] == 64 and body["stream_options"] == {"include_usage": True}, "the client's body is left untouched"


def test_prefill_body_caps_max_completion_tokens_for_chat():
    leg = prefill_body({"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}, CHAT_COMPLETIONS_PATH, {})
    assert (leg["max_tokens"], leg["max_completion_tokens"]) == (1, 1)
    leg = prefill_body({"prompt": "hi", "max_completion_tokens": 9}, COMPLETIONS_PATH, {})
    assert leg["max_completion_tokens"] == 1
    assert "max_completion_tokens" not in prefill_body({"prompt": "hi"}, COMPLETIONS_PATH, {})


def test_decode_body_is_the_clients_body_plus_parameters():
    body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 8, "stream": True, "logprobs": 1}
    params = kvpush_params("decode", "t1", 2, "prefill-0")
    assert decode_body(body, params) == {**body, "kv_transfer_params": params}


def test_kvpush_params_are_what_the_connector_parses():
    prefill = parse(kvpush_params("prefill", "xfer-1", 3, "decode-7", traceparent="00-" + "a" * 32 + "-" + "b" * 16 + "-01", client_request_id="r1", timeout_ms=2500))
    assert (prefill.role, prefill.transfer_id, prefill.attempt, prefill.peer_engine_id) == ("prefill", "xfer-1", 3, "decode-7")
    assert (prefill.timeout_s, prefill.client_request_id, prefill.traceparent[:5]) == (2.5, "r1", "00-aa")
    decode = parse(kvpush_params("decode", "xfer-1", 3, "prefill-2"))
    assert (decode.role, decode.peer_engine_id, decode.timeout_s, decode.traceparent) == ("decode", "prefill-2", None, "")


def test_upstream_push_decode_params_name_the_prefill_side_channel():
    params = upstream_push_decode_params("prefill-engine-001", "10.0.0.5", 5600, 8, 1, "req-1", "xfer-1")
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert (params["remote_engine_id"], params["remote_host"], params["remote_port"]) == ("prefill-engine-001", "10.0.0.5", 5600)
    assert (params["tp_size"], params["pp_size"], params["remote_request_id"]) == (8, 1, "req-1")
    assert PULL_PREFILL_PARAMS["do_remote_decode"] is True and PULL_PREFILL_PARAMS["remote_engine_id"] is None


@pytest.mark.parametrize(
    ("body", "message"),
    [([1, 2], "JSON object"), ({"prompt": "x", "n": 2}, "n=2"), ({"prompt": "x", "best_of": 3}, "best_of=3"), ({"prompt": "x", "kv_transfer_params": {}}, "set by the router")],
)
def test_unroutable_bodies_are_refused(body, message):
    with pytest.raises(BadRequest, match=message):
        check_routable(body)


def test_routable_body_passes():
    body = {"prompt": "x", "n": 1}
    assert check_routable(body) is body


def test_a_request_id_kvpush_cannot_carry_is_refused():
    assert check_client_request_id("r" * 256) == "r" * 256
    with pytest.raises(BadRequest, match="X-Request-Id is 257 characters long"):
        check_client_request_id("r" * 257)


# ---- transfer failures ----


@pytest.mark.parametrize(
    ("reason", "status"),
    [
        ("REGISTRATION_DEADLINE_EXCEEDED", 504),
        ("PREFILL_DEADLINE_EXCEEDED", 504),
        ("PREFILL_ENGINE_LOST", 503),
        ("DECODE_ENGINE_LOST", 503),
        ("TOKEN_COUNT_MISMATCH", 400),
        ("SUPERSEDED", 409),
        ("WRITE_FAILED", 502),
        ("CANCELLED_BY_ROUTER", 502),
        ("CANCELLED_BY_PREFILL", 502),
        ("CANCELLED_BY_DECODE", 502),
        ("BROKER_SHARD_LOST", 503),
        ("BROKER_SHARD_MOVED", 503),
        ("END_REASON_PREFILL_ENGINE_LOST", 503),  # the prefix is optional
        ("A_REASON_FROM_A_NEWER_BROKER", 502),
    ],
)
def test_end_reason_status(reason, status):
    assert end_reason_status(reason) == status


def test_every_end_reason_has_a_status_and_a_label():
    names = {name.removeprefix("END_REASON_") for name in tr_pb.EndReason.keys()} - {"UNSPECIFIED", "COMPLETED"}
    assert set(END_REASONS) == names
    assert all(end_reason_status(name) in (400, 409, 502, 503, 504) for name in names)
    assert len(set(FAILURE_REASONS)) == len(FAILURE_REASONS) == len(END_REASONS) + len(ROUTER_REASONS), "a bounded label set, no name twice"


def transfer(state: int, reason: int = 0, *, detail: str = "", client_request_id: str = "req-1", prefill: str = "prefill-0", decode: str = "decode-0",
             timeline: tuple[int, ...] = (tr_pb.TIMELINE_ENTRY_KIND_REGISTERED, tr_pb.TIMELINE_ENTRY_KIND_PREFILL_DONE)) -> AttemptRecord:
    message = tr_pb.Transfer(
        key=tr_pb.TransferKey(transfer_id="xfer-1", attempt=2), client_request_id=client_request_id, state=state, end_reason=reason, detail=detail,
        prefill_engine_id=prefill, decode_engine_id=decode,
    )
    for kind in timeline:
        message.timeline.add(kind=kind)
    return AttemptRecord.from_transfer(message)


def explain(record: AttemptRecord):
    return explain_attempt(record, "req-1", "prefill-0", "decode-0")


def test_attempt_record_from_the_brokers_transfer():
    record = transfer(tr_pb.TRANSFER_STATE_FAILED, tr_pb.END_REASON_WRITE_FAILED, detail="rank tp0: boom", timeline=(tr_pb.TIMELINE_ENTRY_KIND_REGISTERED,))
    assert (record.transfer_id, record.attempt, record.state, record.reason, record.detail) == ("xfer-1", 2, "FAILED", "WRITE_FAILED", "rank tp0: boom")
    assert (record.registered, record.prefill_done, record.ended) == (True, False, True)
    assert record.describe() == "FAILED WRITE_FAILED: rank tp0: boom"
    live = transfer(tr_pb.TRANSFER_STATE_WAITING_FOR_PREFILL)
    assert (live.reason, live.ended, live.describe()) == ("", False, "the broker holds it as WAITING_FOR_PREFILL")
    assert transfer(99).state == "99", "a state a newer broker added shows as its number"


def test_a_live_or_done_attempt_gives_no_reason():
    assert explain(transfer(tr_pb.TRANSFER_STATE_MATCHED)) is None
    assert explain(transfer(tr_pb.TRANSFER_STATE_DONE, tr_pb.END_REASON_COMPLETED)) is None


@pytest.mark.parametrize(
    ("state", "reason", "status", "retry_side"),
    [
        (tr_pb.TRANSFER_STATE_FAILED, tr_pb.END_REASON_PREFILL_ENGINE_LOST, 503, "prefill"),
        (tr_pb.TRANSFER_STATE_FAILED, tr_pb.END_REASON_DECODE_ENGINE_LOST, 503, "decode"),
        (tr_pb.TRANSFER_STATE_FAILED, tr_pb.END_REASON_WRITE_FAILED, 502, "prefill"),
        (tr_pb.TRANSFER_STATE_FAILED, tr_pb.END_REASON_TOKEN_COUNT_MISMATCH, 400, None),
        (tr_pb.TRANSFER_STATE_CANCELLED, tr_pb.END_REASON_CANCELLED_BY_ROUTER, 502, None),
        (tr_pb.TRANSFER_STATE_CANCELLED, tr_pb.END_REASON_CANCELLED_BY_DECODE, 502, "decode"),
        (tr_pb.TRANSFER_STATE_SUPERSEDED, tr_pb.END_REASON_SUPERSEDED, 409, None),
        # A broker shard's fault: retried, avoiding no engine.
        (tr_pb.TRANSFER_STATE_FAILED, tr_pb.END_REASON_BROKER_SHARD_LOST, 503, BROKER_SIDE),
        (tr_pb.TRANSFER_STATE_FAILED, tr_pb.END_REASON_BROKER_SHARD_MOVED, 503, BROKER_SIDE),
    ],
)
def test_an_ended_attempt_gives_its_reason_status_and_retry(state, reason, status, retry_side):
    verdict = explain(transfer(state, reason, detail="what happened"))
    name = tr_pb.EndReason.Name(reason).removeprefix("END_REASON_")
    assert (verdict.status, verdict.reason, verdict.retry_side) == (status, name, retry_side)
    assert verdict.message == f"transfer xfer-1 attempt 2 ended {tr_pb.TransferState.Name(state).removeprefix('TRANSFER_STATE_')} with {name}: what happened"


@pytest.mark.parametrize(
    ("timeline", "side"),
    [
        ((tr_pb.TIMELINE_ENTRY_KIND_REGISTERED,), "prefill"),  # P never reported
        ((tr_pb.TIMELINE_ENTRY_KIND_PREFILL_DONE,), "decode"),  # D never registered
        ((tr_pb.TIMELINE_ENTRY_KIND_REGISTERED, tr_pb.TIMELINE_ENTRY_KIND_PREFILL_DONE), "prefill"),  # the write was too slow
    ],
)
def test_a_deadline_blames_the_side_that_kept_the_transfer_waiting(timeline, side):
    verdict = explain(transfer(tr_pb.TRANSFER_STATE_FAILED, tr_pb.END_REASON_REGISTRATION_DEADLINE_EXCEEDED, timeline=timeline))
    assert (verdict.status, verdict.retry_side) == (504, side)


def test_the_routers_own_deadline_blames_by_what_the_broker_saw():
    assert deadline_side(None, prefill_finished=False) == "prefill"
    assert deadline_side(None, prefill_finished=True) == "decode"
    assert deadline_side(transfer(tr_pb.TRANSFER_STATE_WAITING_FOR_REGISTRATION, timeline=(tr_pb.TIMELINE_ENTRY_KIND_PREFILL_DONE,)), True) == "decode"


@pytest.mark.parametrize(
    ("fields", "why"),
    [
        ({"client_request_id": "someone-else"}, "it belongs to request 'someone-else', not 'req-1'"),
        ({"prefill": "prefill-9"}, "it names prefill engine 'prefill-9', not 'prefill-0'"),
        ({"decode": "decode-9"}, "it names decode engine 'decode-9', not 'decode-0'"),
    ],
)
def test_another_requests_record_is_a_conflict_whatever_its_state(fields, why):
    for state, reason in ((tr_pb.TRANSFER_STATE_WAITING_FOR_PREFILL, 0), (tr_pb.TRANSFER_STATE_DONE, tr_pb.END_REASON_COMPLETED)):
        verdict = explain(transfer(state, reason, **fields))
        assert (verdict.status, verdict.reason, verdict.retry_side) == (409, "TRANSFER_CONFLICT", None)
        assert why in verdict.message and "another router uses the same transfer id" in verdict.message


def test_empty_fields_of_a_record_are_no_conflict():
    record = transfer(tr_pb.TRANSFER_STATE_CANCELLED, tr_pb.END_REASON_CANCELLED_BY_ROUTER, client_request_id="", prefill="", decode="", timeline=())
    assert explain(record).reason == "CANCELLED_BY_ROUTER"


def parse_config(*argv: str) -> RouterConfig:
    parser = argparse.ArgumentParser()
    RouterConfig.add_arguments(parser)
    return RouterConfig.from_args(parser.parse_args(list(argv)))


def test_config_from_flags():
    config = parse_config(
        "--prefill", "http://10.0.0.1:8100=prefill-0", "--prefill", "http://10.0.0.2:8100=prefill-1", "--decode", "http://10.0.0.3:8200/=decode-0",
        "--policy", "least_loaded", "--control-plane", "10.0.0.9:50051", "--token", "s3cret", "--listen", "0.0.0.0:9000",
    )
    assert [e.engine_id for e in config.prefill] == ["prefill-0", "prefill-1"]
    assert config.decode == (Endpoint("http://10.0.0.3:8200", "decode-0"),)
    assert (config.policy, config.mode, config.host, config.port, config.resolve_token()) == ("least_loaded", "push", "0.0.0.0", 9000, "s3cret")
    assert (config.transfer_deadline_slack_s, config.early_poll_delay_s) == (0.5, 0.25)
    tuned = parse_config("--prefill", "http://p:1=p", "--decode", "http://d:1=d", "--mode", "pull", "--transfer-deadline-slack", "1.5", "--early-poll-delay", "0")
    assert (tuned.transfer_deadline_slack_s, tuned.early_poll_delay_s) == (1.5, 0.0)


def test_config_from_environment(monkeypatch, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("from-file\n")
    monkeypatch.setenv("KVPUSH_ROUTER_PREFILL", "http://p:1=prefill-0, http://p:2=prefill-1")
    monkeypatch.setenv("KVPUSH_ROUTER_DECODE", "http://d:1=decode-0")
    monkeypatch.setenv("KVPUSH_ROUTER_MODE", "pull")
    monkeypatch.setenv("KVPUSH_TOKEN_FILE", str(token_file))
    config = parse_config()
    assert [e.url for e in config.prefill] == ["http://p:1", "http://p:2"]
    assert (config.mode, config.resolve_token()) == ("pull", "from-file")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--decode", "http://d:1=d"], "at least one"),
        (["--prefill", "http://p:1=p", "--decode", "http://d:1=d"], "--control-plane"),
        (["--prefill", "http://p:1=p", "--decode", "http://d:1=d", "--control-plane", "cp:1"], "credentials"),
        (["--prefill", "http://p:1=p", "--decode", "http://d:1=d", "--mode", "pull", "--policy", "random"], "--policy"),
        (["--prefill", "http://p:1=p", "--decode", "http://d:1=d", "--mode", "teleport"], "--mode"),
        (["--prefill", "http://p:1=p", "--decode", "http://d:1=d", "--mode", "pull", "--prefill-timeout", "0"], "timeout"),
        (["--prefill", "http://p:1=p", "--decode", "http://d:1=d", "--mode", "pull", "--transfer-deadline-slack", "-1"], "--transfer-deadline-slack"),
        (["--prefill", "http://p:1=p", "--decode", "http://d:1=d", "--mode", "pull", "--early-poll-delay", "-0.1"], "--early-poll-delay"),
    ],
)
def test_config_errors_name_the_setting(argv, message, monkeypatch):
    for name in ("KVPUSH_TOKEN", "KVPUSH_TOKEN_FILE", "KVPUSH_CONTROL_PLANE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match=message):
        parse_config(*argv)


@pytest.mark.parametrize("text", ["http://p:1", "p:1=prefill-0", "ftp://p:1=x", "http://p=prefill-0"])
def test_bad_endpoints_are_refused(text):
    with pytest.raises(ValueError):
        parse_endpoint(text)
