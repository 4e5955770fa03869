"""The API's reads: SQL over the read models the scheduler and telemetry keep, never their writes.

    jobs, nodes                           written by the scheduler (0100, 0102)
    telemetry_* samples, jobs, alerts     written by telemetry (02xx)
    events                                the scheduler's log: a job's timeline (granted to gpuorch_api, 0300)
    api_submissions                       the API's own table (0300): what it published for whom

The listings of jobs, queues, tenants, usage and the report take ``tenants`` (None: all) and return only rows of those
tenants; ``resolve`` finds a job id among them (the routes answer 404 for another tenant's job, so its existence is
not disclosed). ``job`` and ``nodes`` read unfiltered: the routes decide what the caller sees. Plain dicts out; the
shaping for people is in ``domain/views.py``.
"""

from __future__ import annotations

import base64
import json
import uuid
from collections.abc import Collection
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import asyncpg
from gpuorch_contracts import JobSpec
from gpuorch_report import Period, WeeklyReport, read_report

from gpuorch_api.domain.series import EPOCH as SERIES_EPOCH
from gpuorch_api.domain.series import SeriesWindow, aligned

JOB_COLUMNS = """j.job_id, j.name, j.tenant, j.tier, j.priority_class, j.state, j.spec::text AS spec, j.placement_id,
    j.node_ids, j.assignments::text AS assignments, j.exit_code, j.reason, j.pending_reason, j.estimated_start,
    j.requeues, j.submitted_at, j.placed_at, j.started_at, j.ended_at, j.updated_at, j.array_id,
    j.array_index, j.array_counts::text AS array_counts, j.session_parks::text AS session_parks"""

ACTIVE_STATES = ("placed", "running", "preempting")

JOB_SORTS = {"submitted": ("j.submitted_at", "timestamptz"), "name": ("j.name", "text"), "state": ("j.state", "text"),
             "tenant": ("j.tenant", "text"), "tier": ("j.tier", "text"), "ended": ("coalesce(j.ended_at, 'infinity')", "timestamptz"),
             "index": ("j.array_index", "integer")}
"""The orders of a job listing (``sort=name``, ``sort=-submitted``): a sort key's column and its SQL type (the
keyset cursor's value is cast back to it). ``index``: an array's tasks. A column that may be NULL (``ended``) is
compared through ``coalesce`` so that the keyset stays a total order."""


@dataclass(frozen=True)
class JobCursor:
    """Where a page of a job listing ends: the sort key's value of its last row (as text) and that row's job id."""

    value: str
    job_id: uuid.UUID

    def encode(self, sort: str) -> str:
        """The opaque text a client sends back as ``cursor=`` (URL-safe base64 of the sort, value and job id)."""
        raw = json.dumps([sort, self.value, str(self.job_id)], separators=(",", ":")).encode()
        return base64.urlsafe_b64encode(raw).decode().rstrip("=")

    @classmethod
    def decode(cls, text: str, sort: str) -> JobCursor:
        """The cursor ``encode`` wrote for ``sort``; ValueError when ``text`` is not one, or was of another sort."""
        try:
            named, value, job_id = json.loads(base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)))
            found = cls(str(value), uuid.UUID(str(job_id)))
        except (ValueError, TypeError) as e:
            raise ValueError(f"not a cursor of this listing: {text!r}") from e
        if named != sort:
            raise ValueError(f"the cursor is of sort={named!r}, not sort={sort!r}: start again without a cursor")
        return found


def _tenant_list(tenants: Collection[str] | None) -> list[str] | None:
    return sorted(tenants) if tenants is not None else None


def _job(row: asyncpg.Record) -> dict[str, Any]:
    out = dict(row)
    out["spec"] = json.loads(out["spec"]) if out.get("spec") else {}
    out["assignments"] = json.loads(out["assignments"]) if out.get("assignments") else []
    return out


RESOLVE_SQL = """SELECT job_id FROM jobs j LEFT JOIN api_submissions s USING (job_id)
   WHERE j.job_id BETWEEN $1::uuid AND $2::uuid
     AND ($3::text[] IS NULL OR j.tenant = ANY($3) OR (j.tenant = '' AND s.spec->>'tenant' = ANY($3)))
   LIMIT 2"""
