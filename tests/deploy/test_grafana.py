"""Grafana as deployed: the dashboards are the generator's output, their queries parse (promtool) and read only
metrics that gpuorch exports (or dcgm-exporter's names it keeps), their data sources are provisioned, and compose
and Kubernetes both provision them."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
GRAFANA = ROOT / "deploy" / "grafana"
DASHBOARDS = sorted((GRAFANA / "dashboards").glob("*.json"))
SOURCES = [*ROOT.glob("libs/*/src/**/*.py"), *ROOT.glob("services/*/src/**/*.py")]
PROMQL_WORDS = {"sum", "by", "max", "min", "avg", "count", "rate", "increase", "histogram_quantile", "le", "on",
                "sum_over_time", "avg_over_time", "clamp_min", "and", "or", "unless", "without", "bool", "offset"}


def exported_metrics() -> set[str]:
    """Names gpuorch's code exports: metric names in its source, with the suffixes Prometheus adds."""
    names: set[str] = set()
    for path in SOURCES:
        names.update(re.findall(r'"((?:gpuorch_|DCGM_FI_)[a-z0-9_A-Z]+)"', path.read_text()))
    names.update(f"gpuorch_node_agent_{n}_total" for n in (
        "heartbeats", "registrations", "usage_samples", "health_events", "publish_failures", "nvml_event_failures"))
    return names | {f"{n}{suffix}" for n in names for suffix in ("_bucket", "_count", "_sum", "_total")}


def expressions() -> list[tuple[str, str]]:
    found = []
    for path in DASHBOARDS:
        for panel in json.loads(path.read_text())["panels"]:
            for target in panel.get("targets", []):
                if "expr" in target:
                    found.append((f"{path.name}: {panel['title']}", target["expr"]))
    return found


def metric_names(expr: str) -> set[str]:
    without_groupings = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    without_labels = re.sub(r"\{[^}]*\}", "", re.sub(r'"[^"]*"', "", without_groupings))
    without_ranges = re.sub(r"\[[^\]]*\]", "", without_labels)
    words = set(re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", without_ranges))
    return {w for w in words if w not in PROMQL_WORDS and w != "ALERTS" and not w.startswith("__")
            and not re.fullmatch(r"e\d*", w)}


def test_dashboards_are_the_generators_output() -> None:
    result = subprocess.run(["python", str(GRAFANA / "make_dashboards.py"), "--check"], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert {p.stem for p in DASHBOARDS} >= {"gpuorch-fleet", "gpuorch-tenants", "gpuorch-queues",
                                             "gpuorch-scheduler", "gpuorch-alerts", "gpuorch-job"}


def test_queries_read_metrics_that_gpuorch_exports() -> None:
    exported = exported_metrics()
    alert_exprs = [(f"alerts.yml: {r['alert']}", r["expr"]) for g in yaml.safe_load(
        (ROOT / "deploy" / "prometheus" / "alerts.yml").read_text())["groups"] for r in g["rules"]]
    for where, expr in [*expressions(), *alert_exprs]:
        unknown = metric_names(expr) - exported
        assert not unknown, f"{where} reads {unknown}, which no gpuorch code exports"


def test_queries_parse_as_promql(tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian package prometheus; .ci/run installs it)")
    rules = [{"record": f"dashboard:query_{k}", "expr": re.sub(r"\$\w+", ".*", expr)}
             for k, (_, expr) in enumerate(expressions())]
    path = tmp_path / "dashboards.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboards", "rules": rules}]}))
    result = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_data_sources_are_provisioned_and_dashboards_use_only_them() -> None:
    provisioned = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "gpuorch.yaml").read_text())
    uids = {source["uid"] for source in provisioned["datasources"]}
    assert {"prometheus", "jaeger"} <= uids
    used: set[str] = set()

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("datasource"), dict):
                used.add(node["datasource"]["uid"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    for path in DASHBOARDS:
        walk(json.loads(path.read_text()))
    assert used <= uids and "jaeger" in used, "a job's traces are one click away: some panel reads Jaeger"


def test_compose_provisions_grafana_from_deploy_grafana() -> None:
    compose = yaml.safe_load((ROOT / "deploy" / "compose.yaml").read_text())
    grafana = compose["services"]["grafana"]
    mounts = {volume.split(":")[1]: volume.split(":")[0] for volume in grafana["volumes"]}
    assert (ROOT / "deploy" / mounts["/etc/grafana/provisioning"]).resolve() == GRAFANA / "provisioning"
    assert (ROOT / "deploy" / mounts["/var/lib/grafana/dashboards"]).resolve() == GRAFANA / "dashboards"
    provider = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "gpuorch.yaml").read_text())
    assert provider["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert (GRAFANA / "dashboards" / Path(home).name).exists()
