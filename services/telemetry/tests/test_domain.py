"""Pure rules: sizing, attribution, detection (no I/O)."""

from __future__ import annotations

import uuid

import pytest
from gpuorch_contracts import GpuSample, ProcessUsage
from gpuorch_telemetry.domain.attribution import ActiveAllocation, attribute_gpu_sample, throttle_flags
from gpuorch_telemetry.domain.detection import (
    CONTENDED,
    IDLE,
    MEMORY_PRESSURE,
    OVERSIZED,
    STARVED,
    THROTTLED,
    DetectionConfig,
    DeviceWindow,
    JobFacts,
    Neighbour,
    evaluate_job,
    health_event_finding,
)
from gpuorch_telemetry.domain.sizing import memory_class_gb, smallest_fit, weights_memory_mib


@pytest.mark.parametrize(
    ("model", "peak_mib", "profile"),
    [
        ("A100-40GB", 3000, "1g.5gb"), ("A100-40GB", 4500, "1g.10gb"), ("A100-40GB", 9000, "3g.20gb"),
        ("A100-40GB", 30000, "7g.40gb"), ("H100-80GB", 7000, "1g.10gb"), ("NVIDIA H100 80GB HBM3", 9000, "1g.20gb"),
        ("A100-80GB", 20000, "3g.40gb"), ("H100-80GB", 70000, None),
        ("L4", 5000, None), ("T4", 5000, None), (None, 5000, None),  # no MIG, or the model unknown: a share only
    ],
)
def test_smallest_mig_profile_holds_peak_with_headroom(model: str | None, peak_mib: int, profile: str | None) -> None:
    fit = smallest_fit(peak_mib, model, headroom=0.2, p95_util_of_gpu_pct=30.0)
    assert fit.mig_profile == profile
    assert fit.share_memory_mib >= peak_mib * 1.2 and fit.share_memory_mib % 1024 == 0
    assert fit.share_milli == 400  # 30 % * 1.2 = 36 % -> rounded up to 400 milli


def test_memory_class_and_weights() -> None:
    assert memory_class_gb(81559) == 80 and memory_class_gb(40536) == 40 and memory_class_gb(16384) is None
    assert weights_memory_mib(7_000_000_000, "fp16") == 13352
    assert weights_memory_mib(7_000_000_000, "int8") == 6676


def _alloc(job: uuid.UUID, device: str, *, milli: int = 1000, pid: int | None = None, mig: str | None = None,
           index: int = 0) -> ActiveAllocation:
    return ActiveAllocation(job_id=job, tenant="t", node_id="n1", device_uuid=device, gpu_index=index, milli=milli,
                            memory_mib=None, mig_profile=mig, pid=pid, container_id=None)


def test_child_process_on_a_gpu_held_alone_belongs_to_the_job() -> None:
    job = uuid.uuid4()
    sample = GpuSample(index=0, uuid="GPU-a", utilization_pct=70, memory_total_mib=81920,
                       processes=[ProcessUsage(pid=999, gpu_memory_mib=5000)])
    result = attribute_gpu_sample(sample, [_alloc(job, "GPU-a", pid=100)])
    assert result.process_jobs == [job]
    assert result.usage[0].memory_used_mib == 5000 and result.usage[0].util_pct == 70
    assert result.usage[0].alloc_memory_mib == 81920


def test_a_share_never_takes_a_process_it_did_not_start() -> None:
    job = uuid.uuid4()
    sample = GpuSample(index=0, uuid="GPU-a", utilization_pct=70, memory_total_mib=81920, processes=[
        ProcessUsage(pid=101, pgid=100, gpu_memory_mib=3000),  # the share's own child
        ProcessUsage(pid=999, gpu_memory_mib=30720),  # a neighbour whose allocation telemetry does not know
    ])
    result = attribute_gpu_sample(sample, [_alloc(job, "GPU-a", milli=250, pid=100)])
    assert result.process_jobs == [job, None]
    assert result.usage[0].memory_used_mib == 3000


