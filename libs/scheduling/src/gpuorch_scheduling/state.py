"""The scheduler's state: a pure fold over its event log.

``SchedulerState.apply(event)`` is the only way state changes; the live service and a replay from the log call the
same function with the same events, so they end in the same state (tested). The state is plain data that
round-trips through ``to_snapshot``/``from_snapshot`` (JSON-safe dicts) for snapshots.

The fold also keeps what the scheduling cycle reads current, so nothing is rebuilt per cycle: the live ``fleet``
(gpuorch_policy.Fleet: free capacity per node, placement indexes) gets a job's assignments when the job starts
holding capacity and gives them back when it stops; ``queued`` and ``active`` index the jobs by state;
``tenant_held`` sums what each tenant holds and ``usage`` its decayed GPU-seconds per GPU model (fair share over
time, ``gpuorch_scheduling.usage``); ``mig`` holds the MIG reconfigurations under way (their GPUs are
closed to placements in the fleet) and ``mig_history`` when each GPU's last ones ended (``domain.mig``). Finished
jobs leave memory ``retention_s`` after they end (log time), unless a waiting job depends on them (``dependents``);
the log and the read model keep them. Arrays (``arrays``) are records of their own whose next tasks the fold
materializes as queued jobs (``_fill``: a pure function of the log, so a replay makes the same tasks); so are
advance reservations (``reservations``, with the nodes each holds as logged).

``capacity_violations`` checks usage independently of the fleet's arrays: re-derived from the jobs alone for the
whole state (tests and the crash drill), from what the fold counted per node for given nodes; the plan applier
checks each decision with ``Fleet.check`` before it is logged and ``capacity_violations(nodes)`` on the nodes a
committed plan touched.
"""

from __future__ import annotations

import json
import math
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from gpuorch_contracts import (
    TERMINAL_STATES,
    ArrayParallelismChanged,
    GpuAllocation,
    GpuHealthChanged,
    JobAccepted,
    JobCancelled,
    JobCheckpointed,
    JobFailed,
    JobFinished,
    JobLost,
    JobPlaced,
    JobPreempting,
    JobPriorityChanged,
    JobRejected,
    JobRequeued,
    JobSpec,
    JobStarted,
    Message,
    MigReconfiguration,
    NodeAssignment,
    NodeInventory,
    NodeLivenessChanged,
    NodeRegistered,
    ReservationCreated,
    ReservationDeleted,
    ReservationRefused,
    SessionParked,
    parse_indices,
)
from gpuorch_policy.fleet import DEFAULT_GPU_MEMORY_MIB, Fleet, gpu_units
from gpuorch_policy.model import GPU_MILLI

from gpuorch_scheduling.arrays import ArrayRecord
from gpuorch_scheduling.usage import DEFAULT_HALF_LIFE_S, DecayedUsage

_FIELDS: dict[type, frozenset[str]] = {}


def field_of(message: Message, name: str) -> Any:
    """The value of ``message``'s contract field ``name``, or None when its type has no such field (a plain
    ``getattr`` with a default costs a pydantic lookup that raises for every missing name: this is the fold's
    hottest line)."""
    kind = type(message)
    fields = _FIELDS.get(kind)
    if fields is None:
        fields = _FIELDS[kind] = frozenset(kind.model_fields)
    return getattr(message, name) if name in fields else None


ACTIVE_STATES = frozenset({"placed", "running", "preempting"})
"""States in which a job holds capacity."""


@dataclass
class JobRecord:
    job_id: uuid.UUID
    spec: JobSpec
    state: str = "queued"
    accepted_at: float = 0.0
    placement_id: uuid.UUID | None = None
    assignments: list[NodeAssignment] = field(default_factory=list)
    placed_at: float | None = None
    started_at: float | None = None
    ended_at: float | None = None
    exit_code: int | None = None
    reason: str | None = None
    requeues: int = 0
    log_path: str | None = None
    checkpointed: bool = False
    enqueued_at: float = 0.0
    queued_seq: int = 0
    """Order of entering the queue (acceptance or requeue) in the log: first come, first served among jobs queued
    at the same time (one batch)."""
    traceparent: str | None = None
    """W3C trace context of the submission, so every later message about the job joins the same trace."""
    preempting_at: float | None = None
    """When the scheduler asked this placement to stop for a preemption (JobPreempting)."""
    stopped_nodes: list[str] = field(default_factory=list)
    """Nodes where the current placement is known to have ended while the job itself has not: confirmed stopped
    after a preemption, or a gang rank lost (``JobLost``, its node lost) and the ranks stopped after it. The job
    holds its capacity on every node until all did; then the scheduler requeues it (or fails it)."""
    preemptions: int = 0
    stopping_nodes: list[str] = field(default_factory=list)
    """Nodes of a cancelled placement, or of a gang that ended with its first rank, whose executor has not yet
    confirmed it ended there: its capacity stays held."""
    array_id: uuid.UUID | None = None
    """The array this job is a task of (``arrays``), with its index."""
    array_index: int | None = None
    parking: bool = False
    """An interactive session being stopped to be parked (``sessions``): once stopped it is parked, not requeued."""
    parks: list[list[float | None]] = field(default_factory=list)
    """A session's last parks, ``[parked at, resumed or ended at (None: still parked), GPUs given back]`` (log
    time; at most ``MAX_PARKS``): the report's GPU hours given back by parking."""

    @property
    def holds_capacity(self) -> bool:
        return self.state in ACTIVE_STATES or bool(self.stopping_nodes)

    @property
    def losing_ranks(self) -> bool:
        """A rank of the placement (placed or running) was lost: the other ranks are being stopped, their capacity
        held, and the job is requeued or failed once each ended (``decisions.rank_ended``)."""
        return bool(self.stopped_nodes) and self.state in ("placed", "running")

    def still_running(self, ended: str | None) -> list[str]:
        """The nodes of the placement where it has not ended, besides ``ended`` (a gang's other ranks)."""
        return sorted({a.node_id for a in self.assignments} - set(self.stopped_nodes) - {ended})

    def to_dict(self) -> dict[str, Any]:
        return {
            "job_id": str(self.job_id), "spec": self.spec.model_dump(mode="json"), "state": self.state,
            "accepted_at": self.accepted_at, "placement_id": str(self.placement_id) if self.placement_id else None,
            "assignments": [a.model_dump(mode="json") for a in self.assignments], "placed_at": self.placed_at,
            "started_at": self.started_at, "ended_at": self.ended_at, "exit_code": self.exit_code,
            "reason": self.reason, "requeues": self.requeues, "log_path": self.log_path,
            "checkpointed": self.checkpointed, "enqueued_at": self.enqueued_at, "queued_seq": self.queued_seq,
            "traceparent": self.traceparent,
            "preempting_at": self.preempting_at, "stopped_nodes": list(self.stopped_nodes),
            "preemptions": self.preemptions, "stopping_nodes": list(self.stopping_nodes),
            "array_id": str(self.array_id) if self.array_id else None, "array_index": self.array_index,
            "parking": self.parking, "parks": self.parks,
        }

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> JobRecord:
        return cls(
            job_id=uuid.UUID(raw["job_id"]), spec=JobSpec.model_validate(raw["spec"]), state=raw["state"],
            accepted_at=raw["accepted_at"],
            placement_id=uuid.UUID(raw["placement_id"]) if raw["placement_id"] else None,
            assignments=[NodeAssignment.model_validate(a) for a in raw["assignments"]],
            placed_at=raw["placed_at"], started_at=raw["started_at"], ended_at=raw["ended_at"],
            exit_code=raw["exit_code"], reason=raw["reason"], requeues=raw["requeues"], log_path=raw["log_path"],
            checkpointed=raw["checkpointed"], enqueued_at=raw["enqueued_at"], queued_seq=raw.get("queued_seq", 0),
            traceparent=raw.get("traceparent"),
            preempting_at=raw.get("preempting_at"), stopped_nodes=list(raw.get("stopped_nodes", [])),
            preemptions=raw.get("preemptions", 0), stopping_nodes=list(raw.get("stopping_nodes", [])),
            array_id=uuid.UUID(raw["array_id"]) if raw.get("array_id") else None,
            array_index=raw.get("array_index"), parking=raw.get("parking", False),
            parks=[list(p) for p in raw.get("parks", [])],
        )


