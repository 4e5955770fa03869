"""A job that outgrew its GPU memory (a share stopped by the watchdog, a MIG job out of memory in its slice) is
requeued with a larger ask, or fails: never loops."""

from __future__ import annotations

import uuid

from gpuorch_contracts import GpuRequest, JobFailed, JobRequeued, JobSpec, ProcessRun, SubmitJob
from gpuorch_scheduling.escalation import next_mig_profiles, next_share
from gpuorch_scheduling.scheduler import Scheduler
from gpuorch_scheduling.state import SchedulerState
from gpuorch_scheduling.step import Input
from gpuorch_scheduling.testing import registered_node

RUN = ProcessRun(argv=["python", "serve.py"])
SHARE = GpuRequest(gpu_milli=250, gpu_memory_mib=4096)


def exceeded(scheduler: Scheduler, job_id: uuid.UUID, peak: int, node: str | None = None) -> JobFailed:
    job = scheduler.state.jobs[job_id]
    return JobFailed(job_id=job_id, placement_id=job.placement_id, node_id=node or job.assignments[0].node_id,
                     cause="gpu_oom", stop_reason="gpu_memory_exceeded", gpu_memory_peak_mib=peak,
                     reason=f"gpu_memory_exceeded: used {peak} MiB of 4096")


def placed_share(max_requeues: int = 3, model: str = "H100-80GB", log: list | None = None
                 ) -> tuple[Scheduler, uuid.UUID]:
    scheduler = Scheduler()
    step = scheduler.step([Input(registered_node("n1", gpus=1, model=model))], 1.0)
    submit = SubmitJob(spec=JobSpec(name="serve", run=RUN, resources=SHARE, max_requeues=max_requeues))
    step2 = scheduler.step([Input(submit)], 2.0)
    if log is not None:
        log.extend(step.events + step2.events)
    assert scheduler.state.jobs[submit.job_id].state == "placed"
    return scheduler, submit.job_id


def test_next_share_climbs_the_mig_profile_ladder_of_the_fleet() -> None:
    h100 = [("H100-80GB", 81920)]
    assert next_share(SHARE, 36864, h100) == GpuRequest(gpu_milli=250, gpu_memory_mib=40448)  # 3g.40gb
    assert next_share(SHARE, 9000, h100).gpu_memory_mib == 9984  # type: ignore[union-attr]  # 1g.10gb
    assert next_share(SHARE, 90000, h100) is None  # larger than any GPU
    assert next_share(SHARE, 20000, [("L4", 23034)]).gpu_memory_mib == 20480  # type: ignore[union-attr]  # GiB
    picky = GpuRequest(gpu_memory_mib=4096, gpu_models=["L4"])
    assert next_share(picky, 36864, [("L4", 23034), ("H100-80GB", 81920)]) is None  # only L4 accepted


def test_an_outgrown_share_is_requeued_with_a_larger_share_and_a_restart_agrees() -> None:
    log: list = []
    scheduler, job_id = placed_share(log=log)
    step = scheduler.step([Input(exceeded(scheduler, job_id, 30720))], 3.0)
    requeued = [e for e, _ in step.events if isinstance(e, JobRequeued)]
    assert len(requeued) == 1 and requeued[0].resources is not None
    assert requeued[0].resources.gpu_memory_mib == 40448  # 30720 + 20 % = 36864 -> the 40 GB profile size
    assert "escalated to a share of 40448 MiB" in requeued[0].reason
    job = scheduler.state.jobs[job_id]
    assert job.state == "placed" and job.requeues == 1  # placed again at once, on its larger share
    assert job.spec.resources.gpu_memory_mib == 40448
    assert job.assignments[0].gpus[0].memory_mib == 40448
    restored = SchedulerState.from_snapshot(scheduler.state.to_snapshot())
    assert restored.jobs[job_id].spec.resources.gpu_memory_mib == 40448
    replayed = SchedulerState()
    for event, headers in log + step.events:
        replayed.apply(event, headers)
    assert replayed.jobs[job_id].spec.resources == scheduler.state.jobs[job_id].spec.resources  # the fold agrees


def test_a_share_nothing_in_the_fleet_fits_fails_with_that_reason() -> None:
    scheduler, job_id = placed_share(model="A100-40GB")
    step = scheduler.step([Input(exceeded(scheduler, job_id, 90000))], 3.0)
    job = scheduler.state.jobs[job_id]
    assert job.state == "failed"
    assert "no GPU in the fleet has 108000 MiB" in (job.reason or "")
    assert not [e for e, _ in step.events if isinstance(e, JobRequeued)]


def test_escalation_stops_at_max_requeues() -> None:
    scheduler, job_id = placed_share(max_requeues=0)
    scheduler.step([Input(exceeded(scheduler, job_id, 30720))], 3.0)
    job = scheduler.state.jobs[job_id]
    assert job.state == "failed" and "requeue limit 0 reached" in (job.reason or "")


def test_a_report_from_another_node_or_placement_changes_nothing() -> None:
    scheduler, job_id = placed_share()
    forged = exceeded(scheduler, job_id, 30720, node="n2")
    step = scheduler.step([Input(forged)], 3.0)
    assert step.events == [] and scheduler.state.jobs[job_id].state == "placed"


def test_a_mig_job_out_of_memory_in_its_slice_is_requeued_one_profile_size_up() -> None:
    scheduler = Scheduler()
    scheduler.step([Input(registered_node("n1", gpus=1, mig=True))], 1.0)
    submit = SubmitJob(spec=JobSpec(name="infer", run=RUN, resources=GpuRequest(mig_profiles=["1g.10gb"])))
    scheduler.step([Input(submit)], 2.0)
    job = scheduler.state.jobs[submit.job_id]
    assert job.state == "placed"
    oom = JobFailed(job_id=job.job_id, placement_id=job.placement_id, node_id="n1", cause="gpu_oom",
                    reason="GPU out of memory (exited 1)")
    step = scheduler.step([Input(oom)], 3.0)
    [requeued] = [e for e, _ in step.events if isinstance(e, JobRequeued)]
    assert requeued.resources is not None and requeued.resources.mig_profiles == ["1g.20gb", "2g.20gb"]
    job = scheduler.state.jobs[submit.job_id]
    assert job.state == "queued" and job.spec.resources.mig_profiles == ["1g.20gb", "2g.20gb"]  # awaits a layout
    assert next_mig_profiles(GpuRequest(mig_profiles=["7g.80gb"]), [("A100-80GB", 81920)]) is None


def test_a_mig_job_ending_by_itself_or_stopped_is_not_escalated() -> None:
    scheduler = Scheduler()
    scheduler.step([Input(registered_node("n1", gpus=1, mig=True))], 1.0)
    submit = SubmitJob(spec=JobSpec(name="infer", run=RUN, resources=GpuRequest(mig_profiles=["1g.10gb"])))
    scheduler.step([Input(submit)], 2.0)
    job = scheduler.state.jobs[submit.job_id]
    failed = JobFailed(job_id=job.job_id, placement_id=job.placement_id, node_id="n1", cause="nonzero_exit",
                       reason="exited 3")
    scheduler.step([Input(failed)], 3.0)
    assert scheduler.state.jobs[submit.job_id].state == "failed"
