"""The openb protocol: inflation to ratio x capacity, per-seed shuffle, and the paper's metrics."""

from __future__ import annotations

import numpy as np
from gpuorch_policy import Request
from gpuorch_policy.openb import Task, inflate, protocol_workload
from gpuorch_policy.replay import discrete_mean

TASKS = [
    Task(f"t{i}", Request(cpu_milli=1000, num_gpu=1, gpu_milli=m)) for i, m in enumerate((1000, 500, 250, 1000))
] + [Task("cpu", Request(cpu_milli=2000))]
ORIGINAL_MILLI = 2750


def test_inflation_keeps_every_task_and_stops_at_the_ratio() -> None:
    capacity = 4000
    out = inflate(TASKS, capacity, 1.3, np.random.default_rng(7))
    assert [t.name for t in out[: len(TASKS)]] == [t.name for t in TASKS]
    total = sum(t.gpu_request_milli for t in out)
    assert ORIGINAL_MILLI < total <= 1.3 * capacity
    assert 1.3 * capacity - total < 1000  # it stopped at the first draw that would go over
    assert all(t.name.split("-tuned-")[0] == t.source for t in out[len(TASKS) :])


def test_a_list_above_the_ratio_is_cut_down() -> None:
    out = inflate(TASKS, 1000, 1.3, np.random.default_rng(7))
    assert sum(t.gpu_request_milli for t in out) <= 1300
    assert len(out) < len(TASKS)


def test_shuffle_depends_on_the_seed_only() -> None:
    a = [t.name for t in protocol_workload(TASKS, 4000, 1.3, 42)]
    b = [t.name for t in protocol_workload(TASKS, 4000, 1.3, 42)]
    c = [t.name for t in protocol_workload(TASKS, 4000, 1.3, 43)]
    assert a == b
    assert a != c or len(a) < 3


def test_discrete_mean_matches_the_simulators_analysis() -> None:
    arrived = np.array([98.6, 99.4, 99.6, 100.2, 100.6, 129.6, 130.0])
    allocated = np.array([90.0, 91.0, 92.0, 93.0, 94.0, 95.0, 96.0])
    assert discrete_mean(arrived, allocated, 100) == 92.5  # steps rounding to 100: 99.6 and 100.2
    assert discrete_mean(arrived, allocated, 130) == 95.5
    assert discrete_mean(arrived, allocated, 120) != discrete_mean(arrived, allocated, 120)  # NaN: no data


def test_discrete_mean_widens_to_neighbours_when_a_point_has_no_step() -> None:
    arrived = np.array([49.0, 51.0])
    assert discrete_mean(arrived, np.array([10.0, 20.0]), 50) == 15.0
