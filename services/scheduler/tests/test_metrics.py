"""The scheduler's queue metrics (Kueue's names and labels, KAI's for latency) follow what it decided."""

from __future__ import annotations

from datetime import UTC, datetime

import asyncpg
import pytest
from gpuorch_contracts import CreateReservation, GpuRequest, JobSpec, ProcessRun, SubmitJob
from gpuorch_messaging.bounded_gauges import export_bounded_queues
from gpuorch_scheduler.handlers import SchedulerService
from gpuorch_scheduling.queueing import QueuePolicy, Quota
from gpuorch_scheduling.scheduler import SchedulerConfig
from gpuorch_scheduling.testing import registered_node as node
from prometheus_client import REGISTRY

pytestmark = pytest.mark.integration
RUN = ProcessRun(argv=["python", "-c", "pass"])


def value(name: str, **labels: str) -> float | None:
    return REGISTRY.get_sample_value(name, labels)


async def test_pending_running_waits_and_quota_per_tenant_and_tier(migrated_dsn: str) -> None:
    tenant = "metrics-team"  # the registry is the process's: a tenant no other test uses
    conn = await asyncpg.connect(migrated_dsn)
    try:
        queues = QueuePolicy(quotas={tenant: Quota(gpus=2)})
        service = SchedulerService(conn, SchedulerConfig(queues=queues))
        await service.recover()
        await service.handle(node("n1", gpus=4))
        admitted_before = value("gpuorch_admitted_workloads_total", cluster_queue=tenant) or 0.0
        waits_before = value("gpuorch_admission_wait_time_seconds_count", cluster_queue=tenant, tier="batch") or 0.0
        for _ in range(3):
            await service.handle(SubmitJob(spec=JobSpec(run=RUN, tenant=tenant, tier="batch",
                                                        resources=GpuRequest(gpus=1))))
        await service.tick()
        assert value("gpuorch_pending_workloads", cluster_queue=tenant, status="active", tier="batch") == 1
        assert value("gpuorch_pending_workloads", cluster_queue=tenant, status="active", tier="training") == 0
        assert value("gpuorch_admitted_active_workloads", cluster_queue=tenant, tier="batch") == 2
        assert value("gpuorch_admitted_workloads_total", cluster_queue=tenant) == admitted_before + 2
        assert value("gpuorch_admission_wait_time_seconds_count", cluster_queue=tenant, tier="batch") == \
            waits_before + 2
        quota = {"cohort": "", "cluster_queue": tenant, "flavor": "default", "resource": "nvidia.com/gpu"}
        assert value("gpuorch_cluster_queue_resource_usage", **quota) == 2
        assert value("gpuorch_cluster_queue_nominal_quota", **quota) == 2
        assert value("gpuorch_cluster_queue_nominal_quota", **{**quota, "resource": "gpu_memory_mib"}) is None
        assert (value("gpuorch_task_scheduling_latency_milliseconds_count") or 0) >= 2
        assert value("gpuorch_e2e_scheduling_latency_milliseconds") is not None
        assert 0 < (value("gpuorch_fair_share_factor", tenant=tenant) or 0) <= 1

        reserved = CreateReservation(tenant="metrics-vip", gpus=1, start_at=datetime.now(UTC), duration_s=3600)
        await service.handle(reserved)
        await service.tick()
        assert value("gpuorch_reservation_gpus", tenant="metrics-vip", phase="active") == 1
        assert value("gpuorch_reservation_idle_gpus", tenant="metrics-vip") == 2  # the node's 2 free GPUs
    finally:
        await conn.close()


async def test_a_preemption_is_counted_for_the_tenant_it_makes_room_for(migrated_dsn: str) -> None:
    low, high = "metrics-low", "metrics-high"  # tenants no other test uses (the registry is the process's)
    conn = await asyncpg.connect(migrated_dsn)
    try:
        service = SchedulerService(conn, SchedulerConfig())
        await service.recover()
        await service.handle(node("n1", gpus=1))
        before = value("gpuorch_preempted_workloads_total", preempting_cluster_queue=high,
                       reason="InCohortReclamation") or 0.0
        await service.handle(SubmitJob(spec=JobSpec(run=RUN, tenant=low, priority_class="low", preemptible=True,
                                                    resources=GpuRequest(gpus=1))))
        urgent = SubmitJob(spec=JobSpec(run=RUN, tenant=high, priority_class="high", resources=GpuRequest(gpus=1)))
        await service.handle(urgent)
        await service.tick()
        assert [j.state for j in service.state.jobs.values() if j.spec.tenant == low] == ["preempting"]
        assert value("gpuorch_preempted_workloads_total", preempting_cluster_queue=high,
                     reason="InCohortReclamation") == before + 1
        assert value("gpuorch_preempted_workloads_total", preempting_cluster_queue=high,
                     reason="InClusterQueue") is None
    finally:
        await conn.close()


def test_a_bounded_queue_at_its_bound_is_reported_full() -> None:
    export_bounded_queues({"t.a.dlq": 3, "t.b.dlq": 2}, {"t.a.dlq": 3, "t.b.dlq": 3})
    value = REGISTRY.get_sample_value
    assert value("gpuorch_bounded_queue_messages", {"queue": "t.a.dlq"}) == 3
    assert value("gpuorch_bounded_queue_full", {"queue": "t.a.dlq"}) == 1  # at its bound: dropping its oldest
    assert value("gpuorch_bounded_queue_full", {"queue": "t.b.dlq"}) == 0
