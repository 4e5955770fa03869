"""MIG layouts that follow demand, planned and carried out by the scheduler (pure: state and time in, events out).

    every ``plan_interval_s``, at a tick, while MIG matters (a waiting job accepts MIG profiles, or a GPU is in MIG
    mode) and the mode is not ``off``:
        planner_input(state) ──► gpuorch_policy.plan_mig ──► MigPlanProposed (published when the proposals change;
                                                              telemetry turns them into recommendations)
        mode ``auto``: MigExecution.start(each proposal)   ──► MigReconfiguration(draining): no new placements there
    every tick: MigExecution.tick(jobs still on each draining GPU, which of them are preemptible)
        Preempt            ──► JobPreempting + StopJob(reason preempt, the job's checkpoint grace), then the usual
                               requeue once its executor confirms the stop
        SendApplyMigLayout ──► ApplyMigLayout (commands) + MigReconfiguration(applying, command_id)
        Resume / Alert     ──► MigReconfiguration(in_service, applied or not) [+ FleetAlert]
    MigLayoutApplied (the node-agent's answer) ──► MigExecution.applied ──► MigReconfiguration(in_service)

Contract:
- The execution's state is the fold of the logged ``MigReconfiguration`` events (``SchedulerState.mig``,
  ``mig_history``): a restarted scheduler rebuilds it from the log, so a GPU being drained stays closed to new
  placements and an ``ApplyMigLayout`` is never sent while a job holds the GPU or one of its instances.
- ``MigExecution`` (``gpuorch_policy.mig_execution``) decides every step; this module only reads the state into it
  and writes its actions out as events (``execution_of`` / ``actions_to_decision``).
- Only preemptible jobs are preempted, after ``ExecutionSettings.drain_wait_s``, through the same JobPreempting +
  StopJob a priority preemption uses (checkpoint signal, the job's grace, requeue); others are waited for.
- Planner input from the scheduler's view: GPUs of alive nodes whose model has a MIG table; waiting whole-GPU and
  MIG jobs (declared GPU memory, and the peak earlier jobs of the same name used: telemetry's rollups, read by the
  service before each plan); runtime
  left from each job's estimate or limit (a preemptible job leaves within its grace). Warm-pool demand samples are
  kept in memory by the caller (one per plan) and re-learned after a restart.
"""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from gpuorch_contracts import (
    ApplyMigLayout,
    FleetAlert,
    JobPreempting,
    MigGpuLayout,
    MigLayoutApplied,
    MigPlanProposed,
    MigProposalView,
    MigReconfiguration,
    MigSlot,
)
from gpuorch_policy.mig_execution import (
    Action,
    Alert,
    ExecutionSettings,
    MigExecution,
    Preempt,
    Reconfiguration,
    Resume,
    SendApplyMigLayout,
)
from gpuorch_policy.mig_geometry import Slot
from gpuorch_policy.mig_planner import (
    MIG_PLAN_NOTE,
    GpuState,
    InstanceState,
    MigPlan,
    MigProposal,
    PendingJob,
    PlannerSettings,
    describe,
    plan_mig,
    slice_demand,
)
from gpuorch_policy.mig_profiles import mig_table_for

from gpuorch_scheduling.decisions import Decision, at, decision_id, stops
from gpuorch_scheduling.state import SchedulerState

GpuKey = tuple[str, int]
UNKNOWN_END_S = 3600.0


@dataclass(frozen=True)
class MigControl:
    """How the scheduler plans and changes MIG layouts (``GPUORCH_MIG_*`` settings)."""

    planner: PlannerSettings = field(default_factory=PlannerSettings)
    execution: ExecutionSettings = field(default_factory=ExecutionSettings)
    plan_interval_s: float = 60.0
    pool_samples: int = 31
    """Warm-pool demand samples kept (one per plan): ``pool_window_s / plan_interval_s`` + 1 by default."""

    @property
    def mode(self) -> str:
        return self.planner.mode


# -- reading the state ------------------------------------------------------------------------------------------


def slots(layout: Sequence[MigSlot] | None) -> tuple[Slot, ...] | None:
    return None if layout is None else tuple(Slot(s.profile, s.start) for s in layout)


