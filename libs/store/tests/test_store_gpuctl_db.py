"""``gpuctl db migrate|status`` (services/gpuctl/.../db_cmd.py) against the real PostgreSQL."""

from __future__ import annotations

import json

import asyncpg
import pytest
from gpuorch_gpuctl.db_cmd import db_app
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
