"""The weekly review as one typed document: what ``GET /api/v1/report`` answers (its OpenAPI schema), what
``gpuctl report --json`` prints and what its tables, CSV and charts are drawn from.

    WeeklyReport
        period (since, start, end, generated_at), scope (tenant, tenants)
        tenants       TenantUse per tenant: allocated vs used GPU-hours, idle, energy          (most idle first)
        jobs          JobUse per job: GPUs and memory allocated vs used, mean/p95 utilisation,  (most idle first)
                      idle GPU-hours, telemetry's detections and advice
        tenant_series utilisation of each tenant's allocation over time  \\  the utilisation chart
        fleet_series  utilisation of every GPU over time                 /  (series_source says from what)
        queue_waits   wait by request shape and tier
        conclusions   what to change (``findings``)

Fleet-wide lines (``fleet_series``, throttling and autoscaler conclusions) name nodes and pools, never another
tenant's jobs; everything else is limited to the report's tenants.
"""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, Field


class TenantUse(BaseModel):
    tenant: str
    jobs: int = 0
    allocated_gpu_hours: float = 0.0
    used_gpu_hours: float = 0.0
    """Allocation x utilisation."""
    idle_gpu_hours: float = 0.0
    energy_kwh: float = 0.0
    use_pct: float | None = None
    """Used / allocated GPU-hours, in percent (None with nothing allocated)."""
    parked_gpu_hours: float = 0.0
    """GPU-hours its interactive sessions gave back by being parked while idle (docs/sessions.md)."""
    parks: int = 0


class JobUse(BaseModel):
    job_id: str
    name: str
    tenant: str
    tier: str
    state: str
    devices: int
    gpus: float | None
    alloc_memory_mib_per_gpu: int | None
    peak_memory_mib_per_gpu: int | None
    mean_util_pct: float | None
    p95_util_pct: float | None
    allocated_gpu_hours: float | None
    used_gpu_hours: float | None
    idle_gpu_hours: float | None
    energy_kwh: float | None
    detections: str = ""
    """Telemetry's detections about the job in the period, comma-separated (``idle, oversized``)."""
    advice: str = ""


class TenantPoint(BaseModel):
    bucket: datetime
    tenant: str
    util_pct: float | None
    """Utilisation of the tenant's allocation (weighted by the GPU share each job holds)."""
    gpus_allocated: float | None


class FleetPoint(BaseModel):
    bucket: datetime
    util_pct: float | None
    gpus: int


class QueueWait(BaseModel):
    shape: str
    """The request in words: ``4 GPUs (H100-80GB)``, ``share 250m``, ``MIG 1g.10gb``."""
    tier: str
    jobs: int
    waited: int
    """Jobs of this shape with a wait (placed, or still queued)."""
    mean_wait_s: float
    max_wait_s: float
    queued_now: int
    never_fits: int
    reason: str


class Conclusion(BaseModel):
    kind: str
    """idle_gpus | idle_reservation | right_size | share_size | short_of | throttling | autoscaler | parked_sessions"""
    subject: str
    text: str
    gpu_hours: float | None = None
    gpus_freed: float | None = None


class WeeklyReport(BaseModel):
    since: str
    start: datetime
    end: datetime
    generated_at: datetime
    tenant: str | None = None
    """The one tenant asked for (``--tenant``, ``?tenant=``), if any."""
    tenants_shown: list[str] | None = None
    """The tenants the report covers; None: every tenant (an operator's report)."""
    tenants: list[TenantUse] = Field(default_factory=list)
    jobs: list[JobUse] = Field(default_factory=list)
    tenant_series: list[TenantPoint] = Field(default_factory=list)
    fleet_series: list[FleetPoint] = Field(default_factory=list)
    series_source: str = "rollups"
    """``rollups`` (5-minute buckets), or ``raw samples (<width> buckets)`` when the period has too few buckets."""
    queue_waits: list[QueueWait] = Field(default_factory=list)
    conclusions: list[Conclusion] = Field(default_factory=list)

    @property
    def period(self) -> str:
        return f"{self.start:%Y-%m-%d %H:%M} - {self.end:%Y-%m-%d %H:%M} UTC"
