"""Batches against the real PostgreSQL: one transaction per batch, a poison message isolated from the rest of its
batch, the plan applier refusing a plan that would over-allocate, and the Batcher answering each delivery."""

from __future__ import annotations

import asyncio
import uuid

import asyncpg
import pytest
from gpuorch_contracts import GpuRequest, JobPlaced, JobSpec, Message, ProcessRun, SubmitJob
from gpuorch_scheduler import metrics
from gpuorch_scheduler.batcher import Batcher
from gpuorch_scheduler.handlers import SchedulerService
from gpuorch_scheduling import CycleResult, Decision
from gpuorch_scheduling import scheduler as core
from gpuorch_scheduling.testing import registered_node as node

pytestmark = pytest.mark.integration
RUN = ProcessRun(argv=["python", "-c", "pass"])


def submit(name: str = "job", gpus: int = 1) -> SubmitJob:
    return SubmitJob(spec=JobSpec(name=name, run=RUN, resources=GpuRequest(gpus=gpus)))


async def _rebuilt_equals_live(conn: asyncpg.Connection, service: SchedulerService) -> None:
    rebuilt = SchedulerService(conn)
    await rebuilt.recover()
    assert rebuilt.state.to_snapshot() == service.state.to_snapshot()


async def test_a_batch_commits_in_one_transaction(migrated_dsn: str) -> None:
    conn = await asyncpg.connect(migrated_dsn)
    try:
        service = SchedulerService(conn)
        await service.recover()
        batch: list[Message] = [node("n1", gpus=4), node("n2", gpus=4), *(submit(f"j{k}") for k in range(6))]
        outcomes = await service.handle_batch(batch)
        assert outcomes == [None] * len(batch)
        # every event of the batch was written by one transaction (one xmin), decisions included
        assert await conn.fetchval("SELECT count(DISTINCT xmin::text) FROM events") == 1
        assert await conn.fetchval("SELECT count(*) FROM events WHERE type = 'job.placed'") == 6
        assert await conn.fetchval("SELECT count(*) FROM outbox WHERE type = 'launch_job'") == 6
        assert await conn.fetchval("SELECT count(*) FROM jobs WHERE state = 'placed'") == 6
        assert service.state.capacity_violations() == []
        # a redelivered batch changes nothing
        assert await service.handle_batch(batch) == [None] * len(batch)
        assert await conn.fetchval("SELECT count(*) FROM events WHERE type = 'job.accepted'") == 6
        await _rebuilt_equals_live(conn, service)
    finally:
        await conn.close()


