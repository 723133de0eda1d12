# SPDX-License-Identifier: Apache-2.0
"""Service configs: flags, KVPUSH_* environment fallbacks, validation, secrets on disk."""

from __future__ import annotations

import argparse
import pathlib

import pytest

from kvpush.etcd.settings import EtcdSettings
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


def etcd_and_shards(monkeypatch, env: dict[str, str], argv: list[str]) -> tuple[EtcdSettings, ShardMembership]:
    """The etcd settings and shard membership as `kvpush registrar` and `kvpush broker` parse them."""
    for name in ("KVPUSH_ETCD", "KVPUSH_ETCD_PREFIX", "KVPUSH_ETCD_TIMEOUT_S"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    parser = argparse.ArgumentParser()
    EtcdSettings.add_arguments(parser)
    ShardMembership.add_arguments(parser)
    args = parser.parse_args(argv)
    return EtcdSettings.from_args(args), ShardMembership.from_args(args)


def test_the_etcd_endpoints_and_prefix_come_from_flags_or_the_environment(monkeypatch):
    assert etcd_and_shards(monkeypatch, {}, [])[0] == EtcdSettings()  # no endpoints: a registrar keeps its directory in process, a broker is unsharded
    assert (EtcdSettings().endpoints, EtcdSettings().prefix, EtcdSettings().timeout_s) == (None, "/kvpush/", 5.0)
    from_env, _ = etcd_and_shards(monkeypatch, {"KVPUSH_ETCD": "127.0.0.1:2379, 127.0.0.1:2381", "KVPUSH_ETCD_TIMEOUT_S": "2"}, ["--etcd-prefix", "/team-a/"])
    assert (from_env.endpoints, from_env.prefix, from_env.timeout_s) == (("127.0.0.1:2379", "127.0.0.1:2381"), "/team-a/", 2.0)
    assert etcd_and_shards(monkeypatch, {}, ["--etcd", "127.0.0.1:1"])[0].endpoints == ("127.0.0.1:1",)
    client = from_env.client()
    assert (client.endpoints, client.timeout_s) == (["127.0.0.1:2379", "127.0.0.1:2381"], 2.0)
    with pytest.raises(ValueError, match="--etcd-prefix must end with '/'"):
        EtcdSettings(endpoints=("127.0.0.1:1",), prefix="/kvpush")
    with pytest.raises(ValueError, match="--etcd-timeout must be a positive number"):
        EtcdSettings(timeout_s=0)


@pytest.mark.parametrize("endpoints", ["bad", "127.0.0.1", "127.0.0.1:0", "127.0.0.1:99999", ":2379", "127.0.0.1:2379,etcd-1"])
def test_a_malformed_etcd_endpoint_is_refused_naming_it(monkeypatch, capsys, endpoints):
    with pytest.raises(SystemExit):
        etcd_and_shards(monkeypatch, {}, ["--etcd", endpoints])
    assert "is not host:port" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="KVPUSH_ETCD=.* is not host:port"):
        etcd_and_shards(monkeypatch, {"KVPUSH_ETCD": endpoints}, [])


def test_a_broker_on_etcd_is_a_named_member_that_advertises_where_it_listens(monkeypatch):
    etcd, shards = etcd_and_shards(monkeypatch, {}, ["--etcd", "127.0.0.1:1,127.0.0.1:2", "--member-id", "broker-0", "--shard-lease-ttl", "3"])
    assert (etcd.endpoints, shards.member_id, shards.lease_ttl_s, etcd.prefix) == (("127.0.0.1:1", "127.0.0.1:2"), "broker-0", 3, "/kvpush/")
    shards.check_on_etcd("127.0.0.1:0")
    assert shards.address("127.0.0.1:0", 5000) == "127.0.0.1:5000"
    with pytest.raises(ValueError, match="--advertise"):
        shards.address("0.0.0.0:50053", 50053)
    with pytest.raises(ValueError, match="--advertise"):
        shards.check_on_etcd("0.0.0.0:50053")
    _, advertised = etcd_and_shards(monkeypatch, {}, ["--etcd", "127.0.0.1:1", "--member-id", "broker-0", "--advertise", "broker-0.brokers:50053"])
    advertised.check_on_etcd("0.0.0.0:50053")
    assert advertised.address("0.0.0.0:50053", 50053) == "broker-0.brokers:50053"
    _, unnamed = etcd_and_shards(monkeypatch, {}, ["--etcd", "127.0.0.1:1"])
    with pytest.raises(ValueError, match="--member-id"):
        unnamed.check_on_etcd("127.0.0.1:0")
    with pytest.raises(ValueError, match="end with '/'"):
        etcd_and_shards(monkeypatch, {}, ["--etcd", "127.0.0.1:1", "--member-id", "b", "--etcd-prefix", "/x"])
