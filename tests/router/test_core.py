# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""The router's HTTP-free core: engine choice, leg bodies, transfer parameters, and its configuration."""

from __future__ import annotations

import argparse

import pytest

from kvpush.connector.params import parse
from kvpush.services.router.config import RouterConfig, parse_endpoint
from kvpush.services.router.core import (
    CHAT_COMPLETIONS_PATH,
    COMPLETIONS_PATH,
    PULL_PREFILL_PARAMS,
    BadRequest,
    Endpoint,
    EnginePool,
    check_routable,
    decode_body,
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