def mig_slots(layout: Sequence[Slot] | None) -> list[MigSlot] | None:
    return None if layout is None else [MigSlot(profile=s.profile, start=s.start) for s in layout]


def reconfiguration_of(event: MigReconfiguration) -> Reconfiguration:
    """The execution's record of one GPU from the last logged step of its reconfiguration."""
    proposal = MigProposal(event.node_id, event.gpu_index, event.model, slots(event.current), slots(event.target),
                           tuple(event.drains), tuple(event.enables), event.reason)
    began = event.occurred_at.timestamp()
    since = event.started_at if event.phase == "draining" and event.started_at is not None else began
    return Reconfiguration(proposal, event.phase, since, frozenset(event.preempted),  # type: ignore[arg-type]
                           event.command_id)


def execution_of(state: SchedulerState, settings: ExecutionSettings) -> MigExecution:
    """A ``MigExecution`` holding every reconfiguration under way in ``state`` (a fresh object each call)."""
    return MigExecution(settings, {key: reconfiguration_of(e) for key, e in state.mig.items()})


def holders(state: SchedulerState, node_id: str) -> dict[int, set[str]]:
    """GPU index -> the jobs holding that GPU or one of its MIG instances on ``node_id``."""
    found: dict[int, set[str]] = {}
    for job_id, assignments in state.fleet.holdings(node_id):
        for assignment in assignments:
            if assignment.node_id == node_id:
                for alloc in assignment.gpus:
                    found.setdefault(alloc.gpu_index, set()).add(str(job_id))
    return found


def draining_jobs(state: SchedulerState) -> tuple[dict[GpuKey, set[str]], set[str]]:
    """(jobs still on each GPU under reconfiguration, the ones among them that may be preempted now)."""
    running: dict[GpuKey, set[str]] = {}
    by_node: dict[str, dict[int, set[str]]] = {}
    for node_id, gpu_index in state.mig:
        on_node = by_node.setdefault(node_id, holders(state, node_id))
        running[(node_id, gpu_index)] = on_node.get(gpu_index, set())
    preemptible = set()
    for jobs in running.values():
        for job_id in jobs:
            job = state.jobs.get(uuid.UUID(job_id))
            if job is not None and job.spec.preemptible and job.state in ("placed", "running"):
                preemptible.add(job_id)
    return running, preemptible


def mig_matters(state: SchedulerState) -> bool:
    """Whether a plan could propose anything: a waiting job accepts MIG profiles, or a GPU is in MIG mode."""
    if any(job.spec.resources.mig_profiles for job in state.queued.values()):
        return True
    return any(gpu.mig_enabled for node in state.nodes.values() for gpu in node.inventory.gpus)


def planner_input(state: SchedulerState, now: float, peaks: Mapping[str, int] | None = None
                  ) -> tuple[list[GpuState], list[PendingJob], dict[str, float]]:
    """(GPUs, waiting jobs, seconds until each running job leaves its GPU) as the planner reads them; ``peaks``:
    job name -> the peak GPU memory earlier jobs of that name used (telemetry's rollups)."""
    gpus: list[GpuState] = []
    running: set[str] = set()
    for node_id, node in state.nodes.items():
        if node.liveness != "alive":
            continue
        capable = [g for g in node.inventory.gpus if mig_table_for(g.model)]
        if not capable:
            continue
        on_node = holders(state, node_id)
        by_uuid = {alloc.gpu_uuid: str(job_id) for job_id, assignments in state.fleet.holdings(node_id)
                   for a in assignments if a.node_id == node_id for alloc in a.gpus if alloc.mig_profile}
        for gpu in capable:
            instances = tuple(InstanceState(m.profile, m.placement_start, by_uuid.get(m.uuid), m.uuid)
                              for m in gpu.mig_instances) if gpu.mig_enabled else ()
            whole = () if gpu.mig_enabled else tuple(sorted(on_node.get(gpu.index, set())))  # whole or shares
            key = (node_id, gpu.index)
            healthy = node.gpu_health.get(gpu.index, gpu.health) in ("healthy", "degraded")
            gpus.append(GpuState(node_id, gpu.index, gpu.model, gpu.mig_enabled, instances, whole,
                                 in_service=healthy and key not in state.mig,
                                 reconfigured_at=tuple(state.mig_history.get(key, ()))))
            running.update(i.job_id for i in instances if i.job_id)
            running.update(whole)
    pending = []
    for job in state.queued.values():
        resources = job.spec.resources
        if not resources.gpus and not resources.mig_profiles:
            continue
        pending.append(PendingJob(
            str(job.job_id), job.spec.tier, max(0.0, now - job.enqueued_at), whole_gpus=resources.gpus,
            nodes=job.spec.gang.nodes, mig_profiles=tuple(resources.mig_profiles),
            memory_mib=resources.gpu_memory_mib, gpu_models=tuple(resources.gpu_models),
            peak_memory_mib=(peaks or {}).get(job.spec.name) if resources.mig_profiles else None))
    ends_in: dict[str, float] = {}
    for job_id in running:
        job = state.jobs.get(uuid.UUID(job_id))
        if job is None:
            continue
        if job.spec.preemptible:
            ends_in[job_id] = job.spec.checkpoint.grace_s
            continue
        length = job.spec.runtime_estimate_s or job.spec.max_runtime_s
        begun = job.started_at or job.placed_at or now
        ends_in[job_id] = max(0.0, begun + length - now) if length else UNKNOWN_END_S
    return gpus, pending, ends_in


