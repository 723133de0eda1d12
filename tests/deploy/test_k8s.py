# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""deploy/k8s, offline: Kubernetes schemas (kubernetes-validate), references between objects, and kvpush's own config parsers."""

from __future__ import annotations

import argparse
import json
import types
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from kvpush.connector.config import ConnectorConfig
from kvpush.services.common.tokens import load_tokens_dir
from kvpush.services.router.config import RouterConfig, parse_endpoint

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
WORKLOADS = ("Deployment", "StatefulSet")


def load_documents() -> list[dict]:
    documents = []
    for path in sorted(K8S.glob("*.yaml")):
        documents += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    return documents


DOCUMENTS = load_documents()


def find(kind: str, name: str) -> dict:
    return next(d for d in DOCUMENTS if d["kind"] == kind and d["metadata"]["name"] == name)


def containers(workload: dict) -> list[dict]:
    return workload["spec"]["template"]["spec"]["containers"]


def token_mount(workload: dict, container: dict) -> tuple[str, dict]:
    """Where the container mounts the kvpush-tokens Secret, and that volume's secret source."""
    (mount,) = [m for m in container["volumeMounts"] if m["name"].startswith("token")]
    (volume,) = [v for v in workload["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]]
    assert volume["secret"]["secretName"] == "kvpush-tokens" and mount["readOnly"]
    return mount["mountPath"], volume["secret"]


def own_token_file(workload: dict, container: dict, identity: str) -> str:
    """The one token file a pod gets: only identity's key of the Secret."""
    path, source = token_mount(workload, container)
    (item,) = source["items"]
    assert item["key"] == identity
    return f"{path}/{item['path']}"


def test_every_file_has_documents_and_every_object_is_in_the_namespace():
    assert len(list(K8S.glob("*.yaml"))) >= 5
    for doc in DOCUMENTS:
        assert doc["metadata"]["labels"]["app.kubernetes.io/part-of"] == "kvpush", doc["metadata"]["name"]
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == "kvpush", doc["metadata"]["name"]


@pytest.mark.parametrize("doc", DOCUMENTS, ids=[f"{d['kind']}/{d['metadata']['name']}" for d in DOCUMENTS])
def test_objects_match_the_kubernetes_schema(doc):
    # strict: unknown fields (typos) fail too.
    kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)


def test_selectors_match_pod_labels_and_services_find_their_pods():
    workloads = [d for d in DOCUMENTS if d["kind"] in WORKLOADS]
    for workload in workloads:
        selector = workload["spec"]["selector"]["matchLabels"]
        assert selector.items() <= workload["spec"]["template"]["metadata"]["labels"].items(), workload["metadata"]["name"]
    for service in (d for d in DOCUMENTS if d["kind"] == "Service"):
        matches = [w for w in workloads if service["spec"]["selector"].items() <= w["spec"]["template"]["metadata"]["labels"].items()]
        assert len(matches) == 1, service["metadata"]["name"]
        port_names = {p["name"] for c in containers(matches[0]) for p in c.get("ports", [])}
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in port_names, (service["metadata"]["name"], port)
    for statefulset in (d for d in DOCUMENTS if d["kind"] == "StatefulSet"):
        headless = find("Service", statefulset["spec"]["serviceName"])
        assert headless["spec"]["clusterIP"] == "None"


def test_referenced_secrets_configmaps_and_claims_exist():
    names = {(d["kind"], d["metadata"]["name"]) for d in DOCUMENTS}
    for workload in (d for d in DOCUMENTS if d["kind"] in WORKLOADS):
        pod = workload["spec"]["template"]["spec"]
        for volume in pod.get("volumes", []):
            if "secret" in volume:
                assert ("Secret", volume["secret"]["secretName"]) in names
            if "persistentVolumeClaim" in volume:
                assert ("PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"]) in names
        for container in pod["containers"]:
            for source in container.get("envFrom", []):
                assert ("ConfigMap", source["configMapRef"]["name"]) in names
            mounted = {m["name"] for m in container.get("volumeMounts", [])}
            assert mounted <= {v["name"] for v in pod.get("volumes", [])}


def test_every_container_has_resources_and_probes():
    for workload in (d for d in DOCUMENTS if d["kind"] in WORKLOADS):
        for container in containers(workload):
            assert container["resources"]["requests"] and container["resources"]["limits"], workload["metadata"]["name"]
            assert "readinessProbe" in container and "livenessProbe" in container, workload["metadata"]["name"]


