"""Job-level trace workloads: arrival and runtime from the trace times, tiers by shape (the replay itself:
libs/scheduling/tests/test_trace_replay.py)."""

from __future__ import annotations

from gpuorch_policy import Request
from gpuorch_policy.jobs import jobs_from_tasks, tier_of
from gpuorch_policy.openb import Task

BIG = Request(cpu_milli=1000, num_gpu=2, gpu_milli=1000)
SMALL = Request(cpu_milli=1000, num_gpu=1, gpu_milli=300)


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
