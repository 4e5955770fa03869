"""Simulated jobs with known usage profiles, through the handlers into the real PostgreSQL.

Each profile must raise exactly its detection with the right advice; the normal job raises nothing.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from datetime import datetime, timedelta

import pytest
from gpuorch_contracts import (
    AlertRaised,
    AlertResolved,
    GpuAllocation,
    GpuHealthChanged,
    JobFinished,
    RecommendationMade,
    utc_now,
)
from gpuorch_contracts.jobs import GpuRequest
from gpuorch_messaging.testing import RecordingPublisher
from gpuorch_telemetry.domain.detection import DetectionConfig
from gpuorch_telemetry.handlers import TelemetryHandlers
from gpuorch_telemetry.simulation import (
    PROFILES,
    SimulatedGpu,
    SimulatedJob,
    gpu_uuid,
    simulated_job,
    usage_message,
)
from gpuorch_telemetry.store import TelemetryStore

pytestmark = pytest.mark.integration

WINDOW_S = 120.0
CONFIG = DetectionConfig(window_s=WINDOW_S, oversized_min_observed_s=600.0)


class Clock:
    def __init__(self, now: datetime) -> None:
        self.now = now

    def __call__(self) -> datetime:
        return self.now


@pytest.fixture
async def store(migrated_dsn: str) -> AsyncIterator[TelemetryStore]:
    s = await TelemetryStore.open(migrated_dsn, max_size=4)
    yield s
    await s.close()


def _whole_gpu_job(name: str, node: str, index: int, pid: int, **kwargs: object) -> SimulatedJob:
    return simulated_job(name, node, [GpuAllocation(gpu_uuid=gpu_uuid(node, index), gpu_index=index)], pid,
                         **kwargs)  # type: ignore[arg-type]


async def _run_profiles(handlers: TelemetryHandlers, clock: Clock) -> dict[str, SimulatedJob]:
    """Six jobs on one node of H100s (one GPU each, plus an inference share), sampled every 10 s for the window."""
    node = "node-1"
    inventory = {"node_id": node, "cpu_milli": 64000, "memory_mib": 262144,  # the scheduler's read model of it
                 "gpus": [{"uuid": gpu_uuid(node, i), "index": i, "model": "H100-80GB", "memory_total_mib": 81920}
                          for i in range(6)]}
    await handlers.store.pool.execute(
        "INSERT INTO nodes (node_id, liveness, inventory, inventory_hash) VALUES ($1, 'alive', $2::jsonb, 'h')",
        node, json.dumps(inventory))
    start = clock.now - timedelta(minutes=20)
    jobs = {
        "normal": _whole_gpu_job("normal", node, 0, 1000),
        "idle": _whole_gpu_job("idle", node, 1, 2000),
        "oversized": _whole_gpu_job("oversized", node, 2, 3000, parameter_count=1_500_000_000, dtype="fp32"),
        "starved": _whole_gpu_job("starved", node, 3, 4000, cpu_milli=4000),
        "throttled": _whole_gpu_job("throttled", node, 4, 5000),
        "memory_bound": simulated_job(
            "memory_bound", node, [GpuAllocation(gpu_uuid=gpu_uuid(node, 5), gpu_index=5, milli=250,
                                                 memory_mib=20480)], 6000, tier="inference",
            resources=GpuRequest(gpu_milli=250, gpu_memory_mib=20480)),
    }
    gpus = []
    for index, (profile, job) in enumerate(jobs.items()):
        gpus.append(SimulatedGpu(node_id=node, index=index, uuid=gpu_uuid(node, index), profile=PROFILES[profile],
                                 pids=[job.pid], milli_of_gpu=0.25 if profile == "memory_bound" else 1.0))
    for job in jobs.values():
        for message in job.lifecycle(start, start + timedelta(seconds=5)):
            await handlers.handle(message)
    t = clock.now - timedelta(seconds=WINDOW_S)
    while t <= clock.now:
        await handlers.handle(usage_message(node, gpus, t))
        t += timedelta(seconds=10)
    return jobs


async def test_each_profile_raises_its_detection_and_a_normal_job_nothing(store: TelemetryStore) -> None:
    clock = Clock(utc_now())
    publisher = RecordingPublisher()
    handlers = TelemetryHandlers(store=store, publisher=publisher, detection=CONFIG, clock=clock)
    jobs = await _run_profiles(handlers, clock)

    evaluated, raised, _ = await handlers.evaluate_due_jobs()
    assert evaluated == 6 and raised == 5

    by_job: dict[uuid.UUID, set[str]] = {}
    for alert in await store.alerts():
        by_job.setdefault(alert.job_id, set()).add(alert.kind)  # type: ignore[arg-type]
    assert jobs["normal"].job_id not in by_job
    assert by_job[jobs["idle"].job_id] == {"idle"}
    assert by_job[jobs["oversized"].job_id] == {"oversized"}
    assert by_job[jobs["starved"].job_id] == {"starved"}
    assert by_job[jobs["throttled"].job_id] == {"throttled"}
    assert by_job[jobs["memory_bound"].job_id] == {"memory_pressure"}

    alerts = {m.kind: m for m in publisher.of_type(AlertRaised)}
    [recommendation] = publisher.of_type(RecommendationMade)
    assert set(alerts) == {"idle", "starved", "throttled", "memory_pressure"}
    assert all(key.startswith(("alert.", "recommendation.")) for _, key, _ in publisher.published)
    assert "no process ran" in alerts["idle"].explanation
    assert alerts["starved"].evidence["host_cpu_pct"] == 390.0 and "CPU" in (alerts["starved"].advice or "")
    assert "thermal" in alerts["throttled"].explanation and alerts["throttled"].evidence["thermal_pct"] == 100.0
    assert "replica" in (alerts["memory_pressure"].advice or "")  # inference: an autoscaling signal
    assert recommendation.job_id == jobs["oversized"].job_id
    assert "1g.10gb" in (recommendation.advice or "") and "int8" in (recommendation.advice or "")  # an H100's
    assert recommendation.evidence["peak_memory_mib"] == 6000
    assert recommendation.evidence["fp16_weights_mib"] == 2862

    # Evaluating again later raises nothing new (one open alert per job and kind).
    clock.now += timedelta(seconds=61)
    _, raised_again, _ = await handlers.evaluate_due_jobs()
    assert raised_again == 0 and len(publisher.of_type(AlertRaised)) == 4

    # The idle job ends: its alert is resolved and the resolution published.
    idle = jobs["idle"]
    await handlers.handle(JobFinished(job_id=idle.job_id, placement_id=idle.placement_id, node_id="node-1",
                                      exit_code=0, duration_s=1200))
    [resolved] = publisher.of_type(AlertResolved)
    assert resolved.job_id == idle.job_id and resolved.kind == "idle"
    assert not [a for a in await store.alerts(job_id=idle.job_id, open_only=True)]


async def test_accounting_rows_follow_the_executor_pid_map(store: TelemetryStore) -> None:
    clock = Clock(utc_now())
    handlers = TelemetryHandlers(store=store, publisher=RecordingPublisher(), detection=CONFIG, clock=clock)
    jobs = await _run_profiles(handlers, clock)
    rows = await store.pool.fetch(
        "SELECT job_id, count(*) AS n, max(memory_used_mib) AS peak, avg(util_pct) AS util, "
        "sum(process_count) AS procs FROM telemetry_job_samples GROUP BY job_id"
    )
    usage = {r["job_id"]: r for r in rows}
    assert len(usage) == 6 and all(r["n"] == 13 for r in rows)
    assert usage[jobs["oversized"].job_id]["peak"] == 6000
    assert usage[jobs["normal"].job_id]["util"] == pytest.approx(85.0)
    assert usage[jobs["idle"].job_id]["procs"] == 0
    assert usage[jobs["memory_bound"].job_id]["util"] == pytest.approx(70.0)  # of its 250-milli share
    unattributed = await store.pool.fetchval("SELECT count(*) FROM telemetry_process_samples WHERE job_id IS NULL")
    assert unattributed == 0


async def test_gpu_health_events_and_ecc_samples_raise_and_resolve(store: TelemetryStore) -> None:
    clock = Clock(utc_now())
    publisher = RecordingPublisher()
    handlers = TelemetryHandlers(store=store, publisher=publisher, detection=CONFIG, clock=clock)
    jobs = await _run_profiles(handlers, clock)
    gpu = gpu_uuid("node-1", 4)
    await handlers.handle(GpuHealthChanged(node_id="node-1", gpu_uuid=gpu, gpu_index=4, health="unhealthy",
                                           reason="XID 79 reported", xid=79, action="drain"))
    await handlers.handle(GpuHealthChanged(node_id="node-1", gpu_uuid=gpu, gpu_index=4, health="unhealthy",
                                           reason="XID 79 reported", xid=79, action="drain"))
    [alert] = publisher.of_type(AlertRaised)
    assert alert.kind == "gpu_unhealthy" and alert.severity == "critical" and alert.evidence["xid"] == 79
    assert alert.job_id == jobs["throttled"].job_id and "fallen off the bus" in alert.explanation
    await handlers.handle(GpuHealthChanged(node_id="node-1", gpu_uuid=gpu, gpu_index=4, health="healthy",
                                           reason="reset"))
    [resolved] = publisher.of_type(AlertResolved)
    assert resolved.alert_id == alert.alert_id

    ecc_gpu = SimulatedGpu(node_id="node-2", index=0, uuid=gpu_uuid("node-2", 0), profile=PROFILES["normal"],
                           pids=[7])
    message = usage_message("node-2", [ecc_gpu], clock.now)
    broken = message.model_copy(update={"samples": [message.samples[0].model_copy(
        update={"ecc_uncorrected": 3, "remapped_rows_failed": True})]})
    await handlers.handle(broken)
    ecc = [m for m in publisher.of_type(AlertRaised) if m.gpu_uuid == ecc_gpu.uuid]
    assert len(ecc) == 1 and "row remap failed" in ecc[0].explanation and ecc[0].advice == "Replace the GPU."


async def test_job_events_in_any_order_build_the_same_job_map(store: TelemetryStore) -> None:
    clock = Clock(utc_now())
    handlers = TelemetryHandlers(store=store, publisher=RecordingPublisher(), detection=CONFIG, clock=clock)
    job = _whole_gpu_job("late-accept", "node-3", 0, 4242, tenant="team-z")
    accepted, placed, started = job.lifecycle(clock.now - timedelta(minutes=5), clock.now - timedelta(minutes=4))
    for message in (started, placed, accepted):  # competing instances may apply them in any order
        await handlers.handle(message)
    row = await store.pool.fetchrow("SELECT * FROM telemetry_jobs WHERE job_id = $1", job.job_id)
    assert (row["state"], row["tenant"], row["placement_id"]) == ("running", "team-z", job.placement_id)
    gpu = SimulatedGpu(node_id="node-3", index=0, uuid=gpu_uuid("node-3", 0), profile=PROFILES["normal"],
                       pids=[4242])
    await handlers.handle(usage_message("node-3", [gpu], clock.now))
    tenant = await store.pool.fetchval("SELECT tenant FROM telemetry_job_samples WHERE job_id = $1", job.job_id)
    assert tenant == "team-z"

    # A requeue applied after the next placement (another instance was faster) keeps the newer placement.
    from gpuorch_contracts import JobPlaced, JobRequeued

    replaced = JobPlaced(job_id=job.job_id, placement_id=uuid.uuid4(), occurred_at=clock.now,
                         assignments=[{"node_id": "node-4", "gpus": [{"gpu_uuid": gpu_uuid("node-4", 1),
                                                                     "gpu_index": 1}]}])
    await handlers.handle(replaced)
    await handlers.handle(JobRequeued(job_id=job.job_id, reason="preempted", requeues=1,
                                      occurred_at=clock.now - timedelta(seconds=1)))
    active = await store.pool.fetch(
        "SELECT node_id FROM telemetry_job_allocations WHERE job_id = $1 AND released_at IS NULL", job.job_id
    )
    assert [r["node_id"] for r in active] == ["node-4"]


async def test_an_unpublishable_alert_does_not_fail_its_message_and_is_published_later(store: TelemetryStore) -> None:
    from gpuorch_messaging import PublishError

    class Unroutable(RecordingPublisher):
        broken = True

        async def publish(self, message, *, headers=None):  # type: ignore[no-untyped-def]
            if self.broken:
                raise PublishError("unroutable: no queue bound")
            await super().publish(message, headers=headers)

    publisher = Unroutable()
    handlers = TelemetryHandlers(store=store, publisher=publisher, detection=CONFIG, clock=Clock(utc_now()))
    await handlers.handle(GpuHealthChanged(node_id="node-9", gpu_uuid="GPU-9", gpu_index=0, health="unhealthy",
                                           reason="XID 48", xid=48))  # must not raise: the alert is committed
    assert [a.kind for a in await store.alerts(open_only=True)] == ["gpu_unhealthy"]
    assert publisher.published == []
    publisher.broken = False
    assert await handlers.publish_pending() == 1
    [raised] = publisher.of_type(AlertRaised)
    assert raised.evidence["xid"] == 48 and "double-bit ECC" in raised.explanation


async def test_each_detection_is_a_span_in_its_jobs_trace(store: TelemetryStore,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """While spans are exported, what an evaluation finds about a job is a ``telemetry.detect`` span below the
    trace context the job's placement arrived with (none for a job with nothing found)."""
    import gpuorch_telemetry.handlers as telemetry_handlers

    spans: list[tuple[str, uuid.UUID, str | None, dict[str, object]]] = []

    def record(name: str, job_id: uuid.UUID, traceparent: str | None, start_s: float, end_s: float | None = None,
               attributes: dict[str, object] | None = None, tracer_name: str = "") -> str | None:
        spans.append((name, job_id, traceparent, dict(attributes or {})))
        return None

    monkeypatch.setattr(telemetry_handlers, "tracing_exported", lambda: True)
    monkeypatch.setattr(telemetry_handlers, "record_job_span", record)
    clock = Clock(utc_now())
    handlers = TelemetryHandlers(store=store, publisher=RecordingPublisher(), detection=CONFIG, clock=clock)
    jobs = await _run_profiles(handlers, clock)
    traces = {job.job_id: f"00-{uuid.uuid4().hex}-{uuid.uuid4().hex[:16]}-01" for job in jobs.values()}
    handlers.job_traces.update(traces)
    await handlers.evaluate_due_jobs()
    by_job = {job_id: (name, parent, attributes) for name, job_id, parent, attributes in spans}
    assert jobs["normal"].job_id not in by_job and len(spans) == 5
    name, parent, attributes = by_job[jobs["throttled"].job_id]
    assert name == "telemetry.detect" and parent == traces[jobs["throttled"].job_id]
    assert attributes["gpuorch.findings"] == ["throttled"] and "thermal" in str(attributes["gpuorch.explanation"])
