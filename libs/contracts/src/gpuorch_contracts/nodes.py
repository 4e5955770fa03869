"""Node inventory and node-agent events.

A node's inventory (GPUs, MIG instances, topology) is sent whole only when it changes (``inventory_hash``);
heartbeats carry compact live state and are latest-wins: an old heartbeat has no value once a newer one exists.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Literal

from pydantic import Field, StringConstraints

from gpuorch_contracts.envelope import Message, Strict
from gpuorch_contracts.text import (
    ONE_LINE,
    Count,
    GpuUuid,
    Hostname,
    LabelValue,
    MiB,
    MigProfileName,
    Name,
    OptionalToken,
    ShortText,
    Token,
)

GpuIndex = Annotated[int, Field(ge=0, le=1024)]
Pid = Annotated[int, Field(ge=0, le=2**31 - 1)]
Percent = Annotated[float, Field(ge=0, le=100)]
Celsius = Annotated[float, Field(ge=-273, le=1000)]
Watts = Annotated[float, Field(ge=0, le=100_000)]

GpuHealth = Literal["healthy", "degraded", "unhealthy", "unknown"]
TopologyLevel = Literal["self", "nvlink", "same_board", "single_switch", "multi_switch", "host_bridge", "node", "system"]
"""Path between two GPUs, best first, following NVML's topology levels (NVLink when peers are linked)."""


class MigInstance(Strict):
    uuid: GpuUuid
    profile: MigProfileName
    memory_mib: MiB
    slices: int = Field(ge=1, le=8, description="compute (GPC) slices")
    placement_start: int = Field(ge=0, le=8)
    placement_size: int = Field(ge=1, le=8)


class GpuInfo(Strict):
    uuid: GpuUuid
    index: GpuIndex
    model: Name
    name: OptionalToken = ""
    memory_total_mib: MiB
    compute_capability: Annotated[str, StringConstraints(max_length=16), ONE_LINE] | None = None
    pci_bus_id: Annotated[str, StringConstraints(max_length=64), ONE_LINE] | None = None
    mig_enabled: bool = False
    mig_instances: Annotated[list[MigInstance], Field(max_length=64)] = []
    health: GpuHealth = "healthy"
    health_reason: ShortText | None = None


class NodeInventory(Strict):
    node_id: Name
    hostname: Hostname = ""
    cpu_milli: int = Field(ge=0, le=1_024_000_000)
    memory_mib: MiB
    gpus: Annotated[list[GpuInfo], Field(max_length=64)] = []
    nvlink_pairs: Annotated[list[tuple[GpuIndex, GpuIndex]], Field(max_length=2048)] = Field(
        default=[], description="GPU index pairs joined by NVLink"
    )
    labels: Annotated[dict[Name, LabelValue], Field(max_length=64)] = {}
    topology: Annotated[list[tuple[GpuIndex, GpuIndex, TopologyLevel]], Field(max_length=2080)] = Field(
        default=[], description="(gpu index a, gpu index b, best path) for each pair a < b; empty when unknown"
    )


class NodeRegistered(Message):
    """A node-agent started, or its inventory changed."""

    TYPE = "node.registered"
    type: Literal["node.registered"] = "node.registered"
    inventory: NodeInventory
    inventory_hash: Token


class GpuLive(Strict):
    """Compact live state of one GPU in a heartbeat; ``None`` means the reading failed (unknown)."""

    index: GpuIndex
    utilization_pct: Percent | None = None
    memory_used_mib: MiB | None = None
    temperature_c: Celsius | None = None
    power_w: Watts | None = None
    health: GpuHealth = "healthy"


class NodeHeartbeat(Message):
    TYPE = "node.heartbeat"
    type: Literal["node.heartbeat"] = "node.heartbeat"
    node_id: Name
    inventory_hash: Token
    sequence: Count
    gpus: Annotated[list[GpuLive], Field(max_length=64)] = Field(
        default=[], description="The GPUs' live state; empty when no GPU's utilisation or health changed since the "
        "last heartbeat that carried it (sent with every inventory and at least every few heartbeats): "
        "'as last reported'")
    nvml_errors: Annotated[list[ShortText], Field(max_length=64)] = Field(
        default=[], description="NVML calls that failed for this reading ('function: error'); their fields are None"
    )


