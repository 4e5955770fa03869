"""Job-level replay: jobs leave, FIFO blocks behind its head, priority with backfill does not."""

from __future__ import annotations

from gpuorch_policy import Request, TaskMix, build_policy
from gpuorch_policy.jobs import Job, jobs_from_tasks, replay_jobs, tier_of
from gpuorch_policy.openb import Task

from .conftest import make_node

BIG = Request(cpu_milli=1000, num_gpu=2, gpu_milli=1000)
SMALL = Request(cpu_milli=1000, num_gpu=1, gpu_milli=300)


def _policy(jobs):
    return build_policy("gpuorch", TaskMix.from_requests(j.request for j in jobs))


def scenario() -> list[Job]:
    return [
        Job("first", Request(cpu_milli=1000, num_gpu=1, gpu_milli=1000), "training", arrival=0.0, runtime=100.0),
        Job("big", BIG, "training", arrival=1.0, runtime=10.0),
        Job("small", SMALL, "inference", arrival=2.0, runtime=5.0),
    ]


def test_fifo_head_blocks_the_small_job() -> None:
    jobs = scenario()
    result = replay_jobs([make_node("n", gpus=2)], jobs, _policy(jobs), queue_policy="fifo")
    assert result.never_started == 0
    assert result.tiers["inference"].queueing_mean == 108.0  # waits for first (t=100) and big (t=110)


def test_priority_backfill_runs_the_small_job_at_once() -> None:
    jobs = scenario()
    result = replay_jobs([make_node("n", gpus=2)], jobs, _policy(jobs), queue_policy="priority-backfill")
    assert result.tiers["inference"].queueing_mean == 0.0
    assert result.tiers["training"].queueing_p95 > 0
    assert result.makespan == 110.0


def test_jobs_from_trace_times_and_tiers() -> None:
    tasks = [
        Task("a", SMALL, creation_time=100, deletion_time=160, scheduled_time=110),
        Task("b", Request(cpu_milli=10), creation_time=50, deletion_time=70),
        Task("c", BIG, creation_time=None, deletion_time=10),
    ]
    jobs = jobs_from_tasks(tasks, compression=10.0, load=2.0)
    assert [j.name for j in jobs] == ["b", "a"]
    assert jobs[1].arrival == 5.0 and jobs[1].runtime == 5.0
    assert [tier_of(t.request) for t in tasks] == ["inference", "batch", "training"]
