"""Prometheus metrics of telemetry.

Per instance (summable across instances): samples ingested, ingest lag, batch sizes, evaluations, alerts published.

Fleet-wide (exported by ONE instance, the holder of a PostgreSQL advisory lock, so that a sum over instances never
double-counts): dcgm-exporter names where the meaning is the same, with dcgm-exporter's labels (``gpu``, ``UUID``,
``device``, ``Hostname``), plus gpuorch's per-job and per-tenant allocation against use and open alerts.

    DCGM_FI_DEV_GPU_UTIL      gauge  %      GPU utilisation
    DCGM_FI_DEV_FB_USED       gauge  MiB    framebuffer memory used
    DCGM_FI_DEV_FB_FREE       gauge  MiB    framebuffer memory free
    DCGM_FI_DEV_GPU_TEMP      gauge  °C     GPU temperature
    DCGM_FI_DEV_POWER_USAGE   gauge  W      power draw
    DCGM_FI_DEV_SM_CLOCK      gauge  MHz    SM clock
(the per-GPU families are rendered to text by PostgreSQL once per refresh and appended by ``serve_metrics``)
    gpuorch_gpu_throttled     gauge  0/1    any throttle reason reported (label ``reason``)
    gpuorch_job_gpus_allocated / gpuorch_job_gpus_used / gpuorch_job_gpus_idle          GPUs (shares count fractionally)
    gpuorch_job_gpu_memory_allocated_bytes / gpuorch_job_gpu_memory_used_bytes
    gpuorch_tenant_gpus_allocated / _used / _idle, gpuorch_tenant_gpu_memory_allocated_bytes / _used_bytes
    gpuorch_telemetry_alerts_open{category,kind,severity}
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from gpuorch_observability import start_metrics_server
from prometheus_client import Counter, Histogram
from prometheus_client.core import REGISTRY, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gpuorch_telemetry.store import IngestOutcome

MIB = 1024 * 1024

SAMPLES_INGESTED = Counter(
    "gpuorch_telemetry_samples_ingested_total", "GpuUsageSampled messages by outcome", ["outcome"]
)
INGEST_LAG = Histogram(
    "gpuorch_telemetry_ingest_lag_seconds", "From a sample's occurred_at to its commit",
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 300),
)
BATCH_SIZE = Histogram(
    "gpuorch_telemetry_ingest_batch_messages", "Messages per ingest transaction",
    buckets=(1, 4, 16, 32, 64, 128, 256, 512),
)
JOBS_EVALUATED = Counter("gpuorch_telemetry_jobs_evaluated_total", "Job evaluations run by this instance")
ALERTS_PUBLISHED = Counter(
    "gpuorch_telemetry_alert_events_published_total", "Alert/recommendation events confirmed", ["type", "kind"]
)


def record_ingest(outcome: IngestOutcome, committed_at: datetime) -> None:
    SAMPLES_INGESTED.labels("applied").inc(outcome.applied)
    SAMPLES_INGESTED.labels("duplicate").inc(outcome.duplicates)
    SAMPLES_INGESTED.labels("out_of_range").inc(outcome.out_of_range)
    BATCH_SIZE.observe(outcome.applied + outcome.duplicates + outcome.out_of_range)
    for occurred_at in outcome.applied_occurred_at:
        INGEST_LAG.observe(max(0.0, (committed_at - occurred_at).total_seconds()))


@dataclass
class FleetSnapshot:
    gpu_text: bytes = b""
    """Per-GPU families, pre-rendered (``TelemetryStore.gpu_metrics_text``)."""
    jobs: list[Any] = field(default_factory=list)
    alerts: list[Any] = field(default_factory=list)
    leader: bool = False


class FleetCollector(Collector):
    """Yields the fleet-wide gauges from the latest snapshot (refreshed by the service, read by scrapes)."""

    def __init__(self) -> None:
        self._snapshots: dict[str, FleetSnapshot] = {}
        self._lock = threading.Lock()

    def update(self, instance: str, snapshot: FleetSnapshot) -> None:
        """Store ``instance``'s latest snapshot (several services may share one process, e.g. in tests)."""
        with self._lock:
            self._snapshots[instance] = snapshot

    def gpu_text(self) -> bytes:
        with self._lock:
            snap = next((s for s in self._snapshots.values() if s.leader), None)
        return snap.gpu_text if snap is not None else b""

    def forget(self, instance: str) -> None:
        with self._lock:
            self._snapshots.pop(instance, None)

    def describe(self) -> Iterator[Metric]:
        """Every family this collector may yield (so ``/metrics?name[]=...`` can skip it when not asked for)."""
        yield from self._families(FleetSnapshot(leader=True))

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            snap = next((s for s in self._snapshots.values() if s.leader), FleetSnapshot())
        yield from self._families(snap)

    @staticmethod
    def _families(snap: FleetSnapshot) -> Iterator[Metric]:
        leader = GaugeMetricFamily(
            "gpuorch_telemetry_metrics_leader", "1 on the instance that exports the fleet-wide gauges"
        )
        leader.add_metric([], 1.0 if snap.leader else 0.0)
        yield leader
        if not snap.leader:
            return
        yield from _job_families(snap.jobs)
        alerts = GaugeMetricFamily(
            "gpuorch_telemetry_alerts_open", "Open alerts and recommendations", labels=["category", "kind", "severity"]
        )
        for r in snap.alerts:
            alerts.add_metric([r["category"], r["kind"], r["severity"]], float(r["n"]))
        yield alerts