def test_control_plane_is_probed_over_grpc_health_and_configured_from_the_configmap():
    deployment = find("Deployment", "kvpush-control-plane")
    (container,) = containers(deployment)
    grpc_port = next(p["containerPort"] for p in container["ports"] if p["name"] == "grpc")
    assert container["readinessProbe"]["grpc"]["port"] == grpc_port == container["livenessProbe"]["grpc"]["port"]
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"]["type"] == "Recreate"
    config = find("ConfigMap", "kvpush-control-plane")["data"]
    assert config["KVPUSH_LISTEN"].endswith(f":{grpc_port}")
    metrics_port = next(p["containerPort"] for p in container["ports"] if p["name"] == "metrics")
    assert config["KVPUSH_METRICS_PORT"] == str(metrics_port)
    tokens_dir, source = token_mount(deployment, container)
    assert config["KVPUSH_TOKENS_DIR"] == tokens_dir and "items" not in source  # every identity's key


def test_the_tokens_secret_is_a_valid_tokens_dir_with_every_pods_identity(tmp_path):
    for key, value in find("Secret", "kvpush-tokens")["stringData"].items():
        (tmp_path / key).write_text(value)
    identities = load_tokens_dir(tmp_path).identities  # names are identities, no token is shared
    pods = {f"{d['metadata']['name']}-{i}" for d in DOCUMENTS if d["kind"] == "StatefulSet" for i in range(d["spec"]["replicas"])}
    assert identities == {"router"} | pods


def engine_kv_config(role: str) -> tuple[dict, dict]:
    statefulset = find("StatefulSet", f"vllm-{role}")
    (container,) = containers(statefulset)
    raw = next(a for a in container["args"] if a.startswith("--kv-transfer-config=")).split("=", 1)[1]
    pod_name = f"{statefulset['metadata']['name']}-0"
    return json.loads(raw.replace("$(POD_NAME)", pod_name)), container


@pytest.mark.parametrize(("role", "kv_role"), [("prefill", "kv_producer"), ("decode", "kv_consumer")])
def test_engines_run_kvpush_with_a_config_the_connector_accepts(tmp_path, role, kv_role):
    kv_config, container = engine_kv_config(role)
    assert (kv_config["kv_connector"], kv_config["kv_role"], kv_config["engine_id"]) == ("KvpushConnector", kv_role, f"vllm-{role}-0")
    extra = kv_config["kv_connector_extra_config"]
    assert extra["token_file"] == own_token_file(find("StatefulSet", f"vllm-{role}"), container, kv_config["engine_id"])
    service = find("Service", "kvpush-control-plane")
    host, port = extra["control_plane"].rsplit(":", 1)
    assert host == "kvpush-control-plane.kvpush.svc" and int(port) == next(p["port"] for p in service["spec"]["ports"] if p["name"] == "grpc")
    token_file = tmp_path / "token"
    token_file.write_text("t")
    parsed = ConnectorConfig.from_kv_transfer_config(
        types.SimpleNamespace(kv_role=kv_config["kv_role"], engine_id=kv_config["engine_id"],
                              kv_connector_extra_config={**extra, "token_file": str(token_file)})
    )
    assert (parsed.role, parsed.control_plane) == (role, extra["control_plane"])
    assert container["resources"]["limits"]["nvidia.com/gpu"] == container["resources"]["requests"]["nvidia.com/gpu"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["OTEL_TRACES_EXPORTER"] == "otlp" and env["OTEL_EXPORTER_OTLP_ENDPOINT"].endswith(":4318")
    assert any(p["name"] == "nixl-side" and str(p["containerPort"]) == env["VLLM_NIXL_SIDE_CHANNEL_PORT"] for p in container["ports"])


def test_router_configmap_is_a_valid_router_config_naming_the_engine_pods(monkeypatch):
    config = find("ConfigMap", "kvpush-router")["data"]
    for name, value in config.items():
        monkeypatch.setenv(name, value)
    parser = argparse.ArgumentParser()
    RouterConfig.add_arguments(parser)
    router = RouterConfig.from_args(parser.parse_args([]))
    assert (router.mode, router.policy, router.port) == ("push", "least_loaded", 8000)
    for role, endpoints in (("prefill", router.prefill), ("decode", router.decode)):
        statefulset = find("StatefulSet", f"vllm-{role}")
        service = find("Service", statefulset["spec"]["serviceName"])
        for index, endpoint in enumerate(endpoints):
            pod = f"{statefulset['metadata']['name']}-{index}"
            assert endpoint == parse_endpoint(f"http://{pod}.{service['metadata']['name']}.kvpush.svc:{service['spec']['ports'][0]['port']}={pod}")
    (container,) = containers(find("Deployment", "kvpush-router"))
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    assert str(router.token_file) == own_token_file(find("Deployment", "kvpush-router"), container, "router")