"""A job-id prefix as a range of the primary key (its index answers it; a ``LIKE`` on ``job_id::text`` would
read every row): UUIDs compare byte by byte, as their hex digits do."""

UUID_SHAPE = "xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx"


def job_id_range(prefix: str) -> tuple[uuid.UUID, uuid.UUID] | None:
    """The lowest and highest job ids starting with ``prefix`` (a start of the canonical form, any case), or None
    when ``prefix`` cannot start one (too long, a character other than a hex digit, a dash out of place)."""
    prefix = prefix.lower()
    if not prefix or len(prefix) > len(UUID_SHAPE):
        return None
    for char, shape in zip(prefix, UUID_SHAPE, strict=False):
        if (shape == "-") != (char == "-") or (shape == "x" and char not in "0123456789abcdef"):
            return None
    digits = prefix.replace("-", "")
    return uuid.UUID(digits.ljust(32, "0")), uuid.UUID(digits.ljust(32, "f"))


class ReadModels:
    """Reads over a connection pool (``asyncpg.Pool``); each call uses one pooled connection."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self.pool = pool

    async def ping(self) -> None:
        async with self.pool.acquire() as conn:
            await conn.fetchval("SELECT 1")

    async def jobs(self, *, tenants: Collection[str] | None, state: str | None = None, tenant: str | None = None,
                   tier: str | None = None, limit: int = 100, array: uuid.UUID | None = None,
                   search: str | None = None, sort: str = "-submitted", after: JobCursor | None = None,
                   with_total: bool = False) -> tuple[list[dict[str, Any]], int | None]:
        """A page of jobs in ``sort`` order (``JOB_SORTS``; ``-``: descending, ties broken by job id), filtered;
        ``search``: a name containing it (any case) or a job id starting with it. A rejected job's empty spec is
        filled from the API's own submissions. An array is one row (its tasks counted in ``array_counts``); with
        ``array``, that array's tasks by index. ``after``: the keyset cursor of the last row of the previous page
        (``job_cursor``): rows inserted meanwhile never shift a later page. With ``with_total``: the count of every
        row matching the filters (all pages), else None."""
        column, cast = JOB_SORTS["index" if array is not None else sort.lstrip("-")]
        descending = sort.startswith("-") and array is None
        bounds = job_id_range(search) if search else None
        where = """($1::text[] IS NULL OR j.tenant = ANY($1) OR (j.tenant = '' AND s.spec->>'tenant' = ANY($1)))
                  AND ($2::text IS NULL OR j.state = $2)
                  AND ($3::text IS NULL OR j.tenant = $3 OR (j.tenant = '' AND s.spec->>'tenant' = $3))
                  AND ($4::text IS NULL OR j.tier = $4 OR (j.tier = '' AND s.spec->>'tier' = $4))
                  AND (($5::uuid IS NULL AND j.array_id IS NULL) OR j.array_id = $5)
                  AND ($6::text IS NULL OR strpos(lower(coalesce(nullif(j.name, ''), s.spec->>'name', '')),
                                                   lower($6)) > 0
                       OR j.job_id BETWEEN $7::uuid AND $8::uuid)"""
        args: list[Any] = [_tenant_list(tenants), state, tenant, tier, array, search or None,
                           *(bounds or (None, None))]
        keyset = ""
        if after is not None:
            keyset = f"AND ({column}, j.job_id) {'<' if descending else '>'} ($9::text::{cast}, $10::uuid)"
            args += [after.value, after.job_id]
        order = "DESC" if descending else "ASC"
        async with self.pool.acquire() as conn:
            rows = await conn.fetch(
                f"""SELECT {JOB_COLUMNS}, s.spec::text AS submitted_spec, ({column})::text AS sort_value
                    FROM jobs j LEFT JOIN api_submissions s USING (job_id)
                    WHERE {where} {keyset}
                    ORDER BY {column} {order}, j.job_id {order} LIMIT {int(limit)}""", *args)
            total = (await conn.fetchval(f"""SELECT count(*) FROM jobs j LEFT JOIN api_submissions s USING (job_id)
                                             WHERE {where}""", *args[:8]) if with_total else None)
        return [_with_submitted_spec(r) for r in rows], total

    async def resolve(self, prefix: str, *, tenants: Collection[str] | None) -> uuid.UUID | None:
        """The job id an id or unique prefix names among the caller's jobs; None when none, several, or ``prefix``
        is not the start of a job id (anything but hex digits and dashes where a UUID has them)."""
        bounds = job_id_range(prefix)
        if bounds is None:
            return None
        async with self.pool.acquire() as conn:
            rows = await conn.fetch(RESOLVE_SQL, *bounds, _tenant_list(tenants))
        return rows[0]["job_id"] if len(rows) == 1 else None

    async def job(self, job_id: uuid.UUID) -> dict[str, Any] | None:
        async with self.pool.acquire() as conn:
            row = await conn.fetchrow(
                f"""SELECT {JOB_COLUMNS}, s.spec::text AS submitted_spec FROM jobs j
                    LEFT JOIN api_submissions s USING (job_id) WHERE j.job_id = $1""", job_id)
        return _with_submitted_spec(row) if row is not None else None

    async def timeline(self, job_id: uuid.UUID, since: datetime, until: datetime | None) -> list[dict[str, Any]]:
        """The job's events from the scheduler's log, in log order (bounded by the span of its life)."""
        async with self.pool.acquire() as conn:
            rows = await conn.fetch(
                """SELECT type, occurred_at, payload::text AS payload FROM events
                   WHERE recorded_at >= $2::timestamptz - interval '5 minutes'
                     AND recorded_at <= coalesce($3::timestamptz, now()) + interval '5 minutes'
                     AND payload->>'job_id' = $1::text
                   ORDER BY position LIMIT 500""", str(job_id), since, until)
        return [{"type": r["type"], "at": r["occurred_at"], **_timeline_detail(json.loads(r["payload"]))}
                for r in rows]

    async def recent_events(self, *, tenants: Collection[str] | None, since: datetime, limit: int
                            ) -> list[dict[str, Any]]:
        """The newest events since ``since``, newest first, as the live stream shows them (live.visible): the
        scheduler's log, and telemetry's detections (``alert.raised``, ``alert.resolved``, ``recommendation.made``
        from its alerts table, which the live stream carries but the scheduler's log does not). Those of jobs of
        ``tenants`` (None: every tenant) and those that are no job's nor tenant's (a node's liveness, a GPU's
        health). Heartbeats are not events worth a line."""
        async with self.pool.acquire() as conn:
            rows = await conn.fetch(
                """SELECT e.type, e.occurred_at, e.payload::text AS payload FROM events e
                   LEFT JOIN jobs j ON e.payload ? 'job_id' AND j.job_id::text = e.payload->>'job_id'
                   WHERE e.recorded_at >= $2 AND e.type NOT LIKE '%heartbeat%'
                     AND ($1::text[] IS NULL OR j.tenant = ANY($1) OR e.payload->>'tenant' = ANY($1)
                          OR (NOT e.payload ? 'job_id' AND NOT e.payload ? 'tenant'))
                   ORDER BY e.position DESC LIMIT $3""", _tenant_list(tenants), since, limit)
            detections = await conn.fetch(
                """SELECT type, at, job_id, tenant, node_id, kind, severity, explanation, advice, reason FROM (
                       SELECT CASE category WHEN 'alert' THEN 'alert.raised' ELSE 'recommendation.made' END AS type,
                              raised_at AS at, job_id, tenant, node_id, kind, severity, explanation, advice,
                              NULL::text AS reason FROM telemetry_alerts WHERE raised_at >= $2
                       UNION ALL
                       SELECT 'alert.resolved', resolved_at, job_id, tenant, node_id, kind, severity, NULL, NULL,
                              resolve_reason FROM telemetry_alerts
                       WHERE category = 'alert' AND resolved_at >= $2) AS d
                   WHERE $1::text[] IS NULL OR tenant = ANY($1) OR (tenant IS NULL AND job_id IS NULL)
                   ORDER BY at DESC LIMIT $3""", _tenant_list(tenants), since, limit)
        logged = [{"type": r["type"], "at": r["occurred_at"], **_event_detail(json.loads(r["payload"]))} for r in rows]
        detected = [{k: (str(v) if k == "job_id" else v) for k, v in r.items() if v is not None} for r in detections]
        return sorted(logged + detected, key=lambda e: e["at"], reverse=True)[:limit]

    async def usage(self, job_id: uuid.UUID, since: datetime) -> dict[str, Any]:
        """What telemetry measured for the job so far: per device, peak and latest memory, mean utilisation."""
        async with self.pool.acquire() as conn:
            rows = await conn.fetch(
                """SELECT node_id, device_uuid, gpu_index, max(alloc_milli) AS alloc_milli,
                          count(*) AS samples, max(memory_used_mib) AS peak_memory_mib,
                          avg(util_pct)::real AS mean_util_pct, max(sampled_at) AS last_sample_at,
                          (max(sampled_at) - min(sampled_at)) AS observed
                   FROM telemetry_job_samples WHERE job_id = $1 AND sampled_at >= $2::timestamptz - interval '1 minute'
                   GROUP BY node_id, device_uuid, gpu_index ORDER BY node_id, gpu_index""", job_id, since)
        devices = []
        gpu_hours = 0.0
        for r in rows:
            observed_s = r["observed"].total_seconds() if r["observed"] is not None else 0.0
            gpu_hours += observed_s / 3600.0 * r["alloc_milli"] / 1000.0
            devices.append({"node_id": r["node_id"], "device_uuid": r["device_uuid"], "gpu_index": r["gpu_index"],
                            "alloc_milli": r["alloc_milli"], "samples": r["samples"],
                            "peak_memory_mib": r["peak_memory_mib"], "mean_util_pct": r["mean_util_pct"],
                            "last_sample_at": r["last_sample_at"]})
        return {"devices": devices, "gpu_hours": round(gpu_hours, 6)}

    async def job_series(self, job_id: uuid.UUID, window: SeriesWindow) -> dict[str, Any]:
        """Utilisation and memory of each device the job held over ``window`` (``domain.series``): telemetry's job
        rollups and the minutes not rolled up yet, or its raw job samples for a short window."""
        async with self.pool.acquire() as conn:
            devices = await conn.fetch(
                """SELECT DISTINCT node_id, device_uuid, gpu_uuid, gpu_index FROM telemetry_job_samples
                   WHERE job_id = $1 ORDER BY node_id, gpu_index, device_uuid""", job_id)
            if window.from_rollups:
                rows = await conn.fetch(
                    """SELECT bucket, device_uuid AS key, sum(util_pct_s) / nullif(sum(util_s), 0) AS util_pct,
                              sum(memory_mib_s) / nullif(sum(observed_s), 0) AS memory_mib
                       FROM (SELECT * FROM telemetry_job_rollups WHERE job_id = $1 AND bucket BETWEEN $2 AND $3
                             UNION ALL
                             SELECT * FROM telemetry_job_rollups_pending WHERE job_id = $1
                               AND bucket BETWEEN $2 AND $3) r
                       GROUP BY 1, 2""", job_id, window.start, window.end)
            else:
                rows = await conn.fetch(
                    """SELECT date_bin($4::interval, sampled_at, $5) AS bucket, device_uuid AS key,
                              avg(util_pct) AS util_pct, avg(memory_used_mib) AS memory_mib
                       FROM telemetry_job_samples WHERE job_id = $1 AND sampled_at >= $2 AND sampled_at < $3::timestamptz + $4::interval
                       GROUP BY 1, 2""", job_id, window.start, window.end, timedelta(seconds=window.bucket_s),
                    SERIES_EPOCH)
        labels = {d["device_uuid"]: f"{d['node_id']} GPU {d['gpu_index']}" +
                  ("" if d["device_uuid"] == d["gpu_uuid"] else f" ({d['device_uuid']})") for d in devices}
        labels.update({r["key"]: r["key"] for r in rows if r["key"] not in labels})
        return aligned([dict(r) for r in rows], window, labels)

    async def gpu_series(self, node_id: str, window: SeriesWindow) -> dict[str, Any]:
        """Utilisation and memory of each GPU of ``node_id`` over ``window`` (whole GPUs, whoever used them; no
        job or tenant is named): telemetry's GPU rollups up to its watermark and the newest samples binned the
        same way after it, or raw samples for a short window."""
        async with self.pool.acquire() as conn:
            gpus = await conn.fetch(
                """SELECT DISTINCT ON (gpu_uuid) gpu_uuid, gpu_index FROM (
                       SELECT gpu_uuid, gpu_index FROM telemetry_gpu_samples WHERE node_id = $1 AND sampled_at >= $2
                       UNION ALL
                       SELECT gpu_uuid, gpu_index FROM telemetry_gpu_rollups WHERE node_id = $1 AND bucket >= $2) g
                   ORDER BY gpu_uuid""", node_id, window.start)
            width = timedelta(seconds=window.bucket_s)
            raw = """SELECT date_bin($4::interval, sampled_at, $5) AS bucket, gpu_uuid AS key,
                            avg(util_pct) AS util_pct, avg(memory_used_mib) AS memory_mib
                     FROM telemetry_gpu_samples WHERE node_id = $1 AND sampled_at >= $2 AND sampled_at < $3::timestamptz + $4::interval
                     GROUP BY 1, 2"""
            if window.from_rollups:
                rolled = await conn.fetchval(
                    "SELECT rolled_until FROM telemetry_rollup_watermarks WHERE name = 'gpu'") or window.start
                rows = [*await conn.fetch(
                    """SELECT bucket, gpu_uuid AS key, util_pct_s / nullif(util_s, 0) AS util_pct,
                              memory_mib_s / nullif(observed_s, 0) AS memory_mib
                       FROM telemetry_gpu_rollups WHERE node_id = $1 AND bucket BETWEEN $2 AND $3 AND bucket < $4""",
                    node_id, window.start, window.end, rolled),
                    *await conn.fetch(raw, node_id, max(window.start, rolled), window.end, width, SERIES_EPOCH)]
            else:
                rows = await conn.fetch(raw, node_id, window.start, window.end, width, SERIES_EPOCH)
        gpus = sorted(gpus, key=lambda g: g["gpu_index"])
        return aligned([dict(r) for r in rows], window, {g["gpu_uuid"]: f"GPU {g['gpu_index']}" for g in gpus})

    async def run_peaks(self, name: str, tenant: str, runs: int) -> list[int]:
        """The peak GPU memory (MiB, per device) of each of the latest ``runs`` ended jobs named ``name`` of
        ``tenant`` that telemetry measured (raw samples and rollups: a run just ended has no rollup yet)."""
        async with self.pool.acquire() as conn:
            rows = await conn.fetch(
                """WITH recent AS (SELECT job_id FROM telemetry_jobs WHERE name = $1 AND tenant = $2
                                   AND ended_at IS NOT NULL ORDER BY ended_at DESC LIMIT $3)
                   SELECT job_id, max(peak) AS peak FROM (
                       SELECT job_id, memory_used_max AS peak FROM telemetry_job_rollups
                       WHERE job_id IN (SELECT job_id FROM recent)
                       UNION ALL
                       SELECT job_id, memory_used_mib FROM telemetry_job_samples
                       WHERE job_id IN (SELECT job_id FROM recent)) AS peaks
                   GROUP BY job_id""", name, tenant, runs)
        return [int(r["peak"]) for r in rows if r["peak"] is not None]

    async def advice(self, job_id: uuid.UUID) -> list[dict[str, Any]]:
        """Telemetry's alerts and recommendations about the job, newest first."""
        async with self.pool.acquire() as conn:
            rows = await conn.fetch(
                """SELECT category, kind, severity, explanation, advice, raised_at, resolved_at, resolve_reason
                   FROM telemetry_alerts WHERE job_id = $1 ORDER BY raised_at DESC LIMIT 50""", job_id)
        return [dict(r) for r in rows]

    async def nodes(self) -> list[dict[str, Any]]:
        """Every node with its inventory, liveness, isolation and when it was last heard of (its newest GPU sample,
        else the scheduler's last change of its row); the newest sample of each GPU, and of each MIG instance a
        job used in the last minutes (telemetry's job samples: a MIG instance has no sample of its own); with each
        active allocation, its job's newest sample per device (``usage``: memory and utilisation of its share)."""
        async with self.pool.acquire() as conn:
            rows = await conn.fetch(
                """SELECT n.node_id, n.liveness, n.inventory::text AS inventory, n.isolation::text AS isolation,
                          n.updated_at, s.last_sample_at
                   FROM nodes n LEFT JOIN (
                       SELECT node_id, max(sampled_at) AS last_sample_at FROM telemetry_gpu_samples
                       WHERE sampled_at > now() - interval '1 day' GROUP BY node_id) s USING (node_id)
                   ORDER BY n.node_id""")
            samples = await conn.fetch(
                """SELECT DISTINCT ON (node_id, gpu_uuid) node_id, gpu_uuid, util_pct, memory_used_mib,
                          temperature_c, power_w, sampled_at
                   FROM telemetry_gpu_samples WHERE sampled_at > now() - interval '5 minutes'
                   ORDER BY node_id, gpu_uuid, sampled_at DESC""")
            slices = await conn.fetch(
                """SELECT DISTINCT ON (node_id, device_uuid) node_id, device_uuid, util_pct, memory_used_mib
                   FROM telemetry_job_samples
                   WHERE sampled_at > now() - interval '5 minutes' AND device_uuid <> gpu_uuid
                   ORDER BY node_id, device_uuid, sampled_at DESC""")
            active = await conn.fetch(
                "SELECT job_id, tenant, assignments::text AS assignments FROM jobs WHERE state = ANY($1::text[])",
                list(ACTIVE_STATES))
            job_samples = await conn.fetch(
                """SELECT DISTINCT ON (job_id, device_uuid) job_id, device_uuid, util_pct, memory_used_mib,
                          alloc_memory_mib
                   FROM telemetry_job_samples WHERE sampled_at > now() - interval '1 minute'
                   ORDER BY job_id, device_uuid, sampled_at DESC""")
        latest = {(s["node_id"], s["gpu_uuid"]): dict(s) for s in samples}
        out = []
        for r in rows:
            out.append({"node_id": r["node_id"], "liveness": r["liveness"], "inventory": json.loads(r["inventory"]),
                        "isolation": json.loads(r["isolation"]) if r["isolation"] else None,
                        "last_seen": r["last_sample_at"] or r["updated_at"],
                        "samples": {uuid_: s for (node, uuid_), s in latest.items() if node == r["node_id"]},
                        "slice_samples": {s["device_uuid"]: dict(s) for s in slices if s["node_id"] == r["node_id"]}})
        used = {(str(s["job_id"]), s["device_uuid"]): dict(s) for s in job_samples}
        allocations = [{"job_id": a["job_id"], "tenant": a["tenant"], "assignments": json.loads(a["assignments"]),
                        "usage": {device: u for (job, device), u in used.items() if job == str(a["job_id"])}}
                       for a in active]
        return [{**node, "allocations": allocations} for node in out]

    async def queued(self, *, tenants: Collection[str] | None) -> list[dict[str, Any]]:
        async with self.pool.acquire() as conn:
            rows = await conn.fetch(
                """SELECT job_id, name, tenant, tier, priority_class, pending_reason, estimated_start, submitted_at
                   FROM jobs WHERE state = 'queued' AND ($1::text[] IS NULL OR tenant = ANY($1))
                   ORDER BY submitted_at""", _tenant_list(tenants))
        return [dict(r) for r in rows]

    async def tenant_use(self, *, tenants: Collection[str] | None) -> list[dict[str, Any]]:
        """Per tenant: GPUs allocated to its active jobs, jobs queued and running, and what its allocations used
        over the last five minutes (mean utilisation of the allocation, from telemetry's job samples)."""
        async with self.pool.acquire() as conn:
            rows = await conn.fetch(
                """WITH alloc AS (
                       SELECT tenant, sum(coalesce(  -- a MIG instance: its compute slices / 7 (gpu_equivalents)
                                  substring(g->>'mig_profile' from '^([0-9]+)[cg][.]')::int * 1000.0 / 7,
                                  (g->>'milli')::int)) / 1000.0 AS gpus
                       FROM jobs, jsonb_array_elements(assignments) a, jsonb_array_elements(a->'gpus') g
                       WHERE state = ANY($2::text[]) GROUP BY tenant),
                   counts AS (
                       SELECT tenant, count(*) FILTER (WHERE state = 'queued') AS queued,
                              count(*) FILTER (WHERE state = ANY($2::text[])) AS running
                       FROM jobs WHERE state NOT IN ('succeeded', 'failed', 'cancelled', 'rejected')
                       GROUP BY tenant),
                   used AS (
                       SELECT tenant, avg(util_pct)::real AS mean_util_pct
                       FROM telemetry_job_samples WHERE sampled_at > now() - interval '5 minutes' GROUP BY tenant)
                   SELECT t.tenant, coalesce(alloc.gpus, 0)::real AS allocated_gpus,
                          coalesce(counts.queued, 0) AS queued, coalesce(counts.running, 0) AS running,
                          used.mean_util_pct
                   FROM (SELECT tenant FROM alloc UNION SELECT tenant FROM counts UNION SELECT tenant FROM used) t
                   LEFT JOIN alloc USING (tenant) LEFT JOIN counts USING (tenant) LEFT JOIN used USING (tenant)
                   WHERE $1::text[] IS NULL OR t.tenant = ANY($1)
                   ORDER BY t.tenant""", _tenant_list(tenants), list(ACTIVE_STATES))
        return [dict(r) for r in rows]

    async def usage_by_day(self, *, tenants: Collection[str] | None, days: int) -> list[dict[str, Any]]:
        """Per UTC day and tenant over the last ``days``: GPU-hours allocated, used (allocation x utilisation) and
        idle, from telemetry's rollups and the minutes not rolled up yet (the weekly report's first chart)."""
        async with self.pool.acquire() as conn:
            rows = await conn.fetch(
                """WITH usage AS (
                       SELECT bucket, tenant, alloc_milli, observed_s, util_pct_s, idle_s FROM telemetry_job_rollups
                       WHERE bucket >= now() - make_interval(days => $2)
                       UNION ALL
                       SELECT bucket, tenant, alloc_milli, observed_s, util_pct_s, idle_s
                       FROM telemetry_job_rollups_pending WHERE bucket >= now() - make_interval(days => $2))
                   SELECT date_trunc('day', bucket AT TIME ZONE 'UTC')::date AS day, tenant,
                          sum(observed_s * alloc_milli / 1000.0) / 3600.0 AS allocated_gpu_hours,
                          sum(util_pct_s / 100.0 * alloc_milli / 1000.0) / 3600.0 AS used_gpu_hours,
                          sum(idle_s * alloc_milli / 1000.0) / 3600.0 AS idle_gpu_hours
                   FROM usage WHERE $1::text[] IS NULL OR tenant = ANY($1)
                   GROUP BY 1, 2 ORDER BY 1, 2""", _tenant_list(tenants), days)
        return [{"day": r["day"], "tenant": r["tenant"],
                 **{k: round(float(r[k] or 0.0), 4) for k in ("allocated_gpu_hours", "used_gpu_hours",
                                                              "idle_gpu_hours")}} for r in rows]

    async def mig_plan(self) -> dict[str, Any] | None:
        """The scheduler's MIG plan row (``mig_plan``, migration 0103), or None before a scheduler first ran."""
        async with self.pool.acquire() as conn:
            row = await conn.fetchrow("SELECT mode, plan::text AS plan, under_way::text AS under_way, "
                                      "history::text AS history, updated_at FROM mig_plan WHERE id = 1")
        if row is None:
            return None
        return {"mode": row["mode"], "plan": json.loads(row["plan"]), "under_way": json.loads(row["under_way"]),
                "history": json.loads(row["history"]), "updated_at": row["updated_at"]}

    async def fair_share(self) -> dict[str, Any] | None:
        """The scheduler's fair share row (``fair_share``, migration 0105), or None before a scheduler wrote it."""
        async with self.pool.acquire() as conn:
            row = await conn.fetchrow("SELECT half_life_s, model_weights::text AS model_weights, lines::text AS lines, "
                                      "computed_at FROM fair_share WHERE id = 1")
        if row is None:
            return None
        return {"half_life_s": row["half_life_s"], "model_weights": json.loads(row["model_weights"]),
                "computed_at": row["computed_at"], "tenants": json.loads(row["lines"])}

    async def reservations(self, *, tenants: Collection[str] | None,
                           reservation_id: uuid.UUID | None = None) -> list[dict[str, Any]]:
        """Reservation rows (``reservations``, migration 0106) of ``tenants`` (None: all), newest start first, each
        with the liveness of its nodes (``node_liveness``: [[node, liveness]])."""
        async with self.pool.acquire() as conn:
            rows = await conn.fetch(
                """SELECT r.*, (SELECT array_agg(ARRAY[n.node_id, n.liveness]) FROM nodes n
                                WHERE n.node_id = ANY(r.nodes)) AS node_liveness
                   FROM reservations r
                   WHERE ($1::text[] IS NULL OR r.tenant = ANY($1::text[]))
                     AND ($2::uuid IS NULL OR r.reservation_id = $2)
                   ORDER BY r.start_at DESC NULLS LAST, r.created_at DESC LIMIT 1000""",
                sorted(tenants) if tenants is not None else None, reservation_id)
        return [dict(r) for r in rows]

    async def report(self, period: Period, *, tenants: Collection[str] | None,
                     tenant: str | None) -> WeeklyReport:
        """The weekly review of ``period`` (``gpuorch_report``), limited to ``tenants`` (None: all)."""
        async with self.pool.acquire() as conn:
            return await read_report(conn, period, tenants=tenants, tenant=tenant)

    async def record_submission(self, job_id: uuid.UUID, identity: str, spec: dict[str, Any]) -> None:
        async with self.pool.acquire() as conn:
            await conn.execute(
                "INSERT INTO api_submissions (job_id, identity, spec) VALUES ($1, $2, $3::text::jsonb) "
                "ON CONFLICT (job_id) DO NOTHING", job_id, identity, json.dumps(spec))


def _with_submitted_spec(row: asyncpg.Record) -> dict[str, Any]:
    out = _job(row)
    submitted = out.pop("submitted_spec", None)
    if not out["spec"] and submitted:  # rejected at admission: the scheduler kept no spec, the API did
        spec = json.loads(submitted)
        out["spec"] = spec
        out["name"] = out["name"] or spec.get("name", "")
        out["tenant"] = out["tenant"] or spec.get("tenant", "")
        out["tier"] = out["tier"] or spec.get("tier", "")
        out["priority_class"] = out["priority_class"] or spec.get("priority_class", "")
    for field in ("tier", "priority_class"):  # a row rejected at admission keeps none: the spec's default, as sent
        out[field] = out[field] or JobSpec.model_fields[field].default
    return out


def _event_detail(payload: dict[str, Any]) -> dict[str, Any]:
    """A logged event's line in a listing of recent events: its job (when it is a job's) and its timeline detail."""
    job = {"job_id": payload["job_id"]} if payload.get("job_id") else {}
    return {**job, **_timeline_detail(payload)}


def _timeline_detail(payload: dict[str, Any]) -> dict[str, Any]:
    """The fields of a logged event worth a line in a timeline (never the whole spec)."""
    keep = ("reason", "pending_reason", "node_id", "exit_code", "placement_id", "duration_s", "tenant")
    detail = {k: payload[k] for k in keep if payload.get(k) is not None}
    if payload.get("assignments"):
        detail["nodes"] = [a.get("node_id") for a in payload["assignments"]]
    return detail
