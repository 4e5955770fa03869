"""What an install exposes (issue 29, the smaller items), checked on the files as the tools will read them (no
Docker engine or cluster here: tests/deploy validates the same files against their schemas).

- compose: every published port binds 127.0.0.1; no password is written in the file: each is a variable that
  deploy/compose-secrets.py generates (with the broker definitions holding their hashes), and compose refuses to
  start without it; no container shares the host's PID namespace or network.
- Kubernetes: no pod uses hostPID, hostNetwork or hostIPC; NetworkPolicies deny ingress to every gpuorch pod but the
  API's HTTP port and, for Prometheus only, the metrics ports; the broker and the database take connections from
  gpuorch's services only.
"""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.broker_users import gen
from tests.deploy.test_validation import manifests

pytestmark = pytest.mark.security

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
GPUORCH_PODS = {"scheduler", "telemetry", "executor", "node-agent", "api", "gpuorch-migrate"}


def _compose() -> dict[str, Any]:
    return yaml.safe_load((DEPLOY / "compose.yaml").read_text())  # type: ignore[no-any-return]


def test_compose_publishes_ports_on_localhost_only_and_shares_no_host_namespace() -> None:
    published = 0
    for name, service in _compose()["services"].items():
        for port in service.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port} on every address"
            published += 1
        assert service.get("pid") in (None, "service:executor"), f"{name} shares the host's PID namespace"
        assert service.get("network_mode") is None and service.get("ipc") is None, name
        assert not service.get("privileged"), name
    assert published >= 8


def test_compose_has_no_written_password_and_the_generator_makes_each_one(tmp_path: Path) -> None:
    text = (DEPLOY / "compose.yaml").read_text()
    assert not re.search(r"-dev@|PASSWORD: +[^$\s]", text), "a password is written in compose.yaml"
    referenced = set(re.findall(r"\$\{(\w+):\?", text))
    assert {"GPUORCH_POSTGRES_PASSWORD", "GPUORCH_GRAFANA_ADMIN_PASSWORD",
            gen.password_variable("scheduler")} <= referenced

    def generate(*args: str) -> dict[str, str]:
        subprocess.run([sys.executable, str(DEPLOY / "compose-secrets.py"), "--out", str(tmp_path), *args],
                       check=True, capture_output=True)
        lines = (tmp_path / ".env").read_text().splitlines()
        return dict(line.split("=", 1) for line in lines if "=" in line and not line.startswith("#"))

    first = generate()
    assert referenced <= set(first), f"not generated: {sorted(referenced - set(first))}"
    assert stat.S_IMODE(os.stat(tmp_path / ".env").st_mode) == 0o600
    assert len(set(first.values())) == len(first) and all(len(v) >= 32 for v in first.values())
    definitions = json.loads((tmp_path / ".secrets" / "definitions.json").read_text())
    for user in definitions["users"]:
        assert gen.password_hash(user["name"], first[gen.password_variable(user["name"])]) == user["password_hash"]
    assert generate() == first  # kept on a second run
    rotated = generate("--rotate")
    assert not set(rotated.values()) & set(first.values())
    broker_volumes = _compose()["services"]["rabbitmq"]["volumes"]
    assert "./.secrets/definitions.json:/etc/rabbitmq/definitions.json:ro" in broker_volumes  # not the dev one


def _k8s() -> list[dict[str, Any]]:
    return [obj for _, obj in manifests()]


def test_no_kubernetes_pod_shares_a_host_namespace() -> None:
    workloads = [o for o in _k8s() if o["kind"] in ("Deployment", "DaemonSet", "StatefulSet", "Job")]
    assert len(workloads) >= 6
    for workload in workloads:
        pod = workload["spec"]["template"]["spec"]
        for key in ("hostPID", "hostNetwork", "hostIPC"):
            assert not pod.get(key), f"{workload['metadata']['name']} sets {key}"


def _selects(policy: dict[str, Any], labels: dict[str, str]) -> bool:
    selector = policy["spec"]["podSelector"]
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expression in selector.get("matchExpressions", []):
        assert expression["operator"] == "In"
        if labels.get(expression["key"]) not in expression["values"]:
            return False
    return True


def test_network_policies_let_in_only_api_http_and_prometheus_on_metrics() -> None:
    objects = _k8s()
    policies = [o for o in objects if o["kind"] == "NetworkPolicy"]
    workloads = [o for o in objects if o["kind"] in ("Deployment", "DaemonSet", "Job")
                 and o["spec"]["template"]["metadata"]["labels"].get("app.kubernetes.io/name") in GPUORCH_PODS]
    assert {w["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/name"] for w in workloads} == GPUORCH_PODS
    for workload in workloads:
        labels = workload["spec"]["template"]["metadata"]["labels"]
        mine = [p for p in policies if _selects(p, labels)]
        assert any("Ingress" in p["spec"]["policyTypes"] and not p["spec"].get("ingress") for p in mine), \
            f"{labels} has no default-deny ingress policy"
        for rule in (r for p in mine for r in p["spec"].get("ingress", [])):
            ports = {port["port"] for port in rule.get("ports", [])}
            assert ports, f"a rule lets every port of {labels} in"
            if labels["app.kubernetes.io/name"] == "api" and ports == {"http"}:
                continue  # the one public port
            assert ports == {"metrics"}, (labels, ports)
            assert all(peer.get("podSelector", {}).get("matchLabels") == {"app.kubernetes.io/name": "prometheus"}
                       for peer in rule["from"]), rule
    backing = [o for o in yaml.safe_load_all((DEPLOY / "k8s" / "backing" / "networkpolicy.yaml").read_text()) if o]
    broker = next(p for p in backing if _selects(p, {"app.kubernetes.io/name": "gpuorch-rabbitmq"}))
    amqp = next(r for r in broker["spec"]["ingress"] if {"port": 5672, "protocol": "TCP"} in r.get("ports", []))
    [peer] = amqp["from"]
    assert set(peer["podSelector"]["matchExpressions"][0]["values"]) <= GPUORCH_PODS and "namespaceSelector" not in peer
    database = next(p for p in backing if _selects(p, {"cnpg.io/cluster": "gpuorch-db"}))
    sql = next(r for r in database["spec"]["ingress"] if {"port": 5432, "protocol": "TCP"} in r.get("ports", []))
    assert set(sql["from"][0]["podSelector"]["matchExpressions"][0]["values"]) <= GPUORCH_PODS - {"executor"}
