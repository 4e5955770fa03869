"""``gpuctl mig plan`` (from the read models in PostgreSQL and from a snapshot file) and ``gpuctl bench mig``."""

from __future__ import annotations

import asyncio
import json
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import asyncpg
import pytest
import typer
from gpuorch_gpuctl_ops.bench_mig_cmd import mig as bench_mig
from gpuorch_gpuctl_ops.mig_cmd import mig_app
from typer.testing import CliRunner

H100 = {"uuid": "GPU-0", "index": 0, "model": "H100-80GB", "memory_total_mib": 81559}


def inventory(node_id: str, *gpus: dict[str, object]) -> str:
    return json.dumps({"node_id": node_id, "cpu_milli": 64000, "memory_mib": 524288, "gpus": list(gpus)})


@pytest.mark.integration
def test_plan_from_the_read_models_slices_an_idle_gpu_for_waiting_mig_jobs(migrated_dsn: str, tmp_path: Path) -> None:
    waiting = [uuid.uuid4() for _ in range(2)]

    async def fill() -> None:
        conn = await asyncpg.connect(migrated_dsn)
        try:
            await conn.execute(
                "INSERT INTO nodes (node_id, liveness, inventory, inventory_hash) VALUES ('n1', 'alive', $1::jsonb, 'h')",
                inventory("n1", H100))
            for job_id in waiting:
                spec = {"name": "infer", "tier": "inference",
                        "resources": {"mig_profiles": ["3g.40gb", "1g.10gb"]}, "gang": {"nodes": 1}}
                await conn.execute(
                    """INSERT INTO jobs (job_id, name, tenant, tier, priority_class, state, spec, submitted_at)
                       VALUES ($1, 'infer', 'acme', 'inference', 'normal', 'queued', $2::jsonb, $3)""",
                    job_id, json.dumps(spec), datetime.now(UTC) - timedelta(minutes=5))
        finally:
            await conn.close()

    asyncio.run(fill())
    saved = tmp_path / "snapshot.json"
    result = CliRunner().invoke(mig_app, ["plan", "--dsn", migrated_dsn, "--json", "--save", str(saved)])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)
    assert plan["mode"] == "advise" and plan["input"] == {"gpus": 1, "pending_jobs": 2}
    (proposal,) = plan["proposals"]
    assert (proposal["node_id"], proposal["gpu_index"], proposal["current"]) == ("n1", 0, "whole GPU")
    assert sorted(proposal["enables"]) == sorted(str(j) for j in waiting) and proposal["needs_reset"]
    assert proposal["target_profiles"].count("3g.40gb") == 2  # no peak history: the first choice, twice

    # the saved snapshot gives the same plan without the database; mode off gives none
    again = CliRunner().invoke(mig_app, ["plan", "--snapshot", str(saved), "--json"])
    assert json.loads(again.stdout)["proposals"] == plan["proposals"]
    off = CliRunner().invoke(mig_app, ["plan", "--snapshot", str(saved), "--mode", "off"])
    assert off.exit_code == 0 and "off: no proposals" in off.stdout
    text = CliRunner().invoke(mig_app, ["plan", "--snapshot", str(saved)], env={"COLUMNS": "300"})
    assert "whole GPU" in text.stdout and "2 waiting MIG job(s)" in text.stdout


def test_a_malformed_snapshot_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"gpus": [{"node_id": "n1"}]}')
    result = CliRunner().invoke(mig_app, ["plan", "--snapshot", str(bad)])
    assert result.exit_code != 0 and "not a MIG planner snapshot" in result.output


@pytest.mark.timeout(600)  # 8 layout-hours through the scheduler: about 40 s alone, minutes on a busy machine
def test_bench_mig_json_compares_static_layouts_with_the_planner() -> None:
    app = typer.Typer()  # the command alone (see test_bench_capacity)
    app.command()(bench_mig)
    # the first hour of the day on 2 nodes (the night's batch asks for slices): a full day takes minutes a layout
    short = ["--seed", "1", "--nodes", "2", "--hours", "1", "--tick-s", "5", "--json"]
    result = CliRunner().invoke(app, [*short, "--mig-only"])
    assert result.exit_code == 0, result.output
    layouts = json.loads(result.stdout)["layouts"]
    assert set(layouts) == {"whole", "all_1g.10gb", "fixed_mix", "planner"}
    for row in layouts.values():
        assert set(row) >= {"completed_jobs", "gpu_allocation_pct", "mean_wait_s", "reconfigurations"}
        assert set(row["mean_wait_s"]) == {"inference", "training", "batch"}
        assert 0 <= row["gpu_allocation_pct"] <= 100
    # static layouts never change; whole GPUs run no MIG job, seven 1g.10gb slices no whole-GPU job
    assert all(layouts[n]["reconfigurations"] == 0 for n in ("whole", "all_1g.10gb", "fixed_mix"))
    assert layouts["planner"]["reconfigurations"] > 0
    assert layouts["whole"]["completed_jobs"] == 0 and layouts["all_1g.10gb"]["unstarted_jobs"]["training"] > 0
    # by default, as on a fleet without MIG, small jobs ask for a whole GPU on the whole layout: it runs them too
    unpartitioned = CliRunner().invoke(app, short)
    document = json.loads(unpartitioned.stdout)
    assert document["small_on_whole"] is True and set(document["layouts"]) == set(layouts)
    whole = document["layouts"]["whole"]
    assert whole["completed_jobs"] > 0 and sum(whole["unstarted_jobs"].values()) < sum(
        layouts["whole"]["unstarted_jobs"].values())
