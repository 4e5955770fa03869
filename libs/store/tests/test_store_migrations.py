"""Migration runner against the real PostgreSQL: ordering, idempotence, locking, and refusals."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import asyncpg
import pytest
from gpuorch_store.migrations import (
    MigrationError,
    available_migrations,
    ensure_database,
    migrate,
    pending_migrations,
    status,
)

pytestmark = pytest.mark.integration


def write(directory: Path, files: dict[str, str]) -> Path:
    directory.mkdir(exist_ok=True)
    for name, sql in files.items():
        (directory / name).write_text(sql)
    return directory


async def ledger(dsn: str) -> list[tuple[int, str]]:
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch("SELECT version, name FROM schema_migrations ORDER BY version")
        return [(r["version"], r["name"]) for r in rows]
    finally:
        await conn.close()


def test_packaged_files_are_found_in_order() -> None:
    names = [m.file_name for m in available_migrations()]
    assert names[:3] == ["0001_events.sql", "0002_snapshots.sql", "0003_outbox.sql"]


async def test_migrate_applies_everything_once_and_rerun_is_a_noop(pg_dsn: str) -> None:
    lines: list[str] = []
    applied = await migrate(pg_dsn, progress=lines.append)
    assert applied == [m.file_name for m in available_migrations()]
    assert any("0001_events.sql" in line for line in lines)
    assert await ledger(pg_dsn) == [(m.version, m.name) for m in available_migrations()]
    assert await migrate(pg_dsn) == []
    assert await pending_migrations(pg_dsn) == []
    assert {row.state for row in await status(pg_dsn)} == {"applied"}


async def test_status_on_an_empty_database_lists_pending_and_creates_nothing(pg_dsn: str) -> None:
    rows = await status(pg_dsn)
    assert [r.state for r in rows] == ["pending"] * len(available_migrations())
    conn = await asyncpg.connect(pg_dsn)
    try:
        assert await conn.fetchval("SELECT to_regclass('schema_migrations')") is None
    finally:
        await conn.close()


async def test_concurrent_migrators_serialize(pg_dsn: str) -> None:
    results = await asyncio.gather(*(migrate(pg_dsn) for _ in range(4)))
    all_applied = [name for result in results for name in result]
    assert sorted(all_applied) == sorted(m.file_name for m in available_migrations())
    assert len(await ledger(pg_dsn)) == len(available_migrations())


async def test_changed_checksum_is_refused(pg_dsn: str, tmp_path: Path) -> None:
    sql = write(
        tmp_path / "sql", {"0001_a.sql": "CREATE TABLE a (x int);", "0002_b.sql": "CREATE TABLE b (x int);"}
    )
    assert await migrate(pg_dsn, sql_dir=sql) == ["0001_a.sql", "0002_b.sql"]
    write(sql, {"0001_a.sql": "CREATE TABLE a (x bigint);", "0003_c.sql": "CREATE TABLE c (x int);"})
    with pytest.raises(MigrationError, match=re.escape("0001_a.sql changed after it was applied")):
        await migrate(pg_dsn, sql_dir=sql)
    assert [r.state for r in await status(pg_dsn, sql_dir=sql)] == ["changed", "applied", "pending"]
    assert await ledger(pg_dsn) == [(1, "a"), (2, "b")]  # 0003 was not applied either


async def test_missing_file_and_holes_are_refused(pg_dsn: str, tmp_path: Path) -> None:
    sql = write(tmp_path / "sql", {"0001_a.sql": "CREATE TABLE a (x int);", "0002_b.sql": "SELECT 1;"})
    await migrate(pg_dsn, sql_dir=sql)
    (sql / "0002_b.sql").unlink()
    with pytest.raises(MigrationError, match=re.escape("0002_b.sql was applied but its file is missing")):
        await migrate(pg_dsn, sql_dir=sql)
    holes = write(tmp_path / "holes", {"0001_a.sql": "SELECT 1;", "0003_c.sql": "SELECT 1;"})
    with pytest.raises(MigrationError, match="hole"):
        await migrate(pg_dsn, sql_dir=holes)


async def test_ranges_are_independent_but_ordered_within(pg_dsn: str, tmp_path: Path) -> None:
    sql = write(
        tmp_path / "sql", {"0001_a.sql": "SELECT 1;", "0200_t.sql": "SELECT 1;", "0201_u.sql": "SELECT 1;"}
    )
    assert await migrate(pg_dsn, sql_dir=sql) == ["0001_a.sql", "0200_t.sql", "0201_u.sql"]
    write(sql, {"0100_s.sql": "SELECT 1;"})  # a new range below an applied one: fine
    assert await migrate(pg_dsn, sql_dir=sql) == ["0100_s.sql"]
    renamed = write(tmp_path / "renamed", {p.name: p.read_text() for p in sql.iterdir()})
    (renamed / "0200_t.sql").rename(renamed / "0200_telemetry.sql")
    with pytest.raises(MigrationError, match=re.escape("0200_telemetry.sql was applied under the name 't'")):
        await migrate(pg_dsn, sql_dir=renamed)


async def test_a_new_file_below_an_applied_one_of_its_range_is_refused(pg_dsn: str, tmp_path: Path) -> None:
    sql = write(tmp_path / "sql", {"0001_a.sql": "SELECT 1;", "0002_b.sql": "SELECT 2;"})
    await migrate(pg_dsn, sql_dir=sql)
    conn = await asyncpg.connect(pg_dsn)
    try:  # as if 0001 had never been applied here but 0002 had (e.g. a branch merged out of order)
        await conn.execute("DELETE FROM schema_migrations WHERE version = 1")
    finally:
        await conn.close()
    refusal = re.escape("0001_a.sql is new but sorts before the applied 0002")
    with pytest.raises(MigrationError, match=refusal):
        await migrate(pg_dsn, sql_dir=sql)


async def test_a_failing_file_leaves_nothing_of_itself(pg_dsn: str, tmp_path: Path) -> None:
    sql = write(
        tmp_path / "sql",
        {
            "0001_a.sql": "CREATE TABLE a (x int);",
            "0002_b.sql": "CREATE TABLE b (x int); SELECT no_such_function();",
        },
    )
    with pytest.raises(asyncpg.UndefinedFunctionError):
        await migrate(pg_dsn, sql_dir=sql)
    assert await ledger(pg_dsn) == [(1, "a")]
    conn = await asyncpg.connect(pg_dsn)
    try:
        assert await conn.fetchval("SELECT to_regclass('b')") is None
    finally:
        await conn.close()


async def test_ensure_database_creates_once(pg_dsn: str) -> None:
    assert await ensure_database(pg_dsn) is False  # the fixture created it
    missing = pg_dsn + "_new"
    try:
        assert await ensure_database(missing) is True
        assert await ensure_database(missing) is False
        assert await migrate(missing) != []
    finally:
        admin = await asyncpg.connect(pg_dsn.rsplit("/", 1)[0] + "/postgres")
        try:
            await admin.execute(f'DROP DATABASE IF EXISTS "{missing.rsplit("/", 1)[1]}" WITH (FORCE)')
        finally:
            await admin.close()
