# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""deploy/k8s, offline, in both forms (embedded, scaled): Kubernetes schemas (kubernetes-validate), labels and selectors, references between objects, tokens."""

from __future__ import annotations

import kubernetes_validate
import pytest

from kvpush.services.broker import servicer as broker_servicer
from kvpush.services.common.tokens import BROKER_IDENTITY, ROUTER_IDENTITY, load_tokens_dir
from kvpush.services.registrar import servicer as registrar_servicer
from tests.deploy.manifests import EMBEDDED, FORMS, K8S, SCALED, WORKLOADS, Form, containers, kvpush_containers, pod_labels

FORM_IDS = [form.name for form in FORMS]
# Every object once: the scaled form shares the engine, router, namespace and cache files.
ALL_OBJECTS = EMBEDDED.documents + [d for d in SCALED.documents if d not in EMBEDDED.documents]
# A registrar or broker alone is ready when the service it serves is (a broker marks its own serving once it
# mirrors the engines); the one-process control plane when it answers at all, as before.
READY_SERVICE = {"registrar": registrar_servicer.SERVICE_NAME, "broker": broker_servicer.SERVICE_NAME}


def test_both_forms_have_files_and_the_scaled_one_has_no_one_process_control_plane():
    assert len(EMBEDDED.files) >= 5 and len(list((K8S / "scaled").glob("*.yaml"))) >= 4
    assert not [d for d in SCALED.documents if d["metadata"]["name"] == "kvpush-control-plane"]


@pytest.mark.parametrize("form", FORMS, ids=FORM_IDS)
def test_every_object_is_in_the_namespace_and_defined_once(form: Form):
    for doc in form.documents:
        assert doc["metadata"]["labels"]["app.kubernetes.io/part-of"] == "kvpush", doc["metadata"]["name"]
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == "kvpush", doc["metadata"]["name"]
    names = [(d["kind"], d["metadata"]["name"]) for d in form.documents]
    assert len(names) == len(set(names))


@pytest.mark.parametrize("doc", ALL_OBJECTS, ids=[f"{d['kind']}/{d['metadata']['name']}" for d in ALL_OBJECTS])
def test_objects_match_the_kubernetes_schema(doc):
    # strict: unknown fields (typos) fail too.
    kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)


@pytest.mark.parametrize("form", FORMS, ids=FORM_IDS)
def test_selectors_match_pod_labels_and_services_find_their_pods(form: Form):
    for workload in form.of_kind(*WORKLOADS):
        selector = workload["spec"]["selector"]["matchLabels"]
        assert selector.items() <= pod_labels(workload).items(), workload["metadata"]["name"]
    for service in form.of_kind("Service"):
        matches = form.selected(service["spec"]["selector"])
        assert len(matches) == 1, service["metadata"]["name"]
        port_names = {p["name"] for c in containers(matches[0]) for p in c.get("ports", [])}
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in port_names, (service["metadata"]["name"], port)
    for statefulset in form.of_kind("StatefulSet"):
        headless = form.find("Service", statefulset["spec"]["serviceName"])
        assert headless["spec"]["clusterIP"] == "None"
        assert form.selected(headless["spec"]["selector"]) == [statefulset]


@pytest.mark.parametrize("form", FORMS, ids=FORM_IDS)
def test_referenced_secrets_configmaps_keys_and_claims_exist(form: Form):
    names = {(d["kind"], d["metadata"]["name"]) for d in form.documents}
    for workload in form.of_kind(*WORKLOADS):
        pod = workload["spec"]["template"]["spec"]
        for volume in pod.get("volumes", []):
            if "secret" in volume:
                assert ("Secret", volume["secret"]["secretName"]) in names
            if "persistentVolumeClaim" in volume:
                assert ("PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"]) in names
        claim_templates = {t["metadata"]["name"] for t in workload["spec"].get("volumeClaimTemplates", [])}
        for container in pod["containers"]:
            for source in container.get("envFrom", []):
                assert ("ConfigMap", source["configMapRef"]["name"]) in names
            for entry in container.get("env", []):
                ref = entry.get("valueFrom", {}).get("configMapKeyRef")
                if ref:
                    assert ref["key"] in form.find("ConfigMap", ref["name"])["data"], (workload["metadata"]["name"], ref)
            mounted = {m["name"] for m in container.get("volumeMounts", [])}
            assert mounted <= {v["name"] for v in pod.get("volumes", [])} | claim_templates
            # Every $(VAR) in the args is defined in the pod (Kubernetes would pass it through literally).
            form.expanded_args(workload, container)


@pytest.mark.parametrize("form", FORMS, ids=FORM_IDS)
def test_every_container_has_resources_and_probes(form: Form):
    for workload in form.of_kind(*WORKLOADS):
        for container in containers(workload):
            assert container["resources"]["requests"] and container["resources"]["limits"], workload["metadata"]["name"]
            assert "readinessProbe" in container and "livenessProbe" in container, workload["metadata"]["name"]


@pytest.mark.parametrize("form", FORMS, ids=FORM_IDS)
def test_the_tokens_secret_is_a_valid_tokens_dir_with_every_callers_identity(tmp_path, form: Form):
    for key, value in form.find("Secret", "kvpush-tokens")["stringData"].items():
        (tmp_path / key).write_text(value)
    identities = load_tokens_dir(tmp_path).identities  # names are identities, no token is shared
    engines = {f"{s['metadata']['name']}-{i}" for s in form.of_kind("StatefulSet") if s["metadata"]["name"].startswith("vllm-") for i in range(s["spec"]["replicas"])}
    # Broker shards call the registrars as the `broker` identity; the one-process control plane calls nobody.
    brokers = {BROKER_IDENTITY} if any(c["args"][0] == "broker" for _, c in kvpush_containers(form)) else set()
    assert identities == {ROUTER_IDENTITY} | engines | brokers


@pytest.mark.parametrize("form", FORMS, ids=FORM_IDS)
def test_servers_are_probed_over_grpc_health_on_their_grpc_port(form: Form):
    """kvpush's servers (and etcd) answer grpc.health.v1 without credentials; readiness names the service they serve."""
    servers = [(w, c) for w, c in kvpush_containers(form) if c["args"][0] != "router"]
    servers += [(w, c) for w in form.of_kind(*WORKLOADS) for c in containers(w) if c["name"] == "etcd"]
    assert servers
    for workload, container in servers:
        port = next(p["containerPort"] for p in container["ports"] if p["name"] in ("grpc", "client"))
        ready, alive = container["readinessProbe"]["grpc"], container["livenessProbe"]["grpc"]
        assert ready["port"] == port == alive["port"] and "service" not in alive, workload["metadata"]["name"]
        command = container["args"][0]
        assert ready.get("service") == READY_SERVICE.get(command), workload["metadata"]["name"]



def test_the_one_process_control_plane_is_one_replica_never_two():
    deployment = EMBEDDED.find("Deployment", "kvpush-control-plane")
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"]["type"] == "Recreate"
