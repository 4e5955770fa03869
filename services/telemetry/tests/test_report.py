"""``gpuctl report`` over rollups that telemetry wrote (the CLI reads PostgreSQL only; it never imports telemetry)."""

from __future__ import annotations

import asyncio
import json
import re
from datetime import UTC, datetime, timedelta
from pathlib import Path

import asyncpg
import pytest
import typer
from gpuorch_contracts import GpuAllocation
from gpuorch_gpuctl_ops.report_cmd import report
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
    before_rollup = {j["name"]: j for j in json.loads(fresh.stdout)["jobs"]}
    assert before_rollup["forgotten-notebook"]["idle_gpu_hours"] == pytest.approx(2 * 40 / 60)
    result = await asyncio.to_thread(
        runner.invoke, app, ["--since", "1h", "--json", "--out", str(tmp_path), "--dsn", migrated_dsn]
    )
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
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
    assert names == ["allocation_vs_use.png", "conclusions.csv", "idle_gpu_hours.png", "jobs.csv", "queue_wait.png",
                     "report.html", "tenants.csv", "utilisation.png"]
    assert payload["series_source"] == "rollups" and payload["charts"]["utilisation.png"] >= 6
    idle = [c for c in payload["conclusions"] if c["kind"] == "idle_gpus"]
    assert [c["subject"] for c in idle] == ["nlp"] and idle[0]["gpu_hours"] == pytest.approx(2 * 40 / 60)
    page = (tmp_path / "report.html").read_text()
    # one self-contained page: the charts drawn by the inlined uPlot from the inlined data, nothing fetched
    assert "GpuorchCharts" in page and 'id="report-data"' in page and "forgotten-notebook" in page
    assert not re.findall(r"""(?:src|href)=["'](?!#)""", page)
    assert "Tenant nlp held 1.33 GPU-hours of GPUs idle (100 % of the 1.33 GPU-hours it was allocated), most in " \
           "forgotten-notebook" in page
    assert (tmp_path / "utilisation.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    table = await asyncio.to_thread(runner.invoke, app, ["--since", "1h", "--dsn", migrated_dsn],
                                    env={"COLUMNS": "200"})
    assert table.exit_code == 0 and "forgotten-notebook" in table.output and "nlp" in table.output

    only = await asyncio.to_thread(runner.invoke, app, ["--since", "1h", "-o", "json", "--tenant", "vision",
                                                        "--dsn", migrated_dsn])
    assert only.exit_code == 0, only.output
    assert [j["name"] for j in json.loads(only.stdout)["jobs"]] == ["busy-train"]
    rows = await asyncio.to_thread(runner.invoke, app, ["-o", "csv", "--from", start.isoformat(),
                                                        "--to", (start + timedelta(minutes=20)).isoformat(),
                                                        "--dsn", migrated_dsn])
    assert rows.exit_code == 0, rows.output
    lines = rows.stdout.splitlines()
    assert lines[0].startswith("job_id,name,tenant,tier,state") and len(lines) == 3
    by_name = {line.split(",")[1]: line for line in lines[1:]}
    assert set(by_name) == {"forgotten-notebook", "busy-train"}
    empty = await asyncio.to_thread(runner.invoke, app, ["--from", "2020-01-01", "--to", "2020-01-02", "--json",
                                                         "--dsn", migrated_dsn])
    assert empty.exit_code == 0 and json.loads(empty.stdout)["jobs"] == []


async def test_a_short_period_charts_raw_samples_and_concludes(migrated_dsn: str, tmp_path: Path) -> None:
    """Right after a demo there is no closed 5-minute bucket: the chart reads raw samples in seconds-wide buckets,
    and the conclusions still name the idle tenant."""
    now = datetime.now(UTC)
    start = now - timedelta(seconds=90)
    store = await TelemetryStore.open(migrated_dsn, max_size=2)
    try:
        handlers = TelemetryHandlers(store=store, publisher=RecordingPublisher(),
                                     detection=DetectionConfig(window_s=60.0), clock=lambda: now)
        idle = simulated_job("notebook", "node-7", [GpuAllocation(gpu_uuid=gpu_uuid("node-7", 0), gpu_index=0)],
                             300, tenant="research")
        for m in idle.lifecycle(start, start):
            await handlers.handle(m)
        gpus = [SimulatedGpu(node_id="node-7", index=0, uuid=gpu_uuid("node-7", 0)),
                SimulatedGpu(node_id="node-7", index=1, uuid=gpu_uuid("node-7", 1), profile=PROFILES["normal"])]
        await asyncio.gather(*(handlers.handle(usage_message("node-7", gpus, start + timedelta(seconds=s)))
                               for s in range(0, 90, 2)))
    finally:
        await store.close()
    conn = await asyncpg.connect(migrated_dsn)
    try:  # the scheduler's read model of the node (no scheduler runs here)
        inventory = {"node_id": "node-7", "cpu_milli": 64000, "memory_mib": 262144,
                     "gpus": [{"uuid": gpu_uuid("node-7", i), "index": i, "model": "H100-80GB",
                               "memory_total_mib": 81559} for i in range(2)]}
        await conn.execute("INSERT INTO nodes (node_id, liveness, inventory, inventory_hash) VALUES ($1, $2, $3, $4)",
                           "node-7", "alive", json.dumps(inventory), "h")
    finally:
        await conn.close()
    app = typer.Typer()
    app.command()(report)
    result = await asyncio.to_thread(CliRunner().invoke, app, ["--since", "1h", "--json", "--out", str(tmp_path),
                                                               "--dsn", migrated_dsn])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert payload["series_source"].startswith("raw samples")
    assert payload["charts"]["utilisation.png"] > 10
    assert any(c["kind"] == "idle_gpus" and c["subject"] == "research" for c in payload["conclusions"]), payload
    (autoscaler,) = [c for c in payload["conclusions"] if c["kind"] == "autoscaler"]
    assert autoscaler["text"].startswith("The autoscaler would have changed nothing")