def test_shared_gpu_attributes_by_process_group_and_splits_utilisation_by_memory() -> None:
    a, b = uuid.uuid4(), uuid.uuid4()
    sample = GpuSample(index=0, uuid="GPU-a", utilization_pct=60, memory_total_mib=40000, processes=[
        ProcessUsage(pid=101, pgid=100, gpu_memory_mib=3000),   # child of job a (same process group)
        ProcessUsage(pid=200, gpu_memory_mib=1000),             # job b's started pid
        ProcessUsage(pid=300, gpu_memory_mib=500),              # unknown: two jobs share the GPU
    ])
    result = attribute_gpu_sample(sample, [_alloc(a, "GPU-a", milli=500, pid=100), _alloc(b, "GPU-a", milli=250,
                                                                                         pid=200)])
    assert result.process_jobs == [a, b, None]
    usage = {u.job_id: u for u in result.usage}
    # 60 % of the GPU split by memory: a holds 3000/4500 -> 40 % of the GPU = 80 % of its 500-milli share.
    assert usage[a].util_pct == pytest.approx(80.0)
    assert usage[b].util_pct == pytest.approx(60 * 1000 / 4500 / 0.25)
    assert usage[a].alloc_memory_mib == 20000 and usage[b].memory_used_mib == 1000


def test_mig_instances_attribute_by_instance_uuid() -> None:
    a, b = uuid.uuid4(), uuid.uuid4()
    sample = GpuSample(index=2, uuid="GPU-p", utilization_pct=None, memory_total_mib=81920, processes=[
        ProcessUsage(pid=1, gpu_memory_mib=4000, gpu_instance_uuid="MIG-1", sm_util_pct=50),
        ProcessUsage(pid=2, gpu_memory_mib=9000, gpu_instance_uuid="MIG-2"),
    ])
    result = attribute_gpu_sample(sample, [_alloc(a, "MIG-1", mig="1g.10gb", index=2),
                                           _alloc(b, "MIG-2", mig="1g.10gb", index=2)])
    assert result.process_jobs == [a, b]
    usage = {u.job_id: u for u in result.usage}
    assert usage[a].util_pct == 50 and usage[a].alloc_memory_mib == 10240
    assert usage[b].util_pct is None and usage[b].memory_used_mib == 9000


def test_throttle_reason_names() -> None:
    assert throttle_flags(["sw_thermal_slowdown"]) == (True, False)
    assert throttle_flags(["sw_power_cap"]) == (False, True)
    assert throttle_flags(["gpu_idle"]) == (False, False)


def _window(**overrides: object) -> DeviceWindow:
    base: dict[str, object] = dict(
        device_uuid="GPU-a", node_id="n1", gpu_uuid="GPU-a", alloc_milli=1000, alloc_memory_mib=81920,
        gpu_memory_total_mib=81920, mig_profile=None, samples=60, span_s=590.0, samples_with_process=60,
        util_samples=60, mean_util_pct=85.0, p95_util_pct=95.0, max_util_pct=99.0, mean_gpu_util_pct=85.0,
        peak_memory_mib=60000, mean_memory_mib=58000.0, lifetime_peak_memory_mib=60000, pressure_samples=0,
        mean_host_cpu_pct=200.0, mean_io_wait_pct=2.0, thermal_samples=0, power_samples=0, max_temperature_c=65.0,
        mean_power_w=300.0, mean_sm_clock_mhz=1400.0,
    )
    base.update(overrides)
    return DeviceWindow(**base)  # type: ignore[arg-type]


JOB = JobFacts(job_id=uuid.uuid4(), tenant="t", name="j", tier="training", state="running", cpu_milli=4000,
               model_parameter_count=None, model_dtype=None, running_for_s=7200.0)


def _kinds(window: DeviceWindow, job: JobFacts = JOB) -> set[str]:
    return {f.kind for f in evaluate_job(job, [window], DetectionConfig()).findings}


