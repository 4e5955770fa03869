"""The leader lease against the real PostgreSQL (``leadership``): taken over once it expired or its leader's
session is gone, never while renewed; a superseded leader's commits are refused by the fence; release hands it on."""

from __future__ import annotations

import asyncio
import json

import asyncpg
import pytest
from gpuorch_contracts import GpuRequest, JobSpec, ProcessRun, SubmitJob
from gpuorch_scheduler.handlers import SchedulerService
from gpuorch_scheduler.leadership import LEASE_LOCK_KEY, LeaderLease, LeadershipLost
from gpuorch_scheduling.testing import registered_node as node

pytestmark = pytest.mark.integration

RUN = ProcessRun(argv=["python", "-c", "pass"])


async def test_a_renewed_lease_is_kept_an_unrenewed_one_is_taken_over_and_the_old_leader_is_fenced(
    migrated_dsn: str
) -> None:
    first = LeaderLease(migrated_dsn, "first", lease_s=2.0, renew_s=0.2)
    second = LeaderLease(migrated_dsn, "second", lease_s=2.0, renew_s=0.2)
    writer = await asyncpg.connect(migrated_dsn, server_settings=(await _acquired(first)).session_settings())
    try:
        assert first.epoch == 1 and not await second.try_acquire()
        for _ in range(12):  # renewed for longer than the lease: never taken over
            await first.renew()
            assert not await second.try_acquire()
            await asyncio.sleep(0.2)
        async with writer.transaction():
            await first.fence(writer)  # still the leader: the commit may go on
        await asyncio.sleep(2.1)  # first stops renewing (paused) but keeps every session
        assert await second.try_acquire() and second.epoch == 2
        assert await _ends(writer)  # the old leader's write session was ended by the takeover
        writer = await asyncpg.connect(migrated_dsn)
        with pytest.raises(LeadershipLost):
            async with writer.transaction():
                await first.fence(writer)
        with pytest.raises((LeadershipLost, asyncpg.InterfaceError, asyncpg.PostgresConnectionError)):
            await first.renew()  # its lease session was ended too, or finds epoch 2
    finally:
        await writer.close()
        for lease in (first, second):
            await lease.close()


async def test_a_dead_leader_is_replaced_at_once_and_a_released_lease_too(migrated_dsn: str) -> None:
    first = await _acquired(LeaderLease(migrated_dsn, "first", lease_s=30.0, renew_s=1.0))
    second = LeaderLease(migrated_dsn, "second", lease_s=30.0, renew_s=1.0)
    third = LeaderLease(migrated_dsn, "third", lease_s=30.0, renew_s=1.0)
    try:
        assert not await second.try_acquire()
        await first.close()  # its process died: the session lock went with its session, long before the expiry
        assert await second.try_acquire() and second.epoch == 2
        await second.release()  # a clean stop hands the lease on without waiting for the expiry either
        assert await third.try_acquire() and third.epoch == 3
    finally:
        for lease in (second, third):
            await lease.close()


async def test_a_standby_outlives_an_unexpected_error_of_a_try_and_still_takes_the_lease(migrated_dsn: str) -> None:
    lease = LeaderLease(migrated_dsn, "standby", lease_s=2.0, renew_s=0.05)
    real, failures = lease._take_lease, []

    async def failing_once() -> bool:
        if not failures:
            failures.append(1)
            raise asyncpg.exceptions.InternalServerError("unexpected")  # neither a lost session nor a held row lock
        return await real()

    lease._take_lease = failing_once  # type: ignore[method-assign]
    try:
        assert await asyncio.wait_for(lease.acquire(asyncio.Event()), timeout=30.0)
        assert failures == [1] and lease.epoch == 1
    finally:
        await lease.close()


async def _ends(conn: asyncpg.Connection, timeout_s: float = 10.0) -> bool:
    """Whether the server ends ``conn``'s session (seen by the client within ``timeout_s``)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not conn.is_closed() and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.02)
    return conn.is_closed()


async def _acquired(lease: LeaderLease) -> LeaderLease:
    assert await lease.try_acquire()
    return lease


async def test_a_leaders_commands_carry_its_epoch_and_a_superseded_leader_commits_nothing(migrated_dsn: str) -> None:
    """The service fenced by a lease: its LaunchJobs carry the epoch; once another instance took the lease, a batch
    fails as a whole with ``LeadershipLost`` (for the broker to redeliver to the next leader), nothing of it
    committed, instead of each message being answered with an error alone."""
    lease = await _acquired(LeaderLease(migrated_dsn, "first", lease_s=30.0, renew_s=1.0))
    conn = await asyncpg.connect(migrated_dsn, server_settings=lease.session_settings())
    successor = LeaderLease(migrated_dsn, "second", lease_s=30.0, renew_s=1.0)
    try:
        service = SchedulerService(conn, fenced=True, leader_epoch=lease.epoch)
        await service.recover()
        await service.handle(node("n1", gpus=2))
        await service.handle(SubmitJob(spec=JobSpec(run=RUN, resources=GpuRequest(gpus=1))))
        [body] = await conn.fetch("SELECT body FROM outbox WHERE type = 'launch_job'")
        assert json.loads(bytes(body["body"]))["leader_epoch"] == 1
        await lease.close()  # its lease session died (the process kept its other sessions: a network split)
        assert await successor.try_acquire() and successor.epoch == 2
        assert await _ends(conn)  # the takeover ended the old leader's write session too
        conn = await asyncpg.connect(migrated_dsn)
        service = SchedulerService(conn, fenced=True, leader_epoch=1)
        await service.recover()
        logged = await conn.fetchval("SELECT count(*) FROM events")
        with pytest.raises(LeadershipLost):
            await service.handle_batch([SubmitJob(spec=JobSpec(run=RUN, resources=GpuRequest(gpus=1)))
                                        for _ in range(2)])
        assert await conn.fetchval("SELECT count(*) FROM events") == logged
    finally:
        await conn.close()
        await successor.close()


async def test_the_lease_session_serves_one_operation_at_a_time(migrated_dsn: str) -> None:
    """Renewals, a step-down and a takeover attempt at once on one lease (a keeper that outlives its leader's
    step-down, a standby's retry beside it) each run on the lease's one session in turn: none fails with asyncpg's
    "another operation is in progress" (which reads as a lost session: dropped, with its session lock, so a standby
    could take a live leader's lease), and the session holding the lock is the same one throughout."""
    lease = await _acquired(LeaderLease(migrated_dsn, "only", lease_s=30.0, renew_s=1.0))
    observer = await asyncpg.connect(migrated_dsn)
    try:
        holder = await _lock_holder(observer)
        assert holder is not None
        await asyncio.gather(*(lease.renew() for _ in range(5)))
        await asyncio.gather(lease.renew(), lease.release())  # the keeper renews as its leader steps down
        assert lease.epoch == 0 and await _lock_holder(observer) is None
        taken, _ = await asyncio.gather(lease.try_acquire(), lease.renew())  # the renewal finds epoch 2
        assert taken and lease.epoch == 2
        assert await _lock_holder(observer) == holder  # the same session: never dropped as if lost
    finally:
        await observer.close()
        await lease.close()


async def _lock_holder(conn: asyncpg.Connection) -> int | None:
    """The backend pid holding the lease's session lock (``LEASE_LOCK_KEY``), if any."""
    return await conn.fetchval(
        "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted AND objsubid = 1 AND "
        "database = (SELECT oid FROM pg_database WHERE datname = current_database()) AND "
        "((classid::bigint << 32) | objid::bigint) = $1", LEASE_LOCK_KEY)
