"""The service with the real broker and PostgreSQL: competing instances, /metrics, rollups and retention."""

from __future__ import annotations

import asyncio
import socket
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import httpx
import pytest
from gpuorch_contracts import GpuAllocation, JobPlaced, NodeAssignment, utc_now
from gpuorch_messaging import Broker
from gpuorch_messaging.testing import RecordingPublisher
from gpuorch_telemetry.domain.detection import DetectionConfig
from gpuorch_telemetry.entrypoint import Settings, TelemetryService
from gpuorch_telemetry.handlers import TelemetryHandlers
from gpuorch_telemetry.metrics import serve_metrics
from gpuorch_telemetry.simulation import PROFILES, SimulatedGpu, gpu_uuid, simulated_job, usage_message
from gpuorch_telemetry.store import RetentionPolicy, TelemetryStore

pytestmark = pytest.mark.integration


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _node(node: str, gpus: int = 2) -> list[SimulatedGpu]:
    return [SimulatedGpu(node_id=node, index=i, uuid=gpu_uuid(node, i), profile=PROFILES["normal"], pids=[100 + i])
            for i in range(gpus)]


async def _wait_for(predicate, timeout_s: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.1)


@pytest.fixture
async def services(amqp_url: str, migrated_dsn: str) -> AsyncIterator[list[TelemetryService]]:
    started = []
    for i in range(2):
        service = TelemetryService(Settings(
            amqp_url=amqp_url, database_url=migrated_dsn, metrics_port=0, instance=f"telemetry/test-{i}",
            prefetch=64, metrics_refresh_s=0.2, evaluation_tick_s=0.2, publish_tick_s=0.5,
        ))
        await service.start(serve_metrics=False)
        started.append(service)
    yield started
    for service in started:
        await service.stop()


async def test_two_instances_side_by_side_store_each_sample_once(
    services: list[TelemetryService], amqp_url: str, migrated_dsn: str
) -> None:
    job = simulated_job("train", "node-1", [GpuAllocation(gpu_uuid=gpu_uuid("node-1", 0), gpu_index=0)], 100)
    now = utc_now()
    messages = [*job.lifecycle(now - timedelta(minutes=5), now - timedelta(minutes=5))]
    samples = [usage_message(f"node-{n}", _node(f"node-{n}"), now - timedelta(seconds=s))
               for n in range(1, 21) for s in range(0, 100, 10)]
    store = services[0].store
    assert store is not None

    async def job_mapped() -> bool:
        """The allocation (JobPlaced) and the pid (JobStarted) are stored: samples after this are attributed."""
        mapped = await store.pool.fetchval(
            "SELECT (SELECT count(*) FROM telemetry_job_allocations WHERE job_id = $1) > 0 "
            "AND (SELECT count(*) FROM telemetry_job_processes WHERE job_id = $1) > 0", job.job_id)
        return bool(mapped)

    publisher = Broker(amqp_url, producer="test")
    await publisher.connect()
    try:
        for m in messages:
            await publisher.publish(m)
        await _wait_for(job_mapped)  # samples before the job map are simply unattributed
        await publisher.publish_many(samples)
        await publisher.publish_many(samples[:50])  # redelivered duplicates, consumed by either instance
    finally:
        await publisher.close()

    async def all_in() -> bool:
        n = await store.pool.fetchval("SELECT count(*) FROM telemetry_ingested_messages")
        return bool(n == len(samples))

    await _wait_for(all_in)
    await asyncio.sleep(0.5)  # duplicates still in flight would show up as extra rows below
    assert await store.pool.fetchval("SELECT count(*) FROM telemetry_gpu_samples") == len(samples) * 2
    job_rows = await store.pool.fetchval("SELECT count(*) FROM telemetry_job_samples WHERE job_id = $1", job.job_id)
    assert job_rows == 10