@dataclass
class NodeRecord:
    inventory: NodeInventory
    inventory_hash: str
    liveness: str = "alive"  # alive | suspect | lost
    gpu_health: dict[int, str] = field(default_factory=dict)
    fenced: list[tuple[uuid.UUID, uuid.UUID]] = field(default_factory=list)
    """(job, placement) that held this node when it was declared lost: should the node return with them still
    running (its executor failed to fence), the scheduler stops them."""

    @property
    def node_id(self) -> str:
        return self.inventory.node_id

    @property
    def schedulable(self) -> bool:
        return self.liveness == "alive"

    def to_dict(self) -> dict[str, Any]:
        return {
            "inventory": self.inventory.model_dump(mode="json"), "inventory_hash": self.inventory_hash,
            "liveness": self.liveness, "gpu_health": {str(k): v for k, v in self.gpu_health.items()},
            "fenced": [[str(j), str(p)] for j, p in self.fenced],
        }

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> NodeRecord:
        return cls(
            inventory=NodeInventory.model_validate(raw["inventory"]), inventory_hash=raw["inventory_hash"],
            liveness=raw["liveness"], gpu_health={int(k): v for k, v in raw["gpu_health"].items()},
            fenced=[(uuid.UUID(j), uuid.UUID(p)) for j, p in raw.get("fenced", [])],
        )


@dataclass
class Reservation:
    """Whole nodes promised to ``tenant`` from ``start`` to ``end`` (unix seconds), as logged
    (``gpuorch_scheduling.reservations``)."""

    reservation_id: uuid.UUID
    tenant: str
    gpus: int
    gpu_model: str | None
    nodes: frozenset[str]
    start: float
    end: float
    created_by: str | None = None
    deleted_at: float | None = None
    reason: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"reservation_id": str(self.reservation_id), "tenant": self.tenant, "gpus": self.gpus,
                "gpu_model": self.gpu_model, "nodes": sorted(self.nodes), "start": self.start, "end": self.end,
                "created_by": self.created_by, "deleted_at": self.deleted_at, "reason": self.reason}

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Reservation:
        return cls(uuid.UUID(raw["reservation_id"]), raw["tenant"], raw["gpus"], raw["gpu_model"],
                   frozenset(raw["nodes"]), raw["start"], raw["end"], raw.get("created_by"), raw.get("deleted_at"),
                   raw.get("reason"))


@dataclass(slots=True)
class _Holding:
    """What a job holds, as the fold counted it when it began to hold: per assignment (node, mCPU, MiB, ((GPU uuid,
    milli), ...)); (GPUs, GPU memory MiB, host mCPU, host memory MiB) for its tenant; (GPU model, GPUs) for its
    decayed usage."""

    on: tuple[tuple[str, int, int, tuple[tuple[str, int], ...]], ...]
    amounts: tuple[float, float, float, float]
    models: tuple[tuple[str, float], ...]


RESERVATION_MEMORY_S = 7 * 86400.0
"""Reservations that ended (or were deleted) longer ago than this leave memory (the read model keeps them)."""
DEFAULT_RETENTION_S = 3600.0
MAX_PARKS = 50
"""Parks remembered per session (``JobRecord.parks``)."""
MIG_HISTORY = 8
"""Ended reconfigurations remembered per GPU (the planner's cap counts those of the last hour)."""