DCGM_FAMILIES: tuple[tuple[str, str, str], ...] = (
    ("DCGM_FI_DEV_GPU_UTIL", "GPU utilization (in %).", "util_pct"),
    ("DCGM_FI_DEV_FB_USED", "Framebuffer memory used (in MiB).", "memory_used_mib"),
    ("DCGM_FI_DEV_FB_FREE", "Framebuffer memory free (in MiB).", "memory_total_mib - memory_used_mib"),
    ("DCGM_FI_DEV_GPU_TEMP", "GPU temperature (in C).", "temperature_c"),
    ("DCGM_FI_DEV_POWER_USAGE", "Power draw (in W).", "power_w"),
    ("DCGM_FI_DEV_SM_CLOCK", "SM clock frequency (in MHz).", "sm_clock_mhz"),
)
"""(name, help, SQL expression over the latest sample's columns), rendered by ``TelemetryStore.gpu_metrics_text``."""
THROTTLE_FAMILY = ("gpuorch_gpu_throttled", "1 while the GPU reports this clock event reason (NVML name)")
def _job_families(rows: list[Any]) -> Iterator[Metric]:
    job_labels = ["job_id", "job_name", "tenant", "tier"]
    per_job = {
        "gpus_allocated": GaugeMetricFamily("gpuorch_job_gpus_allocated", "GPUs allocated (shares fractional)",
                                            labels=job_labels),
        "gpus_used": GaugeMetricFamily("gpuorch_job_gpus_used", "GPUs' worth used: allocation x utilisation",
                                       labels=job_labels),
        "gpus_idle": GaugeMetricFamily("gpuorch_job_gpus_idle", "Allocated GPUs idle in the latest sample",
                                       labels=job_labels),
        "memory_allocated_mib": GaugeMetricFamily("gpuorch_job_gpu_memory_allocated_bytes",
                                                  "GPU memory allocated", labels=job_labels),
        "memory_used_mib": GaugeMetricFamily("gpuorch_job_gpu_memory_used_bytes", "GPU memory used",
                                             labels=job_labels),
    }
    tenants: dict[str, dict[str, float]] = {}
    for r in rows:
        labels = [str(r["job_id"]), r["name"], r["tenant"], r["tier"]]
        for key, family in per_job.items():
            value = float(r[key] or 0.0) * (MIB if key.endswith("_mib") else 1)
            family.add_metric(labels, value)
            totals = tenants.setdefault(r["tenant"], {})
            totals[key] = totals.get(key, 0.0) + value
    yield from per_job.values()
    names = {
        "gpus_allocated": ("gpuorch_tenant_gpus_allocated", "GPUs allocated to the tenant's running jobs"),
        "gpus_used": ("gpuorch_tenant_gpus_used", "GPUs' worth used by the tenant's running jobs"),
        "gpus_idle": ("gpuorch_tenant_gpus_idle", "Allocated GPUs idle in the latest sample"),
        "memory_allocated_mib": ("gpuorch_tenant_gpu_memory_allocated_bytes", "GPU memory allocated"),
        "memory_used_mib": ("gpuorch_tenant_gpu_memory_used_bytes", "GPU memory used"),
    }
    for key, (name, doc) in names.items():
        family = GaugeMetricFamily(name, doc, labels=["tenant"])
        for tenant, totals in sorted(tenants.items()):
            family.add_metric([tenant], totals.get(key, 0.0))
        yield family


FLEET = FleetCollector()
_registered = False


def register_fleet_collector() -> FleetCollector:
    """Register the fleet collector in the default registry once per process."""
    global _registered
    if not _registered:
        REGISTRY.register(FLEET)
        _registered = True
    return FLEET


def serve_metrics(port: int, addr: str = "0.0.0.0") -> None:
    """Serve ``/metrics`` (default registry plus the fleet's pre-rendered per-GPU text), ``/healthz`` and
    ``/readyz`` (``gpuorch_observability.start_metrics_server``) in a daemon thread.

    ``?name[]=...`` restricts the registry part to those names (and leaves the per-GPU text out unless one of the
    DCGM names is asked for), as prometheus-client's own server does.
    """
    gpu_names = {name for name, _, _ in DCGM_FAMILIES} | {THROTTLE_FAMILY[0]}

    def gpu_text(names: set[str] | None) -> bytes:
        return FLEET.gpu_text() if names is None or gpu_names & names else b""

    start_metrics_server(port, addr, extra=gpu_text)
