"""``gpuctl report`` over rollups that telemetry wrote (the CLI reads PostgreSQL only; it never imports telemetry)."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import typer
from gpuorch_contracts import GpuAllocation
from gpuorch_gpuctl.report_cmd import report
from gpuorch_messaging.testing import RecordingPublisher
from gpuorch_telemetry.domain.detection import DetectionConfig
from gpuorch_telemetry.handlers import TelemetryHandlers
from gpuorch_telemetry.simulation import PROFILES, SimulatedGpu, gpu_uuid, simulated_job, usage_message
from gpuorch_telemetry.store import TelemetryStore
from typer.testing import CliRunner

pytestmark = pytest.mark.integration


async def test_report_ranks_idle_work_and_writes_charts(migrated_dsn: str, tmp_path: Path) -> None:
    wall = datetime.now(UTC).replace(second=0, microsecond=0)
    closed_until = wall.replace(minute=wall.minute - wall.minute % 5)
    now = closed_until + timedelta(minutes=2)  # rollups cover [start, closed_until): 38 minutes; 2 stay pending
    start = now - timedelta(minutes=40)
    store = await TelemetryStore.open(migrated_dsn, max_size=2)
    try:
        handlers = TelemetryHandlers(store=store, publisher=RecordingPublisher(),
                                     detection=DetectionConfig(window_s=300.0), clock=lambda: now)
        busy = simulated_job("busy-train", "node-1", [GpuAllocation(gpu_uuid=gpu_uuid("node-1", 0), gpu_index=0)],
                             100, tenant="vision")
        idle = simulated_job("forgotten-notebook", "node-1",
                             [GpuAllocation(gpu_uuid=gpu_uuid("node-1", i), gpu_index=i) for i in (1, 2)], 200,
                             tenant="nlp")
        for job in (busy, idle):
            for m in job.lifecycle(start, start):
                await handlers.handle(m)
        gpus = [SimulatedGpu(node_id="node-1", index=0, uuid=gpu_uuid("node-1", 0), profile=PROFILES["normal"],
                             pids=[100]),
                SimulatedGpu(node_id="node-1", index=1, uuid=gpu_uuid("node-1", 1)),
                SimulatedGpu(node_id="node-1", index=2, uuid=gpu_uuid("node-1", 2))]
        moments = [start + timedelta(seconds=s) for s in range(0, 2400, 10)]
        await asyncio.gather(*(handlers.handle(usage_message("node-1", gpus, t)) for t in moments))
        await handlers.evaluate_due_jobs()
        app = typer.Typer()
        app.command()(report)
        runner = CliRunner()
        fresh = await asyncio.to_thread(runner.invoke, app, ["--since", "1h", "--json", "--dsn", migrated_dsn])
        while await store.roll_up(now):
            pass
    finally:
        await store.close()
    # Before any rollup the raw samples answer; after it, rollups plus the tail not rolled up yet: same figures.
    assert fresh.exit_code == 0, fresh.output
    before_rollup = {j["name"]: j for j in json.loads(fresh.output)["jobs"]}
    assert before_rollup["forgotten-notebook"]["idle_gpu_hours"] == pytest.approx(2 * 40 / 60)
    result = await asyncio.to_thread(
        runner.invoke, app, ["--since", "1h", "--json", "--out", str(tmp_path), "--dsn", migrated_dsn]
    )
    assert result.exit_code == 0, result.output
    payload = json.loads(result.output)
    first, second = payload["jobs"]
    assert first["name"] == "forgotten-notebook" and first["tenant"] == "nlp"
    assert first["idle_gpu_hours"] == pytest.approx(2 * 40 / 60)  # 2 GPUs for 40 minutes: 38 rolled up + 2 pending
    assert first["allocated_gpu_hours"] == pytest.approx(before_rollup["forgotten-notebook"]["allocated_gpu_hours"])
    assert first["detections"] == "idle" and "Stop or cancel" in first["advice"]
    assert second["name"] == "busy-train" and second["mean_util_pct"] == pytest.approx(85.0)
    assert second["idle_gpu_hours"] == 0 and second["peak_memory_mib_per_gpu"] == 60000
    tenants = {t["tenant"]: t for t in payload["tenants"]}
    assert tenants["vision"]["use_pct"] == pytest.approx(85.0)
    assert tenants["nlp"]["used_gpu_hours"] == 0
    names = sorted(Path(p).name for p in payload["files"])
    assert names == ["allocation_vs_use.png", "idle_gpu_hours.png", "report.html", "utilisation.png"]
    page = (tmp_path / "report.html").read_text()
    assert page.count("data:image/png;base64,") == 3 and "forgotten-notebook" in page
    assert (tmp_path / "utilisation.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    table = await asyncio.to_thread(runner.invoke, app, ["--since", "1h", "--dsn", migrated_dsn],
                                    env={"COLUMNS": "200"})
    assert table.exit_code == 0 and "forgotten-notebook" in table.output and "nlp" in table.output