def test_each_rule_fires_on_its_profile_and_not_on_a_normal_job() -> None:
    assert _kinds(_window()) == set()
    assert _kinds(_window(samples_with_process=0, mean_util_pct=0.0, max_util_pct=0.0, peak_memory_mib=0,
                          lifetime_peak_memory_mib=0)) == {IDLE}
    assert _kinds(_window(mean_util_pct=10.0, mean_host_cpu_pct=395.0)) == {STARVED}
    assert _kinds(_window(mean_util_pct=10.0, mean_io_wait_pct=40.0)) == {STARVED}
    assert _kinds(_window(mean_util_pct=10.0)) == set()  # low but neither CPU- nor I/O-bound: not starved
    assert _kinds(_window(thermal_samples=50, max_temperature_c=90.0)) == {THROTTLED}
    assert _kinds(_window(pressure_samples=45, peak_memory_mib=79000)) == {MEMORY_PRESSURE}
    assert _kinds(_window(peak_memory_mib=6000, lifetime_peak_memory_mib=6000)) == {OVERSIZED}


def test_not_enough_data_judges_nothing() -> None:
    evaluation = evaluate_job(JOB, [_window(span_s=100.0, samples_with_process=0)], DetectionConfig())
    assert evaluation.findings == [] and evaluation.cleared == set()


def test_oversized_advice_names_profile_share_and_precisions() -> None:
    job = JobFacts(job_id=uuid.uuid4(), tenant="t", name="llm", tier="inference", state="running", cpu_milli=2000,
                   model_parameter_count=1_500_000_000, model_dtype="fp32", running_for_s=7200.0)
    [finding] = evaluate_job(job, [_window(peak_memory_mib=6000, lifetime_peak_memory_mib=6000, p95_util_pct=50.0,
                                           gpu_model="H100-80GB")], DetectionConfig()).findings
    assert finding.category == "recommendation"
    assert "1g.10gb" in (finding.advice or "") and "fp16" in (finding.advice or "")
    assert finding.evidence["fp16_weights_mib"] == 2862 and finding.evidence["int8_weights_mib"] == 1431
    assert finding.evidence["recommended_share_milli"] == 600


def test_oversized_advice_on_a_gpu_without_mig_names_a_share_not_a_profile() -> None:
    # An L4 (23034 MiB) sits in the A30's 24 GB memory class, but has no MIG: no "1g.6gb" advice.
    window = _window(gpu_model="L4", gpu_memory_total_mib=23034, alloc_memory_mib=23034, peak_memory_mib=4000,
                     lifetime_peak_memory_mib=4000, p95_util_pct=50.0)
    [finding] = evaluate_job(JOB, [window], DetectionConfig()).findings
    assert finding.kind == OVERSIZED
    assert "MIG" not in (finding.advice or "") and "1g." not in (finding.advice or "")
    assert "a share of 5 GiB" in (finding.advice or "") and "recommended_mig_memory_mib" not in finding.evidence


def test_a_share_starved_by_a_busy_neighbour_on_a_saturated_gpu_is_contended() -> None:
    serving = JobFacts(job_id=uuid.uuid4(), tenant="serving", name="chat", tier="inference", state="running",
                       cpu_milli=1000, model_parameter_count=None, model_dtype=None, running_for_s=600.0)
    batch = JobFacts(job_id=uuid.uuid4(), tenant="research", name="embed", tier="batch", state="running",
                     cpu_milli=1000, model_parameter_count=None, model_dtype=None, running_for_s=600.0)
    share = dict(alloc_milli=250, alloc_memory_mib=8192, peak_memory_mib=6000, lifetime_peak_memory_mib=6000,
                 mean_gpu_util_pct=98.0, mean_host_cpu_pct=20.0)
    victim = _window(**share, mean_util_pct=35.0)
    noisy = Neighbour(batch, _window(**share, mean_util_pct=100.0))
    [finding] = evaluate_job(serving, [victim], DetectionConfig(), [noisy]).findings
    assert finding.kind == CONTENDED and finding.severity == "warning"  # inference: latency-sensitive
    assert "got 35 % of its 250-milli share" in finding.explanation and "embed" in finding.explanation
    calm = evaluate_job(serving, [victim], DetectionConfig(), [Neighbour(batch, _window(**share, mean_util_pct=50.0))])
    assert calm.findings == [] and CONTENDED in calm.cleared  # the neighbour keeps to its share
    unsaturated = _window(**{**share, "mean_gpu_util_pct": 60.0}, mean_util_pct=35.0)
    assert evaluate_job(serving, [unsaturated], DetectionConfig(), [noisy]).findings == []
    assert CONTENDED not in evaluate_job(JOB, [_window()], DetectionConfig(), [noisy]).cleared  # a whole GPU


