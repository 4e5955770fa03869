"""The dashboard's workbench reads against the real PostgreSQL: the job listing's search, sort and keyset cursor
(stable while jobs are added), and utilisation series from telemetry's samples and rollups with gaps left open."""

from __future__ import annotations

import asyncio
import json
import uuid
from datetime import UTC, datetime, timedelta

import asyncpg
import httpx
import pytest
from gpuorch_api.domain.series import SeriesWindow, aligned
from gpuorch_contracts import decode

from .conftest import RunningApi, auth

pytestmark = pytest.mark.integration

SPEC = {"run": {"runtime": "process", "argv": ["python", "-c", "pass"]}, "resources": {"gpus": 1}}
INSERT = """INSERT INTO jobs (job_id, name, tenant, tier, priority_class, state, spec, assignments, node_ids,
                submitted_at, started_at, ended_at)
            VALUES ($1, $2, $3, $4, 'normal', $5, $6::text::jsonb, '[]', $7, $8, $9, $10)"""


async def add_jobs(dsn: str, count: int, *, tenant: str = "acme", at: datetime, prefix: str = "job") -> list[str]:
    """``count`` queued jobs of ``tenant`` submitted a second apart from ``at`` on, newest last."""
    ids = [uuid.uuid4() for _ in range(count)]
    conn = await asyncpg.connect(dsn)
    try:
        for i, job_id in enumerate(ids):
            await conn.execute(INSERT, job_id, f"{prefix}-{i:02d}", tenant, "batch" if i % 2 else "training",
                               "queued", json.dumps(SPEC), [], at + timedelta(seconds=i), None, None)
    finally:
        await conn.close()
    return [str(i) for i in ids]


async def pages(http: httpx.AsyncClient, who: str, **params: object) -> tuple[list[list[str]], list[int]]:
    """Every page of a listing, following X-Next-Cursor: the job ids of each page and each page's X-Total-Count."""
    found, totals, cursor = [], [], None
    while True:
        answer = await http.get("/api/v1/jobs", params={**params, **({"cursor": cursor} if cursor else {})},
                                headers=auth(who))
        assert answer.status_code == 200, answer.text
        found.append([j["id"] for j in answer.json()])
        totals.append(int(answer.headers["X-Total-Count"]))
        cursor = answer.headers.get("X-Next-Cursor")
        if cursor is None:
            assert "Link" not in answer.headers
            return found, totals
        assert answer.headers["Link"].endswith('; rel="next"') and f"cursor={cursor}" in answer.headers["Link"]


async def test_the_job_list_pages_by_cursor_searches_sorts_and_stays_stable_under_inserts(
        api: RunningApi, migrated_dsn: str) -> None:
    start = datetime.now(UTC) - timedelta(hours=1)
    acme = await add_jobs(migrated_dsn, 7, at=start)
    research = await add_jobs(migrated_dsn, 3, tenant="research", at=start, prefix="secret")
    async with httpx.AsyncClient(base_url=api.url) as http:
        found, totals = await pages(http, "acme", limit=3)
        assert found == [acme[6:3:-1], acme[3:0:-1], acme[0:1]]  # newest first, nothing repeated or skipped
        assert totals == [7, 7, 7]

        # a job submitted while a client pages lands before its first page, never on a later one
        first = await http.get("/api/v1/jobs", params={"limit": 3}, headers=auth("acme"))
        newer = await add_jobs(migrated_dsn, 2, at=datetime.now(UTC), prefix="newer")
        second = await http.get("/api/v1/jobs", params={"limit": 3, "cursor": first.headers["X-Next-Cursor"]},
                                headers=auth("acme"))
        assert [j["id"] for j in second.json()] == acme[3:0:-1]
        assert second.headers["X-Total-Count"] == "9"
        assert [j["id"] for j in (await http.get("/api/v1/jobs", params={"limit": 2}, headers=auth("acme"))).json()
                ] == newer[::-1]

        by_name, _ = await pages(http, "acme", sort="name", limit=4, q="job-")
        assert [i for page in by_name for i in page] == acme  # job-00 .. job-06
        descending, _ = await pages(http, "acme", sort="-name", limit=5, tier="batch")
        # batch: job-01, -03, -05 and newer-01 (every second job), names descending
        assert [i for page in descending for i in page] == [newer[1], acme[5], acme[3], acme[1]]

        # search: a name part (any case) or an id prefix; another tenant's job is never found
        assert [j["id"] for j in (await http.get("/api/v1/jobs", params={"q": "JOB-04"},
                                                 headers=auth("acme"))).json()] == [acme[4]]
        assert [j["id"] for j in (await http.get("/api/v1/jobs", params={"q": acme[2][:8]},
                                                 headers=auth("acme"))).json()] == [acme[2]]
        hidden = await http.get("/api/v1/jobs", params={"q": research[0][:8]}, headers=auth("acme"))
        assert hidden.json() == [] and hidden.headers["X-Total-Count"] == "0"
        assert len((await http.get("/api/v1/jobs", params={"q": "secret"}, headers=auth("ops"))).json()) == 3

        # a cursor of another order, or not a cursor at all, is refused (not silently restarted)
        refused = await http.get("/api/v1/jobs", params={"sort": "name", "cursor": first.headers["X-Next-Cursor"]},
                                 headers=auth("acme"))
        assert refused.status_code == 400 and "sort" in refused.json()["detail"]
        assert (await http.get("/api/v1/jobs", params={"cursor": "bm9wZQ"}, headers=auth("acme"))).status_code == 400
        assert (await http.get("/api/v1/jobs", params={"sort": "bogus"}, headers=auth("acme"))).status_code == 422


