# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""deploy/k8s's two forms as parsed objects, and what the tests ask of them: lookups, pods' environments, token mounts, kvpush's CLI parsers."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import re
from pathlib import Path

import yaml

from kvpush.cli import SUBCOMMANDS

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
WORKLOADS = ("Deployment", "StatefulSet")
KVPUSH_IMAGE = "ghcr.io/kvpush/kvpush:"
# What a fieldRef of the downward API stands for in a rendered pod.
POD_IP = "10.0.0.7"


def _documents(paths: list[Path]) -> list[dict]:
    documents = []
    for path in paths:
        documents += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    return documents


@dataclasses.dataclass(frozen=True)
class Form:
    """One way to deploy: the files `kubectl apply` gets and the objects in them."""

    name: str
    files: tuple[Path, ...]

    @functools.cached_property
    def documents(self) -> list[dict]:
        return _documents(list(self.files))

    def find(self, kind: str, name: str) -> dict:
        (found,) = [d for d in self.documents if d["kind"] == kind and d["metadata"]["name"] == name]
        return found

    def of_kind(self, *kinds: str) -> list[dict]:
        return [d for d in self.documents if d["kind"] in kinds]

    def selected(self, selector: dict) -> list[dict]:
        """The workloads whose pods carry every label of selector."""
        return [w for w in self.of_kind(*WORKLOADS) if selector.items() <= pod_labels(w).items()]

    def pod_env(self, workload: dict, container: dict, pod_index: int = 0) -> dict[str, str]:
        """The container's environment as the kubelet builds it (envFrom ConfigMaps, then env; later wins)."""
        env: dict[str, str] = {}
        for source in container.get("envFrom", []):
            env.update(self.find("ConfigMap", source["configMapRef"]["name"])["data"])
        for entry in container.get("env", []):
            env[entry["name"]] = self._env_value(workload, entry, pod_index)
        return env

    def _env_value(self, workload: dict, entry: dict, pod_index: int) -> str:
        if "value" in entry:
            return entry["value"]
        source = entry["valueFrom"]
        if "configMapKeyRef" in source:
            return self.find("ConfigMap", source["configMapKeyRef"]["name"])["data"][source["configMapKeyRef"]["key"]]
        field = source["fieldRef"]["fieldPath"]
        return {"metadata.name": f"{workload['metadata']['name']}-{pod_index}", "status.podIP": POD_IP}[field]

    def expanded_args(self, workload: dict, container: dict, pod_index: int = 0) -> list[str]:
        """The container's args with $(VAR) replaced from its environment, as Kubernetes does."""
        env = self.pod_env(workload, container, pod_index)
        return [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], arg) for arg in container.get("args", [])]


EMBEDDED = Form("embedded", tuple(sorted(K8S.glob("*.yaml"))))
# The scaled-out control plane (scaled/) replaces the one-process one (10-control-plane.yaml); the
# namespace, model cache, engines and router are the same files.
SCALED = Form("scaled", tuple(sorted([p for p in K8S.glob("*.yaml") if p.name != "10-control-plane.yaml"] + list((K8S / "scaled").glob("*.yaml")))))
FORMS = (EMBEDDED, SCALED)


def containers(workload: dict) -> list[dict]:
    return workload["spec"]["template"]["spec"]["containers"]


def pod_labels(workload: dict) -> dict:
    return workload["spec"]["template"]["metadata"]["labels"]


def port_of(container: dict, name: str) -> int:
    return next(p["containerPort"] for p in container["ports"] if p["name"] == name)


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


def kvpush_containers(form: Form) -> list[tuple[dict, dict]]:
    """(workload, container) for every container running the `kvpush` command."""
    return [(w, c) for w in form.of_kind(*WORKLOADS) for c in containers(w) if c["image"].startswith(KVPUSH_IMAGE)]


def subcommand_parser(command: str) -> argparse.ArgumentParser:
    """`kvpush COMMAND`'s own parser, built as kvpush.cli builds it (its defaults read the environment now)."""
    parser = argparse.ArgumentParser(prog=f"kvpush {command}")
    importlib.import_module(SUBCOMMANDS[command][0]).configure_parser(parser)
    return parser


def parser_flags(parser: argparse.ArgumentParser) -> set[str]:
    return {option for action in parser._actions for option in action.option_strings}


def parser_envs(parser: argparse.ArgumentParser) -> set[str]:
    """The environment variables the parser's settings read (kvpush.settings writes "(env NAME" into each help)."""
    return {m.group(1) for action in parser._actions for m in re.finditer(r"\(env (\w+)", action.help or "")}


def flags_in(args: list[str]) -> list[str]:
    return [arg.split("=", 1)[0] for arg in args if arg.startswith("--")]


def service_target(form: Form, target: str) -> tuple[dict, dict]:
    """The Service a `<name>.kvpush.svc:<port>` target names and that Service's port entry."""
    host, port = target.rsplit(":", 1)
    name, namespace, svc = host.split(".")
    assert (namespace, svc) == ("kvpush", "svc"), target
    service = form.find("Service", name)
    (entry,) = [p for p in service["spec"]["ports"] if p["port"] == int(port)]
    return service, entry
