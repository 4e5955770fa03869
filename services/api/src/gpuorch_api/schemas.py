"""The shapes the API answers with, for its OpenAPI document (``/openapi.json``) and for clients.

``domain.views`` builds plain dicts; FastAPI validates each answer against these models (extra keys are dropped,
a missing one is a server error: the document cannot drift from the answers without a test failing).
"""

from __future__ import annotations

import uuid
from datetime import date, datetime
from typing import Any, Literal

from gpuorch_contracts.jobs import JobState, PriorityClass, Tier
from gpuorch_contracts.nodes import GpuHealth
from gpuorch_contracts.telemetry import Severity
from gpuorch_identity import Role
from gpuorch_messaging.dead_letters import DeadLetter, SkippedDeadLetter
from pydantic import BaseModel, Field

from gpuorch_api.problems import Problem


def _problem(description: str) -> dict[str, Any]:
    return {"model": Problem, "description": description}  # under MEDIA_TYPE: problems.documented_as_problems


ERRORS: dict[int | str, dict[str, Any]] = {
    401: _problem("no token, or a token the identity map does not know (with WWW-Authenticate: Bearer)"),
    403: _problem("the caller's identity may not do this"),
    422: _problem("an invalid parameter or body: every invalid field in errors, and in detail as one line"),
}
"""Documented on every route: what ``entrypoint``'s error handlers answer (not FastAPI's default shapes)."""

# A field with a closed set of values is typed with it (an ``enum`` in the OpenAPI document); a value outside it is a
# server error, never passed on (test_openapi_enums). The contracts' own types where they define one:
Liveness = Literal["alive", "suspect", "lost"]
"""``NodeLivenessChanged.liveness``, as the scheduler's read model keeps it."""
AdviceCategory = Literal["alert", "recommendation"]
ReservationState = Literal["pending", "active", "ended", "refused", "deleted"]
MigMode = Literal["off", "advise", "auto", "unknown"]
"""The scheduler's ``GPUORCH_SCHEDULER_MIG_MODE``; ``unknown`` before a scheduler first wrote its plan."""


class JobSummary(BaseModel):
    id: str
    name: str
    tenant: str
    tier: Tier
    priority_class: PriorityClass
    state: JobState
    node: str | None
    nodes: list[str]
    gpus: str = Field(description="what the job holds per GPU: `0,1` whole GPUs, `2:250m/4096MiB` a share, "
                      "`3:3g.40gb` a MIG instance (`-` none)")
    allocated_gpus: float = Field(description=(
        "GPU equivalents held (a number, as before): a whole GPU 1, a share its milli / 1000, a MIG instance its "
        "compute slices / 7 (a `3g.40gb` slice 0.429, not 1); `gpus` names the slices"))
    exit_code: int | None
    reason: str | None
    pending_reason: str | None
    submitted_at: datetime
    started_at: datetime | None
    ended_at: datetime | None
    requeues: int
    estimated_start: datetime | None
    updated_at: datetime | None = Field(default=None, description=(
        "when the scheduler last wrote this row (a parked session's refused resume rewrites it)"))
    array_id: str | None = Field(default=None, description="the array this job is a task of")
    array_index: int | None = None
    array_counts: dict[str, int] | None = Field(default=None, description=(
        "an array's tasks by state: queued (not started yet), running, succeeded, failed, cancelled"))


class TimelineEvent(BaseModel, extra="allow"):
    type: str
    at: datetime


class RecentEvent(TimelineEvent):
    """A line of ``/api/v1/events/recent``: a logged event (its job, if a job's, and the timeline's detail) or one of
    telemetry's detections (``alert.raised``/``alert.resolved``/``recommendation.made``: kind, severity, explanation)."""

    job_id: str | None = None


class DeviceUsage(BaseModel):
    node_id: str
    device_uuid: str
    gpu_index: int
    alloc_milli: int
    samples: int
    peak_memory_mib: int | None
    mean_util_pct: float | None
    last_sample_at: datetime


class Usage(BaseModel):
    devices: list[DeviceUsage]
    gpu_hours: float


class Advice(BaseModel):
    category: AdviceCategory
    kind: str
    severity: Severity
    explanation: str
    advice: str | None
    raised_at: datetime
    resolved_at: datetime | None
    resolve_reason: str | None


class JobDetail(JobSummary):
    spec: dict[str, Any]
    placement_id: str | None
    placed_at: datetime | None
    assignments: list[dict[str, Any]]
    timeline: list[TimelineEvent]
    usage: Usage
    advice: list[Advice]
    trace_url: str | None


class JobRef(BaseModel):
    """A job on a GPU or MIG slice; for a visible job, what it holds and uses of it now (its newest sample)."""

    job_id: str | None
    tenant: str
    milli: int
    mig_profile: str | None = None
    memory_mib: int | None = None
    """The GPU memory of its share (None: a whole GPU or a MIG slice, or not shown)."""
    memory_used_mib: int | None = None
    utilization_pct: float | None = None
    """SM utilisation of its allocation (100: it uses all of its share)."""


