"""A database role per service against the real PostgreSQL (migrations 0005, 0101, 0205): each service's login
user does its own work through the store's real code paths and is refused everything else; clients only read."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from datetime import UTC, date, datetime, timedelta

import asyncpg
import pytest
from gpuorch_contracts import JobQueued
from gpuorch_store.events import NewEvent, append
from gpuorch_store.outbox import add_to_outbox

pytestmark = pytest.mark.integration

ROLES = ("gpuorch_scheduler", "gpuorch_telemetry", "gpuorch_reader", "gpuorch_operator")


@pytest.fixture
async def logins(migrated_dsn: str) -> AsyncIterator[dict[str, str]]:
    """One LOGIN user per group role (unique names: roles are cluster-wide); role -> DSN as that user."""
    suffix = uuid.uuid4().hex[:8]
    users = {role: f"t_{suffix}_{role.removeprefix('gpuorch_')}" for role in ROLES}
    admin = await asyncpg.connect(migrated_dsn)
    try:
        for role, user in users.items():
            await admin.execute(f'CREATE ROLE "{user}" LOGIN IN ROLE {role}')
        # as deployments must: telemetry's sessions act as the group role, so its partitions belong to it
        await admin.execute(f'ALTER ROLE "{users["gpuorch_telemetry"]}" SET role = gpuorch_telemetry')
        base, database = migrated_dsn.rsplit("/", 1)
        host = base.split("@", 1)[1]
        yield {role: f"postgresql://{user}@{host}/{database}" for role, user in users.items()}
    finally:
        for user in users.values():
            await admin.execute(f'DROP ROLE IF EXISTS "{user}"')
        await admin.close()


async def refused(dsn: str, sql: str, *args: object) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await conn.execute(sql, *args)
    finally:
        await conn.close()


def new_event() -> NewEvent:
    return NewEvent(stream="scheduler", message_id=uuid.uuid4(), type="test.happened", schema_version=1,
                    occurred_at=datetime.now(UTC), payload={"n": 1}, headers={})


async def test_group_roles_exist_and_cannot_log_in(migrated_dsn: str) -> None:
    conn = await asyncpg.connect(migrated_dsn)
    try:
        rows = await conn.fetch("SELECT rolname, rolcanlogin FROM pg_roles WHERE rolname = ANY($1::text[])",
                                list(ROLES))
    finally:
        await conn.close()
    assert {r["rolname"]: r["rolcanlogin"] for r in rows} == dict.fromkeys(ROLES, False)


async def test_the_scheduler_writes_its_log_outbox_and_read_models_only(logins: dict[str, str]) -> None:
    dsn = logins["gpuorch_scheduler"]
    conn = await asyncpg.connect(dsn)
    try:
        async with conn.transaction():
            assert len(await append(conn, [new_event()])) == 1
            await add_to_outbox(conn, [JobQueued(job_id=uuid.uuid4(), pending_reason="test")])
            # the leader lease (scheduler leadership.py): fenced reads and renewals
            assert await conn.fetchval("SELECT epoch FROM scheduler_leadership WHERE id = 1 FOR SHARE") == 0
        assert await conn.fetchval("UPDATE scheduler_leadership SET epoch = epoch + 1, expires_at = "
                                   "clock_timestamp() WHERE id = 1 RETURNING epoch") == 1
        assert await conn.fetchval("SELECT count(*) FROM jobs") == 0
    finally:
        await conn.close()
    await refused(dsn, "SELECT count(*) FROM telemetry_alerts")
    await refused(dsn, "UPDATE events SET type = 'forged'")
    await refused(dsn, "CREATE TABLE scheduler_own (x int)")


async def test_telemetry_owns_its_tables_and_nothing_else(logins: dict[str, str]) -> None:
    dsn = logins["gpuorch_telemetry"]
    conn = await asyncpg.connect(dsn)
    try:  # day partitions are created and dropped by telemetry itself at run time: only an owner may
        today = date.today()
        await conn.execute("SELECT telemetry_ensure_day_partitions($1, $2)", today, today + timedelta(days=1))
        await conn.execute("SELECT telemetry_drop_day_partitions($1)", datetime.now(UTC) - timedelta(days=400))
        assert await conn.fetchval("SELECT count(*) FROM telemetry_alerts") == 0
    finally:
        await conn.close()
    await refused(dsn, "SELECT count(*) FROM events")
    await refused(dsn, "SELECT count(*) FROM outbox")
    await refused(dsn, "DELETE FROM jobs")


async def test_clients_only_read_and_operators_also_see_the_log(logins: dict[str, str]) -> None:
    reader, operator = logins["gpuorch_reader"], logins["gpuorch_operator"]
    for dsn in (reader, operator):
        conn = await asyncpg.connect(dsn)
        try:
            for table in ("jobs", "nodes", "telemetry_alerts", "telemetry_job_accounting"):
                await conn.fetchval(f"SELECT count(*) FROM {table}")
        finally:
            await conn.close()
        await refused(dsn, "DELETE FROM jobs")
        await refused(dsn, "INSERT INTO outbox (exchange) VALUES ('x')")
        await refused(dsn, "DELETE FROM telemetry_alerts")
    await refused(reader, "SELECT count(*) FROM events")
    await refused(reader, "SELECT count(*) FROM outbox")
    conn = await asyncpg.connect(operator)
    try:  # gpuctl db status / replay
        await conn.fetchval("SELECT count(*) FROM events")
        await conn.fetchval("SELECT count(*) FROM outbox")
        await conn.fetchval("SELECT max(version) FROM schema_migrations")
    finally:
        await conn.close()


async def test_a_service_role_may_call_migrate_on_an_up_to_date_database(logins: dict[str, str]) -> None:
    """The scheduler migrates at start; with its own role that must be a no-op, not a permission error."""
    from gpuorch_store.migrations import migrate

    assert await migrate(logins["gpuorch_scheduler"]) == []
    assert await migrate(logins["gpuorch_telemetry"]) == []