@dataclass
class SchedulerState:
    jobs: dict[uuid.UUID, JobRecord] = field(default_factory=dict)
    nodes: dict[str, NodeRecord] = field(default_factory=dict)
    position: int = 0
    """Log position of the last applied event."""
    retention_s: float = DEFAULT_RETENTION_S
    """Seconds (log time) a finished job stays in memory after it stopped holding capacity."""
    fleet: Fleet = field(default_factory=Fleet)
    queued: dict[uuid.UUID, JobRecord] = field(default_factory=dict)
    active: dict[uuid.UUID, JobRecord] = field(default_factory=dict)
    queued_by_tenant: dict[str, int] = field(default_factory=dict)
    preemptible: dict[uuid.UUID, JobRecord] = field(default_factory=dict)
    """The preemptible jobs among ``active`` (preemption looks for victims here only)."""
    stopping: dict[uuid.UUID, JobRecord] = field(default_factory=dict)
    """Active jobs being stopped (preempted, cancelled while running, a gang ended or losing a rank): their room
    frees once confirmed."""
    tenant_held: dict[str, list[float]] = field(default_factory=dict)
    """Tenant -> (GPUs, GPU memory MiB, host mCPU, host memory MiB) held by its active jobs."""
    clock: float = 0.0
    """The latest event time folded (log time; drives retention)."""
    mig: dict[tuple[str, int], MigReconfiguration] = field(default_factory=dict)
    """(node, GPU index) -> the last step of its MIG reconfiguration under way (draining or applying): the fleet
    offers neither the GPU nor its instances until the step ``in_service`` is folded."""
    mig_history: dict[tuple[str, int], list[float]] = field(default_factory=dict)
    """(node, GPU index) -> when its last reconfigurations ended, applied or not: the planner's cap and hysteresis
    count both, so a refused, failed or abandoned change is not tried again at once."""
    queue_seq: int = 0
    """The last ``JobRecord.queued_seq`` given."""
    not_alive: set[str] = field(default_factory=set)
    """Nodes whose liveness is suspect or lost (a tick looks at these and at the silent ones only)."""
    arrays: dict[uuid.UUID, ArrayRecord] = field(default_factory=dict)
    """Job arrays by their job id (``arrays``): their tasks are jobs of their own once materialized."""
    dependents: dict[uuid.UUID, set[uuid.UUID]] = field(default_factory=dict)
    """Job or array id -> the jobs and arrays that depend on it and have not ended (derived). A job with
    dependents is not forgotten at retention: they still need its outcome."""
    reservations: dict[uuid.UUID, Reservation] = field(default_factory=dict)
    """Advance reservations by id (``reservations``), from ReservationCreated / ReservationDeleted."""
    usage: DecayedUsage = field(default_factory=DecayedUsage)
    """Decayed GPU-seconds per tenant and GPU model (``usage``): what fair share over time reads. Changed by the
    fold when a job starts or stops holding GPUs, at log time."""
    _ended: deque[tuple[float, uuid.UUID]] = field(default_factory=deque)
    _ending: set[uuid.UUID] = field(default_factory=set)
    _json: dict[object, str] = field(default_factory=dict)
    """Each record's JSON in the snapshot, dropped when the fold touches the record (snapshots cost O(changes))."""
    _held: dict[uuid.UUID, _Holding] = field(default_factory=dict)
    """Job -> what it holds as the fold counted it when it began to hold (``_Holding``), given back by the same
    amounts when it stops (a requeue clears the assignments before that runs)."""
    _holders: dict[str, set[uuid.UUID]] = field(default_factory=dict)
    """Node -> the jobs holding capacity there; node -> what all of them hold there (``_node_use``: [mCPU, MiB,
    {GPU uuid: milli}]). Kept by the fold from the jobs, apart from the fleet's arrays, so that
    ``capacity_violations(nodes)`` checks usage independently of the fleet."""
    _node_use: dict[str, list[Any]] = field(default_factory=dict)

    # -- the fold ---------------------------------------------------------------------------------------------

    def apply(self, event: Message, headers: dict[str, Any] | None = None) -> None:
        """Apply one logged event with the headers logged beside it. Pure: depends only on the event and its
        headers (the event's ``occurred_at`` is the time)."""
        if type(event) is JobPlaced and self._placed(event):
            return
        at = event.occurred_at.timestamp()
        self.clock = max(self.clock, at)
        job_id = field_of(event, "job_id")
        job = self.jobs.get(job_id) if job_id is not None else None
        held_before = job is not None and job.holds_capacity
        self._fold(event, at, headers)
        if self._json:
            self._json.pop(job_id, None)
        node_id = event.inventory.node_id if isinstance(event, NodeRegistered) else field_of(event, "node_id")
        if node_id is not None and not isinstance(event, JobStarted | JobFinished | JobFailed | JobCheckpointed):
            self._json.pop(("node", node_id), None)
        if isinstance(event, NodeLivenessChanged) and event.liveness == "lost":
            self._json.clear()  # the fold touched every job that was stopping there (cheap: nodes are rarely lost)
        if job_id is not None:
            self._reindex(job_id, held_before)
            array = self.arrays.get(job_id) if job is None else (
                self.arrays.get(job.array_id) if job.array_id is not None else None)
            if array is not None:
                self._fill(array)
        elif isinstance(event, NodeLivenessChanged) and event.liveness == "lost":
            for other in [j for j in self.active.values() if j.state in TERMINAL_STATES or j.stopped_nodes]:
                self._reindex(other.job_id, True)
                if other.array_id is not None and other.array_id in self.arrays:
                    self._fill(self.arrays[other.array_id])
        self._forget_ended()

    def _placed(self, event: JobPlaced) -> bool:
        """``apply`` of a JobPlaced for a plain queued job (not an array task, nothing of an earlier placement still
        stopping): the same changes as the general path (``_fold`` then ``_reindex``), without its dispatch (the
        plan applier folds one per placement). False, having changed nothing, for any other case."""
        job_id = event.job_id
        job = self.jobs.get(job_id)
        if job is None or job.state != "queued" or job.stopping_nodes or job.stopped_nodes or job.array_id is not None:
            return False
        at = event.occurred_at.timestamp()
        self.clock = max(self.clock, at)
        job.state, job.placement_id, job.placed_at = "placed", event.placement_id, at
        job.assignments = list(event.assignments)
        job.reason = None
        if self._json:
            self._json.pop(job_id, None)
        self.fleet.hold(job_id, job.spec, job.assignments)
        self._hold(job)
        self.active[job_id] = job
        if job.spec.preemptible:
            self.preemptible[job_id] = job
        elif self.preemptible:
            self.preemptible.pop(job_id, None)
        if self.stopping:
            self.stopping.pop(job_id, None)
        if self.queued.pop(job_id, None) is not None:
            self.queued_by_tenant[job.spec.tenant] -= 1
        self._forget_ended()
        return True

    def _reindex(self, job_id: uuid.UUID, held_before: bool) -> None:
        """Keep the fleet, the indexes and the tenants' holdings in step with one job's new state."""
        job = self.jobs.get(job_id)
        if job is None:
            return
        held = job.holds_capacity
        if held and not held_before:
            self.fleet.hold(job_id, job.spec, job.assignments)
            self._hold(job)
        elif held_before and not held:
            self.fleet.free(job_id)
            self._release(job)
        if held:
            self.active[job_id] = job
        else:
            self.active.pop(job_id, None)
        # (an empty map is not asked: each lookup hashes the job id, a Python-level ``UUID.__hash__``)
        if held and job.spec.preemptible:
            self.preemptible[job_id] = job
        elif self.preemptible:
            self.preemptible.pop(job_id, None)
        if held and (job.state == "preempting" or job.stopping_nodes or job.stopped_nodes):
            self.stopping[job_id] = job
        elif self.stopping:
            self.stopping.pop(job_id, None)
        array = self.arrays.get(job.array_id) if job.array_id is not None else None
        if job.state == "queued":
            if job_id not in self.queued:
                self.queued_by_tenant[job.spec.tenant] = self.queued_by_tenant.get(job.spec.tenant, 0) + 1
                if array is not None:
                    array.queued_tasks += 1
            self.queued[job_id] = job
        elif self.queued.pop(job_id, None) is not None:
            self.queued_by_tenant[job.spec.tenant] -= 1
            if array is not None:
                array.queued_tasks -= 1
        if job.state in TERMINAL_STATES:
            if array is not None and job.array_index is not None and not held:
                array.task_ended(job.array_index, job.state)  # a stopping task still counts as running
            elif job.spec.depends_on:
                self._unlink(job_id, job.spec)
        if not held and job.state in TERMINAL_STATES and job_id not in self._ending:
            self._ended.append((self.clock, job_id))  # log time only grows: the deque stays in order
            self._ending.add(job_id)

    def _count_held(self, tenant: str, holding: _Holding, sign: int) -> None:
        """Add (``sign`` +1) or take away (-1) a holding in its tenant's amounts and decayed usage."""
        row = self.tenant_held.get(tenant)
        if row is None:
            row = self.tenant_held[tenant] = [0.0, 0.0, 0.0, 0.0]
        for k, value in enumerate(holding.amounts):
            row[k] += sign * value
        for model, gpus in holding.models:
            self.usage.change(tenant, model, sign * gpus, self.clock)

    def _measure(self, job: JobRecord) -> _Holding:
        """What a placed job holds: per assignment (node, mCPU, MiB, ((GPU uuid, milli), ...)); (GPUs, GPU memory
        MiB, host mCPU, host memory MiB); and (GPU model, GPUs) per model (whole GPUs count 1, a share or MIG slice
        its fraction)."""
        cpu, memory = job.spec.cpu_milli, job.spec.memory_mib
        gpus = mem = 0.0
        by_model: dict[str, float] = {}
        on = []
        nodes = self.nodes
        for assignment in job.assignments:
            allocs = assignment.gpus
            on.append((assignment.node_id, cpu, memory, tuple([(g.gpu_uuid, g.milli) for g in allocs])))
            node = nodes.get(assignment.node_id)
            devices = _devices(node.inventory) if node is not None else {}
            for alloc in allocs:
                gpu = devices.get(alloc.gpu_index)
                if alloc.mig_profile is None:  # ``gpu_units`` of a whole GPU or a share, without the call
                    g, m = alloc.milli / GPU_MILLI, alloc.memory_mib or 0
                else:
                    g, m = gpu_units(alloc, gpu[0] if gpu is not None else DEFAULT_GPU_MEMORY_MIB)
                gpus += g
                mem += m
                model = gpu[1] if gpu is not None else "unknown"
                by_model[model] = by_model.get(model, 0.0) + g
        n = len(job.assignments)
        return _Holding(tuple(on), (gpus, mem, float(cpu * n), float(memory * n)), tuple(by_model.items()))

    def _forget_ended(self) -> None:
        cutoff = self.clock - self.retention_s
        while self._ended and self._ended[0][0] < cutoff:
            _, job_id = self._ended.popleft()
            if self.dependents.get(job_id):
                self._ended.append((self.clock, job_id))  # a waiting job still needs its outcome
                continue
            self._ending.discard(job_id)
            job = self.jobs.get(job_id)
            if job is not None and job.state in TERMINAL_STATES and not job.holds_capacity:
                del self.jobs[job_id]
                self._json.pop(job_id, None)
            elif job is None:
                self.arrays.pop(job_id, None)

    # -- arrays and dependencies ----------------------------------------------------------------------------------

    def _link(self, dependent: uuid.UUID, spec: JobSpec) -> None:
        for dependency in spec.depends_on:
            self.dependents.setdefault(dependency.job_id, set()).add(dependent)

    def _unlink(self, dependent: uuid.UUID, spec: JobSpec) -> None:
        for dependency in spec.depends_on:
            waiting = self.dependents.get(dependency.job_id)
            if waiting is not None:
                waiting.discard(dependent)
                if not waiting:
                    del self.dependents[dependency.job_id]

    def _fill(self, array: ArrayRecord) -> None:
        """Materialize the array's next tasks as far as its parallelism and the queued window allow (the fold's
        own rule: a replay makes the same tasks); end the array once nothing is pending or live."""
        while array.wants_task():
            index = array.next_index()
            if index is None:
                break
            task = JobRecord(job_id=array.task_id(index), spec=array.spec, accepted_at=self.clock,
                             enqueued_at=self.clock, queued_seq=self._next_seq(), traceparent=array.traceparent,
                             array_id=array.array_id, array_index=index)
            self.jobs[task.job_id] = task
            array.live[index] = task.job_id
            self._reindex(task.job_id, False)
        if array.ended_at is None and not array.pending and not array.live:
            array.ended_at = self.clock
            self._unlink(array.array_id, array.spec)
            if array.array_id not in self._ending:
                self._ended.append((self.clock, array.array_id))
                self._ending.add(array.array_id)

    def _fold(self, event: Message, at: float, headers: dict[str, Any] | None) -> None:
        match event:  # the cases are of distinct classes: the commonest first
            case JobPlaced():
                job = self.jobs.get(event.job_id)
                if job is not None and job.state == "queued":
                    job.state, job.placement_id, job.placed_at = "placed", event.placement_id, at
                    job.assignments = list(event.assignments)
                    job.reason = None
            case JobAccepted() if event.spec.array is not None:
                if event.job_id not in self.arrays:
                    self.arrays[event.job_id] = ArrayRecord.accepted(
                        event.job_id, event.spec, at, (headers or {}).get("traceparent"))
                    self._link(event.job_id, event.spec)
            case JobCancelled() if event.job_id in self.arrays:
                array = self.arrays[event.job_id]
                if array.ended_at is None:
                    array.cancel_pending(parse_indices(event.array_tasks) if event.array_tasks else None)
                    array.reason = event.reason
            case ArrayParallelismChanged():
                array = self.arrays.get(event.job_id)
                if array is not None:
                    array.parallelism = event.parallelism
            case JobPriorityChanged():
                changed = self.jobs.get(event.job_id)
                if changed is not None:
                    changed.spec = changed.spec.model_copy(update={"priority_class": event.priority_class})
            case JobAccepted():
                if event.job_id not in self.jobs:
                    self.jobs[event.job_id] = JobRecord(
                        job_id=event.job_id, spec=event.spec, accepted_at=at, enqueued_at=at,
                        queued_seq=self._next_seq(),
                        traceparent=(headers or {}).get("traceparent"),
                    )
                    self._link(event.job_id, event.spec)
            case JobRejected():
                pass  # never entered the queue
            case JobStarted():
                job = self._current(event.job_id, event.placement_id)
                if job is not None and job.state in ("placed", "running"):
                    job.state, job.started_at, job.log_path = "running", at, event.log_path
            case JobFinished() | JobFailed() | JobLost() if self._stop_confirmed(event):
                pass  # a cancelled (or ended gang's) placement ended on that node: its capacity there is free now
            case JobFinished():
                job = self._current(event.job_id, event.placement_id)
                if job is not None and job.losing_ranks:
                    self._rank_stopped(job, event.node_id)
                elif job is not None and job.holds_capacity:
                    self._end(job, "succeeded" if event.exit_code == 0 else "failed", at, event.exit_code)
                    job.stopping_nodes = job.still_running(event.node_id)  # a gang's other ranks: held until stopped
            case JobFailed():
                job = self.jobs.get(event.job_id)
                current = job is not None and event.placement_id in (None, job.placement_id)
                if job is not None and current and job.state == "preempting" and stopped_as_asked(event):
                    # the preempted placement ended on this node: the scheduler requeues once every node did
                    if event.node_id is not None and event.node_id not in job.stopped_nodes:
                        job.stopped_nodes.append(event.node_id)
                    elif event.node_id is None:
                        job.stopped_nodes = [a.node_id for a in job.assignments]
                elif job is not None and current and event.node_id is not None and job.losing_ranks:
                    self._rank_stopped(job, event.node_id)
                elif job is not None and current and job.state in ("placed", "running") \
                        and outgrew_gpu_memory(event, job):
                    job.reason = event.reason  # stays active until the scheduler decides (escalation.py)
                elif job is not None and current and (
                    job.holds_capacity or (event.placement_id is None and job.state == "queued")
                ):
                    self._end(job, "failed", at, event.exit_code, event.reason)
                    if event.node_id is not None:  # a gang's other ranks: held until stopped
                        job.stopping_nodes = job.still_running(event.node_id)
            case JobLost():
                job = self._current(event.job_id, event.placement_id)
                if job is not None and job.state in ACTIVE_STATES:
                    # stays active until the scheduler decides (requeue or fail, once every rank ended)
                    self._rank_lost(job, event.node_id, f"lost on {event.node_id}: {event.reason}")
            case JobCheckpointed():
                job = self._current(event.job_id, event.placement_id)
                if job is not None:
                    job.checkpointed = True
            case JobPreempting():
                job = self._current(event.job_id, event.placement_id)
                if job is not None and job.holds_capacity and job.state != "preempting":
                    job.state, job.reason = "preempting", event.reason
                    job.preempting_at = at  # stopped_nodes kept: a rank already lost stays ended
                    job.parking = event.park
            case JobRequeued():
                job = self.jobs.get(event.job_id)
                if job is not None and job.state == "parked" and job.parks:
                    job.parks[-1][1] = at  # resumed: the park ends
                if job is not None and job.state not in TERMINAL_STATES:
                    job.state, job.placement_id, job.assignments = "queued", None, []
                    job.placed_at = job.started_at = None
                    job.requeues, job.reason, job.enqueued_at = event.requeues, event.reason, at
                    job.queued_seq = self._next_seq()
                    job.preempting_at, job.stopped_nodes = None, []
                    if event.resources is not None:  # an escalated share (escalation.py)
                        job.spec = job.spec.model_copy(update={"resources": event.resources})
                    if event.preempted:
                        job.preemptions += 1
            case SessionParked():  # sessions: a parked session holds nothing and waits for a resume
                job = self.jobs.get(event.job_id)
                if job is not None and job.state == "preempting" and job.parking:
                    job.state, job.placement_id, job.assignments, job.reason = "parked", None, [], event.reason
                    job.placed_at = job.started_at = job.preempting_at = None
                    job.stopped_nodes, job.parking = [], False
                    job.parks = [*job.parks[-(MAX_PARKS - 1):], [at, None, event.gpus]]
            case JobCancelled():
                job = self.jobs.get(event.job_id)
                if job is not None and job.state not in TERMINAL_STATES:
                    if job.state == "parked" and job.parks:
                        job.parks[-1][1] = at  # stopped while parked: the park ends
                    if job.holds_capacity:  # held until the executors confirm the stop (or the node is lost)
                        job.stopping_nodes = sorted({a.node_id for a in job.assignments} - set(job.stopped_nodes))
                    self._end(job, "cancelled", at, None, event.reason)
            case NodeRegistered():
                node = self.nodes.get(event.inventory.node_id)
                if node is None:
                    self.nodes[event.inventory.node_id] = NodeRecord(event.inventory, event.inventory_hash)
                else:
                    node.inventory, node.inventory_hash = event.inventory, event.inventory_hash
                    node.liveness = "alive"
                self.not_alive.discard(event.inventory.node_id)
                record = self.nodes[event.inventory.node_id]
                record.gpu_health = {g.index: g.health for g in event.inventory.gpus}
                self.fleet.upsert_node(record.inventory, record.schedulable, record.gpu_health)
            case GpuHealthChanged():
                node = self.nodes.get(event.node_id)
                if node is not None:
                    node.gpu_health[event.gpu_index] = event.health
                    self.fleet.set_gpu_health(event.node_id, event.gpu_index, event.health)
            case NodeLivenessChanged():
                node = self.nodes.get(event.node_id)
                if node is not None:
                    if event.liveness == "lost":
                        node.fenced = [(j.job_id, j.placement_id) for j in self.active.values()
                                       if j.placement_id is not None
                                       and any(a.node_id == event.node_id for a in j.assignments)]
                    elif event.liveness == "alive":
                        node.fenced = []
                    node.liveness = event.liveness
                    if event.liveness == "alive":
                        self.not_alive.discard(event.node_id)
                    else:
                        self.not_alive.add(event.node_id)
                    self.fleet.set_schedulable(event.node_id, node.schedulable)
                if event.liveness == "lost":  # whatever ran there is gone (fenced) by now
                    for job in self.jobs.values():
                        if event.node_id in job.stopping_nodes:
                            job.stopping_nodes.remove(event.node_id)
                    for job in self.active.values():
                        if job.state in ACTIVE_STATES and any(a.node_id == event.node_id for a in job.assignments):
                            self._rank_lost(job, event.node_id, f"node {event.node_id} lost")
            case MigReconfiguration():
                self._fold_mig(event, at)
            case ReservationCreated():
                self.reservations = {k: r for k, r in self.reservations.items()
                                     if min(r.end, r.deleted_at or math.inf) > at - RESERVATION_MEMORY_S}
                self.reservations[event.reservation_id] = Reservation(
                    event.reservation_id, event.tenant, event.gpus, event.gpu_model, frozenset(event.nodes),
                    event.start_at.timestamp(), event.end_at.timestamp(), event.created_by)
            case ReservationDeleted():
                reservation = self.reservations.get(event.reservation_id)
                if reservation is not None and reservation.deleted_at is None:
                    reservation.deleted_at, reservation.reason = at, event.reason
            case ReservationRefused():
                pass  # a refusal is history (the read model shows it); nothing is held
            case _:
                raise TypeError(f"the scheduler log holds no {event.TYPE!r} events")

    def _fold_mig(self, event: MigReconfiguration, at: float) -> None:
        key = (event.node_id, event.gpu_index)
        if event.phase == "in_service":
            self.mig.pop(key, None)
            self.mig_history[key] = [*self.mig_history.get(key, [])[-(MIG_HISTORY - 1):], at]
            self.fleet.set_gpu_draining(event.node_id, event.gpu_index, False)
        else:
            self.mig[key] = event
            self.fleet.set_gpu_draining(event.node_id, event.gpu_index, True)

    def _next_seq(self) -> int:
        self.queue_seq += 1
        return self.queue_seq

    def _stop_confirmed(self, event: JobFinished | JobFailed | JobLost) -> bool:
        """Record the end of a cancelled (or ended gang's) placement on one node; True if the event was that."""
        job = self.jobs.get(event.job_id)
        if job is None or not job.stopping_nodes or event.placement_id not in (None, job.placement_id):
            return False
        if event.node_id is None:
            job.stopping_nodes = []
        elif event.node_id in job.stopping_nodes:
            job.stopping_nodes.remove(event.node_id)
        return True

    @staticmethod
    def _rank_stopped(job: JobRecord, node_id: str) -> None:
        if node_id not in job.stopped_nodes:
            job.stopped_nodes.append(node_id)

    def _rank_lost(self, job: JobRecord, node_id: str, reason: str) -> None:
        """A rank of an active placement is gone: recorded as ended there (the first loss names the reason)."""
        if job.state != "preempting" and not job.stopped_nodes:
            job.reason = reason
        self._rank_stopped(job, node_id)

    def _current(self, job_id: uuid.UUID, placement_id: uuid.UUID) -> JobRecord | None:
        """The job if ``placement_id`` is its current placement (events of older placements are history)."""
        job = self.jobs.get(job_id)
        return job if job is not None and job.placement_id == placement_id else None

    @staticmethod
    def _end(job: JobRecord, state: str, at: float, exit_code: int | None, reason: str | None = None) -> None:
        job.state, job.ended_at, job.exit_code = state, at, exit_code
        if reason is not None:
            job.reason = reason

    # -- derived views ----------------------------------------------------------------------------------------

    def active_jobs(self) -> list[JobRecord]:
        return list(self.active.values())

    def queued_jobs(self) -> list[JobRecord]:
        return list(self.queued.values())

    def _hold(self, job: JobRecord) -> None:
        """The job begins to hold its assignments: per node, for its tenant, in decayed usage."""
        job_id = job.job_id
        holding = self._held[job_id] = self._measure(job)
        for node_id, cpu, mem, gpus in holding.on:
            holders = self._holders.get(node_id)
            if holders is None:
                holders = self._holders[node_id] = set()
            holders.add(job_id)
            self._use(node_id, cpu, mem, gpus, +1)
        self._count_held(job.spec.tenant, holding, +1)

    def _release(self, job: JobRecord) -> None:
        """By what it held when it began to hold (a requeue clears the assignments before this runs)."""
        holding = self._held.pop(job.job_id, None)
        if holding is None:
            return
        for node_id, cpu, mem, gpus in holding.on:
            holders = self._holders.get(node_id)
            if holders is not None:
                holders.discard(job.job_id)
            self._use(node_id, cpu, mem, gpus, -1)
        self._count_held(job.spec.tenant, holding, -1)

    def _use(self, node_id: str, cpu: int, mem: int, gpus: tuple[tuple[str, int], ...], sign: int) -> None:
        use = self._node_use.get(node_id)
        if use is None:
            use = self._node_use[node_id] = [0, 0, {}]
        use[0] += sign * cpu
        use[1] += sign * mem
        milli = use[2]
        for gpu_uuid, amount in gpus:
            left = milli.get(gpu_uuid, 0) + sign * amount
            if left:
                milli[gpu_uuid] = left
            else:
                milli.pop(gpu_uuid, None)

    def _holding(self, nodes: set[str] | None) -> list[JobRecord]:
        """The jobs holding capacity (on ``nodes`` when given, by job id)."""
        if nodes is None:
            return [j for j in self.jobs.values() if j.holds_capacity]
        jobs = self.jobs
        found = {j for n in nodes for j in self._holders.get(n, ()) if j in jobs and jobs[j].holds_capacity}
        return [jobs[j] for j in sorted(found, key=str)]

    def jobs_on(self, node_id: str) -> list[JobRecord]:
        """The jobs holding capacity on ``node_id`` (from the fold's index of holders per node)."""
        return self._holding({node_id})

    def gpu_usage(self, nodes: set[str] | None = None) -> dict[tuple[str, str], tuple[int, int]]:
        """(node_id, gpu uuid) -> (milli used, memory MiB used) over active placements."""
        usage: dict[tuple[str, str], tuple[int, int]] = {}
        for job in self._holding(nodes):
            for assignment in job.assignments:
                for gpu in assignment.gpus:
                    milli, mem = usage.get((assignment.node_id, gpu.gpu_uuid), (0, 0))
                    usage[(assignment.node_id, gpu.gpu_uuid)] = (milli + gpu.milli, mem + (gpu.memory_mib or 0))
        return usage

    def host_usage(self, nodes: set[str] | None = None) -> dict[str, tuple[int, int]]:
        """node_id -> (cpu milli used, memory MiB used) over active placements."""
        usage: dict[str, tuple[int, int]] = {}
        for job in self._holding(nodes):
            for assignment in job.assignments:
                cpu, mem = usage.get(assignment.node_id, (0, 0))
                usage[assignment.node_id] = (cpu + job.spec.cpu_milli, mem + job.spec.memory_mib)
        return usage

    def capacity_violations(self, nodes: set[str] | None = None) -> list[str]:
        """Every way current allocations exceed capacity (empty when the invariant holds), sorted. On the whole
        state (``nodes`` None: tests, the crash drill) usage is re-derived from the jobs alone; on ``nodes`` (the
        plan applier, on every node a plan placed on) it is what the fold counted from the jobs as they began and
        stopped holding (``_node_use``): both are independent of the fleet's arrays."""
        if nodes is None:
            return self._violations(*self._derived_use())
        gpu_milli: dict[tuple[str, str], int] = {}
        host: dict[str, list[int]] = {}
        for node_id in nodes:
            use = self._node_use.get(node_id)
            if use is not None:
                host[node_id] = use[:2]
                gpu_milli.update(((node_id, gpu_uuid), milli) for gpu_uuid, milli in use[2].items())
        return self._violations(gpu_milli, host)

    def _derived_use(self) -> tuple[dict[tuple[str, str], int], dict[str, list[int]]]:
        """(node, GPU uuid) -> GPU-milli and node -> [mCPU, MiB] held, re-derived from the jobs alone."""
        gpu_milli: dict[tuple[str, str], int] = {}
        host: dict[str, list[int]] = {}
        for job in self._holding(None):
            cpu, mem = job.spec.cpu_milli, job.spec.memory_mib
            for assignment in job.assignments:
                node_id = assignment.node_id
                used = host.get(node_id)
                if used is None:
                    host[node_id] = [cpu, mem]
                else:
                    used[0] += cpu
                    used[1] += mem
                for gpu in assignment.gpus:
                    key = (node_id, gpu.gpu_uuid)
                    gpu_milli[key] = gpu_milli.get(key, 0) + gpu.milli
        return gpu_milli, host

    def _violations(self, gpu_milli: dict[tuple[str, str], int], host: dict[str, list[int]]) -> list[str]:
        problems: list[str] = []
        for (node_id, gpu_uuid), milli in gpu_milli.items():
            if milli > 1000:
                problems.append(f"{node_id}/{gpu_uuid}: {milli} milli allocated")
            node = self.nodes.get(node_id)
            if node is not None and gpu_uuid not in _device_uuids(node.inventory):
                problems.append(f"{node_id}/{gpu_uuid}: allocated but not in inventory")
        for node_id, (cpu, mem) in host.items():
            node = self.nodes.get(node_id)
            if node is not None and (cpu > node.inventory.cpu_milli or mem > node.inventory.memory_mib):
                problems.append(f"{node_id}: host cpu {cpu}/{node.inventory.cpu_milli} mem {mem}")
        return sorted(problems)

    # -- snapshots --------------------------------------------------------------------------------------------

    def snapshot_json(self) -> str:
        """``to_snapshot()`` as JSON text, built from each record's JSON kept since it last changed: the cost of a
        snapshot grows with what changed since the last one, plus one string join."""
        cache = self._json
        jobs = []
        for job_id, job in self.jobs.items():
            text = cache.get(job_id)
            if text is None:
                text = cache[job_id] = json.dumps(job.to_dict())
            jobs.append(text)
        nodes = []
        for node_id, node in self.nodes.items():
            text = cache.get(("node", node_id))
            if text is None:
                text = cache[("node", node_id)] = json.dumps(node.to_dict())
            nodes.append(text)
        head = json.dumps({"version": 2, "position": self.position, "clock": self.clock, "queue_seq": self.queue_seq,
                           "ended": [[t, str(j)] for t, j in self._ended], **self._mig_snapshot(),
                           "arrays": [a.to_dict() for a in self.arrays.values()], "usage": self.usage.to_list(),
                           "reservations": [r.to_dict() for r in self.reservations.values()]})
        return f'{head[:-1]}, "jobs": [{", ".join(jobs)}], "nodes": [{", ".join(nodes)}]}}'

    def to_snapshot(self) -> dict[str, Any]:
        return {
            "version": 2, "position": self.position, "clock": self.clock, "queue_seq": self.queue_seq,
            "jobs": [j.to_dict() for j in self.jobs.values()],
            "nodes": [n.to_dict() for n in self.nodes.values()],
            "ended": [[t, str(j)] for t, j in self._ended], **self._mig_snapshot(),
            "arrays": [a.to_dict() for a in self.arrays.values()], "usage": self.usage.to_list(),
            "reservations": [r.to_dict() for r in self.reservations.values()],
        }

    def _mig_snapshot(self) -> dict[str, Any]:
        return {"mig": [e.model_dump(mode="json") for e in self.mig.values()],
                "mig_history": [[n, g, times] for (n, g), times in self.mig_history.items()]}

    @classmethod
    def from_snapshot(cls, raw: dict[str, Any], retention_s: float = DEFAULT_RETENTION_S,
                      half_life_s: float = DEFAULT_HALF_LIFE_S) -> SchedulerState:
        """The state a snapshot holds, with the fleet and the indexes rebuilt from it."""
        state = cls(position=raw["position"], retention_s=retention_s, clock=raw.get("clock", 0.0),
                    queue_seq=raw.get("queue_seq", 0), usage=DecayedUsage(half_life_s))
        for node in raw["nodes"]:
            record_n = NodeRecord.from_dict(node)
            state.nodes[record_n.node_id] = record_n
            if record_n.liveness != "alive":
                state.not_alive.add(record_n.node_id)
            state.fleet.upsert_node(record_n.inventory, record_n.schedulable, record_n.gpu_health)
        for raw_array in raw.get("arrays", []):
            array = ArrayRecord.from_dict(raw_array)
            state.arrays[array.array_id] = array
            if array.ended_at is None:
                state._link(array.array_id, array.spec)
        for job in raw["jobs"]:
            record = JobRecord.from_dict(job)
            state.jobs[record.job_id] = record
            if record.spec.depends_on and record.array_id is None and record.state not in TERMINAL_STATES:
                state._link(record.job_id, record.spec)
            if record.holds_capacity:
                state.fleet.hold(record.job_id, record.spec, record.assignments)
                state._hold(record)
                state.active[record.job_id] = record
                if record.spec.preemptible:
                    state.preemptible[record.job_id] = record
                if record.state == "preempting" or record.stopping_nodes or record.stopped_nodes:
                    state.stopping[record.job_id] = record
            elif record.state == "queued":
                state.queued[record.job_id] = record
                tenant = record.spec.tenant
                state.queued_by_tenant[tenant] = state.queued_by_tenant.get(tenant, 0) + 1
                if record.array_id is not None and record.array_id in state.arrays:
                    state.arrays[record.array_id].queued_tasks += 1
        for raw_event in raw.get("mig", []):
            event = MigReconfiguration.model_validate(raw_event)
            state.mig[(event.node_id, event.gpu_index)] = event
            state.fleet.set_gpu_draining(event.node_id, event.gpu_index, True)
        state.mig_history = {(n, int(g)): list(times) for n, g, times in raw.get("mig_history", [])}
        for t, j in raw.get("ended", []):
            state._ended.append((t, uuid.UUID(j)))
            state._ending.add(uuid.UUID(j))
        # the ledger as logged (holding the jobs above counted them again: the snapshot's rows already do)
        state.usage = DecayedUsage.from_list(raw.get("usage", []), half_life_s)
        for raw_reservation in raw.get("reservations", []):
            reservation = Reservation.from_dict(raw_reservation)
            state.reservations[reservation.reservation_id] = reservation
        return state


