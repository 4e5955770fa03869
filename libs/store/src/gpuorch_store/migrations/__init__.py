"""Numbered SQL migrations for the gpuorch database, applied in order under an advisory lock.

Files live in ``gpuorch_store/migrations/sql/NNNN_name.sql`` (package data). Number ranges, one per owner:
0001-0099 event store/outbox/snapshots, 0100-0199 scheduler read models, 0200-0299 telemetry, 0300-0399
executor.

Contract of :func:`migrate`:
- every file runs once, in its own transaction together with its ``schema_migrations`` row: a failing file
  leaves nothing behind and stops the run (files before it stay applied);
- concurrent migrators serialize on a session advisory lock; the later one finds nothing left to do;
- it refuses to run (``MigrationError``, nothing applied) when an applied file changed (checksum or name),
  when an applied version has no file any more, when a range (a block of 100 numbers) has a hole, or when a
  new file sorts before an already applied file of its own range. Ranges are independent: a new 0101 may
  follow an applied 0200.
- a file must not contain statements that cannot run in a transaction (``CREATE INDEX CONCURRENTLY``,
  ``VACUUM``).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime
from importlib import resources
from typing import Any, Literal

import asyncpg

MIGRATION_LOCK_KEY = 0x67707552_0000_0001
"""Session advisory lock key held while migrating (one bigint shared by every gpuorch migrator)."""

RANGE_SIZE = 100
"""Versions form owner ranges of this size: a hole inside a range is an error, between ranges it is not."""

_FILE_NAME = re.compile(r"^(?P<version>\d{4})_(?P<name>[a-z0-9][a-z0-9_]*)\.sql$")

_CREATE_LEDGER = """
CREATE TABLE IF NOT EXISTS schema_migrations (
    version    integer     PRIMARY KEY,
    name       text        NOT NULL,
    checksum   text        NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
)
"""

Progress = Callable[[str], None]


class MigrationError(RuntimeError):
    """The migration files and the database disagree; nothing was applied by the call that raised this."""


@dataclass(frozen=True)
class Migration:
    """One SQL file: ``version`` from its 4-digit prefix, ``checksum`` the sha256 hex of its bytes."""

    version: int
    name: str
    checksum: str
    sql: str

    @property
    def file_name(self) -> str:
        return f"{self.version:04d}_{self.name}.sql"


@dataclass(frozen=True)
class AppliedMigration:
    version: int
    name: str
    checksum: str
    applied_at: datetime


MigrationState = Literal["applied", "pending", "changed", "file-missing"]


@dataclass(frozen=True)
class MigrationStatusRow:
    """``changed``: the applied file's checksum or name differs now; ``file-missing``: applied, no file."""

    version: int
    name: str
    state: MigrationState
    checksum: str
    applied_at: datetime | None

    def as_dict(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "name": self.name,
            "state": self.state,
            "checksum": self.checksum,
            "applied_at": self.applied_at.isoformat() if self.applied_at else None,
        }


def available_migrations(sql_dir: Any = None) -> list[Migration]:
    """Read the migration files shipped in this package (or ``sql_dir``: a path or Traversable), by version.

    Raises ``MigrationError`` for a ``.sql`` file with a malformed name, a duplicate version, or a hole inside
    a range (e.g. 0001, 0003 without 0002).
    """
    directory = sql_dir if sql_dir is not None else resources.files(__package__).joinpath("sql")
    migrations: dict[int, Migration] = {}
    for entry in directory.iterdir():
        if not entry.name.endswith(".sql"):
            continue
        match = _FILE_NAME.match(entry.name)
        if match is None:
            raise MigrationError(f"migration file {entry.name!r} is not named NNNN_lower_snake_name.sql")
        version = int(match["version"])
        if version == 0:
            raise MigrationError(f"migration file {entry.name!r}: version 0000 is not allowed")
        if version in migrations:
            raise MigrationError(
                f"duplicate migration version {version:04d}: {migrations[version].file_name} and {entry.name}"
            )
        raw = entry.read_bytes()
        migrations[version] = Migration(
            version=version,
            name=match["name"],
            checksum=hashlib.sha256(raw).hexdigest(),
            sql=raw.decode("utf-8"),
        )
    ordered = [migrations[v] for v in sorted(migrations)]
    _check_no_holes(m.version for m in ordered)
    return ordered