def demand_sample(gpus: Sequence[GpuState], pending: Sequence[PendingJob], headroom: float) -> int:
    """One warm-pool sample: the compute slices running MIG jobs hold plus those waiting inference would get, on
    the MIG table of the fleet's most common MIG-capable model."""
    models = Counter(g.model for g in gpus)
    if not models:
        return 0
    table = mig_table_for(models.most_common(1)[0][0])
    held = [i.profile for g in gpus for i in g.instances if i.job_id]
    return slice_demand(held, [j for j in pending if j.tier == "inference"], table, headroom)


def plan(state: SchedulerState, control: MigControl, now: float, demand: list[tuple[float, int]],
         peaks: Mapping[str, int] | None = None) -> MigPlan:
    """The planner's proposals for the fleet now. ``demand``: the warm pool's samples, kept by the caller; this
    plan's sample is appended (and samples beyond ``control.pool_samples`` dropped) before planning. ``peaks``:
    see ``planner_input``."""
    gpus, pending, ends_in = planner_input(state, now, peaks)
    demand.append((now, demand_sample(gpus, pending, control.planner.peak_headroom)))
    del demand[: max(0, len(demand) - control.pool_samples)]
    drained = frozenset(j for e in state.mig.values() for j in e.drains)
    return plan_mig(gpus, pending, control.planner, now, drained=drained, demand=demand, ends_in=ends_in,
                    under_way=under_way_slices(state))


def under_way_slices(state: SchedulerState) -> int:
    """Compute slices in MIG mode the reconfigurations under way will leave (the planner's pool counts them)."""
    total = 0
    for event in state.mig.values():
        sizes = {p.name: p.compute_slices for p in mig_table_for(event.model)}
        total += sum(sizes.get(s.profile, 0) for s in event.target or ())
    return total


def plan_message(result: MigPlan) -> MigPlanProposed | None:
    """The published form of a plan (None in mode ``off``)."""
    if result.mode == "off":
        return None
    return MigPlanProposed(mode=result.mode, unmet_jobs=len(result.unmet), held_back=len(result.held_back),
                           proposals=[_view(p) for p in result.proposals[:1000]])


def _view(p: MigProposal) -> MigProposalView:
    return MigProposalView(node_id=p.node_id, gpu_index=p.gpu_index, model=p.model[:128], current=mig_slots(p.current),
                           target=mig_slots(p.target), needs_reset=p.needs_reset, drains=list(p.drains[:64]),
                           enables=list(p.enables[:256]), reason=p.reason[:1000])


def plan_key(message: MigPlanProposed | None) -> tuple[object, ...]:
    """What makes two published plans the same (the proposals' GPUs and targets)."""
    if message is None:
        return ()
    return tuple((p.node_id, p.gpu_index, describe(slots(p.target))) for p in message.proposals)


