"""A job fact counts only from a node the job's current placement is on (the broker proves who sent a fact and for
which node, not that the job runs there)."""

from __future__ import annotations

import uuid

from gpuorch_contracts import (
    GpuRequest,
    JobCheckpointed,
    JobFailed,
    JobFinished,
    JobLost,
    JobSpec,
    JobStarted,
    ProcessRun,
    SubmitJob,
)
from gpuorch_scheduling.scheduler import Scheduler
from gpuorch_scheduling.step import Input
from gpuorch_scheduling.testing import registered_node

RUN = ProcessRun(argv=["python", "train.py"])


def placed() -> tuple[Scheduler, uuid.UUID, uuid.UUID, str, str]:
    scheduler = Scheduler()
    scheduler.step([Input(registered_node("n1", gpus=1)), Input(registered_node("n2", gpus=1))], 1.0)
    submit = SubmitJob(spec=JobSpec(run=RUN, resources=GpuRequest(gpus=1)))
    scheduler.step([Input(submit)], 2.0)
    job = scheduler.state.jobs[submit.job_id]
    assert job.state == "placed"
    on = job.assignments[0].node_id
    return scheduler, submit.job_id, job.placement_id, on, ({"n1", "n2"} - {on}).pop()  # type: ignore[return-value]


def test_another_nodes_executor_cannot_start_finish_fail_lose_or_checkpoint_a_job() -> None:
    scheduler, job_id, placement, on, other = placed()
    for forged in (
        JobStarted(job_id=job_id, placement_id=placement, node_id=other),
        JobCheckpointed(job_id=job_id, placement_id=placement, node_id=other),
        JobFinished(job_id=job_id, placement_id=placement, node_id=other, exit_code=0, duration_s=1),
        JobFailed(job_id=job_id, placement_id=placement, node_id=other, cause="nonzero_exit", reason="forged"),
        JobFailed(job_id=job_id, placement_id=None, node_id=other, cause="nonzero_exit", reason="no placement"),
        JobLost(job_id=job_id, placement_id=placement, node_id=other, reason="forged"),
    ):
        step = scheduler.step([Input(forged)], 3.0)
        assert step.events == [], forged.TYPE  # not logged, nothing decided
        assert scheduler.state.jobs[job_id].state == "placed"
    # the node it runs on speaks for it
    step = scheduler.step([Input(JobStarted(job_id=job_id, placement_id=placement, node_id=on))], 4.0)
    assert [e.TYPE for e, _ in step.events] == ["job.started"]
    step = scheduler.step([Input(JobFinished(job_id=job_id, placement_id=placement, node_id=on, exit_code=0,
                                             duration_s=1))], 5.0)
    assert scheduler.state.jobs[job_id].state == "succeeded"


def test_facts_of_an_older_placement_stay_history() -> None:
    scheduler, job_id, _, on, _ = placed()
    older = JobFinished(job_id=job_id, placement_id=uuid.uuid4(), node_id=on, exit_code=0, duration_s=1)
    step = scheduler.step([Input(older)], 3.0)
    assert [e.TYPE for e, _ in step.events] == ["job.finished"]  # logged as history, changes nothing
    assert scheduler.state.jobs[job_id].state == "placed"
