"""Room freed by a preemption goes to the job it was freed for: lower-priority work queued behind that job must not
take it while the victims are still stopping one by one (a job taking it is preempted again, and again: the
ping-pong the capacity simulation found, thousands of preemptions a day on a busy fleet)."""

from __future__ import annotations

from gpuorch_contracts import Checkpoint, GpuRequest, JobSpec, ProcessRun
from gpuorch_scheduling.harness import Harness
from gpuorch_scheduling.testing import registered_node

RUN = ProcessRun(argv=["python", "train.py"])


def batch(grace_s: float, runtime_s: float | None = None) -> JobSpec:
    return JobSpec(run=RUN, resources=GpuRequest(gpus=1), priority_class="low", preemptible=True,
                   checkpoint=Checkpoint(grace_s=grace_s), runtime_estimate_s=runtime_s)


def test_victims_stopping_one_by_one_free_room_only_the_preemptor_takes() -> None:
    h = Harness(stop_s=60.0)  # each victim stops after its own grace: 5, 10, ... 40 s
    h.add_node(registered_node("n0", gpus=8).inventory)
    victims = [h.submit(batch(grace_s=5.0 * (k + 1)), at=1.0, runtime_s=3600.0) for k in range(8)]
    waiting = [h.submit(batch(grace_s=30.0), at=2.0, runtime_s=3600.0) for _ in range(6)]
    h.run(until=5.0)
    assert all(v.state == "running" for v in victims)
    training = h.submit(JobSpec(run=RUN, resources=GpuRequest(gpus=8), priority_class="high"), at=10.0,
                        runtime_s=600.0)
    h.run(until=120.0)
    assert training.state == "running", training
    assert sum(v.preemptions for v in victims) == 8
    assert all(w.placements == 0 for w in waiting), "a waiting batch job took room freed for the training job"


def test_a_short_job_may_still_backfill_room_that_frees_later_than_it_ends() -> None:
    h = Harness(stop_s=60.0)
    h.add_node(registered_node("n0", gpus=8).inventory)
    victims = [h.submit(batch(grace_s=40.0), at=1.0, runtime_s=3600.0) for _ in range(7)]
    h.run(until=5.0)
    assert all(v.state == "running" for v in victims)
    h.submit(JobSpec(run=RUN, resources=GpuRequest(gpus=8), priority_class="high"), at=10.0, runtime_s=600.0)
    short = h.submit(batch(grace_s=5.0, runtime_s=5.0), at=11.0, runtime_s=5.0)  # ends before the victims stop
    h.run(until=30.0)
    assert short.state == "succeeded", short
