"""deploy/ stays consistent: every YAML parses, Dockerfiles name real workspace members and their console scripts,
compose credentials and node ids match the broker definitions, Prometheus scrapes the ports the services serve,
and the Kubernetes workloads keep their GPU-node and non-root settings."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
YAML_FILES = sorted([*DEPLOY.rglob("*.yaml"), *DEPLOY.rglob("*.yml")])
SERVICE_IMAGES = {"scheduler": "gpuorch-scheduler", "telemetry": "gpuorch-telemetry", "node-agent": "gpuorch-node-agent",
                  "executor": "gpuorch-executor", "gpuctl": "gpuorch-gpuctl", "api": "gpuorch-api"}


def load_all(path: Path) -> list[Any]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def compose() -> dict[str, Any]:
    return load_all(DEPLOY / "compose.yaml")[0]


def k8s_objects() -> list[dict[str, Any]]:
    docs = [doc for path in sorted((DEPLOY / "k8s").glob("*.yaml")) for doc in load_all(path)]
    return [doc for doc in docs if doc["kind"] != "Kustomization"]


def workspace_scripts() -> dict[str, set[str]]:
    """Workspace member name -> its console scripts."""
    members: dict[str, set[str]] = {}
    for pyproject in [*ROOT.glob("libs/*/pyproject.toml"), *ROOT.glob("services/*/pyproject.toml")]:
        project = tomllib.loads(pyproject.read_text())["project"]
        members[project["name"]] = set(project.get("scripts", {}))
    return members


def test_yaml_files_exist_and_parse() -> None:
    assert len(YAML_FILES) >= 10
    for path in YAML_FILES:
        assert load_all(path), f"{path} is empty"


@pytest.mark.parametrize("image", sorted(SERVICE_IMAGES))
def test_dockerfile_syncs_a_workspace_member_and_runs_its_script(image: str) -> None:
    dockerfile = (DEPLOY / "docker" / f"{image}.Dockerfile").read_text()
    package = re.search(r"uv sync --frozen --no-dev --no-editable --package (\S+)", dockerfile)
    entrypoint = re.search(r'^ENTRYPOINT \["([^"]+)"\]$', dockerfile, re.MULTILINE)
    assert package and entrypoint
    assert package.group(1) == SERVICE_IMAGES[image]
    assert entrypoint.group(1) in workspace_scripts()[package.group(1)]
    assert re.search(r"^USER 10001:10001$", dockerfile, re.MULTILINE), "runtime stage must not run as root"
    assert (DEPLOY / "docker" / f"{image}.Dockerfile.dockerignore").exists()


def test_gpu_images_ask_the_nvidia_toolkit_for_the_right_driver_parts() -> None:
    agent = (DEPLOY / "docker" / "node-agent.Dockerfile").read_text()
    executor = (DEPLOY / "docker" / "executor.Dockerfile").read_text()
    assert "NVIDIA_VISIBLE_DEVICES=all" in agent and "NVIDIA_DRIVER_CAPABILITIES=utility" in agent
    assert "NVIDIA_DRIVER_CAPABILITIES=compute,utility" in executor
    assert "AS container" in executor and "/usr/local/bin/docker" in executor


def compose_url(url: str) -> str:
    """A compose URL whose password is ``${VAR:?why}`` (deploy/compose-secrets.py), with the variable's name as
    its password; a literal password is left as it is (and fails the caller's check)."""
    return re.sub(r":\$\{(\w+):\?[^}]*\}@", r":\1@", url)


def test_compose_services_log_in_as_users_of_the_definitions_with_their_own_queues() -> None:
    from tests.deploy.broker_users import gen

    definitions = json.loads((DEPLOY / "rabbitmq" / "definitions.json").read_text())
    users = {u["name"] for u in definitions["users"]}
    permissions = {p["user"]: p for p in definitions["permissions"]}
    services = compose()["services"]
    for name, service in services.items():
        url = service.get("environment", {}).get("GPUORCH_AMQP_URL")
        if url is None:
            continue
        parts = urlsplit(compose_url(url))
        assert parts.username in users, f"{name} logs in as unknown user {parts.username}"
        assert parts.password == gen.password_variable(parts.username), f"{name}: not a generated password"
        assert parts.path == "/" + definitions["vhosts"][0]["name"]
        assert parts.username not in ("admin", "guest"), f"{name} must use its own least-privilege user"
    executor = services["executor"]["environment"]
    read = permissions[urlsplit(compose_url(executor["GPUORCH_AMQP_URL"])).username]["read"]
    for node in executor["GPUORCH_NODE_IDS"].split(","):
        assert re.search(read, f"executor.{node}"), f"executor user may not consume executor.{node}"
    agent = services["node-agent"]["environment"]
    read = permissions[urlsplit(compose_url(agent["GPUORCH_AMQP_URL"])).username]["read"]
    assert re.search(read, f"node-agent.fleet.{agent['GPUORCH_FLEET_NAME']}")


def test_prometheus_scrapes_the_metrics_ports_compose_sets() -> None:
    config = load_all(DEPLOY / "prometheus" / "prometheus.yml")[0]
    targets = {t for job in config["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    for name, service in compose()["services"].items():
        port = service.get("environment", {}).get("GPUORCH_METRICS_PORT")
        if port:
            assert f"{name}:{port}" in targets


def test_kubernetes_workloads_run_on_gpu_nodes_and_as_non_root() -> None:
    objects = k8s_objects()
    kinds = {(o["kind"], o["metadata"]["name"]) for o in objects}
    assert {("Deployment", "scheduler"), ("Deployment", "telemetry"), ("DaemonSet", "executor"),
            ("DaemonSet", "node-agent"), ("Namespace", "gpuorch")} <= kinds
    workloads = [o for o in objects if o["kind"] in ("Deployment", "DaemonSet", "Job")]
    for workload in workloads:
        pod = workload["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["automountServiceAccountToken"] is False
        for container in pod["containers"]:
            assert container["securityContext"]["allowPrivilegeEscalation"] is False
            assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]
        if workload["kind"] == "DaemonSet":
            assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
            assert pod["runtimeClassName"] == "nvidia"
            assert "all-credentials" not in {m["name"] for c in pod["containers"] for m in c.get("volumeMounts", [])}
    scheduler = next(o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == "scheduler")
    assert scheduler["spec"]["replicas"] == 2
    metrics_services = [o for o in objects if o["kind"] == "Service" and o["metadata"]["name"].endswith("-metrics")]
    assert {o["metadata"]["labels"]["app.kubernetes.io/name"] for o in metrics_services} == {
        "scheduler", "telemetry", "executor", "node-agent", "api"}, "every service's metrics port has a Service"
    for service in metrics_services:
        annotations = service["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true"
        assert int(annotations["prometheus.io/port"]) == service["spec"]["ports"][0]["port"]
    listed = set(load_all(DEPLOY / "k8s" / "kustomization.yaml")[0]["resources"])
    assert listed == {p.name for p in (DEPLOY / "k8s").glob("*.yaml")} - {"kustomization.yaml"}


def test_docker_compose_accepts_the_file() -> None:
    docker = shutil.which("docker")
    if docker is None or subprocess.run([docker, "compose", "version"], capture_output=True).returncode != 0:
        pytest.skip("no docker compose client here")
    result = subprocess.run([docker, "compose", "-f", str(DEPLOY / "compose.yaml"), "config", "--quiet"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_kubernetes_credentials_match_the_definitions_and_the_daemonsets(tmp_path: Path) -> None:
    from tests.deploy.broker_users import gen

    secrets_path, definitions_path = tmp_path / "secrets.yaml", tmp_path / "definitions.json"
    gen.main(["--gpu-node", "gpu-a", "--gpu-node", "gpu-b", "--generate-passwords",
              "--k8s-secrets", str(secrets_path), "--output", str(definitions_path)])
    definitions = json.loads(definitions_path.read_text())
    hashes = {u["name"]: u["password_hash"] for u in definitions["users"]}
    reads = {p["user"]: p["read"] for p in definitions["permissions"]}
    secrets = {doc["metadata"]["name"]: doc["stringData"] for doc in load_all(secrets_path)}
    for user, password in secrets["gpuorch-node-credentials"].items():
        assert gen.password_hash(user, password) == hashes[user]
        role, node = re.fullmatch(r"(executor|node-agent)-(gpu-[ab])", user).groups()  # type: ignore[union-attr]
        assert re.search(reads[user], f"{role}.{node}") and not re.search(reads[user], f"{role}.gpu-c")
    for user, url in secrets["gpuorch-amqp"].items():
        parts = urlsplit(url)
        assert parts.username == user and gen.password_hash(user, parts.password) == hashes[user]
    assert len(set(secrets["gpuorch-node-credentials"].values())) == 4  # generated, not shared
    # the DaemonSets build the user name as <role>-<node name> and read the key of the same name
    for name in ("executor", "node-agent"):
        pod = next(o for o in k8s_objects() if o["kind"] == "DaemonSet" and o["metadata"]["name"] == name)
        script = " ".join(pod["spec"]["template"]["spec"]["containers"][0]["command"])
        copy = " ".join(pod["spec"]["template"]["spec"]["initContainers"][-1]["command"])
        assert f"amqp://{name}-${{GPUORCH_NODE_ID}}:" in script and f"/credentials/all/{name}-${{NODE_NAME}}" in copy


def test_jobs_get_uids_of_their_own_and_never_reach_the_docker_socket() -> None:
    """Issue 13: the process-backend executor may hand out job uids (root with only the capabilities for it); no
    manifest mounts the docker socket where a job runs; the container-backend image runs no process job and asks
    the NVIDIA toolkit for no GPU (each job's container gets exactly its own)."""
    objects = k8s_objects()
    for workload in (o for o in objects if o["kind"] in ("Deployment", "DaemonSet", "Job")):
        pod = workload["spec"]["template"]["spec"]
        host_paths = [v["hostPath"]["path"] for v in pod.get("volumes", []) if "hostPath" in v]
        assert not any("docker.sock" in p for p in host_paths), workload["metadata"]["name"]
    executor = next(o for o in objects if o["kind"] == "DaemonSet" and o["metadata"]["name"] == "executor")
    [container] = executor["spec"]["template"]["spec"]["containers"]
    context = container["securityContext"]
    assert context["runAsUser"] == 0 and context["allowPrivilegeEscalation"] is False
    assert set(context["capabilities"]["add"]) == {"SETUID", "SETGID", "CHOWN", "FOWNER", "KILL", "DAC_OVERRIDE"}
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["GPUORCH_EXECUTOR_JOB_UIDS"] == "61000-61063" and env["GPUORCH_EXECUTOR_BACKEND"] == "process"
    dockerfile = (DEPLOY / "docker" / "executor.Dockerfile").read_text()
    container_stage = dockerfile.split("FROM runtime AS container", 1)[1].split("FROM ", 1)[0]
    assert "GPUORCH_EXECUTOR_BACKEND=container " in container_stage  # no process job beside the socket
    assert "NVIDIA_VISIBLE_DEVICES=void" in container_stage
    compose_text = (DEPLOY / "compose.yaml").read_text()
    socket_lines = [line for line in compose_text.splitlines() if "docker.sock" in line]
    assert all(line.lstrip().startswith("#") for line in socket_lines)  # only in the commented GPU variant
    assert "GPUORCH_EXECUTOR_BACKEND: container " in compose_text
