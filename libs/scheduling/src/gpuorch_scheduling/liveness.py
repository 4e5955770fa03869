"""Node leases and runtime limits: which nodes are alive, suspect or lost, and which jobs overran.

Pure: the lease times and ``now`` are passed in (the service measures leases on a monotonic clock, the Harness on its
simulated one). ``Leases`` is the scheduler's memory of the last renewals (never logged: heartbeats are latest-wins
state); the transitions it leads to are logged as ``NodeLivenessChanged``.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from gpuorch_contracts import TERMINAL_STATES, NodeLivenessChanged

from gpuorch_scheduling.decisions import Decision, at, decision_id, requeue_or_fail, stop, stops
from gpuorch_scheduling.state import SchedulerState


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


def liveness(
    state: SchedulerState, last_seen: dict[str, float], now: float, policy: LivenessPolicy,
    executors: dict[str, ExecutorLease] | None = None,
) -> tuple[Decision, str | None]:
    """Lease transitions for every node, and an alert text when most nodes went silent at once.

    A node's lease has two halves: its node-agent's heartbeats (``last_seen``) and, once one was received, its
    executor's (``executors``). A node is ``alive`` only while both are fresh (``suspect_after_s``); otherwise it is
    ``suspect`` and gets no new work. It is declared ``lost`` (its jobs requeued) only when whatever runs its jobs
    has been silent long enough that they are surely stopped: the executor's silence past ``lost_after_s`` and past
    its own fencing deadline (a silent node-agent with a live executor never loses the node's jobs: they still
    run there); for a node whose executor was never heard from, the node-agent's silence past ``lost_after_s``.

    When more than ``mass_silence_fraction`` of the nodes are past the suspect deadline, no node is declared lost
    (a broker or network fault is likelier than many dead nodes): the alert is returned instead.
    """
    executors = executors or {}
    decision = Decision()

    def ages(node_id: str) -> tuple[float, float | None]:
        lease = executors.get(node_id)
        return now - last_seen.get(node_id, now), (now - lease.seen_at if lease is not None else None)

    def fresh(node_id: str) -> bool:
        agent, executor = ages(node_id)
        return agent <= policy.suspect_after_s and (executor is None or executor <= policy.suspect_after_s)

    silent = [n for n in state.nodes if not fresh(n)]
    mass = len(state.nodes) >= 2 and len(silent) > policy.mass_silence_fraction * len(state.nodes)
    requeued: set[uuid.UUID] = set()
    for node_id, node in sorted(state.nodes.items()):
        agent_age, executor_age = ages(node_id)
        if fresh(node_id):
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
            deadline = max(policy.lost_after_s, executors[node_id].fencing_deadline_s + policy.fencing_margin_s)
            gone, why = executor_age > deadline, f"its executor silent for {executor_age:.0f}s"
        if gone and node.liveness != "lost" and not mass:
            decision.logged.append(NodeLivenessChanged(
                message_id=decision_id("liveness", node_id, "lost", now), node_id=node_id, liveness="lost",
                reason=why, occurred_at=at(now)))
            for job in state.active_jobs():
                if job.state in TERMINAL_STATES:
                    continue  # a cancelled placement still stopping: the lost event frees it
                if job.job_id not in requeued and any(a.node_id == node_id for a in job.assignments):
                    requeued.add(job.job_id)
                    decision.extend(requeue_or_fail(job, f"node {node_id} lost"))
                    others = [a for a in job.assignments if a.node_id != node_id]
                    decision.published.extend(
                        stop(a.node_id, job.job_id, job.placement_id, "drain", job.spec.checkpoint.grace_s)  # type: ignore[arg-type]
                        for a in others)
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


def overdue(state: SchedulerState, now: float, already_stopped: set[uuid.UUID] | None = None) -> Decision:
    """Stop running jobs past their max runtime (the executor enforces it too; this covers an executor that
    missed it). Once per placement: placements in ``already_stopped`` are skipped (the caller records them)."""
    decision = Decision()
    for job in state.active_jobs():
        limit = job.spec.max_runtime_s
        if job.state == "running" and limit and job.started_at and now - job.started_at > limit + MAX_RUNTIME_MARGIN_S:
            if already_stopped is not None and job.placement_id in already_stopped:
                continue
            decision.published.extend(stops(job, "max_runtime"))
    return decision
