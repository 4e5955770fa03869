"""Node leases and runtime limits: which nodes are alive, suspect or lost, and which jobs overran.

Pure: the lease times and ``now`` are passed in (the service measures leases on a monotonic clock, the Harness on its
simulated one). ``Leases`` is the scheduler's memory of the last renewals (never logged: heartbeats are latest-wins
state), kept in renewal order so that a tick finds the silent nodes at its front: a tick costs O(silent nodes + nodes
not alive), not O(fleet). ``Deadlines`` does the same for max runtimes. The transitions are logged as
``NodeLivenessChanged``.
"""

from __future__ import annotations

import heapq
import uuid
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from gpuorch_contracts import TERMINAL_STATES, NodeLivenessChanged

from gpuorch_scheduling.decisions import Decision, at, decision_id, rank_ended, stop, stops
from gpuorch_scheduling.state import JobRecord, SchedulerState


@dataclass(frozen=True)
class LivenessPolicy:
    """Lease timings. ``lost_after_s`` must exceed the executors' fencing deadline so a job never runs twice."""

    suspect_after_s: float = 15.0
    lost_after_s: float = 90.0
    mass_silence_fraction: float = 0.5
    fencing_margin_s: float = 5.0
    """Seconds past an executor's own fencing deadline before its node is declared lost."""


@dataclass(frozen=True)
class ExecutorLease:
    """The executor's half of a node's lease: when it last renewed (lease clock) and its own fencing deadline."""

    seen_at: float
    fencing_deadline_s: float


class Leases:
    """The last renewal of each node's lease, both halves, in renewal order (oldest first). Renewal times must not
    decrease (a monotonic clock): the silent nodes are then the ones at the front."""

    def __init__(self, agents: Mapping[str, float] | None = None,
                 executors: Mapping[str, ExecutorLease] | None = None) -> None:
        self.agents: OrderedDict[str, float] = OrderedDict()
        """Node -> when its node-agent last renewed the lease."""
        self.executors: OrderedDict[str, ExecutorLease] = OrderedDict()
        """Node -> the executor's half (once one was received)."""
        for node_id, at_ in sorted((agents or {}).items(), key=lambda kv: kv[1]):
            self.renew_agent(node_id, at_)
        for node_id, lease in sorted((executors or {}).items(), key=lambda kv: kv[1].seen_at):
            self.renew_executor(node_id, lease)

    def renew_agent(self, node_id: str, at_: float) -> None:
        self.agents[node_id] = at_
        self.agents.move_to_end(node_id)

    def renew_executor(self, node_id: str, lease: ExecutorLease) -> None:
        self.executors[node_id] = lease
        self.executors.move_to_end(node_id)

    def ages(self, node_id: str, now: float) -> tuple[float, float | None]:
        """Seconds since each half was renewed (a node-agent never heard from counts as just renewed; None: no
        executor heard from)."""
        lease = self.executors.get(node_id)
        return now - self.agents.get(node_id, now), (now - lease.seen_at if lease is not None else None)

    def silent(self, now: float, after_s: float) -> set[str]:
        """Nodes with a half not renewed for more than ``after_s``."""
        found: set[str] = set()
        for node_id, at_ in self.agents.items():
            if now - at_ <= after_s:
                break
            found.add(node_id)
        for node_id, lease in self.executors.items():
            if now - lease.seen_at <= after_s:
                break
            found.add(node_id)
        return found


