"""Trace replays through the Harness: the arrival protocol on a tiny trace (every policy, placements within
capacity and checkable), and the job replay deciding with the scheduler's own tiers, priorities and backfill."""

from __future__ import annotations

import pytest
from gpuorch_policy import Request, TaskMix, policy_names
from gpuorch_policy.jobs import Job
from gpuorch_policy.openb import parse_nodes, parse_tasks
from gpuorch_policy.verify import check_placements
from gpuorch_scheduling.trace_replay import replay_jobs, replay_protocol

NODES_CSV = """sn,cpu_milli,memory_mib,gpu,model
node-b,32000,131072,4,V100M16
node-a,16000,65536,2,T4
node-c,8000,16384,0,
"""

FIVE_COLUMN_PODS = """name,cpu_milli,memory_mib,num_gpu,gpu_milli
p-cpu,2000,4096,0,0
p-share,4000,8192,1,460
p-one,8000,16384,1,1000
p-two,8000,16384,2,1000
p-four,16000,32768,4,1000
"""


@pytest.mark.parametrize("name", policy_names())
def test_the_arrival_protocol_on_a_small_trace(name: str) -> None:
    nodes = parse_nodes(NODES_CSV.splitlines())
    tasks = parse_tasks(FIVE_COLUMN_PODS.splitlines())
    result = replay_protocol(nodes, tasks, name, seed=3, ratio=1.3, record_outcomes=True)
    assert result.tasks == len(result.outcomes)
    assert result.arrived_pct[-1] <= 130.0
    assert result.allocated_pct[-1] <= 100.0
    assert result.failed == sum(o.node is None for o in result.outcomes) > 0  # 130 % cannot all fit
    assert all(o.node == "node-b" for o in result.outcomes if o.source == "p-four" and o.node is not None)
    records = [{"seed": 3, "task": o.task, "source": o.source, "node": o.node, "gpus": [list(g) for g in o.gpus]}
               for o in result.outcomes]
    assert check_placements(nodes, {t.name: t.request for t in tasks}, records) == []


def test_the_same_seed_replays_the_same_placements() -> None:
    nodes = parse_nodes(NODES_CSV.splitlines())
    tasks = parse_tasks(FIVE_COLUMN_PODS.splitlines())
    runs = [replay_protocol(nodes, tasks, "Random", seed=5, record_outcomes=True).outcomes for _ in range(2)]
    assert runs[0] == runs[1]


BIG = Request(cpu_milli=1000, num_gpu=2, gpu_milli=1000)
SMALL = Request(cpu_milli=1000, num_gpu=1, gpu_milli=300)


def test_the_job_replay_runs_the_schedulers_queue() -> None:
    """A 2-GPU node: a long 1-GPU job runs, a 2-GPU training job must wait for it; the small inference share
    arriving later starts at once beside the long job (higher tier priority, and it fits now)."""
    nodes = parse_nodes("sn,cpu_milli,memory_mib,gpu,model\nn,64000,262144,2,T4\n".splitlines())
    jobs = [
        Job("first", Request(cpu_milli=1000, num_gpu=1, gpu_milli=1000), "training", arrival=0.0, runtime=100.0),
        Job("big", BIG, "training", arrival=1.0, runtime=10.0),
        Job("small", SMALL, "inference", arrival=2.0, runtime=5.0),
    ]
    result = replay_jobs(nodes, jobs, "gpuorch", TaskMix.from_requests(j.request for j in jobs))
    assert result.never_started == 0
    assert result.tiers["inference"].queueing_mean == 0.0
    assert result.tiers["training"].queueing_mean == pytest.approx(99.0 / 2, abs=1.0)  # first at once, big after it
    assert result.makespan == pytest.approx(110.0, abs=1.0)


def test_skipping_idle_ticks_changes_nothing_but_the_cost() -> None:
    """Bursts of jobs with long idle gaps (when queues form and drain, and when nothing runs at all): the job
    replay with idle ticks skipped gives every job the same start, end and preemptions as ticking every second,
    in far fewer steps."""
    import dataclasses
    import random

    from gpuorch_scheduling import trace_replay

    nodes = parse_nodes("sn,cpu_milli,memory_mib,gpu,model\nn1,64000,262144,2,T4\nn2,32000,131072,4,V100M16\n"
                        .splitlines())
    rnd = random.Random(7)
    shapes = [(Request(cpu_milli=1000, num_gpu=1, gpu_milli=1000), "training"), (BIG, "training"),
              (SMALL, "inference"), (Request(cpu_milli=4000, num_gpu=0, gpu_milli=0), "batch")]
    jobs = []
    for burst in range(6):
        start = burst * 5000.0 + rnd.random() * 10
        for k in range(12):
            request, tier = shapes[rnd.randrange(len(shapes))]
            jobs.append(Job(f"b{burst}-{k}", request, tier, arrival=round(start + rnd.random() * 60, 3),
                            runtime=round(20 + rnd.random() * 400, 3)))
    for k in range(30):  # a deep queue of ends close together: some cycles wait for the next tick
        jobs.append(Job(f"deep-{k}", SMALL, "inference", arrival=40000.0, runtime=round(30 + rnd.random(), 3)))
    mix = TaskMix.from_requests(j.request for j in jobs)
    runs = {}
    for skip in (False, True):
        harness = trace_replay._harness(nodes, "gpuorch", mix, 1, skip_idle_ticks=skip)
        harness.scheduler.config = dataclasses.replace(harness.scheduler.config, inline_cycle_max_queue=2)
        specs = trace_replay._Specs(tiers=True)
        sims = [harness.submit(specs.of(job.request, job.runtime), at=job.arrival, runtime_s=job.runtime)
                for job in jobs]
        steps: list[float] = []
        harness.observers.append(lambda step, h, steps=steps: steps.append(step.now))
        harness.run()
        runs[skip] = ([(s.started_at, s.ended_at, s.preemptions, s.state) for s in sims], len(steps))
    assert runs[True][0] == runs[False][0]
    assert any(started is not None and started > job.arrival for (started, *_), job in zip(runs[True][0], jobs, strict=True))
    assert runs[True][1] * 5 < runs[False][1]