def awaiting_plan_note(control: MigControl) -> str:
    """The pending-reason note of a MIG job no plan has judged yet (it waits out the batching window): for jobs
    whose reason begins with ``NO_FREE_MIG``."""
    return (f"{MIG_PLAN_NOTE}considers it at a coming plan (one every {control.plan_interval_s:g} s, for jobs "
            f"waiting {control.planner.min_pending_s:g} s or more)")


def waiting_notes(plan: MigPlanProposed | None, under_way: Iterable[MigReconfiguration]) -> dict[uuid.UUID, str]:
    """Job id -> what the MIG plan does for that waiting job, for its pending reason: a reconfiguration under way
    whose new layout will host it, or (when none) a proposal that would. Advise mode says who can apply it."""
    notes: dict[uuid.UUID, str] = {}
    if plan is not None:
        for p in plan.proposals:
            where = f"{p.node_id} GPU {p.gpu_index}"
            note = (f"{MIG_PLAN_NOTE}repartitions {where} for it" if plan.mode == "auto" else
                    f"{MIG_PLAN_NOTE}(mode advise) would repartition {where} for it: `gpuctl mig plan`; an operator "
                    "applies it, or GPUORCH_MIG_MODE=auto lets the scheduler")
            for job_id in p.enables:
                notes.setdefault(uuid.UUID(job_id), note)
    for r in under_way:
        if r.phase != "in_service":
            for job_id in r.enables:
                notes[uuid.UUID(job_id)] = (f"{MIG_PLAN_NOTE}is repartitioning {r.node_id} GPU {r.gpu_index} for it "
                                            f"({r.phase})")
    return notes


# -- writing the execution's actions as events --------------------------------------------------------------------


def actions_to_decision(state: SchedulerState, execution: MigExecution, actions: Iterable[Action], now: float
                        ) -> Decision:
    """The events and commands that carry out ``actions`` (which ``execution`` just returned). Every GPU an action
    names gets one ``MigReconfiguration`` for its phase after the actions (``execution.active``), so the log folds
    to the execution's state."""
    decision = Decision()
    touched: dict[GpuKey, None] = {}
    resumed: dict[GpuKey, Resume] = {}
    alerts: dict[GpuKey, str] = {}
    for action in actions:
        if isinstance(action, SendApplyMigLayout):
            key = (action.node_id, action.gpu_index)
            reconf = execution.active.get(key)
            command = ApplyMigLayout(
                message_id=decision_id("apply-mig", action.node_id, action.gpu_index, reconf.since if reconf else now),
                node_id=action.node_id, reason=action.reason[:1000],
                layouts=[MigGpuLayout(gpu_index=action.gpu_index, profiles=list(action.profiles))])
            execution.sent(key, str(command.message_id))
            decision.published.append(command)
        elif isinstance(action, Preempt):
            key = action.gpu
            decision.extend(_preempt(state, action))
        elif isinstance(action, Resume):
            key = action.gpu
            resumed[key] = action
        elif isinstance(action, Alert):
            key = action.gpu
            alerts[key] = action.message
            decision.published.append(FleetAlert(
                message_id=decision_id("alert", "mig", key[0], key[1], now), kind="mig_reconfiguration",
                explanation=action.message[:1000], node_ids=[key[0]]))
        else:
            key = action.gpu
        touched[key] = None
    for key in touched:
        reconf = execution.active.get(key)
        if reconf is not None:
            decision.logged.append(_step(reconf, reconf.phase, now))
            continue
        before = state.mig.get(key)
        if before is None:
            continue
        done = resumed.get(key)
        applied = bool(done and done.applied)
        reason = alerts.get(key) or (f"applied {describe(slots(before.target))}" if applied else before.reason)
        decision.logged.append(before.model_copy(update={
            "message_id": decision_id("mig", key[0], key[1], "in_service", now), "phase": "in_service", "applied": applied, "reason": reason[:1000],
            "occurred_at": at(now)}))
    return decision