async def test_competing_evaluators_raise_one_alert_per_job(migrated_dsn: str) -> None:
    now = utc_now()
    config = DetectionConfig(window_s=60.0)
    stores = [await TelemetryStore.open(migrated_dsn, max_size=2) for _ in range(2)]
    publishers = [RecordingPublisher(), RecordingPublisher()]
    try:
        instances = [TelemetryHandlers(store=s, publisher=p, detection=config, clock=lambda: now)
                     for s, p in zip(stores, publishers, strict=True)]
        gpus = []
        for i in range(20):  # twenty idle jobs, one GPU each
            job = simulated_job(f"idle-{i}", "node-1", [GpuAllocation(gpu_uuid=gpu_uuid("node-1", i), gpu_index=i)],
                                1000 + i)
            for m in job.lifecycle(now - timedelta(minutes=10), now - timedelta(minutes=10)):
                await instances[i % 2].handle(m)
            gpus.append(SimulatedGpu(node_id="node-1", index=i, uuid=gpu_uuid("node-1", i)))
        for s in range(0, 70, 10):
            message = usage_message("node-1", gpus, now - timedelta(seconds=s))
            await asyncio.gather(*(h.handle(message) for h in instances))  # both get every message
        for instance in instances:
            instance.evaluation_batch = 3
        results = await asyncio.gather(*(_evaluate_all(h) for h in instances))
        assert sum(jobs for jobs, _ in results) == 20 and all(jobs > 0 for jobs, _ in results)
        assert await stores[0].pool.fetchval("SELECT count(*) FROM telemetry_gpu_samples") == 7 * 20
        assert await stores[0].pool.fetchval("SELECT count(*) FROM telemetry_alerts WHERE kind = 'idle'") == 20
        assert sum(len(p.published) for p in publishers) == 20
    finally:
        for s in stores:
            await s.close()


async def _evaluate_all(handlers: TelemetryHandlers) -> tuple[int, int]:
    jobs = raised = 0
    while True:
        n, r, _ = await handlers.evaluate_due_jobs()
        if n == 0:
            return jobs, raised
        jobs, raised = jobs + n, raised + r
        await asyncio.sleep(0)


async def test_metrics_endpoint_is_scraped(services: list[TelemetryService], amqp_url: str) -> None:
    port = _free_port()
    serve_metrics(port, addr="127.0.0.1")
    job = simulated_job("serve", "node-7", [GpuAllocation(gpu_uuid=gpu_uuid("node-7", 0), gpu_index=0)], 100,
                        tenant="team-m")
    publisher = Broker(amqp_url, producer="test")
    await publisher.connect()
    try:
        now = utc_now()
        for m in job.lifecycle(now - timedelta(minutes=1), now - timedelta(minutes=1)):
            await publisher.publish(m)
        await asyncio.sleep(0.3)
        await publisher.publish(usage_message("node-7", _node("node-7"), utc_now()))
    finally:
        await publisher.close()

    uuid0 = gpu_uuid("node-7", 0)

    async def scraped() -> bool:
        """Both the lifecycle (allocation) and the usage sample were taken in: they arrive on one queue but two
        instances compete for it, so either may be handled first."""
        async with httpx.AsyncClient() as client:
            body = (await client.get(f"http://127.0.0.1:{port}/metrics")).text
        return 'gpuorch_tenant_gpus_allocated{tenant="team-m"} 1.0' in body and \
            'gpuorch_tenant_gpus_used{tenant="team-m"}' in body and f'UUID="{uuid0}"' in body

    await _wait_for(scraped)
    async with httpx.AsyncClient() as client:
        body = (await client.get(f"http://127.0.0.1:{port}/metrics")).text
    assert f'DCGM_FI_DEV_GPU_UTIL{{gpu="0",UUID="{uuid0}",device="nvidia0",Hostname="node-7"}} 85\n' in body
    assert f'DCGM_FI_DEV_FB_USED{{gpu="0",UUID="{uuid0}",device="nvidia0",Hostname="node-7"}} 60000\n' in body
    assert 'gpuorch_tenant_gpus_used{tenant="team-m"} 0.85' in body
    assert f'gpuorch_job_gpu_memory_used_bytes{{job_id="{job.job_id}",job_name="serve",tenant="team-m",' in body
    assert "gpuorch_telemetry_metrics_leader 1.0" in body
    assert 'gpuorch_telemetry_samples_ingested_total{outcome="applied"}' in body
    async with httpx.AsyncClient() as client:
        only = (await client.get(f"http://127.0.0.1:{port}/metrics",
                                 params={"name[]": "gpuorch_telemetry_samples_ingested_total"})).text
    assert "gpuorch_telemetry_samples_ingested_total" in only and "DCGM_FI_DEV_GPU_UTIL" not in only