async def test_a_poison_message_is_isolated_from_the_rest_of_its_batch(migrated_dsn: str,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    real_admit = core.admit

    def admit(state, message, *args, **kwargs):  # type: ignore[no-untyped-def]
        if message.spec.name == "poison":
            raise ValueError("this submission always breaks the handler")
        return real_admit(state, message, *args, **kwargs)

    monkeypatch.setattr(core, "admit", admit)
    conn = await asyncpg.connect(migrated_dsn)
    try:
        service = SchedulerService(conn)
        await service.recover()
        await service.handle(node("n1", gpus=4))
        good_a, poison, good_b = submit("a"), submit("poison"), submit("b")
        outcomes = await service.handle_batch([good_a, poison, good_b])
        assert outcomes[0] is None and outcomes[2] is None
        assert isinstance(outcomes[1], ValueError)
        accepted = {r["job_id"] for r in await conn.fetch("SELECT job_id FROM jobs")}
        assert accepted == {good_a.job_id, good_b.job_id}
        assert poison.job_id not in service.state.jobs
        assert {j.state for j in service.state.jobs.values()} == {"placed"}
        await _rebuilt_equals_live(conn, service)
        # the service keeps going: the next batch commits whole
        assert await service.handle_batch([submit("c")]) == [None]
    finally:
        await conn.close()


async def test_the_plan_applier_refuses_a_plan_that_would_over_allocate(migrated_dsn: str,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    conn = await asyncpg.connect(migrated_dsn)
    try:
        service = SchedulerService(conn)
        await service.recover()
        await service.handle(node("n1", gpus=1))
        first = submit("first")
        await service.handle(first)
        held = service.state.jobs[first.job_id]
        assert held.state == "placed"
        real_schedule = core.schedule

        def over_allocating(state, now, *args, **kwargs):  # type: ignore[no-untyped-def]
            """A cycle that puts every queued job on the GPU the first job already holds."""
            result: CycleResult = real_schedule(state, now, *args, **kwargs)
            bad = [JobPlaced(job_id=j.job_id, placement_id=uuid.uuid4(), assignments=held.assignments)
                   for j in state.queued_jobs()]
            return CycleResult(Decision(logged=bad), result.pending)

        monkeypatch.setattr(core, "schedule", over_allocating)
        second = submit("second")
        refused_before = metrics.PLANS_REFUSED._value.get()
        assert await service.handle_batch([second]) == [None]
        assert metrics.PLANS_REFUSED._value.get() == refused_before + 1
        job = service.state.jobs[second.job_id]
        assert job.state == "queued" and job.assignments == []
        assert service.state.capacity_violations() == []
        assert await conn.fetchval("SELECT count(*) FROM events WHERE type = 'job.placed'") == 1
        row = await conn.fetchrow("SELECT state, pending_reason FROM jobs WHERE job_id = $1", second.job_id)
        assert row["state"] == "queued" and "refused by the plan applier" in row["pending_reason"]
        assert await conn.fetchval("SELECT count(*) FROM outbox WHERE type = 'launch_job'") == 1
        await _rebuilt_equals_live(conn, service)
    finally:
        await conn.close()


async def test_the_batcher_answers_each_delivery_with_its_own_outcome() -> None:
    seen: list[tuple[list[str], bool]] = []

    async def handle_batch(messages: list[Message], *, tick: bool = False,
                           traces: object = None, senders: object = None) -> list[Exception | None]:
        seen.append(([m.spec.name for m in messages], tick))  # type: ignore[attr-defined]
        return [ValueError("bad") if m.spec.name == "bad" else None for m in messages]  # type: ignore[attr-defined]

    batcher = Batcher(handle_batch, max_messages=3, max_wait_s=0.5, tick_s=3600)
    stop = asyncio.Event()
    runner = asyncio.create_task(batcher.run(stop))
    names = ["a", "b", "bad", "c"]
    results = await asyncio.gather(*(batcher.handle(submit(n)) for n in names), return_exceptions=True)
    stop.set()
    await asyncio.wait_for(runner, timeout=5)
    assert [type(r).__name__ for r in results] == ["NoneType", "NoneType", "ValueError", "NoneType"]
    batches = [names for names, _ in seen if names]
    assert batches[0] == ["a", "b", "bad"] and batches[1] == ["c"]  # closed at max_messages, then the rest
    assert seen[0][1] is True  # the first pass also ran the tick that was due


async def _batches_of(batcher: Batcher, arrivals: list[tuple[str, str, bool]]) -> list[list[str]]:
    """Deliver ``(lane, name, submissions)`` in order while the batcher is held, then let it run; its batches."""
    seen: list[list[str]] = []
    release = asyncio.Event()

    async def handle_batch(messages: list[Message], *, tick: bool = False,
                           traces: object = None, senders: object = None) -> list[Exception | None]:
        await release.wait()
        seen.append([m.spec.name for m in messages])  # type: ignore[attr-defined]
        return [None] * len(messages)

    batcher._handle_batch = handle_batch
    deliveries = []
    for lane, name, submissions in arrivals:
        deliveries.append(asyncio.create_task(batcher.lane(lane, submissions=submissions)(submit(name))))
        await asyncio.sleep(0)
    stop = asyncio.Event()
    runner = asyncio.create_task(batcher.run(stop))
    release.set()
    await asyncio.wait_for(asyncio.gather(*deliveries), timeout=5)
    stop.set()
    await asyncio.wait_for(runner, timeout=5)
    return [b for b in seen if b]


async def test_the_batcher_takes_from_every_lane_in_turn_and_keeps_batches_short_while_tenants_share() -> None:
    """A lane's backlog (a flooding tenant) does not keep another tenant's message out of the next batch; while two
    tenants submit, a batch ends with the round that empties a lane."""
    flood = [("scheduler.submit.flood", f"f{i}", True) for i in range(10)]
    arrivals = [*flood, ("scheduler.submit", "q", True), ("scheduler", "e", False)]
    batches = await _batches_of(Batcher(_no_batches, max_messages=4, max_wait_s=0.0, tick_s=3600, budget_s=1.0),
                                arrivals)
    assert sorted(batches[0]) == ["e", "f0", "q"]  # one from each lane; the round that emptied a lane ends it
    assert [name for batch in batches for name in batch if name.startswith("f")] == [f"f{i}" for i in range(10)]
    assert sum(len(b) for b in batches) == 12 and all(len(b) <= 4 for b in batches)


async def test_a_lone_flood_keeps_full_batches() -> None:
    """One submission lane active (and the events queue): no sharing, so batches stay at ``max_messages``."""
    flood = [("scheduler.submit.flood", f"f{i}", True) for i in range(10)]
    batches = await _batches_of(Batcher(_no_batches, max_messages=4, max_wait_s=0.0, tick_s=3600, budget_s=1.0),
                                [*flood, ("scheduler", "e", False)])
    assert sorted(batches[0]) == ["e", "f0", "f1", "f2"] and [len(b) for b in batches] == [4, 4, 3]


async def _no_batches(messages: list[Message], **_: object) -> list[Exception | None]:
    raise AssertionError("replaced by _batches_of")


async def test_only_decisions_are_published_not_the_facts_the_scheduler_consumed(migrated_dsn: str) -> None:
    from gpuorch_contracts import JobStarted

    conn = await asyncpg.connect(migrated_dsn)
    try:
        service = SchedulerService(conn)
        await service.recover()
        job = submit("j")
        await service.handle_batch([node("n1", gpus=1), job])
        placed = service.state.jobs[job.job_id]
        await service.handle(JobStarted(job_id=job.job_id, placement_id=placed.placement_id, node_id="n1",
                                        log_path="/x"))
        types = {r["type"] for r in await conn.fetch("SELECT type FROM outbox")}
        assert types == {"job.accepted", "job.placed", "launch_job"}
        assert await conn.fetchval("SELECT count(*) FROM events WHERE type IN ('node.registered', 'job.started')") == 2
    finally:
        await conn.close()
