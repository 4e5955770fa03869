"""The invariants, checked after every action of the simulation (and the liveness one at the end).

    runs once        a job never runs in two places at once: the live runs of a job (ground truth, ``Truth``)
                     belong to one placement
    GPUs             no GPU over-allocated: the live runs on each GPU ask for at most 1000 milli (ground truth);
                     and the leader's own state re-derives no capacity violation after each commit
    state = log      after every commit, the leader's state equals the fold of the committed log (the read model,
                     folded here independently, one event at a time as committed)
    takeover         a new leader's recovered state is the fold of every committed event (nothing lost)
    liveness (end)   once the faults stopped and the fleet settled: every submission was answered (accepted or
                     rejected); every accepted job ended, or waits in the queue with a pending reason; nothing
                     runs that the log does not say should run

A failure raises ``Violation`` with what was seen; the simulation reports the seed and step.
"""

from __future__ import annotations

import uuid
from typing import Any

from gpuorch_contracts import TERMINAL_STATES, SubmitJob
from gpuorch_scheduling import SchedulerState
from gpuorch_scheduling.step import Step

from gpuorch_dst.database import SimDatabase
from gpuorch_dst.node import Truth
from gpuorch_dst.scheduler_process import LeaderObserver, SchedulerProcess


class Violation(AssertionError):
    def __init__(self, invariant: str, detail: str) -> None:
        super().__init__(f"{invariant}: {detail}")
        self.invariant, self.detail = invariant, detail


def projection(state: SchedulerState) -> tuple[dict[uuid.UUID, tuple[Any, ...]], dict[str, str]]:
    """What must agree between a leader's state and the log's fold (cheap enough to compare after every commit)."""
    jobs = {job_id: (job.state, job.placement_id, tuple(a.node_id for a in job.assignments), job.requeues,
                     tuple(job.stopping_nodes), tuple(job.stopped_nodes))
            for job_id, job in state.jobs.items()}
    return jobs, {node_id: node.liveness for node_id, node in state.nodes.items()}


def difference(mine: SchedulerState, log: SchedulerState) -> str:
    (jobs_a, nodes_a), (jobs_b, nodes_b) = projection(mine), projection(log)
    for job_id in sorted(set(jobs_a) | set(jobs_b), key=str):
        if jobs_a.get(job_id) != jobs_b.get(job_id):
            return f"job {job_id}: in memory {jobs_a.get(job_id)}, in the log {jobs_b.get(job_id)}"
    for node_id in sorted(set(nodes_a) | set(nodes_b)):
        if nodes_a.get(node_id) != nodes_b.get(node_id):
            return f"node {node_id}: in memory {nodes_a.get(node_id)}, in the log {nodes_b.get(node_id)}"
    return ""


class Checker(LeaderObserver):
    """Folds the committed log as it grows (the read model) and checks the invariants."""

    def __init__(self, db: SimDatabase, truth: Truth, retention_s: float) -> None:
        self.db, self.truth = db, truth
        self.log_state = SchedulerState(retention_s=retention_s)
        self.schedulers: list[SchedulerProcess] = []
        self._folded = 0
        self._seen_version = -1
        self.checks = 0

    def catch_up(self) -> None:
        for event, headers in self.db.log[self._folded:]:
            self.log_state.apply(event, headers)
        self._folded = len(self.db.log)
        self.log_state.position = self._folded

    # -- after every action ----------------------------------------------------------------------------------

    def after_each(self) -> None:
        if self.truth.version == self._seen_version:
            return  # nothing started or ended: the ground truth is as checked last time
        self._seen_version = self.truth.version
        self.checks += 1
        placements: dict[uuid.UUID, set[uuid.UUID]] = {}
        gpus: dict[tuple[str, str], int] = {}
        for run in self.truth.live.values():
            placements.setdefault(run.job_id, set()).add(run.placement_id)
            for gpu in run.gpus:
                key = (run.node_id, gpu.gpu_uuid)
                gpus[key] = gpus.get(key, 0) + gpu.milli
        for job_id, live in placements.items():
            if len(live) > 1:
                where = sorted(f"{r.node_id}:{r.placement_id}" for r in self.truth.live.values() if r.job_id == job_id)
                raise Violation("a job runs in two places at once", f"job {job_id} runs as {', '.join(where)}")
        for (node_id, gpu_uuid), milli in gpus.items():
            if milli > 1000:
                raise Violation("a GPU is over-allocated", f"{node_id}/{gpu_uuid}: {milli} milli in use")

    # -- around the leaders ----------------------------------------------------------------------------------

    def took_over(self, process: SchedulerProcess) -> None:
        self.catch_up()
        state = process.scheduler.state  # type: ignore[union-attr]
        if state.position != len(self.db.log) or state.snapshot_json() != self.log_state.snapshot_json():
            raise Violation("a takeover lost committed events",
                            f"{process.name} recovered at position {state.position} of {len(self.db.log)}: "
                            f"{difference(state, self.log_state) or 'snapshots differ'}")

    def committed(self, process: SchedulerProcess, step: Step) -> None:
        self.catch_up()
        for leader in self.schedulers:
            if leader.leading and not leader.needs_reload and leader.epoch == self.db.lease.epoch:
                diff = difference(leader.scheduler.state, self.log_state)  # type: ignore[union-attr]
                if diff:
                    raise Violation("the leader's state is not the fold of the log", f"{leader.name}: {diff}")
                problems = leader.scheduler.state.capacity_violations()  # type: ignore[union-attr]
                if problems:
                    raise Violation("a GPU is over-allocated", f"{leader.name}'s state: {'; '.join(problems[:3])}")

    # -- at the end ------------------------------------------------------------------------------------------

    def settled(self, submitted: list[SubmitJob], leader: SchedulerProcess | None) -> None:
        """Liveness, once the faults stopped and the fleet had time to settle."""
        self.catch_up()
        answered = self.db.known_jobs
        for submit in submitted:
            if submit.job_id not in answered:
                raise Violation("a submission was never answered", f"job {submit.job_id}")
        if leader is None or leader.scheduler is None:
            raise Violation("no leader once the faults stopped", "no scheduler instance holds the lease")
        pending = leader.scheduler.pending
        for job in self.log_state.jobs.values():
            if job.state in TERMINAL_STATES and not job.stopping_nodes:
                continue
            if job.state == "queued" and job.job_id in pending:
                continue
            raise Violation("an accepted job neither ended nor waits with a reason",
                            f"job {job.job_id} is {job.state} (placement {job.placement_id}, "
                            f"stopping on {job.stopping_nodes}, reason {job.reason!r})")
        for run in self.truth.live.values():
            job = self.log_state.jobs.get(run.job_id)
            if job is None or job.placement_id != run.placement_id or job.state in TERMINAL_STATES:
                raise Violation("something runs that the log does not place",
                                f"job {run.job_id} placement {run.placement_id} on {run.node_id} "
                                f"(the log: {job.state if job else 'unknown'}, placement {job.placement_id if job else None})")
