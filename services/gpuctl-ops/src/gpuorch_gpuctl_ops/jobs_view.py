"""Read-only queries over the scheduler's read models (``jobs``, ``nodes``): gpuctl's direct path, taken only with an
explicit ``--dsn``/``GPUORCH_DATABASE_URL`` and no API context (scripts written before the API; decision 31).
Errors as errors.py says, exit 1 as through the API: a database out of reach, no job or several for an id prefix, a
timeout."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Callable
from typing import Any

from gpuorch_contracts.jobs import gpu_equivalents
from gpuorch_gpuctl.errors import fail

TERMINAL = ("succeeded", "failed", "cancelled", "rejected")
DEFAULT_DSN = "postgresql://postgres@127.0.0.1:5432/gpuorch"


async def _connect(dsn: str) -> Any:
    import asyncpg  # the direct path only: the client commands do not load it

    try:
        return await asyncpg.connect(dsn, timeout=10)
    except (OSError, asyncpg.PostgresError) as exc:
        fail(f"cannot reach the database at {dsn.split('@')[-1]}: {type(exc).__name__}: {exc}")


async def resolve_id(dsn: str, prefix: str) -> uuid.UUID:
    """The full job id for an id or a unique prefix of one; exits with a clear message otherwise."""
    conn = await _connect(dsn)
    try:
        rows = await conn.fetch("SELECT job_id FROM jobs WHERE job_id::text LIKE $1 || '%' LIMIT 2", prefix.lower())
    finally:
        await conn.close()
    if not rows:
        fail(f"no job {prefix!r}")
    if len(rows) > 1:
        fail(f"{prefix!r} matches several jobs; give more characters")
    return rows[0]["job_id"]  # type: ignore[no-any-return]


async def get_job(dsn: str, prefix: str) -> dict[str, Any]:
    job_id = await resolve_id(dsn, prefix)
    conn = await _connect(dsn)
    try:
        row = await conn.fetchrow("SELECT * FROM jobs WHERE job_id = $1", job_id)
    finally:
        await conn.close()
    return dict(row) if row else {}


async def list_jobs(dsn: str, *, state: str | None, limit: int) -> list[dict[str, Any]]:
    conn = await _connect(dsn)
    try:
        rows = await conn.fetch(
            "SELECT * FROM jobs WHERE ($1::text IS NULL OR state = $1) AND array_id IS NULL "
            "ORDER BY submitted_at DESC LIMIT $2",
            state, limit,
        )
    finally:
        await conn.close()
    return [dict(r) for r in rows]


async def list_nodes(dsn: str) -> list[dict[str, Any]]:
    conn = await _connect(dsn)
    try:
        rows = await conn.fetch(
            """SELECT n.node_id, n.liveness, n.inventory::text AS inventory, n.isolation::text AS isolation,
                      (SELECT count(*) FROM jobs j WHERE n.node_id = ANY(j.node_ids)
                         AND j.state IN ('placed', 'running', 'preempting')) AS jobs
               FROM nodes n ORDER BY n.node_id""")
    finally:
        await conn.close()
    out = []
    for r in rows:
        inventory = json.loads(r["inventory"])
        models = sorted({g["model"] for g in inventory.get("gpus", [])})
        out.append({"node_id": r["node_id"], "liveness": r["liveness"], "gpu_count": len(inventory.get("gpus", [])),
                    "models": ",".join(models), "jobs": r["jobs"], "cpu_milli": inventory.get("cpu_milli"),
                    "memory_mib": inventory.get("memory_mib"),
                    "isolation": json.loads(r["isolation"]) if r["isolation"] else None})
    return out


async def wait_for_end(dsn: str, job_id: uuid.UUID, *, progress: Callable[[str], None],
                       timeout_s: float = 3600) -> dict[str, Any]:
    """Poll the read model until the job ends; report each state change through ``progress``."""
    conn = await _connect(dsn)
    last = None
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            row = await conn.fetchrow("SELECT * FROM jobs WHERE job_id = $1", job_id)
            if row is not None:
                summary = (row["state"], row["pending_reason"])
                if summary != last:
                    progress(f"{job_id}: {row['state']}" + (f" ({row['pending_reason']})" if row["pending_reason"]
                                                            else ""))
                    last = summary
                if row["state"] in TERMINAL:
                    return dict(row)
            if loop.time() > deadline:
                fail(f"job {job_id} did not end within {timeout_s:.0f}s")
            await asyncio.sleep(0.3)
    finally:
        await conn.close()


def gpu_text(row: dict[str, Any]) -> str:
    assignments = row.get("assignments")
    if isinstance(assignments, str):
        assignments = json.loads(assignments)
    parts = []
    for a in assignments or []:
        for g in a.get("gpus", []):
            label = g.get("mig_profile") or ("" if g.get("milli", 1000) == 1000 else f"{g['milli']}m" + (
                f"/{g['memory_mib']}MiB" if g.get("memory_mib") else ""))
            parts.append(f"{g['gpu_index']}{':' + label if label else ''}")
    return ",".join(parts) or "-"


def allocated_gpus(row: dict[str, Any]) -> float:
    """GPUs held in GPU equivalents, as the API's ``allocated_gpus``: a whole GPU 1, a share its milli / 1000, a MIG
    instance its compute slices / 7 (``gpu_equivalents``)."""
    assignments = row.get("assignments") or []
    assignments = json.loads(assignments) if isinstance(assignments, str) else assignments
    return round(sum(gpu_equivalents(g.get("milli", 1000), g.get("mig_profile"))
                     for a in assignments for g in a.get("gpus", [])), 3)


def public_row(row: dict[str, Any], *, full: bool = False) -> dict[str, Any]:
    """The JSON shape of a job for scripts: id, state, node, exit code, and more."""
    out: dict[str, Any] = {
        "id": str(row["job_id"]), "name": row["name"], "tenant": row["tenant"], "tier": row["tier"],
        "state": row["state"], "node": (row["node_ids"] or [None])[0], "nodes": row["node_ids"] or [],
        "gpus": gpu_text(row), "allocated_gpus": allocated_gpus(row), "exit_code": row["exit_code"], "reason": row["reason"],
        "pending_reason": row["pending_reason"], "submitted_at": row["submitted_at"],
        "started_at": row["started_at"], "ended_at": row["ended_at"], "requeues": row["requeues"],
        "estimated_start": row.get("estimated_start"),
        "array_counts": json.loads(row["array_counts"]) if isinstance(row.get("array_counts"), str)
        else row.get("array_counts"),
    }
    if full:
        spec = row.get("spec")
        out["spec"] = json.loads(spec) if isinstance(spec, str) else spec
        out["placement_id"] = str(row["placement_id"]) if row.get("placement_id") else None
        out["log_path"] = row.get("log_path")
        out["priority_class"] = row.get("priority_class")
    return out