def _check_no_holes(versions: Iterable[int]) -> None:
    previous: int | None = None
    for version in versions:
        if (
            previous is not None
            and version // RANGE_SIZE == previous // RANGE_SIZE
            and version != previous + 1
        ):
            raise MigrationError(
                f"migration files have a hole: {previous:04d} is followed by {version:04d} in the same range"
            )
        previous = version


async def _applied(conn: Any) -> dict[int, AppliedMigration]:
    exists = await conn.fetchval("SELECT to_regclass('schema_migrations') IS NOT NULL")
    if not exists:
        return {}
    rows = await conn.fetch(
        "SELECT version, name, checksum, applied_at FROM schema_migrations ORDER BY version"
    )
    return {
        r["version"]: AppliedMigration(r["version"], r["name"], r["checksum"], r["applied_at"]) for r in rows
    }


def _plan(files: list[Migration], applied: dict[int, AppliedMigration]) -> list[Migration]:
    """Return the files still to apply, or raise ``MigrationError`` when files and ledger disagree."""
    by_version = {m.version: m for m in files}
    problems: list[str] = []
    for version, done in sorted(applied.items()):
        current = by_version.get(version)
        if current is None:
            problems.append(f"{version:04d}_{done.name}.sql was applied but its file is missing")
        elif current.checksum != done.checksum:
            problems.append(
                f"{current.file_name} changed after it was applied "
                f"(checksum {done.checksum[:12]}... recorded, {current.checksum[:12]}... now); "
                "add a new migration instead of editing an applied one"
            )
        elif current.name != done.name:
            problems.append(f"{current.file_name} was applied under the name {done.name!r}")
    highest_applied_per_range: dict[int, int] = {}
    for version in applied:
        block = version // RANGE_SIZE
        highest_applied_per_range[block] = max(highest_applied_per_range.get(block, 0), version)
    pending = [m for m in files if m.version not in applied]
    for m in pending:
        highest = highest_applied_per_range.get(m.version // RANGE_SIZE)
        if highest is not None and m.version < highest:
            problems.append(f"{m.file_name} is new but sorts before the applied {highest:04d} of its range")
    if problems:
        raise MigrationError("refusing to migrate:\n  " + "\n  ".join(problems))
    return pending


async def migrate(dsn: str, *, progress: Progress | None = None, sql_dir: Any = None) -> list[str]:
    """Apply every pending migration file to the database at ``dsn``; return the applied file names in order.

    Idempotent: a second call returns ``[]``; on an up-to-date database it only reads the ledger, so a service's
    own role (0005_service_roles.sql) may call it at start, while applying files takes the owner's rights.
    See the module docstring for what makes it refuse. ``progress``
    receives one human-readable line per step. ``sql_dir`` replaces the packaged files (tests).
    """
    say = progress or (lambda _line: None)
    files = available_migrations(sql_dir)
    conn = await asyncpg.connect(dsn)
    try:
        if not await conn.fetchval("SELECT pg_try_advisory_lock($1)", MIGRATION_LOCK_KEY):
            say("another migrator holds the migration lock; waiting")
            await conn.execute("SELECT pg_advisory_lock($1)", MIGRATION_LOCK_KEY)
        try:
            if await conn.fetchval("SELECT to_regclass('schema_migrations')") is None:
                await conn.execute(_CREATE_LEDGER)  # only then: a service role may not create in the schema
            pending = _plan(files, await _applied(conn))
            if not pending:
                say("database is up to date")
            done: list[str] = []
            for migration in pending:
                say(f"applying {migration.file_name}")
                async with conn.transaction():
                    await conn.execute(migration.sql)
                    await conn.execute(
                        "INSERT INTO schema_migrations (version, name, checksum) VALUES ($1, $2, $3)",
                        migration.version,
                        migration.name,
                        migration.checksum,
                    )
                done.append(migration.file_name)
            return done
        finally:
            await conn.execute("SELECT pg_advisory_unlock($1)", MIGRATION_LOCK_KEY)
    finally:
        await conn.close()


async def status(dsn: str, *, sql_dir: Any = None) -> list[MigrationStatusRow]:
    """One row per known version (files and ledger), sorted; read-only, creates nothing."""
    files = {m.version: m for m in available_migrations(sql_dir)}
    conn = await asyncpg.connect(dsn)
    try:
        applied = await _applied(conn)
    finally:
        await conn.close()
    rows: list[MigrationStatusRow] = []
    for version in sorted(files.keys() | applied.keys()):
        file, done = files.get(version), applied.get(version)
        if done is None:
            assert file is not None
            rows.append(MigrationStatusRow(version, file.name, "pending", file.checksum, None))
        elif file is None:
            rows.append(
                MigrationStatusRow(version, done.name, "file-missing", done.checksum, done.applied_at)
            )
        else:
            changed = file.checksum != done.checksum or file.name != done.name
            state: MigrationState = "changed" if changed else "applied"
            rows.append(MigrationStatusRow(version, file.name, state, done.checksum, done.applied_at))
    return rows


async def pending_migrations(dsn: str, *, sql_dir: Any = None) -> list[Migration]:
    """The files :func:`migrate` would apply now; raises ``MigrationError`` where ``migrate`` would refuse."""
    files = available_migrations(sql_dir)
    conn = await asyncpg.connect(dsn)
    try:
        return _plan(files, await _applied(conn))
    finally:
        await conn.close()


async def ensure_database(dsn: str, *, maintenance_db: str = "postgres") -> bool:
    """Create the database named in ``dsn`` if it does not exist; return True when it was created.

    Connects to ``maintenance_db`` on the same server with the same credentials. Safe against a concurrent
    creator (a ``duplicate_database`` error counts as "already there").
    """
    params = _split_dsn(dsn)
    try:
        conn = await asyncpg.connect(dsn)
    except asyncpg.InvalidCatalogNameError:
        pass
    else:
        await conn.close()
        return False
    admin = await asyncpg.connect(params.with_database(maintenance_db))
    try:
        quoted = '"' + params.database.replace('"', '""') + '"'
        try:
            await admin.execute(f"CREATE DATABASE {quoted}")
        except asyncpg.DuplicateDatabaseError:
            return False
        return True
    finally:
        await admin.close()


@dataclass(frozen=True)
class _DsnParts:
    prefix: str
    database: str
    query: str

    def with_database(self, database: str) -> str:
        return f"{self.prefix}/{database}{self.query}"


def _split_dsn(dsn: str) -> _DsnParts:
    """Split a URL-style DSN ``postgresql://user@host:port/db?opts`` around its database name."""
    from urllib.parse import unquote

    scheme_end = dsn.find("://")
    if scheme_end < 0:
        raise ValueError("expected a URL-style DSN: postgresql://user@host:port/database")
    path_start = dsn.find("/", scheme_end + 3)
    if path_start < 0:
        raise ValueError(f"the DSN names no database: {dsn!r}")
    query_start = dsn.find("?", path_start)
    query = dsn[query_start:] if query_start >= 0 else ""
    database = unquote(dsn[path_start + 1 : query_start if query_start >= 0 else len(dsn)])
    if not database:
        raise ValueError(f"the DSN names no database: {dsn!r}")
    return _DsnParts(prefix=dsn[:path_start], database=database, query=query)


__all__ = [
    "MIGRATION_LOCK_KEY",
    "AppliedMigration",
    "Migration",
    "MigrationError",
    "MigrationStatusRow",
    "available_migrations",
    "ensure_database",
    "migrate",
    "pending_migrations",
    "status",
]