def liveness(
    state: SchedulerState, leases: Leases, now: float, policy: LivenessPolicy,
) -> tuple[Decision, str | None]:
    """Lease transitions, and an alert text when most nodes went silent at once. Looks only at the nodes whose lease
    lapsed and those not alive (a fresh, alive node changes nothing).

    A node's lease has two halves: its node-agent's heartbeats and, once one was received, its executor's. A node is ``alive`` only while both are fresh (``suspect_after_s``); otherwise it is
    ``suspect`` and gets no new work. It is declared ``lost`` (its jobs requeued; a gang's once its other ranks,
    stopped, ended too: ``decisions.rank_ended``) only when whatever runs its jobs
    has been silent long enough that they are surely stopped: the executor's silence past ``lost_after_s`` and past
    its own fencing deadline (a silent node-agent with a live executor never loses the node's jobs: they still
    run there); for a node whose executor was never heard from, the node-agent's silence past ``lost_after_s``.

    When more than ``mass_silence_fraction`` of the nodes not already lost are past the suspect deadline, no node is
    declared lost (a broker or network fault is likelier than many dead nodes): the alert is returned instead. A
    node already lost (dead, or removed from the fleet: scale-in, decommissioning) stays silent for good; it counts
    neither as silent nor in the fleet, or a fleet's past departures would turn one node's failure into a mass
    silence that requeues nothing, for ever.
    """
    decision = Decision()
    silent = {n for n in leases.silent(now, policy.suspect_after_s) if n in state.nodes}
    judged = {n for n in state.not_alive if state.nodes[n].liveness == "lost"}
    fleet = len(state.nodes) - len(judged)
    mass = fleet >= 2 and len(silent - judged) > policy.mass_silence_fraction * fleet
    lost_ranks: dict[uuid.UUID, set[str]] = {}  # job -> its nodes declared lost in this tick (not folded yet)
    for node_id in sorted(silent | state.not_alive):
        node = state.nodes[node_id]
        agent_age, executor_age = leases.ages(node_id, now)
        if node_id not in silent:
            if node.liveness != "alive":
                decision.logged.append(NodeLivenessChanged(
                    message_id=decision_id("liveness", node_id, "alive", now), node_id=node_id, liveness="alive",
                    reason="heartbeat", occurred_at=at(now)))
                # back from lost: whatever of its old placements still runs there (fencing failed) must stop
                decision.published.extend(stop(node_id, job_id, placement_id, "drain", 0)
                                          for job_id, placement_id in node.fenced)
            continue
        if executor_age is None:
            gone, why = agent_age > policy.lost_after_s, f"no heartbeat for {agent_age:.0f}s"
        else:
            deadline = max(policy.lost_after_s, leases.executors[node_id].fencing_deadline_s + policy.fencing_margin_s)
            gone, why = executor_age > deadline, f"its executor silent for {executor_age:.0f}s"
        if gone and node.liveness != "lost" and not mass:
            decision.logged.append(NodeLivenessChanged(
                message_id=decision_id("liveness", node_id, "lost", now), node_id=node_id, liveness="lost",
                reason=why, occurred_at=at(now)))
            for job in state.active_jobs():
                if job.state in TERMINAL_STATES:
                    continue  # a cancelled placement still stopping: the lost event frees it
                if any(a.node_id == node_id for a in job.assignments):
                    ended = lost_ranks.setdefault(job.job_id, set())
                    ended.add(node_id)  # a gang's other ranks are stopped and held until they end too
                    decision.extend(rank_ended(job, ended, f"node {node_id} lost"))
        elif node.liveness == "alive":
            silence = f"no heartbeat for {agent_age:.0f}s" if agent_age > policy.suspect_after_s else \
                f"its executor silent for {executor_age:.0f}s"
            decision.logged.append(NodeLivenessChanged(
                message_id=decision_id("liveness", node_id, "suspect", now), node_id=node_id, liveness="suspect",
                reason=silence, occurred_at=at(now)))
    alert = None
    if mass:
        alert = f"{len(silent)} of {len(state.nodes)} nodes silent at once; not requeueing their jobs"
    return decision, alert


MAX_RUNTIME_MARGIN_S = 30.0


def overdue(state: SchedulerState, now: float, already_stopped: set[uuid.UUID] | None = None,
            jobs: Iterable[JobRecord] | None = None) -> Decision:
    """Stop running jobs past their max runtime (the executor enforces it too; this covers an executor that
    missed it). Once per placement: placements in ``already_stopped`` are skipped (the caller records them).
    ``jobs``: the candidates (``Deadlines.due``), else every job holding capacity."""
    decision = Decision()
    for job in state.active_jobs() if jobs is None else jobs:
        limit = job.spec.max_runtime_s
        if job.state == "running" and limit and job.started_at and now - job.started_at > limit + MAX_RUNTIME_MARGIN_S:
            if already_stopped is not None and job.placement_id in already_stopped:
                continue
            decision.published.extend(stops(job, "max_runtime"))
    return decision


@dataclass
class Deadlines:
    """Running jobs with a max runtime, by when they overrun (a heap): a tick looks at those due only."""

    _heap: list[tuple[float, str, uuid.UUID, uuid.UUID]] = field(default_factory=list)

    def started(self, job: JobRecord) -> None:
        """Note a job that started running (a job without a max runtime is ignored)."""
        limit = job.spec.max_runtime_s
        if limit and job.started_at is not None and job.placement_id is not None:
            heapq.heappush(self._heap, (job.started_at + limit + MAX_RUNTIME_MARGIN_S, str(job.job_id), job.job_id,
                                        job.placement_id))

    def rebuild(self, state: SchedulerState) -> None:
        self._heap = []
        for job in state.active.values():
            if job.state == "running":
                self.started(job)

    def due(self, state: SchedulerState, now: float) -> list[JobRecord]:
        """Jobs past their deadline that still run the placement the deadline was for (each returned once)."""
        found: dict[uuid.UUID, JobRecord] = {}
        while self._heap and self._heap[0][0] < now:
            _, _, job_id, placement_id = heapq.heappop(self._heap)
            job = state.jobs.get(job_id)
            if job is not None and job.placement_id == placement_id and job.state == "running":
                found[placement_id] = job  # a gang's ranks each started it: once per placement
        return list(found.values())
