# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""deploy/k8s, offline, in both forms: kvpush's own parsers (the CLI, the router's and the connector's settings) accept what the manifests pass."""

from __future__ import annotations

import argparse
import dataclasses
import json
import types

import pytest

from kvpush.cli import SUBCOMMANDS
from kvpush.connector.config import ConnectorConfig
from kvpush.services.common.config import ServerConfig
from kvpush.services.router.config import RouterConfig, parse_endpoint
from kvpush.settings import Setting
from tests.deploy.manifests import (
    FORMS,
    KVPUSH_IMAGE,
    Form,
    containers,
    flags_in,
    kvpush_containers,
    own_token_file,
    parser_envs,
    parser_flags,
    port_of,
    service_target,
    subcommand_parser,
    token_mount,
)

KVPUSH = [(form, workload, container) for form in FORMS for workload, container in kvpush_containers(form)]


def set_env(monkeypatch, env: dict[str, str]) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)


@pytest.mark.parametrize(("form", "workload", "container"), KVPUSH, ids=[f"{f.name}-{w['metadata']['name']}" for f, w, _ in KVPUSH])
def test_kvpush_containers_pass_only_flags_and_settings_their_subcommand_has(monkeypatch, form: Form, workload: dict, container: dict):
    command, *args = form.expanded_args(workload, container)
    assert command in SUBCOMMANDS
    set_env(monkeypatch, form.pod_env(workload, container))
    parser = subcommand_parser(command)
    for source in container.get("envFrom", []):
        settings = {k for k in form.find("ConfigMap", source["configMapRef"]["name"])["data"] if k.startswith("KVPUSH_")}
        assert settings <= parser_envs(parser), f"kvpush {command} reads no {sorted(settings - parser_envs(parser))}"
    missing = set(flags_in(args)) - parser_flags(parser)
    assert not missing, f"kvpush {command} has no {sorted(missing)}"
    parsed = parser.parse_args(args)  # an unknown flag or a bad value exits here
    if command == "router":
        return  # test_router_configmap_... checks its settings
    server = ServerConfig.from_args(parsed)
    assert int(server.listen.rsplit(":", 1)[1]) == port_of(container, "grpc")
    assert server.metrics_port == port_of(container, "metrics")
    tokens_dir, source = token_mount(workload, container)
    assert str(server.tokens_dir) == tokens_dir and "items" not in source  # every identity's key
    if command == "broker":
        # Its shard's address is its own pod's gRPC port, and it mirrors engines from the registrars' Service.
        assert parsed.advertise.endswith(f":{port_of(container, 'grpc')}")
        registrar, port = service_target(form, parsed.registrar)
        assert commands_behind(form, registrar) == {"registrar"} and port["targetPort"] == "grpc"


def commands_behind(form: Form, service: dict) -> set[str]:
    """The kvpush subcommands the pods behind service run."""
    (workload,) = form.selected(service["spec"]["selector"])
    return {c["args"][0] for c in containers(workload) if c["image"].startswith(KVPUSH_IMAGE)}


def engine_kv_config(form: Form, role: str) -> tuple[dict, dict, dict]:
    statefulset = form.find("StatefulSet", f"vllm-{role}")
    (container,) = containers(statefulset)
    raw = next(a for a in form.expanded_args(statefulset, container) if a.startswith("--kv-transfer-config=")).split("=", 1)[1]
    return json.loads(raw), statefulset, container


