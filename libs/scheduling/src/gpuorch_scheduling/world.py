"""The Harness's simulated nodes: what an executor and a node-agent would answer to the scheduler's commands.

    LaunchJob(node, placement)   node up ──► JobStarted after ``launch_s``; then JobFinished (exit 0) or JobFailed
                                             (nonzero_exit) when the job's remaining runtime has passed
    StopJob(node, placement)     node up ──► after min(grace, ``stop_s``): JobCheckpointed (a job that checkpoints,
                                             when stopped for a preemption or a drain: its progress is kept), then
                                             JobFailed(killed, stop_reason)
    ApplyMigLayout(node, GPUs)   node up ──► after ``mig_apply_s`` (+ ``mig_reset_s`` when it turns a GPU's MIG
                                             mode on or off): MigLayoutApplied (per GPU, applied or refused) and a
                                             NodeRegistered with the new instances
    a node that is down          answers nothing; its placements are fenced (they end with no report), and
                                 commands sent to it are lost, as on a real node cut off from the broker

Event ids are derived from the placement, the node and the kind, as a real executor's are (one per node, so a
gang's nodes each confirm their own stop). Pure and deterministic: times come from the Harness.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from gpuorch_contracts import (
    ApplyMigLayout,
    GpuInfo,
    JobCheckpointed,
    JobFailed,
    JobFinished,
    JobStarted,
    LaunchJob,
    Message,
    MigGpuOutcome,
    MigInstance,
    MigLayoutApplied,
    NodeInventory,
    NodeRegistered,
    StopJob,
)
from gpuorch_policy.mig_geometry import place_instances
from gpuorch_policy.mig_profiles import mig_table_for

CHECKPOINTED_ON = ("preempt", "drain")
"""Stop reasons on which a job that checkpoints writes its checkpoint (its progress survives the stop)."""


@dataclass
class Behaviour:
    """How a simulated job behaves once started (the workload decides; the scheduler never sees it)."""

    runtime_s: float
    """Seconds of work it needs in all (``math.inf``: it never ends by itself)."""
    exit_code: int = 0
    checkpoints: bool = True
    done_s: float = 0.0
    """Work kept by checkpoints of earlier placements."""
    kept: set[uuid.UUID] = field(default_factory=set)
    """Placements whose checkpoint counted (a gang's nodes checkpoint the same work once)."""


@dataclass
class _Run:
    job_id: uuid.UUID
    placement_id: uuid.UUID
    started_at: float | None = None
    token: int = 0
    """Identifies the pending start/finish event of this run; a stop or a fence changes it (the old one is void)."""


@dataclass
class SimNode:
    inventory: NodeInventory
    up: bool = True
    runs: dict[uuid.UUID, _Run] = field(default_factory=dict)
    generation: int = 0
    """Counts inventory changes (MIG layouts): part of the inventory hash."""

    @property
    def node_id(self) -> str:
        return self.inventory.node_id

    def registered(self) -> NodeRegistered:
        return NodeRegistered(message_id=_event_id(self.node_id, "registered", self.generation),
                              inventory=self.inventory, inventory_hash=f"{self.node_id}:{self.generation}")


Schedule = Callable[[float, Callable[[], list[Message]]], None]
"""``schedule(at, make)``: at simulated time ``at``, the messages ``make()`` returns reach the scheduler."""


@dataclass
class World:
    """Every simulated node, and how long their answers take."""

    launch_s: float | None = 0.0
    """Seconds from LaunchJob to JobStarted; None: placements never start (they hold capacity, nothing runs)."""
    stop_s: float = 1.0
    """Seconds a stopped job takes to end (at most its checkpoint grace)."""
    mig_apply_s: float = 5.0
    mig_reset_s: float = 0.0
    """Seconds more an ``ApplyMigLayout`` takes when it changes a GPU's MIG mode (the GPU reset NVML may need)."""
    nodes: dict[str, SimNode] = field(default_factory=dict)
    behaviour: dict[uuid.UUID, Behaviour] = field(default_factory=dict)
    _tokens: int = 0

    def add(self, inventory: NodeInventory) -> SimNode:
        node = self.nodes.get(inventory.node_id)
        if node is None:
            node = self.nodes[inventory.node_id] = SimNode(inventory)
        else:
            node.inventory, node.up = inventory, True
            node.generation += 1
        return node

    def fence(self, node_id: str) -> None:
        """The node goes silent: whatever ran there is stopped by its own executor, and nothing is reported."""
        node = self.nodes[node_id]
        node.up = False
        node.runs.clear()

    # -- commands ---------------------------------------------------------------------------------------------

    def command(self, message: Message, now: float, schedule: Schedule) -> None:
        """React to one command the scheduler published (others are ignored)."""
        node = self.nodes.get(getattr(message, "node_id", ""))
        if node is None or not node.up:
            return
        if isinstance(message, LaunchJob):
            self._launch(node, message, now, schedule)
        elif isinstance(message, StopJob):
            self._stop(node, message, now, schedule)
        elif isinstance(message, ApplyMigLayout):
            enabled = {g.index: g.mig_enabled for g in node.inventory.gpus}
            reset = any(enabled.get(layout.gpu_index, False) != bool(layout.profiles) for layout in message.layouts)
            delay = self.mig_apply_s + (self.mig_reset_s if reset else 0.0)
            schedule(now + delay, lambda: self._apply_mig(node, message))

    def _token(self) -> int:
        self._tokens += 1
        return self._tokens

    def _launch(self, node: SimNode, launch: LaunchJob, now: float, schedule: Schedule) -> None:
        if launch.placement_id in node.runs or self.launch_s is None:
            if self.launch_s is None:
                node.runs.setdefault(launch.placement_id, _Run(launch.job_id, launch.placement_id))
            return  # idempotent per placement, as a real executor is
        run = node.runs[launch.placement_id] = _Run(launch.job_id, launch.placement_id, token=self._token())
        token = run.token

        def started() -> list[Message]:
            if node.runs.get(launch.placement_id) is not run or run.token != token or not node.up:
                return []
            start = now + self.launch_s  # type: ignore[operator]
            run.started_at = start
            behaviour = self.behaviour.get(launch.job_id) or Behaviour(float("inf"))
            left = max(0.0, behaviour.runtime_s - behaviour.done_s)
            if left != float("inf"):
                schedule(start + left, lambda: self._ended(node, run, token))
            return [JobStarted(message_id=_event_id(launch.placement_id, "started", node.node_id),
                               job_id=launch.job_id, placement_id=launch.placement_id, node_id=node.node_id)]

        schedule(now + self.launch_s, started)  # type: ignore[operator]

    def _ended(self, node: SimNode, run: _Run, token: int) -> list[Message]:
        if node.runs.get(run.placement_id) is not run or run.token != token or not node.up:
            return []
        del node.runs[run.placement_id]
        behaviour = self.behaviour.get(run.job_id) or Behaviour(float("inf"))
        duration = behaviour.runtime_s - behaviour.done_s
        common = {"message_id": _event_id(run.placement_id, "outcome", node.node_id), "job_id": run.job_id,
                  "placement_id": run.placement_id, "node_id": node.node_id}
        if behaviour.exit_code == 0:
            return [JobFinished(**common, exit_code=0, duration_s=max(0.0, duration))]
        return [JobFailed(**common, cause="nonzero_exit", reason=f"exit code {behaviour.exit_code}",
                          exit_code=behaviour.exit_code, duration_s=max(0.0, duration))]

    def _stop(self, node: SimNode, stop: StopJob, now: float, schedule: Schedule) -> None:
        run = node.runs.get(stop.placement_id)
        if run is None:
            run = _Run(stop.job_id, stop.placement_id)  # never launched here (lost, or not yet): confirm at once
            node.runs[stop.placement_id] = run
        run.token = self._token()
        token = run.token
        ends = now + min(stop.grace_s, self.stop_s) if run.started_at is not None else now

        def stopped() -> list[Message]:
            if node.runs.get(stop.placement_id) is not run or run.token != token or not node.up:
                return []
            del node.runs[stop.placement_id]
            behaviour = self.behaviour.get(run.job_id)
            out: list[Message] = []
            ran = ends - run.started_at if run.started_at is not None else 0.0
            if behaviour is not None and behaviour.checkpoints and stop.reason in CHECKPOINTED_ON \
                    and run.started_at is not None:
                if stop.placement_id not in behaviour.kept:
                    behaviour.kept.add(stop.placement_id)
                    behaviour.done_s = min(behaviour.runtime_s, behaviour.done_s + ran)
                out.append(JobCheckpointed(message_id=_event_id(stop.placement_id, "checkpointed", node.node_id),
                                           job_id=run.job_id, placement_id=stop.placement_id, node_id=node.node_id))
            out.append(JobFailed(message_id=_event_id(stop.placement_id, "outcome", node.node_id),
                                 job_id=run.job_id, placement_id=stop.placement_id, node_id=node.node_id,
                                 cause="killed", reason=f"stopped ({stop.reason})", exit_code=143,
                                 duration_s=max(0.0, ran), stop_reason=stop.reason))
            return out

        schedule(ends, stopped)

    def _apply_mig(self, node: SimNode, command: ApplyMigLayout) -> list[Message]:
        if not node.up:
            return []
        gpus = {g.index: g for g in node.inventory.gpus}
        outcomes = []
        for layout in command.layouts:
            gpu = gpus.get(layout.gpu_index)
            table = mig_table_for(gpu.model) if gpu is not None else ()
            slots = place_instances(table, (), list(layout.profiles)) if table else None
            if gpu is None or (layout.profiles and slots is None):
                outcomes.append(MigGpuOutcome(gpu_index=layout.gpu_index, applied=False,
                                              reason="no valid layout holds these profiles on this GPU"))
                continue
            specs = {p.name: p for p in table}
            instances = [MigInstance(uuid=f"MIG-{gpu.uuid}-{node.generation + 1}-{k}", profile=s.profile,
                                     memory_mib=specs[s.profile].memory_mib, slices=specs[s.profile].compute_slices,
                                     placement_start=s.start, placement_size=specs[s.profile].memory_slices)
                         for k, s in enumerate(slots or ())]
            gpus[gpu.index] = gpu.model_copy(update={"mig_enabled": bool(layout.profiles),
                                                     "mig_instances": instances})
            outcomes.append(MigGpuOutcome(gpu_index=layout.gpu_index, applied=True, reason="applied"))
        node.inventory = node.inventory.model_copy(update={"gpus": [gpus[i] for i in sorted(gpus)]})
        node.generation += 1
        answer = MigLayoutApplied(message_id=_event_id(command.message_id, "mig-answer", node.node_id),
                                  node_id=node.node_id, command_id=str(command.message_id), outcomes=outcomes)
        return [answer, node.registered()]


def with_mig_layout(gpu: GpuInfo, profiles: list[str], tag: str = "0") -> GpuInfo:
    """``gpu`` partitioned into ``profiles`` (a static layout for a simulated fleet); unchanged if none fit."""
    table = mig_table_for(gpu.model)
    slots = place_instances(table, (), profiles) if table and profiles else None
    if not slots:
        return gpu
    specs = {p.name: p for p in table}
    return gpu.model_copy(update={"mig_enabled": True, "mig_instances": [
        MigInstance(uuid=f"MIG-{gpu.uuid}-{tag}-{k}", profile=s.profile, memory_mib=specs[s.profile].memory_mib,
                    slices=specs[s.profile].compute_slices, placement_start=s.start,
                    placement_size=specs[s.profile].memory_slices) for k, s in enumerate(slots)]})


_NAMESPACE = uuid.UUID("0b9f6a8e-5c1d-4f2a-9e37-2d8c4b6a1f03")


def _event_id(*parts: object) -> uuid.UUID:
    return uuid.uuid5(_NAMESPACE, ":".join(str(p) for p in parts))
