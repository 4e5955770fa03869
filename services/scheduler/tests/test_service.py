"""SchedulerService against the real PostgreSQL: one transaction per message, idempotency, recovery = live."""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime, timedelta

import asyncpg
import pytest
from gpuorch_contracts import (
    CreateReservation,
    DeleteReservation,
    GpuRequest,
    JobFinished,
    JobSpec,
    JobStarted,
    ProcessRun,
    SubmitJob,
)
from gpuorch_scheduler import readmodels
from gpuorch_scheduler.handlers import Persistence, SchedulerService
from gpuorch_scheduling.scheduler import SchedulerConfig
from gpuorch_scheduling.testing import registered_node as node

pytestmark = pytest.mark.integration
RUN = ProcessRun(argv=["python", "-c", "pass"])


async def test_submit_is_placed_with_commands_in_the_outbox_and_replay_matches(migrated_dsn: str) -> None:
    conn = await asyncpg.connect(migrated_dsn)
    try:
        service = SchedulerService(conn, persistence=Persistence(snapshot_every_events=3))
        await service.recover()
        await service.handle(node("n1", gpus=2))
        submits = [SubmitJob(spec=JobSpec(run=RUN, resources=GpuRequest(gpus=1))) for _ in range(3)]
        for submit in submits:
            await service.handle(submit)
            await service.handle(submit)  # redelivery: no second acceptance
        assert service.state.capacity_violations() == []
        states = {j.job_id: j.state for j in service.state.jobs.values()}
        assert sorted(states.values()) == ["placed", "placed", "queued"]

        outbox = await conn.fetch("SELECT type, routing_key FROM outbox ORDER BY id")
        types = [r["type"] for r in outbox]
        assert types.count("job.accepted") == 3
        assert types.count("job.placed") == 2
        assert sorted(r["routing_key"] for r in outbox if r["type"] == "launch_job") == ["node.n1.launch_job"] * 2
        assert types.count("job.queued") == 1

        placed = next(j for j in service.state.jobs.values() if j.state == "placed")
        started = JobStarted(job_id=placed.job_id, placement_id=placed.placement_id, node_id="n1", log_path="/x")
        await service.handle(started)
        finished = JobFinished(job_id=placed.job_id, placement_id=placed.placement_id, node_id="n1",
                               exit_code=0, duration_s=0.1)
        await service.handle(finished)
        await service.handle(finished)
        assert service.state.jobs[placed.job_id].state == "succeeded"
        # the queued job took the freed GPU in the same transaction
        assert sorted(j.state for j in service.state.jobs.values()) == ["placed", "placed", "succeeded"]

        row = await conn.fetchrow("SELECT state, exit_code, log_path FROM jobs WHERE job_id = $1", placed.job_id)
        assert dict(row) == {"state": "succeeded", "exit_code": 0, "log_path": "/x"}
        assert await conn.fetchval("SELECT count(*) FROM fair_share") == 1  # written by the first step
        await readmodels.write_fair_share(conn, service.state, service.config.queues.fair_share, time.time() + 3600)
        [line] = json.loads(await conn.fetchval("SELECT lines::text FROM fair_share"))
        assert (line["tenant"], line["gpus_held"], line["usage_gpu_hours"] > 1.9) == ("default", 2.0, True)

        snapshots = await conn.fetchval("SELECT count(*) FROM snapshots")
        assert snapshots >= 1
        live = service.state.to_snapshot()
        rebuilt = SchedulerService(conn)
        await rebuilt.recover()
        assert rebuilt.state.to_snapshot() == live
        # and from the log alone, without snapshots
        await conn.execute("DELETE FROM snapshots")
        from_log = SchedulerService(conn)
        await from_log.recover()
        assert from_log.state.to_snapshot() == live
        assert json.loads(json.dumps(live)) == live
    finally:
        await conn.close()


async def test_failed_commit_reloads_state_from_the_log(migrated_dsn: str) -> None:
    conn = await asyncpg.connect(migrated_dsn)
    try:
        service = SchedulerService(conn)
        await service.recover()
        await service.handle(node("n1", gpus=1))
        await conn.execute("ALTER TABLE outbox ADD CONSTRAINT no_inserts CHECK (false) NOT VALID")
        with pytest.raises(asyncpg.CheckViolationError):
            await service.handle(SubmitJob(spec=JobSpec(run=RUN, resources=GpuRequest(gpus=1))))
        await conn.execute("ALTER TABLE outbox DROP CONSTRAINT no_inserts")
        await service.handle(SubmitJob(spec=JobSpec(run=RUN)))
        assert len(service.state.jobs) == 1  # the failed submit left nothing behind, in memory or in the log
        assert await conn.fetchval("SELECT count(*) FROM events WHERE type = 'job.accepted'") == 1
    finally:
        await conn.close()