async def test_utilisation_series_come_from_telemetry_with_gaps_and_only_for_visible_jobs(
        api: RunningApi, migrated_dsn: str) -> None:
    now = datetime.now(UTC)
    job_id = uuid.uuid4()
    conn = await asyncpg.connect(migrated_dsn)
    try:
        await conn.execute(INSERT, job_id, "train", "acme", "training", "running", json.dumps(SPEC), ["n1"],
                           now - timedelta(minutes=2), now - timedelta(seconds=110), None)
        await conn.execute("SELECT telemetry_ensure_day_partitions(current_date - 1, current_date + 1)")
        # samples 100 s to 60 s ago, a gap, then 20 s ago to now: the chart must show the gap
        for back in (100, 90, 80, 70, 60, 20, 10, 0):
            at = now - timedelta(seconds=back)
            await conn.execute(
                """INSERT INTO telemetry_job_samples (sampled_at, job_id, tenant, node_id, device_uuid, gpu_uuid,
                       gpu_index, alloc_milli, memory_used_mib, util_pct, process_count)
                   VALUES ($1, $2, 'acme', 'n1', 'GPU-n1-0', 'GPU-n1-0', 0, 1000, $3, $4, 1)""",
                at, job_id, 1000 + back, 50.0)
            await conn.execute(
                """INSERT INTO telemetry_gpu_samples (sampled_at, node_id, gpu_uuid, gpu_index, util_pct,
                       memory_used_mib, memory_total_mib) VALUES ($1, 'n1', 'GPU-n1-0', 0, 40, 2048, 81920)""", at)
    finally:
        await conn.close()
    async with httpx.AsyncClient(base_url=api.url) as http:
        answer = await http.get(f"/api/v1/jobs/{job_id}/utilisation", headers=auth("acme"))
        assert answer.status_code == 200, answer.text
        series = answer.json()
        assert series["source"].startswith("raw samples") and series["bucket_s"] == 5
        [line] = series["series"]
        assert line["label"] == "n1 GPU 0" and len(line["util_pct"]) == len(series["t"])
        values = [v for v in line["util_pct"] if v is not None]
        assert values == [50.0] * 8
        filled = [i for i, v in enumerate(line["util_pct"]) if v is not None]
        assert filled[5] - filled[4] >= 7  # 40 s without a sample: nulls between, not a joined line
        assert all(line["util_pct"][i] is None for i in range(filled[4] + 1, filled[5]))
        assert (await http.get(f"/api/v1/jobs/{job_id}/utilisation", headers=auth("research"))).status_code == 404

        gpus = (await http.get("/api/v1/nodes/n1/utilisation", params={"since": "5m"}, headers=auth("research"))).json()
        [gpu] = gpus["series"]
        assert gpu["label"] == "GPU 0" and {v for v in gpu["util_pct"] if v is not None} == {40.0}
        assert {v for v in gpu["memory_mib"] if v is not None} == {2048.0}
        day = (await http.get("/api/v1/nodes/n1/utilisation", params={"since": "1d"}, headers=auth("ops"))).json()
        assert day["source"] == "rollups" and day["bucket_s"] == 300  # the newest minutes binned as rollups are
        assert {v for v in day["series"][0]["util_pct"] if v is not None} == {40.0}
        assert (await http.get("/api/v1/nodes/n1/utilisation", params={"since": "90d"},
                               headers=auth("ops"))).status_code == 400