class GpuHealthChanged(Message):
    TYPE = "gpu.health_changed"
    type: Literal["gpu.health_changed"] = "gpu.health_changed"
    node_id: Name
    gpu_uuid: GpuUuid
    gpu_index: GpuIndex
    health: GpuHealth
    reason: ShortText
    xid: int | None = Field(default=None, ge=0, le=2**31 - 1)
    action: Literal["none", "fail_job", "drain", "reset", "replace"] = "none"


class ProcessUsage(Strict):
    """One process seen on a GPU. The optional fields after ``sm_util_pct`` let telemetry join the process to a
    job and tell an input-bound job from an idle one; a producer that cannot read them leaves them ``None``."""

    pid: Pid
    gpu_memory_mib: MiB
    sm_util_pct: Percent | None = None
    pgid: Pid | None = Field(
        default=None, ge=0, description="process group id; equals the job's started pid for the process runtime"
    )
    container_id: OptionalToken | None = Field(
        default=None, description="container the process runs in (from its cgroup), for the container runtime"
    )
    gpu_instance_uuid: GpuUuid | None = Field(
        default=None, description="MIG instance (MIG-...) the process runs on, when the GPU is in MIG mode"
    )
    host_cpu_pct: float | None = Field(
        default=None, ge=0, le=409_600,
        description="host CPU used by the process and its children since the last sample; 100 = one core",
    )
    io_wait_pct: float | None = Field(
        default=None, ge=0, le=100,
        description="share of wall time the process spent blocked on I/O since the last sample",
    )


class GpuSample(Strict):
    index: GpuIndex
    uuid: GpuUuid
    utilization_pct: Percent | None = None
    memory_used_mib: MiB | None = None
    memory_total_mib: MiB | None = None
    temperature_c: Celsius | None = None
    power_w: Watts | None = None
    sm_clock_mhz: int | None = Field(default=None, ge=0, le=100_000)
    throttle_reasons: Annotated[list[Name], Field(max_length=16)] = []
    ecc_corrected: int | None = Field(default=None, ge=0, le=2**31 - 1, description="volatile corrected ECC errors")
    retired_pages: int | None = Field(default=None, ge=0, le=2**31 - 1,
                                      description="pages retired (pre-Ampere ECC handling)")
    ecc_uncorrected: int | None = Field(default=None, ge=0, le=2**31 - 1)
    remapped_rows_pending: bool | None = Field(default=None, description="a row remap waits for a GPU reset")
    remapped_rows_failed: bool | None = Field(default=None, description="a row remap failed: replace the GPU")
    processes: Annotated[list[ProcessUsage], Field(max_length=256)] = []


class GpuUsageSampled(Message):
    TYPE = "gpu.usage_sampled"
    type: Literal["gpu.usage_sampled"] = "gpu.usage_sampled"
    node_id: Name
    samples: Annotated[list[GpuSample], Field(max_length=64)]


class RunningPlacement(Strict):
    """A placement an executor runs (or is stopping): what a scheduler needs to send it a ``StopJob``."""

    placement_id: uuid.UUID
    job_id: uuid.UUID
    idle_s: float | None = Field(default=None, ge=0, le=10**9, description=(
        "an interactive session: seconds since its last proxied request (or its start); None for other jobs"))