async def test_every_message_about_a_job_carries_its_submission_trace(migrated_dsn: str) -> None:
    from gpuorch_observability import configure_tracing, tracer

    configure_tracing("test")
    conn = await asyncpg.connect(migrated_dsn)
    try:
        service = SchedulerService(conn)
        await service.recover()
        await service.handle(node("n1", gpus=1))
        blocker = SubmitJob(spec=JobSpec(run=RUN, resources=GpuRequest(gpus=1)))
        await service.handle(blocker)
        traced = SubmitJob(spec=JobSpec(run=RUN, resources=GpuRequest(gpus=1)))
        with tracer().start_as_current_span("consume job.submit") as span:
            await service.handle(traced)
            trace_id = format(span.get_span_context().trace_id, "032x")
        # free the GPU in another context: the placement of the traced job must still join its trace
        first = service.state.jobs[blocker.job_id]
        restarted = SchedulerService(conn)
        await restarted.recover()
        await restarted.handle(JobFinished(job_id=blocker.job_id, placement_id=first.placement_id, node_id="n1",
                                           exit_code=0, duration_s=1))
        rows = await conn.fetch(
            "SELECT type, headers::text AS headers FROM outbox WHERE convert_from(body, 'UTF8') LIKE '%' || $1 || '%' ORDER BY id",
            str(traced.job_id))
        kinds = {r["type"]: json.loads(r["headers"]).get("traceparent", "").split("-")[1] for r in rows}
        assert set(kinds) >= {"job.accepted", "job.queued", "job.placed", "launch_job"}
        assert set(kinds.values()) == {trace_id}
    finally:
        await conn.close()


async def test_a_rejected_job_keeps_its_spec_and_reason_in_the_read_model(migrated_dsn: str) -> None:
    """``describe`` of a job refused at admission shows what was asked (by any submitter, not only the API's) and
    why; its row belongs to the tenant the job was admitted under."""
    conn = await asyncpg.connect(migrated_dsn)
    try:
        service = SchedulerService(conn, SchedulerConfig())
        await service.recover()
        await service.handle(node("n1", gpus=2))
        too_big = SubmitJob(spec=JobSpec(name="too-big", tenant="acme", tier="training", run=RUN,
                                         resources=GpuRequest(gpus=20)))
        await service.handle(too_big)
        row = await conn.fetchrow("SELECT name, tenant, tier, state, spec::text AS spec, reason FROM jobs "
                                  "WHERE job_id = $1", too_big.job_id)
        assert (row["name"], row["tenant"], row["tier"], row["state"]) == ("too-big", "acme", "training",
                                                                           "rejected")
        assert json.loads(row["spec"])["resources"]["gpus"] == 20
        assert "20" in row["reason"]
        [event] = await conn.fetch("SELECT routing_key FROM outbox WHERE type = 'job.rejected'")
        assert event["routing_key"] == "job.rejected.acme"  # the tenant's subscribers see their rejection
    finally:
        await conn.close()


async def test_a_reservation_is_logged_and_written_to_its_read_model(migrated_dsn: str) -> None:
    conn = await asyncpg.connect(migrated_dsn)
    try:
        service = SchedulerService(conn)
        await service.recover()
        await service.handle(node("n1", gpus=2))
        start = datetime.now(UTC) + timedelta(hours=1)
        request = CreateReservation(tenant="acme", gpus=2, start_at=start, duration_s=3600)
        await service.handle(request)
        row = await conn.fetchrow("SELECT nodes, outcome, end_at FROM reservations WHERE reservation_id = $1",
                                  request.reservation_id)
        assert (row["nodes"], row["outcome"], row["end_at"]) == (["n1"], "created", start + timedelta(hours=1))
        await service.handle(DeleteReservation(reservation_id=request.reservation_id))
        assert await conn.fetchval("SELECT outcome FROM reservations") == "deleted"
        rebuilt = SchedulerService(conn)
        await rebuilt.recover()
        assert rebuilt.state.reservations[request.reservation_id].deleted_at is not None
    finally:
        await conn.close()
