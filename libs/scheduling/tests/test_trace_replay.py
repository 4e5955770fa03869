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
