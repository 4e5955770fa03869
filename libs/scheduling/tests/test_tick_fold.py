"""A tick's decisions, as logged, rebuild the state the tick left in memory: the state is a fold of the log.

The tick's deciders (liveness, preemption timeouts, overdue jobs, idle sessions, reservations) all decide on the
state as the tick found it, so two of them may make the same decision (the same message id): the log keeps it once,
so memory must apply it once.
"""

from __future__ import annotations

import uuid
from typing import Any

from gpuorch_contracts import GpuRequest, JobSpec, Message, ProcessRun, SubmitJob
from gpuorch_scheduling import LivenessPolicy, SchedulerState
from gpuorch_scheduling.scheduler import Scheduler, SchedulerConfig
from gpuorch_scheduling.step import Input, Step
from gpuorch_scheduling.testing import registered_node

RUN = ProcessRun(argv=["python", "train.py"])
CONFIG = SchedulerConfig(liveness=LivenessPolicy(suspect_after_s=15, lost_after_s=90), preemption_margin_s=60)


class LoggedScheduler:
    """A Scheduler and the log its steps write (an event whose id is logged already is not logged again, as the
    event store's append does)."""

    def __init__(self) -> None:
        self.scheduler = Scheduler(CONFIG)
        self.log: dict[uuid.UUID, tuple[Message, dict[str, Any]]] = {}

    def step(self, messages: list[Message], now: float, tick: bool = False) -> Step:
        step = self.scheduler.step([Input(m) for m in messages], now, tick=tick)
        for event, headers in step.events:
            self.log.setdefault(event.message_id, (event, headers))
        return step

    def rebuilt(self) -> SchedulerState:
        state = SchedulerState(retention_s=self.scheduler.state.retention_s)
        for event, headers in self.log.values():
            state.apply(event, headers)
        return state


def job(priority: str, preemptible: bool) -> SubmitJob:
    spec = JobSpec(run=RUN, resources=GpuRequest(gpus=1), priority_class=priority,  # type: ignore[arg-type]
                   preemptible=preemptible, checkpoint={"grace_s": 10})  # type: ignore[arg-type]
    return SubmitJob(spec=spec)


def test_a_preempted_job_on_a_node_lost_after_its_grace_is_requeued_once() -> None:
    logged = LoggedScheduler()
    logged.step([registered_node("n1", gpus=1)], 1.0)
    logged.scheduler.node_heartbeat("n1", 1.0)
    victim, urgent = job("low", preemptible=True), job("critical", preemptible=False)
    logged.step([victim], 2.0)
    logged.step([urgent], 3.0)
    assert logged.scheduler.state.jobs[victim.job_id].state == "preempting"

    # n1 falls silent: 100 s later it is lost AND the victim's stop is past its grace (10 s) + margin (60 s)
    step = logged.step([], 103.0, tick=True)

    ids = [event.message_id for event, _ in step.events]
    assert len(ids) == len(set(ids)), "the tick logged (and applied) one decision twice"
    requeued = logged.scheduler.state.jobs[victim.job_id]
    assert requeued.state == "queued"
    assert requeued.preemptions == 1
    assert logged.rebuilt().to_snapshot() == logged.scheduler.state.to_snapshot()
