"""The weekly review counts the GPU-hours that parking idle sessions gave back, within the period only."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime, timedelta

import asyncpg
import pytest
from gpuorch_report import read_report, resolve_period

pytestmark = pytest.mark.integration


async def test_parked_gpu_hours_per_tenant(migrated_dsn: str) -> None:
    now = datetime.now(UTC)
    hour = 3600.0
    t = now.timestamp()
    parks = {  # [parked at, resumed at | None (still parked), GPUs]
        "lab": [[t - 10 * hour, t - 8 * hour, 1.0], [t - 2 * hour, None, 2.0]],  # 2 + 4 GPU-hours
        "old": [[t - 30 * 24 * hour, t - 29 * 24 * hour, 4.0]],  # before the period
    }
    conn = await asyncpg.connect(migrated_dsn)
    try:
        for tenant, intervals in parks.items():
            await conn.execute(
                "INSERT INTO jobs (job_id, name, tenant, tier, priority_class, state, spec, submitted_at, "
                "session_parks) VALUES ($1, 'nb', $2, 'interactive', 'normal', 'parked', '{}', $3, $4::text::jsonb)",
                uuid.uuid4(), tenant, now - timedelta(days=40), json.dumps(intervals))
        report = await read_report(conn, resolve_period(now, "7d"))
    finally:
        await conn.close()
    lines = {line.tenant: line for line in report.tenants}
    assert lines["lab"].parked_gpu_hours == pytest.approx(6.0, abs=0.01) and lines["lab"].parks == 2
    assert "old" not in lines
    (parked,) = [c for c in report.conclusions if c.kind == "parked_sessions"]
    assert parked.subject == "lab" and "gave back 6.00 GPU-hours" in parked.text