async def test_rollups_keep_accounting_after_raw_retention(migrated_dsn: str) -> None:
    retention = RetentionPolicy(raw_days=2, rollup_days=30, bucket_s=300, sample_interval_s=10)
    store = await TelemetryStore.open(migrated_dsn, retention, max_size=2)
    try:
        now = datetime.now(UTC).replace(minute=30, second=0, microsecond=0)
        two_days_ago = now - timedelta(days=2)
        handlers = TelemetryHandlers(store=store, publisher=RecordingPublisher(), clock=lambda: now)
        job = simulated_job("old", "node-1", [GpuAllocation(gpu_uuid=gpu_uuid("node-1", 0), gpu_index=0)], 100)
        for m in job.lifecycle(two_days_ago - timedelta(minutes=1), two_days_ago - timedelta(minutes=1)):
            await handlers.handle(m)
        gpu = SimulatedGpu(node_id="node-1", index=0, uuid=gpu_uuid("node-1", 0), profile=PROFILES["normal"],
                           pids=[100])
        for s in range(0, 600, 10):  # ten minutes at 85 %, 60000 MiB, 250 W: two full 5-minute buckets
            await handlers.handle(usage_message("node-1", [gpu], two_days_ago + timedelta(seconds=s)))
        await handlers.handle(usage_message("node-1", [gpu], now - timedelta(days=5)))  # beyond raw retention
        assert await store.pool.fetchval("SELECT count(*) FROM telemetry_gpu_samples") == 60

        while await store.roll_up(now, max_buckets=600):
            pass
        row = await store.pool.fetchrow("SELECT * FROM telemetry_job_accounting WHERE job_id = $1", job.job_id)
        assert row["peak_memory_mib"] == 60000 and row["mean_util_pct"] == pytest.approx(85.0)
        assert row["p95_util_pct"] == 90.0 and row["observed_s"] == pytest.approx(600.0)
        assert row["energy_j"] == pytest.approx(250.0 * 600.0) and row["idle_s"] == 0
        assert await store.pool.fetchval("SELECT count(*) FROM telemetry_job_rollups") == 2
        assert await store.pool.fetchval("SELECT count(*) FROM telemetry_gpu_rollups") == 2

        dropped = await store.apply_retention(now + timedelta(days=1))
        assert dropped["raw_partitions"] >= 4
        assert await store.pool.fetchval("SELECT count(*) FROM telemetry_gpu_samples") == 0
        assert await store.pool.fetchval("SELECT count(*) FROM telemetry_job_rollups") == 2
        dropped = await store.apply_retention(now + timedelta(days=31))
        assert dropped["job_rollups"] == 2 and dropped["gpu_rollups"] == 2
    finally:
        await store.close()


async def test_a_task_of_an_array_is_charged_to_its_tenant(migrated_dsn: str) -> None:
    """An array's tasks have no JobAccepted of their own: their first event, JobPlaced, names their tenant."""
    store = await TelemetryStore.open(migrated_dsn, max_size=2)
    try:
        handlers = TelemetryHandlers(store=store, publisher=RecordingPublisher(), detection=DetectionConfig())
        task = uuid.uuid4()
        await handlers.handle(JobPlaced(job_id=task, placement_id=uuid.uuid4(), tenant="acme", assignments=[
            NodeAssignment(node_id="node-1", gpus=[GpuAllocation(gpu_uuid=gpu_uuid("node-1", 0), gpu_index=0)])]))
        assert await store.pool.fetchval("SELECT tenant FROM telemetry_jobs WHERE job_id = $1", task) == "acme"
    finally:
        await store.close()
