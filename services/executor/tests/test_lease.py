"""The executor's lease: heartbeats per node, renewal only on confirm, self-fencing, monotonic deadlines."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from typing import Any

import pytest
from gpuorch_contracts import ExecutorHeartbeat, JobFailed, JobFinished, JobStarted, Message, StopJob
from gpuorch_messaging import PublishError, PublishRefused

from gpuorch_executor.lease import LeaseRenewer

from .conftest import NODE, Harness, launch_job

SLEEPS = "import time; time.sleep(60)"


class FakeMonotonic:
    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


class GatedPublisher:
    """Publishes to an inner publisher while ``mode`` is ``ok``; raises otherwise (broker gone / refusing)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.mode = "ok"

    async def publish(self, message: Message, *, headers: Mapping[str, Any] | None = None) -> None:
        if self.mode == "down" and isinstance(message, ExecutorHeartbeat):
            raise PublishError("not confirmed within 30s")
        if self.mode == "refused" and isinstance(message, ExecutorHeartbeat):
            raise PublishRefused("unroutable: no queue bound for gpuorch.events/executor.heartbeat")
        await self.inner.publish(message, headers=headers)


async def test_each_round_publishes_one_heartbeat_per_node_with_its_running_placements(harness: Harness) -> None:
    command = launch_job(["python", "-c", SLEEPS])
    await harness.executor.handle(command)
    renewer = LeaseRenewer(harness.publisher, [harness.executor], interval_s=1, fencing_deadline_s=8,
                           fencing_grace_s=2)
    assert await renewer.renew()
    assert await renewer.renew()
    beats = harness.publisher.of_type(ExecutorHeartbeat)
    assert [b.sequence for b in beats] == [0, 1]
    assert beats[0].node_id == NODE
    assert [(r.placement_id, r.job_id) for r in beats[0].running] == [(command.placement_id, command.job_id)]
    assert beats[0].fencing_deadline_s == 8 and beats[0].interval_s == 1
    await harness.executor.handle(StopJob(node_id=NODE, job_id=command.job_id, placement_id=command.placement_id,
                                          grace_s=0))
    await harness.until_ended(command.placement_id)
    await renewer.renew()
    assert harness.publisher.of_type(ExecutorHeartbeat)[-1].running == []


async def test_unconfirmed_renewals_fence_every_job_and_a_refusal_still_renews(harness: Harness) -> None:
    clock = FakeMonotonic()
    publisher = GatedPublisher(harness.publisher)
    renewer = LeaseRenewer(publisher, [harness.executor], interval_s=1, fencing_deadline_s=6, fencing_grace_s=2,
                           monotonic=clock)
    command = launch_job(["python", "-c", SLEEPS])
    await harness.executor.handle(command)
    publisher.mode = "refused"  # a broker that answers "unroutable" is reachable: the lease holds
    clock.now += 3
    assert await renewer.renew()
    assert renewer.renewed_at == clock.now
    publisher.mode = "down"
    for _ in range(3):
        clock.now += 1
        assert not await renewer.renew()
        assert (await renewer.check()).action == "none"
    clock.now += 1  # 4 s unrenewed = deadline - grace
    decision = await renewer.check()
    assert decision.action == "fence" and decision.kill_by == renewer.renewed_at + 6
    outcome = await harness.until_ended(command.placement_id)
    assert isinstance(outcome, JobFailed) and outcome.cause == "lost" and outcome.stop_reason == "fenced"
    publisher.mode = "ok"
    assert await renewer.renew()
    assert (await renewer.check()).action == "recovered"


async def test_a_launch_decided_before_a_recovery_is_refused_and_reported_lost(harness: Harness) -> None:
    """A LaunchJob that waited in the node's queue while its lease lapsed (the scheduler may have declared the node
    lost and placed the job elsewhere) must not start when the node is back (found by libs/dst, seed 51)."""
    clock = FakeMonotonic()
    publisher = GatedPublisher(harness.publisher)
    renewer = LeaseRenewer(publisher, [harness.executor], interval_s=1, fencing_deadline_s=6, fencing_grace_s=2,
                           monotonic=clock)
    assert await renewer.renew() and harness.executor.recovered_at is None
    queued = launch_job(["python", "-c", SLEEPS])  # decided while the node was cut off
    publisher.mode = "down"
    clock.now += 3
    assert not await renewer.renew()
    publisher.mode = "ok"
    clock.now += 1  # renewed 4 s (deadline - grace) after the last renewal: a recovery
    assert await renewer.renew() and harness.executor.recovered_at is not None
    await harness.executor.handle(queued)
    outcome = await harness.until_ended(queued.placement_id)
    assert isinstance(outcome, JobFailed) and outcome.cause == "lost" and outcome.stop_reason == "fenced"
    assert not [m for m in harness.publisher.of_type(JobStarted) if m.placement_id == queued.placement_id]


