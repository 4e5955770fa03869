"""A job that outgrew its GPU memory (a share stopped by the watchdog, a MIG job out of memory in its slice) is
requeued with a larger ask, or fails: never loops."""

from __future__ import annotations

import uuid

from gpuorch_contracts import (
    GpuRequest,
    JobFailed,
    JobPlaced,
    JobRequeued,
    JobSpec,
    JobStarted,
    ProcessRun,
    SubmitJob,
)
from gpuorch_policy.mig_planner import PlannerSettings
from gpuorch_scheduling.escalation import next_mig_profiles, next_share, share_escalation
from gpuorch_scheduling.harness import Harness
from gpuorch_scheduling.mig import MigControl
from gpuorch_scheduling.scheduler import Scheduler, SchedulerConfig
from gpuorch_scheduling.state import SchedulerState
from gpuorch_scheduling.step import Input
from gpuorch_scheduling.testing import registered_node
from gpuorch_scheduling.world import with_mig_layout

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
    assert "no share, MIG profile or GPU in the fleet holds 108000 MiB" in (job.reason or "")
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


def test_late_or_repeated_reports_of_the_escalated_attempt_change_nothing() -> None:
    """Whatever arrives after the watchdog's report of an attempt (its JobStarted late, the same report again, another
    report of that attempt such as a plain gpu_oom) is about a placement the job no longer has: ignored, never a
    failure. Its own escalation failure coming back through the scheduler's queue (no node) is refused."""
    scheduler, job_id = placed_share()
    first = scheduler.state.jobs[job_id].placement_id
    report = exceeded(scheduler, job_id, 30720)
    scheduler.step([Input(report)], 3.0)
    late = [JobStarted(job_id=job_id, placement_id=first, node_id="n1"), report,
            JobFailed(job_id=job_id, placement_id=first, node_id="n1", cause="gpu_oom", reason="GPU out of memory")]
    step = scheduler.step([Input(m) for m in late], 4.0)
    job = scheduler.state.jobs[job_id]
    assert (job.state, job.requeues, job.spec.resources.gpu_memory_mib) == ("placed", 1, 40448)
    assert job.placement_id != first and not step.decided
    echo = JobFailed(job_id=job_id, placement_id=job.placement_id, cause="gpu_oom", reason="from the scheduler")
    step = scheduler.step([Input(echo)], 5.0)
    assert step.ignored and scheduler.state.jobs[job_id].state == "placed"


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


H100 = [("H100-80GB", 81920)]
ALL_H100_PROFILES = {"H100-80GB": {"1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"}}


def test_a_mig_profile_in_reach_wins_over_a_share_of_the_same_memory_if_it_gives_the_share_compute() -> None:
    mig, how = share_escalation(SHARE, 36864, H100, ALL_H100_PROFILES)  # type: ignore[misc]
    assert mig == GpuRequest(mig_profiles=["3g.40gb", "4g.40gb"]) and "escalated to MIG 3g.40gb/4g.40gb" in how
    tenth = GpuRequest(gpu_milli=100, gpu_memory_mib=4096)
    assert share_escalation(tenth, 9000, H100, {"H100-80GB": {"1g.10gb"}})[0].mig_profiles == ["1g.10gb"]  # type: ignore[index]
    # 1g.10gb gives 1/7 of the SMs, less than 250m: the share of 9984 MiB keeps the compute the job asked for
    assert share_escalation(SHARE, 9000, H100, {"H100-80GB": {"1g.10gb"}})[0].gpu_memory_mib == 9984  # type: ignore[index]


def test_out_of_mig_reach_the_share_grows_then_a_whole_gpu_then_nothing() -> None:
    assert share_escalation(SHARE, 36864, H100, {})[0].gpu_memory_mib == 40448  # type: ignore[index]
    l4 = [("L4", 23034)]
    whole, how = share_escalation(SHARE, 23000, l4, {})  # type: ignore[misc]  # a share rounds up to 23552 MiB
    assert whole == GpuRequest(gpus=1) and "whole GPU" in how
    assert share_escalation(SHARE, 23100, l4, {}) is None
    assert share_escalation(GpuRequest(gpu_memory_mib=4096, gpu_models=["L4"]), 36864, H100 + l4,
                            ALL_H100_PROFILES) is None  # only L4 accepted


def test_a_share_on_a_mig_enabled_fleet_in_mode_off_goes_to_an_instance_that_exists() -> None:
    scheduler = Scheduler()
    node = registered_node("n1", gpus=2, model="H100-80GB")
    gpus = node.inventory.gpus
    sliced = [gpus[0], with_mig_layout(gpus[1], ["3g.40gb"])]
    node = node.model_copy(update={"inventory": node.inventory.model_copy(update={"gpus": sliced})})
    scheduler.step([Input(node)], 1.0)
    submit = SubmitJob(spec=JobSpec(name="serve", run=RUN, resources=SHARE, max_requeues=3))
    scheduler.step([Input(submit)], 2.0)
    step = scheduler.step([Input(exceeded(scheduler, submit.job_id, 30720))], 3.0)
    [requeued] = [e for e, _ in step.events if isinstance(e, JobRequeued)]
    assert requeued.resources == GpuRequest(mig_profiles=["3g.40gb"])
    assert "escalated to MIG 3g.40gb (40448 MiB): peak 30720 MiB + 20 % headroom = 36864 MiB" in requeued.reason
    job = scheduler.state.jobs[submit.job_id]
    assert job.state == "placed" and job.assignments[0].gpus[0].mig_profile == "3g.40gb"  # on the existing slice


def test_harness_an_outgrown_share_lands_on_the_mig_profile_the_planner_slices_for_it() -> None:
    control = MigControl(planner=PlannerSettings(mode="auto", min_pending_s=0, min_interval_s=0), plan_interval_s=30)
    h = Harness(SchedulerConfig(mig=control), mig_apply_s=5)
    h.add_node(registered_node("n0", gpus=1, model="H100-80GB").inventory)
    job = h.submit(JobSpec(name="serve", run=RUN, resources=SHARE, max_requeues=2), at=1, runtime_s=60)

    def watchdog_stops_it() -> None:  # the executor's share watchdog: the run ends, its report reaches the scheduler
        placement = h.state.jobs[job.job_id].placement_id
        h.world.nodes["n0"].runs.pop(placement)
        h.send(JobFailed(job_id=job.job_id, placement_id=placement, node_id="n0", cause="gpu_oom",
                         stop_reason="gpu_memory_exceeded", gpu_memory_peak_mib=30720,
                         reason="gpu_memory_exceeded: used 30720 MiB of 4096"), at=h.now)

    placed: list[JobPlaced] = []
    h.observers.append(lambda step, _: placed.extend(e for e, _ in step.events if isinstance(e, JobPlaced)))
    h.at(10, watchdog_stops_it)
    h.run()
    assert [p.assignments[0].gpus[0].mig_profile for p in placed] == [None, "3g.40gb"]
    record = h.state.jobs[job.job_id]
    assert job.state == "succeeded" and job.placements == 2 and record.requeues == 1
    assert record.spec.resources.mig_profiles == ["3g.40gb", "4g.40gb"]
    gpu = h.state.nodes["n0"].inventory.gpus[0]
    assert gpu.mig_enabled and {m.profile for m in gpu.mig_instances} & {"3g.40gb", "4g.40gb"}
