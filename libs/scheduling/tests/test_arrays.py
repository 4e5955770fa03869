"""Job arrays on the Harness: parallelism never exceeded, every task run once, cancels of the whole array, one task
or a range, parallelism changed at run time, aftercorr, a job depending on an array, a failover in the middle, and
the memory a large array costs."""

from __future__ import annotations

import json
import uuid
from collections import Counter

from gpuorch_contracts import ArraySpec, JobSpec, LaunchJob, ProcessRun, array_task_id
from gpuorch_scheduling.harness import Harness, SimJob
from gpuorch_scheduling.scheduler import Scheduler, SchedulerConfig
from gpuorch_scheduling.state import SchedulerState
from gpuorch_scheduling.step import Step
from gpuorch_scheduling.testing import registered_node

RUN = ProcessRun(argv=["python", "sweep.py"])


def array_spec(indices: str, parallelism: int | None = None, **fields: object) -> JobSpec:
    return JobSpec.model_validate({"run": RUN.model_dump(mode="json"), **fields,
                                   "array": ArraySpec(indices=indices, parallelism=parallelism).model_dump()})


def harness(nodes: int = 4, gpus: int = 2) -> Harness:
    h = Harness(SchedulerConfig(), keep_steps=True)
    for k in range(nodes):
        h.add_node(registered_node(f"n{k}", gpus=gpus).inventory)
    return h


class Watch:
    """After every step: how many tasks of each array run at once (the world's view), and every launch."""

    def __init__(self, h: Harness) -> None:
        self.peak: Counter[uuid.UUID] = Counter()
        self.launches: list[LaunchJob] = []
        h.observers.append(self)

    def __call__(self, step: Step, h: Harness) -> None:
        running: Counter[uuid.UUID] = Counter()
        for node in h.world.nodes.values():
            for run in node.runs.values():
                task = h.state.jobs.get(run.job_id)
                if task is not None and task.array_id is not None:
                    running[task.array_id] += 1
        for array_id, count in running.items():
            self.peak[array_id] = max(self.peak[array_id], count)
        self.launches += [m for m in step.outgoing if isinstance(m, LaunchJob)]


def started_tasks(watch: Watch, array: SimJob) -> Counter[int]:
    return Counter(m.array_task.task_id for m in watch.launches
                   if m.array_task is not None and m.array_task.array_job_id == array.job_id)


def test_an_array_runs_every_task_once_never_more_than_its_parallelism() -> None:
    h = harness()
    watch = Watch(h)
    sweep = h.submit(array_spec("0-11", 3, runtime_estimate_s=30), at=1, runtime_s=30)
    h.run()
    assert sweep.state == "succeeded"
    assert started_tasks(watch, sweep) == Counter(range(12))
    assert watch.peak[sweep.job_id] == 3
    launch = watch.launches[0]
    assert launch.array_task is not None and launch.array_task.task_count == 12
    assert launch.job_id == array_task_id(sweep.job_id, launch.array_task.task_id)
    record = h.state.arrays[sweep.job_id]
    assert record.counts() == {"queued": 0, "running": 0, "succeeded": 12, "failed": 0, "cancelled": 0}


def test_indices_with_steps_and_lists_name_the_tasks() -> None:
    h = harness()
    watch = Watch(h)
    stepped = h.submit(array_spec("0-99:10"), at=1, runtime_s=5)
    listed = h.submit(array_spec("1,3,5-7", 2), at=1, runtime_s=5)
    h.run()
    assert started_tasks(watch, stepped) == Counter(range(0, 100, 10))
    assert started_tasks(watch, listed) == Counter([1, 3, 5, 6, 7])


def test_a_failed_task_fails_the_array_and_an_afterok_job_on_it_is_cancelled() -> None:
    h = harness()
    sweep = h.submit(array_spec("0-5", 2), at=1, task_behaviour=lambda i: (10.0, 1 if i == 4 else 0))
    after = h.submit(JobSpec(run=RUN, depends_on=[{"job_id": sweep.job_id}]), at=2,  # type: ignore[list-item]
                     runtime_s=5)
    h.run()
    assert sweep.state == "failed" and h.state.arrays[sweep.job_id].counts()["failed"] == 1
    assert after.state == "cancelled" and f"{sweep.job_id} failed" in (after.reason or "")


def test_a_job_after_an_array_starts_once_its_last_task_ended() -> None:
    h = harness()
    sweep = h.submit(array_spec("0-7", 3, runtime_estimate_s=20), at=1, runtime_s=20)
    evaluate = h.submit(JobSpec(run=RUN, depends_on=[{"job_id": sweep.job_id}]), at=2,  # type: ignore[list-item]
                        runtime_s=5)
    h.run()
    assert (sweep.state, evaluate.state) == ("succeeded", "succeeded")
    last_end = max(t.ended_at or 0 for t in h.state.jobs.values() if t.array_id == sweep.job_id)
    assert evaluate.started_at is not None and evaluate.started_at >= last_end