def test_a_bucket_without_a_sample_is_a_gap() -> None:
    start = datetime(2026, 1, 1, tzinfo=UTC)
    window = SeriesWindow.pick(start, start + timedelta(seconds=60))
    assert window.bucket_s == 5 and len(window.axis()) == 13
    rows = [{"bucket": start, "key": "g", "util_pct": 10, "memory_mib": None},
            {"bucket": start + timedelta(seconds=15), "key": "g", "util_pct": 30.04, "memory_mib": 7},
            {"bucket": start, "key": "unknown", "util_pct": 99, "memory_mib": 1}]
    out = aligned(rows, window, {"g": "GPU 0", "idle": "GPU 1"})
    assert out["series"][0]["util_pct"][:4] == [10.0, None, None, 30.0]
    assert out["series"][0]["memory_mib"][:4] == [None, None, None, 7.0]
    assert out["series"][1]["util_pct"] == [None] * 13  # a device without samples: all gaps
    assert SeriesWindow.pick(start, start + timedelta(hours=2)).source == "rollups"


async def test_an_ended_job_is_resubmitted_as_a_new_job_on_the_callers_behalf(
        api: RunningApi, migrated_dsn: str) -> None:
    now = datetime.now(UTC)
    failed, running, theirs = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    spec = {**SPEC, "name": "train", "tenant": "acme", "tier": "batch", "priority_class": "normal"}
    conn = await asyncpg.connect(migrated_dsn)
    try:
        await conn.execute(INSERT, failed, "train", "acme", "batch", "failed", json.dumps(spec), ["n1"],
                           now - timedelta(minutes=3), now - timedelta(minutes=2), now - timedelta(minutes=1))
        await conn.execute(INSERT, running, "train", "acme", "batch", "running", json.dumps(spec), ["n1"],
                           now - timedelta(minutes=3), now - timedelta(minutes=2), None)
        await conn.execute(INSERT, theirs, "x", "research", "batch", "failed", json.dumps(spec), [],
                           now, None, now)
    finally:
        await conn.close()
    async with httpx.AsyncClient(base_url=api.url) as http:
        answer = await http.post(f"/api/v1/jobs/{str(failed)[:8]}/resubmit", headers=auth("acme"))
        assert answer.status_code == 202, answer.text
        new_id = answer.json()["job_id"]
        assert new_id != str(failed) and answer.headers["location"].endswith(f"/api/v1/jobs/{new_id}")
        incoming = await asyncio.wait_for(api.submissions.get(), 10)
        submitted = decode(incoming.body)
        assert (incoming.routing_key, str(submitted.job_id), submitted.on_behalf_of) == (  # type: ignore[attr-defined]
            "job.submit.acme", new_id, "acme-ci")
        assert submitted.spec.name == "train" and submitted.spec.resources.gpus == 1  # type: ignore[attr-defined]
        still = await http.post(f"/api/v1/jobs/{running}/resubmit", headers=auth("acme"))
        assert still.status_code == 409 and "cancel it first" in still.json()["detail"]
        assert (await http.post(f"/api/v1/jobs/{theirs}/resubmit", headers=auth("acme"))).status_code == 404
        assert api.submissions.empty()


async def test_only_operators_change_a_jobs_priority(api: RunningApi, migrated_dsn: str) -> None:
    now = datetime.now(UTC)
    queued, ended = uuid.uuid4(), uuid.uuid4()
    conn = await asyncpg.connect(migrated_dsn)
    try:
        await conn.execute(INSERT, queued, "train", "acme", "batch", "queued", json.dumps(SPEC), [], now, None, None)
        await conn.execute(INSERT, ended, "old", "acme", "batch", "succeeded", json.dumps(SPEC), [], now, now, now)
    finally:
        await conn.close()
    async with httpx.AsyncClient(base_url=api.url) as http:
        mine = await http.post(f"/api/v1/jobs/{queued}/priority", json={"priority_class": "low"}, headers=auth("acme"))
        assert mine.status_code == 403 and "operator" in mine.json()["detail"]
        answer = await http.post(f"/api/v1/jobs/{queued}/priority", json={"priority_class": "high"},
                                 headers=auth("ops"))
        assert answer.status_code == 202, answer.text
        assert answer.headers["location"].endswith(f"/api/v1/jobs/{queued}")
        incoming = await asyncio.wait_for(api.submissions.get(), 10)
        change = decode(incoming.body)
        assert (change.TYPE, incoming.routing_key, change.priority_class, change.on_behalf_of) == (  # type: ignore[attr-defined]
            "job.priority_set", "job.priority_set.acme", "high", "ops")
        late = await http.post(f"/api/v1/jobs/{ended}/priority", json={"priority_class": "high"}, headers=auth("ops"))
        assert late.status_code == 409
        bogus = await http.post(f"/api/v1/jobs/{queued}/priority", json={"priority_class": "urgent"},
                                headers=auth("ops"))
        assert bogus.status_code == 422
        assert api.submissions.empty()
