"""The Grafana dashboards of deploy/grafana/dashboards/, as code (one place for the queries; the JSON is generated).

    uv run python deploy/grafana/make_dashboards.py          # rewrite deploy/grafana/dashboards/*.json
    uv run python deploy/grafana/make_dashboards.py --check  # exit 1 if a checked-in file differs

Dashboards (folder "gpuorch"; data sources of provisioning/datasources: Prometheus uid ``prometheus``, Jaeger uid
``jaeger``):

- ``gpuorch-fleet``: utilisation and memory per GPU and MIG slice (dcgm-exporter names and labels, so NVIDIA's
  DCGM dashboard reads the same series), temperature, power, throttling; nodes by liveness.
- ``gpuorch-tenants``: allocation against use per tenant, quota use against nominal quota, idle GPU-hours.
- ``gpuorch-queues``: queue depth and admission wait per tier and tenant, running jobs, evictions, preemptions.
- ``gpuorch-scheduler``: decision latency and throughput, batches, the outbox, dead letters, executor launches and
  failures by cause, node-agent heartbeat lag.
- ``gpuorch-alerts``: firing alerts (Prometheus rules of deploy/prometheus/alerts.yml) and telemetry's open
  findings.
- ``gpuorch-job``: one job (variable ``job_id``): its traces in Jaeger (one click to the trace) and its GPU use.
  Every table with a ``job_id`` column links here.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
OUT = HERE / "dashboards"
PROMETHEUS = {"type": "prometheus", "uid": "prometheus"}
JAEGER = {"type": "jaeger", "uid": "jaeger"}
JOB_LINK = {"title": "This job: traces and GPU use", "url": "/d/gpuorch-job/gpuorch-job?var-job_id=${__data.fields.job_id}"}


class Layout:
    """Places panels left to right, 24 columns wide, wrapping rows."""

    def __init__(self) -> None:
        self.x = self.y = self.row_height = 0
        self.next_id = 1

    def place(self, panel: dict[str, Any], w: int, h: int) -> dict[str, Any]:
        if self.x + w > 24:
            self.x, self.y, self.row_height = 0, self.y + self.row_height, 0
        panel.update(id=self.next_id, gridPos={"x": self.x, "y": self.y, "w": w, "h": h})
        self.next_id += 1
        self.x += w
        self.row_height = max(self.row_height, h)
        return panel


def targets(*queries: tuple[str, str], instant: bool = False, table: bool = False) -> list[dict[str, Any]]:
    return [{"refId": chr(ord("A") + k), "datasource": PROMETHEUS, "expr": expr, "legendFormat": legend,
             **({"instant": True, "range": False} if instant else {}), **({"format": "table"} if table else {})}
            for k, (expr, legend) in enumerate(queries)]


def timeseries(title: str, *queries: tuple[str, str], unit: str = "short", description: str = "",
               stack: bool = False) -> dict[str, Any]:
    return {"type": "timeseries", "title": title, "description": description, "datasource": PROMETHEUS,
            "targets": targets(*queries),
            "fieldConfig": {"defaults": {"unit": unit, "custom": {
                "fillOpacity": 20 if stack else 0, "stacking": {"mode": "normal" if stack else "none"}}},
                "overrides": []},
            "options": {"legend": {"displayMode": "table", "placement": "right", "calcs": ["lastNotNull", "max"]},
                        "tooltip": {"mode": "multi"}}}


def stat(title: str, expr: str, unit: str = "short", description: str = "") -> dict[str, Any]:
    return {"type": "stat", "title": title, "description": description, "datasource": PROMETHEUS,
            "targets": targets((expr, "")), "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "options": {"reduceOptions": {"calcs": ["lastNotNull"]}, "colorMode": "value", "graphMode": "area"}}


def table(title: str, expr: str, columns: list[str], description: str = "") -> dict[str, Any]:
    """An instant query as a table of its ``columns`` labels and its value; a ``job_id`` column links to the job."""
    panel: dict[str, Any] = {
        "type": "table", "title": title, "description": description, "datasource": PROMETHEUS,
        "targets": targets((expr, ""), instant=True, table=True),
        "transformations": [{"id": "organize", "options": {
            "excludeByName": {"Time": True},
            "indexByName": {name: k for k, name in enumerate([*columns, "Value"])}}},
            {"id": "filterFieldsByName", "options": {"include": {"names": [*columns, "Value"]}}}],
        "fieldConfig": {"defaults": {}, "overrides": []}, "options": {"showHeader": True}}
    if "job_id" in columns:
        panel["fieldConfig"]["overrides"].append({
            "matcher": {"id": "byName", "options": "job_id"},
            "properties": [{"id": "links", "value": [JOB_LINK]}]})
    return panel


def dashboard(uid: str, title: str, description: str, panels: list[tuple[dict[str, Any], int, int]],
              variables: list[dict[str, Any]] | None = None, time_from: str = "now-6h") -> dict[str, Any]:
    layout = Layout()
    return {
        "uid": uid, "title": title, "description": description, "tags": ["gpuorch"], "editable": False,
        "schemaVersion": 39, "version": 1, "refresh": "30s", "time": {"from": time_from, "to": "now"},
        "timezone": "utc", "templating": {"list": variables or []},
        "annotations": {"list": []},
        "links": [{"type": "dashboards", "tags": ["gpuorch"], "asDropdown": True, "title": "gpuorch"}],
        "panels": [layout.place(panel, w, h) for panel, w, h in panels],
    }


def query_variable(name: str, label: str, query: str) -> dict[str, Any]:
    return {"type": "query", "name": name, "label": label, "datasource": PROMETHEUS,
            "query": {"query": query, "refId": name}, "definition": query, "refresh": 2, "includeAll": True,
            "multi": True, "current": {"text": "All", "value": "$__all"}, "allValue": ".*", "sort": 1}


def fleet() -> dict[str, Any]:
    on = '{Hostname=~"$node"}'
    return dashboard("gpuorch-fleet", "gpuorch / Fleet", "GPU utilisation and memory per GPU and MIG slice "
                     "(dcgm-exporter names: DCGM_FI_DEV_*), nodes by liveness", [
        (stat("GPUs reporting", f"count(DCGM_FI_DEV_GPU_UTIL{on})"), 4, 4),
        (stat("Mean utilisation", f"avg(DCGM_FI_DEV_GPU_UTIL{on})", "percent"), 4, 4),
        (stat("Memory in use", f"sum(DCGM_FI_DEV_FB_USED{on}) / (sum(DCGM_FI_DEV_FB_USED{on}) + "
              f"sum(DCGM_FI_DEV_FB_FREE{on}))", "percentunit"), 4, 4),
        (stat("Nodes alive", 'max(gpuorch_scheduler_nodes{liveness="alive"})'), 4, 4),
        (stat("Nodes suspect or lost", 'sum(max by (liveness) (gpuorch_scheduler_nodes{liveness!="alive"}))'), 4, 4),
        (stat("GPUs throttled", 'count(max by (Hostname, UUID) (gpuorch_gpu_throttled{reason!="gpu_idle"}))'), 4, 4),
        (timeseries("Utilisation per GPU and MIG slice", (f"DCGM_FI_DEV_GPU_UTIL{on}", "{{Hostname}} gpu{{gpu}} "
                    "{{UUID}}"), unit="percent", description="A MIG slice is a series of its own (its UUID)."),
         12, 9),
        (timeseries("Memory used per GPU and MIG slice", (f"DCGM_FI_DEV_FB_USED{on} * 1048576",
                                                          "{{Hostname}} gpu{{gpu}} {{UUID}}"), unit="bytes"), 12, 9),
        (timeseries("Memory used, share of each GPU",
                    (f"DCGM_FI_DEV_FB_USED{on} / (DCGM_FI_DEV_FB_USED{on} + DCGM_FI_DEV_FB_FREE{on})",
                     "{{Hostname}} gpu{{gpu}}"), unit="percentunit"), 12, 8),
        (timeseries("Temperature", (f"DCGM_FI_DEV_GPU_TEMP{on}", "{{Hostname}} gpu{{gpu}}"), unit="celsius"), 6, 8),
        (timeseries("Power", (f"DCGM_FI_DEV_POWER_USAGE{on}", "{{Hostname}} gpu{{gpu}}"), unit="watt"), 6, 8),
        (timeseries("Throttle reasons", (f"gpuorch_gpu_throttled{on}", "{{Hostname}} gpu{{gpu}} {{reason}}")),
         12, 8),
        (timeseries("Nodes by liveness", ("max by (liveness) (gpuorch_scheduler_nodes)", "{{liveness}}"),
                    stack=True), 12, 8),
    ], [query_variable("node", "Node", "label_values(DCGM_FI_DEV_GPU_UTIL, Hostname)")])


def tenants() -> dict[str, Any]:
    on = '{tenant=~"$tenant"}'
    return dashboard("gpuorch-tenants", "gpuorch / Tenants: allocation and use", "What each tenant holds, uses "
                     "and leaves idle, and its quota", [
        (timeseries("GPUs allocated vs used, per tenant",
                    (f"sum by (tenant) (gpuorch_job_gpus_allocated{on})", "{{tenant}} allocated"),
                    (f"sum by (tenant) (gpuorch_job_gpus_used{on})", "{{tenant}} used"),
                    description="used = allocation x utilisation (telemetry)"), 12, 9),
        (timeseries("Quota use vs nominal quota (GPUs)",
                    ('gpuorch_cluster_queue_resource_usage{resource="nvidia.com/gpu", cluster_queue=~"$tenant"}',
                     "{{cluster_queue}} in use"),
                    ('gpuorch_cluster_queue_nominal_quota{resource="nvidia.com/gpu", cluster_queue=~"$tenant"}',
                     "{{cluster_queue}} quota"),
                    description="Kueue's names: cluster_queue is the tenant"), 12, 9),
        (timeseries("GPU memory allocated vs used, per tenant",
                    (f"sum by (tenant) (gpuorch_job_gpu_memory_allocated_bytes{on})", "{{tenant}} allocated"),
                    (f"sum by (tenant) (gpuorch_job_gpu_memory_used_bytes{on})", "{{tenant}} used"), unit="bytes"),
         12, 8),
        (timeseries("Idle GPU-hours over the last 24 h, per tenant",
                    (f"sum by (tenant) (sum_over_time(gpuorch_job_gpus_idle{on}[24h:1m])) / 60", "{{tenant}}"),
                    unit="short", description="Allocated GPUs idle, summed minute by minute, in GPU-hours"), 12, 8),
        (table("Jobs holding idle GPUs now", f"sum by (job_id, job_name, tenant, tier) (gpuorch_job_gpus_idle{on}) > 0",
               ["job_id", "job_name", "tenant", "tier"]), 24, 8),
    ], [query_variable("tenant", "Tenant", "label_values(gpuorch_job_gpus_allocated, tenant)")], "now-24h")


def queues() -> dict[str, Any]:
    on = '{cluster_queue=~"$tenant", tier=~"$tier"}'
    wait = f"sum by (le, tier) (rate(gpuorch_admission_wait_time_seconds_bucket{on}[5m]))"
    return dashboard("gpuorch-queues", "gpuorch / Queues", "Queue depth and admission wait per tier and tenant "
                     "(Kueue's metric names and labels, gpuorch_ for kueue_)", [
        (stat("Jobs waiting", f"sum(gpuorch_pending_workloads{on})"), 6, 4),
        (stat("Jobs running", f"sum(gpuorch_admitted_active_workloads{on})"), 6, 4),
        (stat("Admission wait p95 (5m)", f"histogram_quantile(0.95, sum by (le) (rate("
              f"gpuorch_admission_wait_time_seconds_bucket{on}[5m])))", "s"), 6, 4),
        (stat("Evictions (1h)", "sum(increase(gpuorch_evicted_workloads_total{cluster_queue=~\"$tenant\"}[1h]))"),
         6, 4),
        (timeseries("Queue depth per tier", (f"sum by (tier) (gpuorch_pending_workloads{on})", "{{tier}}"),
                    stack=True), 12, 8),
        (timeseries("Queue depth per tenant", (f"sum by (cluster_queue) (gpuorch_pending_workloads{on})",
                                               "{{cluster_queue}}"), stack=True), 12, 8),
        (timeseries("Admission wait per tier (p50, p95)", (f"histogram_quantile(0.5, {wait})", "{{tier}} p50"),
                    (f"histogram_quantile(0.95, {wait})", "{{tier}} p95"), unit="s"), 12, 8),
        (timeseries("Running jobs per tier", (f"sum by (tier) (gpuorch_admitted_active_workloads{on})", "{{tier}}"),
                    stack=True), 12, 8),
        (timeseries("Admissions per second, per tenant", ("sum by (cluster_queue) (rate(gpuorch_admitted_workloads_"
                                                          "total{cluster_queue=~\"$tenant\"}[5m]))",
                                                          "{{cluster_queue}}"), unit="ops"), 12, 8),
        (timeseries("Evictions per hour, by reason", ("sum by (reason) (increase(gpuorch_evicted_workloads_total"
                                                      "{cluster_queue=~\"$tenant\"}[1h]))", "{{reason}}")), 12, 8),
        (timeseries("Preemptions per hour, by the tenant they made room for",
                    ("sum by (preempting_cluster_queue, reason) (increase(gpuorch_preempted_workloads_total"
                     "{preempting_cluster_queue=~\"$tenant\"}[1h]))", "{{preempting_cluster_queue}} {{reason}}")),
         12, 8),
    ], [query_variable("tenant", "Tenant", "label_values(gpuorch_pending_workloads, cluster_queue)"),
        query_variable("tier", "Tier", "label_values(gpuorch_pending_workloads, tier)")])


def scheduler() -> dict[str, Any]:
    def quantiles(metric: str, by: str = "") -> list[tuple[str, str]]:
        return [(f"histogram_quantile({q}, sum by (le{by}) (rate({metric}_bucket[5m])))", f"p{int(q * 100)}")
                for q in (0.5, 0.99)]

    return dashboard("gpuorch-scheduler", "gpuorch / Scheduler: decisions and pipeline", "Decision latency and "
                     "throughput, the outbox, dead letters, launches and node-agent heartbeats", [
        (timeseries("Scheduling cycle (pure decision) latency", *quantiles("gpuorch_scheduler_decision_seconds"),
                    ("gpuorch_e2e_scheduling_latency_milliseconds / 1000", "last cycle"), unit="s"), 8, 8),
        (timeseries("Submission -> placement (first placements)",
                    *quantiles("gpuorch_task_scheduling_latency_milliseconds"), unit="ms"), 8, 8),
        (timeseries("Batch (transaction) time", *quantiles("gpuorch_scheduler_batch_seconds"), unit="s"), 8, 8),
        (timeseries("Throughput", ("sum(rate(gpuorch_admitted_workloads_total[5m]))", "placements/s"),
                    ("sum(rate(gpuorch_messages_consumed_total{queue=~\"scheduler.*\"}[5m]))", "messages/s"),
                    unit="ops"), 12, 8),
        (timeseries("Outbox", ("max(gpuorch_outbox_unsent_rows)", "unsent rows"),
                    ("max(gpuorch_outbox_oldest_unsent_seconds)", "oldest unsent (s)"),
                    ("max(gpuorch_outbox_parked_rows)", "parked rows")), 12, 8),
        (timeseries("Dead letters per queue (10m)", ("sum by (queue, cause) (increase(gpuorch_messages_dead_"
                                                     "lettered_total[10m]))", "{{queue}} {{cause}}")), 12, 8),
        (timeseries("Plans refused, preemptions, requeues (1h)",
                    ("sum(increase(gpuorch_scheduler_plans_refused_total[1h]))", "plans refused"),
                    ("sum(increase(gpuorch_scheduler_preemptions_total[1h]))", "preemptions"),
                    ("sum by (cause) (increase(gpuorch_scheduler_requeues_total[1h]))", "requeued: {{cause}}")),
         12, 8),
        (timeseries("Executor launches per second", ("sum by (node_id) (rate(gpuorch_executor_launches_total[5m]))",
                                                     "{{node_id}}"), unit="ops"), 8, 8),
        (timeseries("Executor failures by cause (1h)", ('sum by (cause) (increase(gpuorch_executor_outcomes_total'
                                                        '{outcome!="finished"}[1h]))', "{{cause}}")), 8, 8),
        (timeseries("Launch latency", *quantiles("gpuorch_executor_launch_seconds"), unit="s"), 8, 8),
        (timeseries("Node-agent heartbeat lag", ("max by (quantile) (gpuorch_node_agent_heartbeat_lag_seconds)",
                                                 "q{{quantile}}"), unit="s"), 12, 8),
        (timeseries("NVML errors and unconfirmed publishes (1h)",
                    ("sum by (function) (increase(gpuorch_node_agent_nvml_errors_total[1h]))", "NVML {{function}}"),
                    ("sum(increase(gpuorch_node_agent_nvml_event_failures_total[1h]))", "NVML event failures"),
                    ("sum(increase(gpuorch_node_agent_publish_failures_total[1h]))", "publishes not confirmed")),
         12, 8),
    ])


def alerts() -> dict[str, Any]:
    return dashboard("gpuorch-alerts", "gpuorch / Alerts", "Prometheus alerts of deploy/prometheus/alerts.yml and "
                     "telemetry's open findings", [
        (table("Firing alerts", 'ALERTS{alertstate="firing", alertname=~"Gpuorch.*"}',
               ["alertname", "severity", "queue", "Hostname", "gpu", "job_id", "job_name", "tenant"]), 24, 8),
        (timeseries("Alerts firing", ('sum by (alertname) (ALERTS{alertstate="firing", alertname=~"Gpuorch.*"})',
                                      "{{alertname}}"), stack=True), 12, 8),
        (timeseries("Telemetry's open findings", ("sum by (category, kind) (gpuorch_telemetry_alerts_open)",
                                                  "{{category}} {{kind}}"), stack=True), 12, 8),
    ])


def job() -> dict[str, Any]:
    traces = {"type": "table", "title": "Traces of this job (Jaeger): click a trace id",
              "description": "Every span of a job carries job_id; the trace shows admission, the decision, the "
                             "commit, the outbox publish, the launch and the run.",
              "datasource": JAEGER,
              "targets": [{"refId": "A", "datasource": JAEGER, "queryType": "search", "service": "gpuorch-scheduler",
                           "tags": "job_id=$job_id", "limit": 20}],
              "fieldConfig": {"defaults": {}, "overrides": []}, "options": {"showHeader": True}}
    on = '{job_id="$job_id"}'
    return dashboard("gpuorch-job", "gpuorch / Job", "One job: its traces and its GPU use", [
        (traces, 24, 8),
        (timeseries("GPUs allocated, used, idle", (f"sum(gpuorch_job_gpus_allocated{on})", "allocated"),
                    (f"sum(gpuorch_job_gpus_used{on})", "used"), (f"sum(gpuorch_job_gpus_idle{on})", "idle")), 12, 8),
        (timeseries("GPU memory allocated vs used", (f"sum(gpuorch_job_gpu_memory_allocated_bytes{on})", "allocated"),
                    (f"sum(gpuorch_job_gpu_memory_used_bytes{on})", "used"), unit="bytes"), 12, 8),
    ], [{"type": "textbox", "name": "job_id", "label": "Job id", "query": "", "current": {"text": "", "value": ""}}],
        "now-24h")


DASHBOARDS = {"gpuorch-fleet": fleet, "gpuorch-tenants": tenants, "gpuorch-queues": queues,
              "gpuorch-scheduler": scheduler, "gpuorch-alerts": alerts, "gpuorch-job": job}


def rendered() -> dict[str, str]:
    """File name -> JSON text of every dashboard."""
    return {f"{uid}.json": json.dumps(make(), indent=2, sort_keys=True) + "\n" for uid, make in DASHBOARDS.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare with the checked-in files; write nothing")
    args = parser.parse_args(argv)
    files = rendered()
    if args.check:
        stale = [name for name, text in files.items()
                 if not (OUT / name).exists() or (OUT / name).read_text() != text]
        extra = sorted({p.name for p in OUT.glob("*.json")} - set(files))
        for name in [*stale, *extra]:
            print(f"deploy/grafana/dashboards/{name} is stale: run deploy/grafana/make_dashboards.py", file=sys.stderr)
        return 1 if stale or extra else 0
    OUT.mkdir(exist_ok=True)
    for name, text in files.items():
        (OUT / name).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