def outgrew_gpu_memory(event: JobFailed, job: JobRecord) -> bool:
    """Did this placement end because it outgrew its GPU memory: a share stopped by the executor's watchdog, or a
    MIG job out of memory in its slice (``escalation.py`` decides what follows)? Only an executor's report (it
    names the node); the scheduler's own failure after an escalation does not. Never a gang's rank: a rank that
    fails so ends the gang like any rank's failure (its other ranks stopped first), it is not escalated."""
    if event.node_id is None or job.spec.gang.nodes > 1:
        return False
    return event.stop_reason == "gpu_memory_exceeded" or (
        event.cause == "gpu_oom" and event.stop_reason is None and job.spec.resources.kind == "mig")


def stopped_as_asked(event: JobFailed) -> bool:
    """Did this placement end because the scheduler (or fencing) stopped it, rather than by itself?"""
    return event.stop_reason in ("preempt", "drain", "fenced") or event.cause in ("killed", "lost")


_DEVICES: dict[int, tuple[NodeInventory, frozenset[str]]] = {}


_GPUS: dict[int, tuple[NodeInventory, dict[int, tuple[int, str]]]] = {}


def _devices(inventory: NodeInventory) -> dict[int, tuple[int, str]]:
    """GPU index -> (memory MiB, model) of an inventory's GPUs, the first GPU of each index (once per inventory
    object: inventories are immutable)."""
    known = _GPUS.get(id(inventory))
    if known is not None and known[0] is inventory:
        return known[1]
    if len(_GPUS) > 100_000:
        _GPUS.clear()
    devices: dict[int, tuple[int, str]] = {}
    for gpu in inventory.gpus:
        devices.setdefault(gpu.index, (gpu.memory_total_mib, gpu.model))
    _GPUS[id(inventory)] = (inventory, devices)
    return devices


def _device_uuids(inventory: NodeInventory) -> frozenset[str]:
    """Every GPU and MIG instance uuid of an inventory (once per inventory object: inventories are immutable)."""
    known = _DEVICES.get(id(inventory))
    if known is not None and known[0] is inventory:
        return known[1]
    if len(_DEVICES) > 100_000:
        _DEVICES.clear()
    uuids = frozenset([g.uuid for g in inventory.gpus] + [m.uuid for g in inventory.gpus for m in g.mig_instances])
    _DEVICES[id(inventory)] = (inventory, uuids)
    return uuids


def allocation_for(job: JobRecord, node_id: str) -> list[GpuAllocation]:
    for assignment in job.assignments:
        if assignment.node_id == node_id:
            return list(assignment.gpus)
    return []
