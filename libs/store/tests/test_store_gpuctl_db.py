"""``gpuctl db migrate|status`` (services/gpuctl/.../db_cmd.py) against the real PostgreSQL."""

from __future__ import annotations

import json

import asyncpg
import pytest
from gpuorch_gpuctl_ops.db_cmd import db_app
from gpuorch_store.migrations import available_migrations
from typer.testing import CliRunner

pytestmark = pytest.mark.integration


def test_db_migrate_creates_the_database_and_status_reports_it(pg_dsn: str) -> None:
    import asyncio

    runner = CliRunner()
    fresh = pg_dsn + "_cli"
    try:
        first = runner.invoke(db_app, ["migrate", "--dsn", fresh, "--json"])
        assert first.exit_code == 0, first.output
        result = json.loads(first.stdout)
        assert result["database_created"] is True
        assert result["applied"] == [m.file_name for m in available_migrations()]
        again = runner.invoke(db_app, ["migrate", "--dsn", fresh, "--json"])
        assert json.loads(again.stdout) == {"database_created": False, "applied": []}
        shown = runner.invoke(db_app, ["status", "--dsn", fresh, "--json"])
        assert shown.exit_code == 0, shown.output
        status = json.loads(shown.stdout)
        assert {m["state"] for m in status["migrations"]} == {"applied"}
        assert status["outbox"]["unsent"] == 0
        text = runner.invoke(db_app, ["status", "--dsn", fresh])
        assert "0001  events" in text.stdout and "outbox: 0 unsent" in text.stdout
    finally:

        async def drop() -> None:
            admin = await asyncpg.connect(pg_dsn.rsplit("/", 1)[0] + "/postgres")
            try:
                await admin.execute(f'DROP DATABASE IF EXISTS "{fresh.rsplit("/", 1)[1]}" WITH (FORCE)')
            finally:
                await admin.close()

        asyncio.run(drop())


def test_db_migrate_without_create_db_fails_cleanly_on_a_missing_database(pg_dsn: str) -> None:
    result = CliRunner().invoke(db_app, ["migrate", "--dsn", pg_dsn + "_absent", "--no-create-db"])
    assert result.exit_code == 1
    assert "InvalidCatalogNameError" in result.output


def test_db_status_shows_parked_outbox_rows_with_their_reason(pg_dsn: str) -> None:
    import asyncio
    import uuid

    from gpuorch_contracts import JobQueued
    from gpuorch_store.migrations import migrate
    from gpuorch_store.outbox import add_to_outbox

    parked = JobQueued(job_id=uuid.uuid4(), pending_reason="p", producer="s")

    async def park_one() -> None:
        await migrate(pg_dsn)
        conn = await asyncpg.connect(pg_dsn)
        try:
            await add_to_outbox(conn, [parked, JobQueued(job_id=uuid.uuid4(), pending_reason="w", producer="s")])
            await conn.execute(
                "UPDATE outbox SET parked_at = now(), attempts = 5, refusals = 5, "
                "last_error = 'PublishRefused: unroutable: no queue bound' WHERE message_id = $1",
                parked.message_id,
            )
        finally:
            await conn.close()

    asyncio.run(park_one())
    runner = CliRunner()
    shown = runner.invoke(db_app, ["status", "--dsn", pg_dsn, "--json"])
    assert shown.exit_code == 0, shown.output
    outbox = json.loads(shown.stdout)["outbox"]
    assert (outbox["unsent"], outbox["parked"]) == (1, 1)
    [row] = outbox["newest_parked"]
    assert row["message_id"] == str(parked.message_id) and row["attempts"] == 5
    assert row["reason"] == "PublishRefused: unroutable: no queue bound" and row["type"] == "job.queued"
    text = runner.invoke(db_app, ["status", "--dsn", pg_dsn]).stdout
    assert "outbox: 1 unsent" in text and "1 parked" in text
    assert f"job.queued {parked.message_id}" in text and "after 5 attempts: PublishRefused: unroutable" in text