class JobIsolation(Strict):
    """How an executor isolates the jobs it runs on its node: what is enforced there, in fact, not in intent.

    ``job_users``: ``per_job_uid`` (each process job runs as an unprivileged uid of its own, no supplementary
    groups: it cannot read the executor's environment, state or credentials, nor another job's files, nor signal
    another job) or ``executor_uid`` (jobs run as the executor's own user: none of that holds).
    ``devices`` (process jobs): ``cgroup_v1`` / ``cgroup_v2`` (the kernel's device controller denies every GPU the
    job was not given) or ``env_only`` (``CUDA_VISIBLE_DEVICES`` only: a job that unsets it sees every GPU).
    ``limits`` (process jobs' host memory/CPU): ``cgroup_v2``, ``cgroup_v1`` or ``none``. ``containers``:
    ``gpus_flag`` (exactly the given GPUs through ``--gpus device=<UUIDs>``, hardened ``docker run``) or
    ``disabled``. ``mig_slices``: whether a job on a MIG slice is confined to it (below). ``notes`` say why
    something is not enforced."""

    job_users: Literal["per_job_uid", "executor_uid"]
    devices: Literal["cgroup_v1", "cgroup_v2", "env_only"]
    limits: Literal["cgroup_v2", "cgroup_v1", "none"]
    containers: Literal["gpus_flag", "disabled"] = "disabled"
    mig_slices: Literal["cgroup_v1", "cgroup_v2", "env_only"] | None = Field(
        default=None, description="process jobs given a MIG slice: confined by the device controller to that "
        "slice's capability nodes (``cgroup_*``), or told apart from the other slices of the same GPU by "
        "``CUDA_VISIBLE_DEVICES`` only (``env_only``: the driver's capabilities are not device nodes, or devices "
        "are not confined at all); None from an executor older than this field")
    shares: Literal["mps", "watchdog", "none"] | None = Field(
        default=None, description="GPU memory of share jobs: MPS limits (the node's MPS daemon ran when the executor "
        "started) and the watchdog, the watchdog alone, or not enforced (its probe is off); docs/sharing.md. None "
        "from an executor older than this field")
    notes: Annotated[list[ShortText], Field(max_length=8)] = []


class ExecutorHeartbeat(Message):
    """An executor renews its node's lease (the node-agent's ``NodeHeartbeat`` is the other half).

    Sent every few seconds per node the executor serves, whatever the node-agent does. A scheduler treats a node
    as alive only while both halves are fresh; a node whose executor is silent gets no new work, and is declared
    ``lost`` (its jobs requeued) only once ``fencing_deadline_s`` has passed since the last of these it received:
    by then an executor that could not renew has stopped every job itself (it fences on the same monotonic clock
    it renews with). ``running`` lists the placements it runs or is stopping, so a scheduler can stop any that it
    no longer assigns there (a node back after being declared lost)."""

    TYPE = "executor.heartbeat"
    type: Literal["executor.heartbeat"] = "executor.heartbeat"
    node_id: Name
    sequence: Count
    fencing_deadline_s: float = Field(gt=0, le=86_400, description="the executor stops every job when it has not "
                                      "renewed its lease for this long; a scheduler must not requeue them sooner")
    interval_s: float = Field(gt=0, le=3_600, description="seconds between this executor's heartbeats")
    running: Annotated[list[RunningPlacement], Field(max_length=4096)] = Field(
        default=[], description="placements active on this node (launching, running or stopping)")
    running_truncated: bool = Field(default=False, description="more placements run than ``running`` lists")
    isolation: JobIsolation | None = Field(default=None, description="how this node isolates its jobs (an "
                                           "executor older than this field sends none)")
    logs_url: Annotated[str, StringConstraints(max_length=512, pattern=r"^https?://[^\s/]+(/[^\s]*)?$"), ONE_LINE] | None = (
        Field(default=None, description="where this executor serves its jobs' logs: GET <logs_url>/jobs/<job_id>/logs"
              "[?follow=1] with the shared service token (None: it serves none); the API proxies logs from it"))


class NodeLivenessChanged(Message):
    """The scheduler's view of a node's lease changed: ``suspect`` takes no new work, ``lost`` has its jobs
    requeued (only after the executor's fencing deadline passed, so a job never runs twice)."""

    TYPE = "node.liveness_changed"
    type: Literal["node.liveness_changed"] = "node.liveness_changed"
    node_id: Name
    liveness: Literal["alive", "suspect", "lost"]
    reason: ShortText = ""


class FleetAlert(Message):
    """Something affecting many nodes at once (e.g. most nodes silent): people must look; nothing is requeued."""

    TYPE = "alert.fleet"
    type: Literal["alert.fleet"] = "alert.fleet"
    kind: Name
    explanation: ShortText
    node_ids: Annotated[list[Name], Field(max_length=10000)] = []


