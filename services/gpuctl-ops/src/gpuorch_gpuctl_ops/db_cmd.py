"""``gpuctl db``: create the database if needed, apply migrations, and show their status.

Mounted by the CLI as ``app.add_typer(db_app, name="db")``. Progress lines go to stderr; ``--json`` prints one
JSON document on stdout. Errors as errors.py says: exit 1 when a migration is refused (files and database
disagree) or the database is out of reach; ``db status`` prints the status first.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Callable, Coroutine
from typing import Annotated, Any

import typer
from gpuorch_gpuctl.errors import fail
from gpuorch_store.migrations import MigrationError, ensure_database, migrate, status
from gpuorch_store.outbox import outbox_backlog, parked_rows

DEFAULT_DSN = "postgresql://postgres@127.0.0.1:5432/gpuorch"
PARKED_SHOWN = 5
"""How many of the newest parked outbox rows ``db status`` lists."""

db_app = typer.Typer(help="Database schema: apply migrations and show their status.", no_args_is_help=True)

DsnOpt = Annotated[
    str,
    typer.Option(
        "--dsn",
        envvar="GPUORCH_DATABASE_URL",
        help="PostgreSQL DSN (default: $GPUORCH_DATABASE_URL or postgresql://postgres@127.0.0.1:5432/gpuorch)",
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="print JSON for scripts")]


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@db_app.command("migrate")
def migrate_command(
    dsn: DsnOpt = DEFAULT_DSN,
    create_database: Annotated[
        bool, typer.Option("--create-db/--no-create-db", help="create the DSN's database if it is missing")
    ] = True,
    as_json: JsonOpt = False,
) -> None:
    """Apply every pending migration, in order, under an advisory lock (safe to run from several places)."""

    async def run() -> dict[str, Any]:
        created = await ensure_database(dsn) if create_database else False
        if created:
            _progress(f"created database {dsn.rsplit('/', 1)[-1].split('?', 1)[0]}")
        applied = await migrate(dsn, progress=_progress)
        return {"database_created": created, "applied": applied}

    result = _run(run)
    if as_json:
        print(json.dumps(result))
    else:
        print(f"applied {len(result['applied'])} migration(s)")
        for name in result["applied"]:
            print(f"  {name}")


def _run(work: Callable[[], Coroutine[Any, Any, dict[str, Any]]]) -> dict[str, Any]:
    """Run a database command; a migration problem or an unreachable database exits with a clear message."""
    try:
        result = asyncio.run(work())
    except MigrationError as exc:
        fail(str(exc))
    except (OSError, ValueError) as exc:
        fail(f"cannot reach the database: {exc}")
    except Exception as exc:
        if type(exc).__module__.startswith("asyncpg"):
            fail(f"{type(exc).__name__}: {exc}")
        raise
    return result


@db_app.command("status")
def status_command(dsn: DsnOpt = DEFAULT_DSN, as_json: JsonOpt = False) -> None:
    """List every migration (applied, pending, changed, file-missing), the outbox backlog and its parked rows."""

    async def run() -> dict[str, Any]:
        import asyncpg

        rows = [row.as_dict() for row in await status(dsn)]
        backlog: dict[str, Any] | None = None
        if any(r["version"] == 4 and r["state"] == "applied" for r in rows):  # outbox with parking
            conn = await asyncpg.connect(dsn)
            try:
                b = await outbox_backlog(conn)
                parked = await parked_rows(conn, limit=PARKED_SHOWN)
            finally:
                await conn.close()
            backlog = {
                "unsent": b.unsent,
                "oldest_unsent_at": b.oldest_unsent_at.isoformat() if b.oldest_unsent_at else None,
                "head_attempts": b.failing_attempts,
                "head_last_error": b.last_error,
                "parked": b.parked,
                "newest_parked": [{
                    "id": p.id, "message_id": str(p.message_id), "type": p.type, "exchange": p.exchange,
                    "routing_key": p.routing_key, "attempts": p.attempts, "reason": p.last_error,
                    "created_at": p.created_at.isoformat(), "parked_at": p.parked_at.isoformat(),
                } for p in parked],
            }
        return {"migrations": rows, "outbox": backlog}

    result = _run(run)
    if as_json:
        print(json.dumps(result))
        return
    for row in result["migrations"]:
        applied_at = row["applied_at"] or "-"
        print(f"{row['version']:04d}  {row['name']:<32} {row['state']:<13} {applied_at}")
    outbox = result["outbox"]
    if outbox is not None:
        line = f"outbox: {outbox['unsent']} unsent"
        if outbox["oldest_unsent_at"]:
            line += f", oldest since {outbox['oldest_unsent_at']}"
        if outbox["head_last_error"]:
            line += f", head row failed {outbox['head_attempts']}x: {outbox['head_last_error']}"
        line += f"; {outbox['parked']} parked (refused by the broker, set aside)"
        print(line)
        for p in outbox["newest_parked"]:
            print(f"  parked {p['parked_at']}  {p['type']} {p['message_id']} -> {p['exchange']}/{p['routing_key']}"
                  f" after {p['attempts']} attempts: {p['reason']}")
    disagree = [f"{r['version']:04d} {r['state']}" for r in result["migrations"]
                if r["state"] in ("changed", "file-missing")]
    if disagree:
        fail(f"the migration files and the database disagree: {', '.join(disagree)}")
