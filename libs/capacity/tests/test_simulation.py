"""The capacity simulation on the Harness: the day is decided by the scheduler the service runs."""

from __future__ import annotations

import uuid
from collections import Counter

from gpuorch_capacity.simulation import H100, L4, DayJob, simulate, summary
from gpuorch_policy import Request
from gpuorch_scheduling.harness import Harness
from gpuorch_scheduling.step import Step


def _training(job_id: int, at: float, gpus: int = 8, runtime: float = 3600.0) -> DayJob:
    request = Request(cpu_milli=4000 * gpus, memory_mib=16384 * gpus, num_gpu=gpus, gpu_milli=1000,
                      gpu_models=(H100.gpu_model,))
    return DayJob(job_id, "training", request, at, runtime, False, "h100")


def _small_day() -> list[DayJob]:
    """A burst of six 8-GPU training jobs at 10:00 (more than the floor and headroom hold), some inference shares
    and a few preemptible batch jobs."""
    jobs = [_training(k, 36000.0 + k) for k in range(6)]
    share = Request(cpu_milli=2000, memory_mib=8192, num_gpu=1, gpu_milli=250, gpu_models=(L4.gpu_model,))
    jobs += [DayJob(6 + k, "inference", share, 36100.0 + 10 * k, 900.0, False, "l4") for k in range(8)]
    batch = Request(cpu_milli=2000, memory_mib=8192, num_gpu=1, gpu_milli=1000)
    jobs += [DayJob(14 + k, "batch", batch, 1000.0 + 60 * k, 2400.0, True, "l4") for k in range(3)]
    return jobs


class OneRunPerJob:
    """An observer: after every step, no job runs on two simulated executors at once (the world's truth)."""

    def __init__(self) -> None:
        self.most_at_once = 0
        self.steps = 0

    def __call__(self, step: Step, harness: Harness) -> None:
        self.steps += 1
        runs: Counter[uuid.UUID] = Counter()
        for node in harness.world.nodes.values():
            for run in node.runs.values():
                if run.started_at is not None:
                    runs[run.job_id] += 1
        self.most_at_once = max(self.most_at_once, max(runs.values(), default=0))


def test_the_autoscaler_grows_the_fleet_for_a_burst_and_every_job_starts_once_at_a_time() -> None:
    check = OneRunPerJob()
    result = simulate("autoscaled", _small_day(), None, boot_s=180.0, observers=[check])
    row = summary(result)
    assert result.nodes["h100"][1] >= 6  # one node, two of headroom: the burst bought more
    assert result.decisions > 0 and result.unfinished == 0
    assert row["training_jobs"] == 6 and row["inference_jobs"] == 8 and row["batch_jobs"] == 3
    assert row["training_mean_wait_s"] < 600  # a boot and a tick, not hours
    assert check.steps > 0 and check.most_at_once == 1
    assert 0 < result.gpu_hours < 16 * H100.gpus * 24 + 40 * L4.gpus * 24


def test_the_same_day_gives_the_same_result() -> None:
    first = simulate("autoscaled", _small_day(), None, boot_s=180.0)
    again = simulate("autoscaled", _small_day(), None, boot_s=180.0)
    assert summary(first) == summary(again)
    assert first.timeline == again.timeline and first.waits == again.waits


def test_a_fixed_fleet_too_small_for_the_burst_queues_it_and_pays_all_day() -> None:
    result = simulate("small", _small_day(), {"h100": 2, "l4": 1}, boot_s=180.0)
    row = summary(result)
    assert result.nodes == {"h100": (2, 2), "l4": (1, 1)} and result.decisions == 0
    assert result.unfinished == 0
    assert row["training_p95_wait_s"] >= 3600  # six 8-GPU jobs on two nodes: two waves behind the first
    assert result.gpu_hours == (2 * H100.gpus + L4.gpus) * 24