def test_xid_health_event_explains_the_class() -> None:
    finding = health_event_finding("n1", "GPU-a", "unhealthy", "fell off the bus", 79, "drain", None, None)
    assert finding is not None and finding.severity == "critical" and "fallen off the bus" in finding.explanation
    assert health_event_finding("n1", "GPU-a", "healthy", "ok", None, "none", None, None) is None


async def test_a_failing_message_fails_alone_and_the_rest_of_its_batch_commits() -> None:
    import asyncio

    from gpuorch_contracts import GpuUsageSampled
    from gpuorch_telemetry.handlers import SampleBatcher
    from gpuorch_telemetry.store import IngestOutcome

    committed: list[str] = []

    async def flush(batch: list[GpuUsageSampled]) -> IngestOutcome:
        if any(m.node_id == "poison" for m in batch):
            raise ValueError("cannot store")
        committed.extend(m.node_id for m in batch)
        return IngestOutcome(applied=len(batch))

    batcher = SampleBatcher(flush, max_batch=3, max_delay_s=10)
    messages = [GpuUsageSampled(node_id=name, samples=[]) for name in ("a", "poison", "b")]
    results = await asyncio.gather(*(batcher.submit(m) for m in messages), return_exceptions=True)
    assert [isinstance(r, ValueError) for r in results] == [False, True, False]
    assert committed == ["a", "b"]


def test_settings_from_environment() -> None:
    from gpuorch_settings import SettingsError
    from gpuorch_telemetry.entrypoint import Settings

    settings = Settings.load({
        "GPUORCH_AMQP_URL": "amqp://x", "GPUORCH_DATABASE_URL": "postgresql://y", "GPUORCH_TELEMETRY_WINDOW_S": "120",
        "GPUORCH_TELEMETRY_IDLE_UTIL_PCT": "3", "GPUORCH_TELEMETRY_RAW_RETENTION_DAYS": "7",
        "GPUORCH_TELEMETRY_EXPORT_GPU_METRICS": "0",
    })
    assert settings.detection.window_s == 120 and settings.detection.idle_util_pct == 3
    assert settings.retention.raw_days == 7 and settings.retention.idle_util_pct == 3
    assert settings.export_gpu_metrics is False and settings.capacity.mode.value == "off"
    with pytest.raises(SettingsError, match="GPUORCH_DATABASE_URL: Field required"):
        Settings.load({"GPUORCH_AMQP_URL": "amqp://x"})
    with pytest.raises(SettingsError, match="GPUORCH_CAPACITY_MODE needs GPUORCH_CAPACITY_POOLS"):
        Settings.load({"GPUORCH_AMQP_URL": "amqp://x", "GPUORCH_DATABASE_URL": "postgresql://y",
                       "GPUORCH_CAPACITY_MODE": "auto"})
    with pytest.raises(SettingsError, match="GPUORCH_TELEMETRY_WINDOW_S: Input should be a valid number"):
        Settings.load({"GPUORCH_AMQP_URL": "amqp://x", "GPUORCH_DATABASE_URL": "postgresql://y",
                       "GPUORCH_TELEMETRY_WINDOW_S": "ten minutes"})