def test_an_interval_that_one_lost_heartbeat_would_fence_is_refused(harness: Harness) -> None:
    with pytest.raises(ValueError):
        LeaseRenewer(harness.publisher, [harness.executor], interval_s=3, fencing_deadline_s=6, fencing_grace_s=2)


async def test_stop_kill_deadline_ignores_wall_clock_steps(harness: Harness) -> None:
    """A stop's SIGKILL is due on the monotonic clock: the wall clock jumping an hour ahead does not hasten it."""
    from .test_process_jobs import IGNORES_SIGTERM, log_text

    wall = [time.time()]
    harness.executor.clock = lambda: wall[0]
    command = launch_job(["python", "-c", IGNORES_SIGTERM])
    await harness.executor.handle(command)
    started = harness.publisher.of_type(JobStarted)[-1]
    await harness.until(lambda: "ready" in log_text(started))  # SIGTERM before its handler would end it at once
    await harness.executor.handle(StopJob(node_id=NODE, job_id=command.job_id, placement_id=command.placement_id,
                                          grace_s=30))
    record = harness.executor.records[command.placement_id]
    assert record.stop is not None and record.stop.kill_at_monotonic is not None
    wall[0] += 3600
    await harness.executor.tick()
    assert not record.stop.killed and record.active
    harness.executor.monotonic = lambda: time.monotonic() + 31  # the grace really passed
    outcome = await harness.until_ended(command.placement_id)
    assert isinstance(outcome, JobFailed) and outcome.cause == "killed"


async def test_max_runtime_counts_on_the_monotonic_clock(harness: Harness) -> None:
    command = launch_job(["python", "-c", SLEEPS], max_runtime_s=50)
    harness.executor.clock = lambda: time.time() + 3600  # wall clock far ahead: not a reason to stop
    await harness.executor.handle(command)
    record = harness.executor.records[command.placement_id]
    assert record.started_monotonic is not None
    await harness.executor.tick()
    assert record.stop is None
    harness.executor.monotonic = lambda: time.monotonic() + 51
    outcome = await harness.until_ended(command.placement_id)
    assert isinstance(outcome, JobFailed) and outcome.cause == "max_runtime"


async def test_a_jobs_supervisor_fences_it_when_the_executor_is_gone(harness: Harness) -> None:
    """The executor renewed its lease once, then died (nothing renews lease.json any more): the supervisor sends
    the checkpoint signal at deadline - grace and SIGKILL at the deadline itself; the outcome says fenced."""
    from .test_process_jobs import IGNORES_SIGTERM

    harness.executor.lease = (time.monotonic(), 4.0, 1.0)  # room for a loaded machine to start python first
    command = launch_job(["python", "-c", IGNORES_SIGTERM])
    await harness.executor.handle(command)
    outcome = await harness.until_ended(command.placement_id)
    assert isinstance(outcome, JobFailed) and outcome.cause == "lost" and outcome.stop_reason == "fenced"
    exit_status = harness.executor.store.read_exit(command.placement_id)
    assert exit_status is not None and exit_status["fenced"] and exit_status["signal"] == 9
    assert outcome.occurred_at.timestamp() == pytest.approx(exit_status["finished_at"], abs=1e-3)  # the real end


async def test_a_renewed_lease_keeps_the_job_running(harness: Harness) -> None:
    renewer = LeaseRenewer(harness.publisher, [harness.executor], interval_s=0.2, fencing_deadline_s=1.0,
                           fencing_grace_s=0.2)
    assert await renewer.renew()
    command = launch_job(["python", "-c", "import time; time.sleep(2)"])
    await harness.executor.handle(command)
    renewing = asyncio.create_task(renewer.run())
    try:
        outcome = await harness.until_ended(command.placement_id)
    finally:
        renewing.cancel()
    assert isinstance(outcome, JobFinished)