def _step(reconf: Reconfiguration, phase: str, now: float) -> MigReconfiguration:
    p = reconf.proposal
    return MigReconfiguration(
        message_id=decision_id("mig", p.node_id, p.gpu_index, phase, now, reconf.command_id), node_id=p.node_id, gpu_index=p.gpu_index, model=p.model[:128], phase=phase,  # type: ignore[arg-type]
        current=mig_slots(p.current), target=mig_slots(p.target), drains=list(p.drains[:64]),
        enables=list(p.enables[:256]), preempted=sorted(reconf.preempted)[:64], command_id=reconf.command_id,
        reason=p.reason[:1000], started_at=reconf.since if phase == "draining" else None, occurred_at=at(now))


def _preempt(state: SchedulerState, action: Preempt) -> Decision:
    """Stop one job on a GPU being reconfigured the way a priority preemption does: checkpoint signal, its grace."""
    job = state.jobs.get(uuid.UUID(action.job_id))
    if job is None or job.placement_id is None or job.state not in ("placed", "running"):
        return Decision()
    decision = Decision(logged=[JobPreempting(
        message_id=decision_id("mig-preempt", job.job_id, job.placement_id), job_id=job.job_id,
        placement_id=job.placement_id, reason=action.reason[:1000])])
    decision.published.extend(stops(job, "preempt"))
    return decision


def start(state: SchedulerState, control: MigControl, result: MigPlan, now: float) -> Decision:
    """Mode ``auto``: begin every executable proposal (a GPU already under reconfiguration is left alone)."""
    execution = execution_of(state, control.execution)
    actions: list[Action] = []
    for proposal in result.executable:
        actions += execution.start(proposal, now)
    return actions_to_decision(state, execution, actions, now)


def advance(state: SchedulerState, control: MigControl, now: float) -> Decision:
    """Each tick: drain, preempt, apply or time out the reconfigurations under way."""
    if not state.mig:
        return Decision()
    execution = execution_of(state, control.execution)
    running, preemptible = draining_jobs(state)
    return actions_to_decision(state, execution, execution.tick(running, preemptible, now), now)


def answered(state: SchedulerState, control: MigControl, message: MigLayoutApplied, now: float) -> Decision:
    """The node-agent's ``MigLayoutApplied``: each outcome for a GPU this scheduler is applying a layout to. An
    applied layout that the node's inventory does not show yet is noted (step ``applying``, ``applied`` true) and
    the GPU resumes when the inventory arrives (``inventory_arrived``): nothing is placed on instances that no
    longer exist."""
    execution = execution_of(state, control.execution)
    actions: list[Action] = []
    waiting: list[MigReconfiguration] = []
    for outcome in message.outcomes:
        key = (message.node_id, outcome.gpu_index)
        before = state.mig.get(key)
        if before is not None and outcome.applied and before.phase == "applying" and \
                before.command_id in (None, message.command_id) and not layout_shown(state, before):
            waiting.append(before.model_copy(update={
                "message_id": decision_id("mig-applied", key[0], key[1], message.command_id, now), "applied": True, "occurred_at": at(now),
                "reason": f"{before.reason}; applied ({outcome.reason}), waiting for the node's new inventory"[:1000]}))
            continue
        actions += execution.applied(key, message.command_id, outcome.applied, outcome.reason, now)
    decision = actions_to_decision(state, execution, actions, now)
    decision.logged.extend(waiting)
    return decision


def inventory_arrived(state: SchedulerState, control: MigControl, node_id: str, now: float) -> Decision:
    """A node's new inventory: GPUs whose applied layout it now shows go back into service."""
    execution = execution_of(state, control.execution)
    actions: list[Action] = []
    for (node, gpu_index), event in list(state.mig.items()):
        if node == node_id and event.phase == "applying" and event.applied and layout_shown(state, event):
            actions += execution.applied((node, gpu_index), event.command_id or "", True, "applied", now)
    return actions_to_decision(state, execution, actions, now)


def layout_shown(state: SchedulerState, event: MigReconfiguration) -> bool:
    """Whether the node's inventory shows ``event``'s target on its GPU (profiles; the node-agent chooses the
    positions)."""
    node = state.nodes.get(event.node_id)
    gpu = next((g for g in node.inventory.gpus if g.index == event.gpu_index), None) if node else None
    if gpu is None:
        return False
    if event.target is None:
        return not gpu.mig_enabled
    return gpu.mig_enabled and sorted(m.profile for m in gpu.mig_instances) == sorted(s.profile for s in event.target)
