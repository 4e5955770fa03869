"""The invariant checker itself, on hand-written logs: it must see each kind of breach (runs with ``make test``)."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import asyncpg
import pytest
from gpuorch_contracts import (
    GpuAllocation,
    GpuRequest,
    JobAccepted,
    JobFinished,
    JobPlaced,
    JobRequeued,
    JobSpec,
    JobStarted,
    Message,
    NodeAssignment,
    ProcessRun,
)
from gpuorch_scheduling.testing import registered_node
from gpuorch_store import NewEvent, append

from tests.chaos.invariants import check_invariants

pytestmark = [pytest.mark.integration]

SPEC = JobSpec(resources=GpuRequest(gpus=1), run=ProcessRun(argv=["python", "-c", "pass"]))
T0 = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def placed(job_id: uuid.UUID, seconds: float, gpu: int = 0, milli: int = 1000) -> JobPlaced:
    return JobPlaced(job_id=job_id, placement_id=uuid.uuid4(), occurred_at=at(seconds), assignments=[
        NodeAssignment(node_id="node-1", gpus=[GpuAllocation(gpu_uuid=f"GPU-node-1-{gpu}", gpu_index=gpu,
                                                             milli=milli)])])


def finished(place: JobPlaced, seconds: float) -> JobFinished:
    return JobFinished(job_id=place.job_id, placement_id=place.placement_id, node_id="node-1", exit_code=0,
                       duration_s=1.0, occurred_at=at(seconds))


async def write(dsn: str, events: list[Message], states: dict[uuid.UUID, str]) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        await append(conn, [NewEvent.from_message("scheduler", e) for e in events])
        for job_id, state in states.items():
            await conn.execute(
                "INSERT INTO jobs (job_id, name, tenant, tier, priority_class, state, spec, submitted_at) "
                "VALUES ($1, 'job', 'default', 'batch', 'normal', $2, $3::jsonb, now())",
                job_id, state, json.dumps(SPEC.model_dump(mode="json")))
    finally:
        await conn.close()


async def test_a_clean_history_holds(migrated_dsn: str) -> None:
    job = uuid.uuid4()
    first = placed(job, 1)
    second = placed(job, 5)
    await write(migrated_dsn, [registered_node("node-1", gpus=1), JobAccepted(job_id=job, spec=SPEC), first,
                               JobStarted(job_id=job, placement_id=first.placement_id, node_id="node-1"),
                               finished(first, 3), JobRequeued(job_id=job, reason="x", requeues=1), second,
                               finished(second, 7)], {job: "succeeded"})
    verdict = await check_invariants(migrated_dsn, with_scheduler_fold=False)
    assert verdict.problems() == [] and verdict.accepted == 1 and verdict.placements == 2


async def test_each_breach_is_seen(migrated_dsn: str, tmp_path: Path) -> None:
    lost, twice, crowded, other = (uuid.uuid4() for _ in range(4))
    first, second = placed(twice, 1, gpu=1), placed(twice, 2, gpu=1)  # the first never ended
    share_a, share_b = placed(crowded, 3, gpu=0, milli=600), placed(other, 4, gpu=0, milli=600)
    await write(migrated_dsn, [registered_node("node-1", gpus=2), *(JobAccepted(job_id=j, spec=SPEC) for j in
                                                                     (lost, twice, crowded, other)),
                               first, second, share_a, share_b],
                {twice: "running", crowded: "running", other: "running"})
    run_log = tmp_path / "runs.txt"
    run_log.write_text(f"start {crowded} {share_a.placement_id} 1\nstart {crowded} {share_a.placement_id} 2\n")
    verdict = await check_invariants(migrated_dsn, run_log=run_log, with_scheduler_fold=False)
    assert [x for x in verdict.lost if str(lost) in x], verdict.lost
    assert any(str(twice) in d for d in verdict.duplicates), verdict.duplicates
    assert any("started 2 times" in d for d in verdict.duplicates), verdict.duplicates
    assert any("1200 milli" in o for o in verdict.over_allocations), verdict.over_allocations
    with pytest.raises(AssertionError, match="invariants broken"):
        verdict.assert_holds()