class MigGpuOutcome(Strict):
    gpu_index: GpuIndex
    applied: bool
    reason: ShortText = ""


class MigLayoutApplied(Message):
    """The node-agent's answer to an ``ApplyMigLayout``: per GPU, applied or refused with the reason (e.g. work
    still running that was not drained). Sent for every command, so a refusal is never silent."""

    TYPE = "node.mig_layout_applied"
    type: Literal["node.mig_layout_applied"] = "node.mig_layout_applied"
    node_id: Name
    command_id: Annotated[str, StringConstraints(max_length=64), ONE_LINE]
    outcomes: Annotated[list[MigGpuOutcome], Field(max_length=64)]


class MigSlot(Strict):
    """One MIG instance of a layout: its profile and the memory slice it starts at."""

    profile: MigProfileName
    start: Annotated[int, Field(ge=0, le=7)]


MigPhase = Literal["draining", "applying", "in_service"]
JobIdText = Annotated[str, StringConstraints(max_length=64), ONE_LINE]


class MigReconfiguration(Message):
    """The scheduler's MIG planner (mode ``auto``) changing one GPU's layout, one event per step:

    ``draining`` (no new placements on the GPU or its instances; ``preempted`` grows as preemptible jobs are asked
    to stop with their checkpoint grace) -> ``applying`` (``ApplyMigLayout`` sent, its message id in
    ``command_id``) -> ``in_service`` (``applied`` true: the new layout; false: refused, failed, timed out or
    abandoned, the GPU keeps the layout it reports, ``reason`` says why). Logged by the scheduler (its state is the
    fold of these) and published, so people and telemetry see GPUs being reconfigured. ``current``/``target``:
    ``None`` is a whole GPU (MIG off)."""

    TYPE = "gpu.mig_reconfiguration"
    type: Literal["gpu.mig_reconfiguration"] = "gpu.mig_reconfiguration"
    node_id: Name
    gpu_index: GpuIndex
    model: Annotated[str, StringConstraints(max_length=128), ONE_LINE] = ""
    phase: MigPhase
    current: Annotated[list[MigSlot], Field(max_length=8)] | None = None
    target: Annotated[list[MigSlot], Field(max_length=8)] | None = None
    drains: Annotated[list[JobIdText], Field(max_length=64)] = []
    """Running jobs that must end (or be preempted with their grace) before the layout can change."""
    enables: Annotated[list[JobIdText], Field(max_length=256)] = []
    """Waiting jobs the new layout would let start."""
    preempted: Annotated[list[JobIdText], Field(max_length=64)] = []
    command_id: Annotated[str, StringConstraints(max_length=64), ONE_LINE] | None = None
    applied: bool | None = None
    reason: ShortText = ""
    started_at: float | None = Field(default=None, ge=0, le=1e11)
    """When the reconfiguration began (unix seconds); ``occurred_at`` is when this step happened."""


class MigProposalView(Strict):
    """One proposal of a MIG plan as people read it (``gpuctl mig plan``, telemetry's recommendations)."""

    node_id: Name
    gpu_index: GpuIndex
    model: Annotated[str, StringConstraints(max_length=128), ONE_LINE] = ""
    current: Annotated[list[MigSlot], Field(max_length=8)] | None = None
    target: Annotated[list[MigSlot], Field(max_length=8)] | None = None
    needs_reset: bool = False
    drains: Annotated[list[JobIdText], Field(max_length=64)] = []
    enables: Annotated[list[JobIdText], Field(max_length=256)] = []
    reason: ShortText = ""


class MigPlanProposed(Message):
    """What the scheduler's MIG planner would change now, published when the plan changes (mode ``advise``, the
    default, and ``auto``, which also carries it out). Telemetry turns each proposal into a recommendation."""

    TYPE = "mig.plan_proposed"
    type: Literal["mig.plan_proposed"] = "mig.plan_proposed"
    mode: Literal["advise", "auto"]
    proposals: Annotated[list[MigProposalView], Field(max_length=1000)] = []
    unmet_jobs: Count = 0
    """Waiting jobs no layout change serves."""
    held_back: Count = 0
    """GPUs hysteresis or the per-hour cap kept as they are."""
