# SPDX-License-Identifier: Apache-2.0
"""Service configs: flags, KVPUSH_* environment fallbacks, validation, secrets on disk."""

from __future__ import annotations

import argparse
import pathlib

import pytest

from kvpush.services.broker.config import BrokerConfig, ShardMembership
from kvpush.services.common.config import ServerConfig
from kvpush.services.registrar.config import RegistrarConfig


def parse(monkeypatch, env: dict[str, str], argv: list[str]) -> argparse.Namespace:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    parser = argparse.ArgumentParser()
    ServerConfig.add_arguments(parser)
    RegistrarConfig.add_arguments(parser)
    BrokerConfig.add_arguments(parser)
    return parser.parse_args(argv)


def test_flags_win_over_the_environment_which_wins_over_defaults(monkeypatch):
    args = parse(monkeypatch, {"KVPUSH_LISTEN": "127.0.0.1:7000", "KVPUSH_LEASE_TTL_S": "7", "KVPUSH_RETENTION_S": "5"}, ["--retention", "9"])
    server, registrar, broker = ServerConfig.from_args(args), RegistrarConfig.from_args(args), BrokerConfig.from_args(args)
    assert server.listen == "127.0.0.1:7000"
    assert registrar.default_lease_ttl_s == 7.0
    assert broker.retention_s == 9.0
    assert server.metrics_port is None and server.metrics_host == "127.0.0.1"


def test_a_malformed_environment_value_is_reported(monkeypatch):
    with pytest.raises(SystemExit, match="KVPUSH_METRICS_PORT"):
        parse(monkeypatch, {"KVPUSH_METRICS_PORT": "many"}, [])


@pytest.mark.parametrize(
    "build",
    [
        lambda: RegistrarConfig(default_lease_ttl_s=100.0, max_lease_ttl_s=60.0),
        lambda: BrokerConfig(max_timeout_s=0),
        lambda: ServerConfig(tls_cert=pathlib.Path("cert.pem")),
        lambda: RegistrarConfig(max_engines=0),
        lambda: RegistrarConfig(max_watches_per_identity=0),
    ],
    ids=["lease bounds", "timeout bound", "partial TLS", "no engines", "no watches"],
)
def test_inconsistent_settings_are_refused(build):
    with pytest.raises(ValueError):
        build()


def test_credentials_and_caps_come_from_flags_or_the_environment(monkeypatch, tmp_path):
    args = parse(monkeypatch, {"KVPUSH_TOKENS_DIR": str(tmp_path), "KVPUSH_MAX_ENGINES": "8"}, ["--max-watches-per-identity", "3"])
    server, registrar = ServerConfig.from_args(args), RegistrarConfig.from_args(args)
    assert server.tokens_dir == tmp_path and not server.mtls
    assert (registrar.max_engines, registrar.max_watches_per_identity) == (8, 3)
    assert (RegistrarConfig().max_engines, RegistrarConfig().max_watches_per_identity) == (4096, 64)


def shard_membership(monkeypatch, argv: list[str]) -> ShardMembership:
    monkeypatch.delenv("KVPUSH_ETCD", raising=False)
    parser = argparse.ArgumentParser()
    ShardMembership.add_arguments(parser)
    return ShardMembership.from_args(parser.parse_args(argv))


def test_a_broker_on_etcd_is_a_named_member_that_advertises_where_it_listens(monkeypatch):
    assert shard_membership(monkeypatch, []).endpoints == ()  # unsharded: nothing else is needed
    shards = shard_membership(monkeypatch, ["--etcd", "127.0.0.1:1,127.0.0.1:2", "--member-id", "broker-0", "--shard-lease-ttl", "3"])
    assert (shards.endpoints, shards.member_id, shards.lease_ttl_s, shards.prefix) == (("127.0.0.1:1", "127.0.0.1:2"), "broker-0", 3, "/kvpush/")
    assert shards.address("127.0.0.1:0", 5000) == "127.0.0.1:5000"
    with pytest.raises(ValueError, match="--advertise"):
        shards.address("0.0.0.0:50053", 50053)
    advertised = shard_membership(monkeypatch, ["--etcd", "127.0.0.1:1", "--member-id", "broker-0", "--advertise", "broker-0.brokers:50053"])
    assert advertised.address("0.0.0.0:50053", 50053) == "broker-0.brokers:50053"
    for argv, message in ((["--etcd", "127.0.0.1:1"], "--member-id"), (["--etcd", "127.0.0.1:1", "--member-id", "b", "--etcd-prefix", "/x"], "end with '/'")):
        with pytest.raises(ValueError, match=message):
            shard_membership(monkeypatch, argv)