@pytest.mark.parametrize("form", FORMS, ids=[f.name for f in FORMS])
@pytest.mark.parametrize(("role", "kv_role"), [("prefill", "kv_producer"), ("decode", "kv_consumer")])
def test_engines_run_kvpush_with_a_config_the_connector_accepts(tmp_path, monkeypatch, form: Form, role, kv_role):
    kv_config, statefulset, container = engine_kv_config(form, role)
    assert (kv_config["kv_connector"], kv_config["kv_role"], kv_config["engine_id"]) == ("KvpushConnector", kv_role, f"vllm-{role}-0")
    extra = kv_config["kv_connector_extra_config"]
    assert extra["token_file"] == own_token_file(statefulset, container, kv_config["engine_id"])
    env = form.pod_env(statefulset, container)
    set_env(monkeypatch, env)
    token_file = tmp_path / "token"
    token_file.write_text("t")
    parsed = ConnectorConfig.from_kv_transfer_config(
        types.SimpleNamespace(kv_role=kv_config["kv_role"], engine_id=kv_config["engine_id"],
                              kv_connector_extra_config={**extra, "token_file": str(token_file)})
    )
    # control_plane comes from kvpush-endpoints: the registrar (alone or in the one process).
    assert (parsed.role, parsed.control_plane) == (role, env["KVPUSH_CONTROL_PLANE"])
    registrar, port = service_target(form, parsed.control_plane)
    assert commands_behind(form, registrar) & {"registrar", "control-plane"} and port["targetPort"] == "grpc"
    broker, port = service_target(form, env["KVPUSH_BROKER"])
    assert commands_behind(form, broker) & {"broker", "control-plane"} and port["targetPort"] == "grpc"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == container["resources"]["requests"]["nvidia.com/gpu"]
    assert env["OTEL_TRACES_EXPORTER"] == "otlp" and env["OTEL_EXPORTER_OTLP_ENDPOINT"].endswith(":4318")
    assert any(p["name"] == "nixl-side" and str(p["containerPort"]) == env["VLLM_NIXL_SIDE_CHANNEL_PORT"] for p in container["ports"])


def test_engines_reach_the_brokers_through_the_connectors_broker_setting(tmp_path, monkeypatch):
    """The connector's `broker` setting (the key kvpush.dev.localstack's scaled stack passes) reads $KVPUSH_BROKER from kvpush-endpoints."""
    settings = {f.name: s for f in dataclasses.fields(ConnectorConfig) for s in f.metadata.values() if isinstance(s, Setting)}
    assert settings["broker"].env == "KVPUSH_BROKER", "kvpush-endpoints gives engines their broker target as $KVPUSH_BROKER"
    for form in FORMS:
        kv_config, statefulset, container = engine_kv_config(form, "decode")
        env = form.pod_env(statefulset, container)
        set_env(monkeypatch, env)
        token_file = tmp_path / "token"
        token_file.write_text("t")
        extra = {**kv_config["kv_connector_extra_config"], "token_file": str(token_file)}
        parsed = ConnectorConfig.from_kv_transfer_config(types.SimpleNamespace(kv_role="kv_consumer", engine_id="vllm-decode-0", kv_connector_extra_config=extra))
        assert parsed.broker == env["KVPUSH_BROKER"], form.name


@pytest.mark.parametrize("form", FORMS, ids=[f.name for f in FORMS])
def test_router_is_a_valid_router_config_naming_the_engine_pods_and_the_brokers(monkeypatch, form: Form):
    deployment = form.find("Deployment", "kvpush-router")
    (container,) = containers(deployment)
    env = form.pod_env(deployment, container)
    set_env(monkeypatch, env)
    parser = argparse.ArgumentParser()
    RouterConfig.add_arguments(parser)
    router = RouterConfig.from_args(parser.parse_args([]))
    assert (router.mode, router.policy, router.port) == ("push", "least_loaded", 8000)
    # The router calls only brokers: its control plane is kvpush-endpoints' broker target.
    assert router.control_plane == form.find("ConfigMap", "kvpush-endpoints")["data"]["KVPUSH_BROKER"]
    broker, _ = service_target(form, router.control_plane)
    assert commands_behind(form, broker) & {"broker", "control-plane"}
    for role, endpoints in (("prefill", router.prefill), ("decode", router.decode)):
        statefulset = form.find("StatefulSet", f"vllm-{role}")
        service = form.find("Service", statefulset["spec"]["serviceName"])
        for index, endpoint in enumerate(endpoints):
            pod = f"{statefulset['metadata']['name']}-{index}"
            assert endpoint == parse_endpoint(f"http://{pod}.{service['metadata']['name']}.kvpush.svc:{service['spec']['ports'][0]['port']}={pod}")
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    assert str(router.token_file) == own_token_file(deployment, container, "router")