def test_aftercorr_runs_task_i_after_task_i_and_cancels_the_partner_of_a_failed_one() -> None:
    h = harness()
    first = h.submit(array_spec("0-5", 6), at=1, task_behaviour=lambda i: (10.0 * (i + 1), 2 if i == 3 else 0))
    second = h.submit(array_spec("0-5", 6, depends_on=[{"condition": "aftercorr", "job_id": str(first.job_id)}]),
                      at=2, runtime_s=5)
    h.run()
    tasks = {(t.array_id, t.array_index): t for t in h.state.jobs.values() if t.array_id is not None}
    for i in range(6):
        mine = tasks[(second.job_id, i)]
        if i == 3:
            assert mine.state == "cancelled" and "task 3 of" in (mine.reason or "")
            continue
        partner = tasks[(first.job_id, i)]
        assert mine.state == "succeeded" and mine.started_at is not None and partner.ended_at is not None
        assert mine.started_at >= partner.ended_at
    assert h.state.arrays[second.job_id].counts()["cancelled"] == 1


def test_cancel_one_task_a_range_then_the_whole_array() -> None:
    h = harness()
    watch = Watch(h)
    sweep = h.submit(array_spec("0-19", 2), at=1, runtime_s=100)
    h.cancel_tasks(sweep.job_id, "1", at=10)          # running: stopped
    h.cancel_tasks(sweep.job_id, "10-14", at=11)      # pending: never materialized
    h.cancel(array_task_id(sweep.job_id, 0), at=12)   # by its own job id
    h.cancel(sweep.job_id, at=150)                    # the rest
    h.run()
    record = h.state.arrays[sweep.job_id]
    assert record.ended_at is not None and sweep.state == "cancelled"
    counts = record.counts()
    assert counts["queued"] == counts["running"] == 0 and counts["cancelled"] + counts["succeeded"] == 20
    started = started_tasks(watch, sweep)
    assert not set(started) & set(range(10, 15)) and max(started.values()) == 1
    assert watch.peak[sweep.job_id] <= 2


def test_parallelism_changed_at_run_time() -> None:
    h = harness(nodes=4, gpus=4)
    watch = Watch(h)
    sweep = h.submit(array_spec("0-39", 2), at=1, runtime_s=50)
    h.set_parallelism(sweep.job_id, 8, at=60)
    peaks: list[int] = []
    h.at(55, lambda: peaks.append(watch.peak[sweep.job_id]))
    h.run()
    assert peaks == [2] and watch.peak[sweep.job_id] == 8
    assert started_tasks(watch, sweep) == Counter(range(40))


def test_an_array_survives_a_failover_and_a_snapshot() -> None:
    h = harness()
    watch = Watch(h)
    sweep = h.submit(array_spec("0-29", 4, runtime_estimate_s=20), at=1, runtime_s=20)
    h.run(until=45)
    again = SchedulerState.from_snapshot(json.loads(h.state.snapshot_json()))
    assert again.to_snapshot() == h.state.to_snapshot()
    state = SchedulerState(retention_s=h.scheduler.config.retention_s)
    for event, headers in (pair for step in h.steps for pair in step.events):
        state.apply(event, headers)
    assert state.to_snapshot()["arrays"] == h.state.to_snapshot()["arrays"]
    standby = Scheduler(h.scheduler.config)
    standby.recovered(state, h.now)
    h.scheduler = standby
    h.run()
    assert sweep.state == "succeeded" and started_tasks(watch, sweep) == Counter(range(30))
    assert watch.peak[sweep.job_id] == 4


def test_a_large_array_keeps_its_pending_tasks_as_ranges() -> None:
    h = harness(nodes=2, gpus=4)
    sweep = h.submit(array_spec("0-9999", 8), at=1, runtime_s=10)
    h.run(until=30)
    record = h.state.arrays[sweep.job_id]
    assert len(record.live) <= 8 and len(record.pending) == 1
    assert sum(1 for j in h.state.jobs.values() if j.array_id == sweep.job_id) < 100
    assert len(h.state.to_snapshot()["arrays"][0]["pending"]) == 1


def test_an_array_after_a_job_waits_for_it_and_is_cancelled_whole_when_it_fails() -> None:
    h = harness()
    watch = Watch(h)
    prep = h.submit(JobSpec(run=RUN, runtime_estimate_s=50), at=1, runtime_s=50)
    broken = h.submit(JobSpec(run=RUN), at=1, runtime_s=20, exit_code=1)
    sweep = h.submit(array_spec("0-99", 4, depends_on=[{"job_id": str(prep.job_id)}]), at=2, runtime_s=10)
    doomed = h.submit(array_spec("0-99", 4, depends_on=[{"job_id": str(broken.job_id)}]), at=2, runtime_s=10)
    h.run()
    assert sweep.state == "succeeded" and started_tasks(watch, sweep) == Counter(range(100))
    first_start = min(t.started_at or 0 for t in h.state.jobs.values() if t.array_id == sweep.job_id)
    assert prep.ended_at is not None and first_start >= prep.ended_at
    record = h.state.arrays[doomed.job_id]
    assert doomed.state == "cancelled" and record.counts()["cancelled"] == 100 and not started_tasks(watch, doomed)
    assert record.reason == f"dependency afterok:{broken.job_id} can never be met: {broken.job_id} failed"
