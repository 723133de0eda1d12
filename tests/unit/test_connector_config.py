# SPDX-License-Identifier: Apache-2.0
"""Connector settings and per-request parameters: every bad value gets a message naming it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvpush.connector.config import ConfigError, ConnectorConfig
from kvpush.connector.params import ParamError, parse


def transfer_config(tmp_path, role="kv_consumer", engine_id="decode-0", **extra):
    token = tmp_path / "token"
    token.write_text("secret\n")
    base = {"control_plane": "127.0.0.1:5000", "token_file": str(token)}
    return SimpleNamespace(kv_role=role, engine_id=engine_id, kv_connector_extra_config={**base, **extra})


def test_valid_config(tmp_path):
    config = ConnectorConfig.from_kv_transfer_config(transfer_config(tmp_path, backends=["UCX", "LIBFABRIC"], idle_wait_ms=2, early_orders=False))
    assert (config.role, config.engine_id, config.token) == ("decode", "decode-0", "secret")
    assert config.backends == ("UCX", "LIBFABRIC") and config.idle_wait_ms == 2.0 and config.early_orders is False
    assert config.nixl_progress_thread_ms is None  # "auto": resolved by the worker from where the KV cache is
    assert ConnectorConfig.from_kv_transfer_config(transfer_config(tmp_path, nixl_progress_thread_ms="auto")).nixl_progress_thread_ms is None
    assert ConnectorConfig.from_kv_transfer_config(transfer_config(tmp_path, nixl_progress_thread_ms=0)).nixl_progress_thread_ms == 0
    assert config.waiting_poll_ms is None and config.fresh_poll_ms == 20.0  # "auto": resolved by the worker, as above
    assert ConnectorConfig.from_kv_transfer_config(transfer_config(tmp_path, waiting_poll_ms=0, fresh_poll_ms=0)).waiting_poll_ms == 0
    assert config.broker == ""  # the broker is at control_plane
    apart = ConnectorConfig.from_kv_transfer_config(transfer_config(tmp_path, broker="ipv4:127.0.0.1:7001,127.0.0.1:7002"))
    assert apart.broker == "ipv4:127.0.0.1:7001,127.0.0.1:7002"


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"role": "kv_both"}, "kv_role must be kv_producer"),
        ({"engine_id": "bad id!"}, "engine_id 'bad id!'"),
        ({"control_plane": "nohost"}, "control_plane"),
        ({"broker": "nohost"}, "broker"),
        ({"backends": "UCX"}, "backends='UCX': expected a non-empty list"),
        ({"idle_wait_ms": -1}, "idle_wait_ms=-1: expected a positive number"),
        ({"early_orders": "yes"}, "early_orders='yes': expected true or false"),
        ({"nixl_progress_thread_ms": -1}, "nixl_progress_thread_ms=-1: expected at least 0"),
        ({"nixl_progress_thread_ms": "fast"}, 'nixl_progress_thread_ms=\'fast\': expected "auto" or whole milliseconds'),
        ({"nixl_progress_thread_ms": 0.5}, 'nixl_progress_thread_ms=0.5: expected "auto" or whole milliseconds'),
        ({"waiting_poll_ms": -5}, "waiting_poll_ms=-5: expected at least 0"),
        ({"fresh_poll_ms": -1}, "fresh_poll_ms=-1: expected at least 0"),
        ({"poll_intervall_ms": 1}, "unknown kv_connector_extra_config keys ['poll_intervall_ms']"),
        ({"token": "inline"}, "not in the engine's command line"),
        ({"token_file": "/nonexistent/token"}, "token_file: cannot read"),
    ],
)
def test_bad_settings_are_named(tmp_path, overrides, message):
    role = overrides.pop("role", "kv_consumer")
    engine_id = overrides.pop("engine_id", "decode-0")
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")):
        ConnectorConfig.from_kv_transfer_config(transfer_config(tmp_path, role=role, engine_id=engine_id, **overrides))


def test_credentials_are_required(tmp_path, monkeypatch):
    monkeypatch.delenv("KVPUSH_TOKEN", raising=False)
    config = SimpleNamespace(kv_role="kv_producer", engine_id="p", kv_connector_extra_config={"control_plane": "h:1"})
    with pytest.raises(ConfigError, match="no credentials"):
        ConnectorConfig.from_kv_transfer_config(config)


def test_params_absent_or_valid():
    assert parse(None) is None and parse({"do_remote_decode": True}) is None
    params = parse({"kvpush": {"role": "decode", "transfer_id": "x-1", "attempt": 2, "prefill_engine_id": "p0", "timeout_ms": 1500}})
    assert params.key == ("x-1", 2) and params.peer_engine_id == "p0" and params.timeout_s == 1.5
    assert parse({"kvpush": {"role": "prefill", "transfer_id": "x-1"}}).attempt == 1


@pytest.mark.parametrize(
    "raw,field",
    [
        ("not a dict", ""),
        ({"role": "both", "transfer_id": "t"}, "role"),
        ({"role": "decode", "transfer_id": "has space", "prefill_engine_id": "p"}, "transfer_id"),
        ({"role": "decode", "transfer_id": "t", "attempt": 0, "prefill_engine_id": "p"}, "attempt"),
        ({"role": "decode", "transfer_id": "t", "attempt": True, "prefill_engine_id": "p"}, "attempt"),
        ({"role": "decode", "transfer_id": "t"}, "prefill_engine_id"),
        ({"role": "decode", "transfer_id": "t", "prefill_engine_id": "p", "timeout_ms": 0}, "timeout_ms"),
        ({"role": "decode", "transfer_id": "t", "prefill_engine_id": "p", "traceparent": 7}, "traceparent"),
        ({"role": "decode", "transfer_id": "t", "prefill_engine_id": "p", "control_plane": "nohostport"}, "control_plane"),
    ],
)
def test_bad_params_name_the_field(raw, field):
    with pytest.raises(ParamError) as info:
        parse({"kvpush": raw})
    assert info.value.field == field
    assert f"kv_transfer_params.kvpush.{field}" in str(info.value)