class MigSlice(BaseModel):
    uuid: str
    profile: str
    memory_mib: int
    allocated: bool
    jobs: list[JobRef]
    utilization_pct: float | None = None
    memory_used_mib: int | None = None


class Gpu(BaseModel):
    index: int
    uuid: str
    model: str
    memory_total_mib: int
    health: GpuHealth
    health_reason: str | None
    mig_enabled: bool
    allocated_milli: int
    free: bool
    mig_slices: list[MigSlice]
    jobs: list[JobRef]
    utilization_pct: float | None
    memory_used_mib: int | None
    temperature_c: float | None
    power_w: float | None


class Node(BaseModel):
    node_id: str
    liveness: Liveness
    hostname: str
    last_seen: datetime | None
    last_seen_s: float | None
    gpus_total: int
    gpus_free: int
    gpus_allocated: int
    mig_slices_total: int
    mig_slices_free: int
    cpu_milli: int | None
    memory_mib: int | None
    isolation: dict[str, Any] | None
    gpus: list[Gpu]


class PendingReason(BaseModel):
    reason: str
    jobs: int


class EstimatedStart(BaseModel):
    job_id: str
    name: str
    tenant: str
    estimated_start: datetime
    in_s: float


class Queue(BaseModel):
    tier: Tier
    depth: int
    oldest_wait_s: float | None
    pending_reasons: list[PendingReason]
    estimated_starts: list[EstimatedStart]


class Tenant(BaseModel):
    tenant: str
    allocated_gpus: float
    quota_gpus: float | None
    used_gpus: float | None
    mean_util_pct: float | None
    queued: int
    running: int


class Caller(BaseModel):
    identity: str
    user: str | None = Field(default=None, description="who signed in through the OpenID provider (None: a static "
                                                        "token)")
    role: Role
    tenants: list[str]
    default_tenant: str | None
    max_priority: PriorityClass


class DailyUsage(BaseModel):
    day: date
    tenant: str
    allocated_gpu_hours: float
    used_gpu_hours: float
    idle_gpu_hours: float


class Replayed(BaseModel):
    queue: str
    replayed: int
    stopped: str | None
    """Why the replay stopped before the queue was empty or the limit reached (None: it did not)."""
    messages: list[DeadLetter]
    """What was published back, in order (``gpuorch_messaging.dead_letters.DeadLetter``)."""
    skipped: list[SkippedDeadLetter] = []
    """What was not replayed and why (no first publisher to replay it as, too large ...): still dead-lettered."""


class TenantShare(BaseModel):
    """One tenant's fair share over time (as Slurm's ``sshare``): its configured and normalised share, its decayed
    usage (GPU-hours weighted by GPU model) and normalised usage, and the factor 2^(-usage/share) (1: used nothing,
    0.5: used exactly its share) that orders tenants together with today's dominant share."""

    tenant: str
    share: float
    normalized_share: float
    usage_gpu_hours: float
    normalized_usage: float
    factor: float
    gpus_held: float


class FairShare(BaseModel):
    """The scheduler's fair share view: its decay half-life and model weights, when it computed the values, and a
    line per tenant the caller sees (normalised over every tenant)."""

    half_life_s: float | None = None
    model_weights: dict[str, float] = {}
    computed_at: datetime | None = None
    tenants: list[TenantShare] = []


class Reservation(BaseModel):
    """An advance reservation as the scheduler logged it: whole nodes for a tenant in a window. ``state``: pending,
    active, ended (from the clock), refused (``reason`` says why) or deleted; ``problems``: why it cannot be
    honoured now (nodes lost or gone)."""

    reservation_id: uuid.UUID
    tenant: str
    gpus: int
    gpu_model: str | None
    nodes: list[str]
    start_at: datetime | None
    end_at: datetime | None
    created_by: str | None
    state: ReservationState
    reason: str | None
    problems: list[str]


class MigPlan(BaseModel):
    """The scheduler's MIG planner: its mode, what it would change now (``proposals``, each with its reason), the
    reconfigurations under way and when each GPU was last reconfigured. For a caller who is not an operator, job ids
    in ``drains``/``enables`` are replaced by their counts."""

    mode: MigMode
    updated_at: datetime | None = None
    proposals: list[dict[str, Any]]
    unmet_jobs: int = 0
    held_back: int = 0
    under_way: list[dict[str, Any]]
    history: list[dict[str, Any]]


class SeriesLine(BaseModel):
    key: str = Field(description="the device's UUID (a MIG instance's own) or the GPU's UUID")
    label: str
    util_pct: list[float | None] = Field(description="per point of `t`: mean utilisation, null where no sample")
    memory_mib: list[float | None] = Field(description="per point of `t`: mean memory used, null where no sample")


class Series(BaseModel):
    """Values over time on one axis (``t``, epoch seconds of each bucket's start), null for a bucket without a
    sample: a gap, drawn as one."""

    source: str = Field(description="`rollups` (5-minute buckets) or `raw samples (N s buckets)` for a short span")
    bucket_s: int
    start: datetime
    end: datetime
    t: list[int]
    series: list[SeriesLine]
