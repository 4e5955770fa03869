"""`make demo` stays true: the demo command runs the whole stack and at least 10 jobs succeed on 3 nodes; kept
(`--keep`), `gpuctl jobs --json` with no flags lists its jobs through its API and `gpuctl down` stops it; then
`gpuctl report --out DIR` draws charts with data in them and lists concrete conclusions."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from conftest import drop_database, drop_vhost

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_demo_runs_a_mixed_workload_on_three_simulated_nodes(tmp_path: Path) -> None:
    suffix = uuid.uuid4().hex[:8]
    vhost, database = f"gpuorch-demo-test-{suffix}", f"gpuorch_demo_test_{suffix}"
    env = {**{k: v for k, v in os.environ.items() if k not in ("GPUORCH_DATABASE_URL", "GPUCTL_SERVER")},
           "GPUORCH_DEMO_VHOST": vhost, "GPUORCH_DEMO_DATABASE_URL": f"postgresql://postgres@127.0.0.1:5432/{database}",
           "GPUCTL_CONFIG": str(tmp_path / "gpuctl.yaml")}
    report = listed = stopped = again = None
    try:
        done = subprocess.run([sys.executable, "-m", "gpuorch_gpuctl", "demo", "--json", "--keep", "--api-port", "0",
                               "--root", str(tmp_path)], env=env, capture_output=True, text=True, timeout=180)
        if done.returncode == 0:  # `make demo` over the kept stack: refused, its state and database untouched
            again = subprocess.run([sys.executable, "-m", "gpuorch_gpuctl", "demo", "--api-port", "0", "--root",
                                    str(tmp_path)], env=env, capture_output=True, text=True, timeout=120)
        if done.returncode == 0:  # kept: gpuctl with no flags reads the demo's jobs through its API
            listed = subprocess.run([sys.executable, "-m", "gpuorch_gpuctl", "jobs", "--json"], env=env,
                                    capture_output=True, text=True, timeout=60)
            # the weekly review right after the demo, as a new user would run it
            report = subprocess.run([sys.executable, "-m", "gpuorch_gpuctl", "report", "--json", "--out",
                                     str(tmp_path / "report"), "--dsn", env["GPUORCH_DEMO_DATABASE_URL"]],
                                    env=env, capture_output=True, text=True, timeout=120)
    finally:
        if (tmp_path / "stack.json").exists():
            stopped = subprocess.run([sys.executable, "-m", "gpuorch_gpuctl", "down", "--json"], env=env,
                                     capture_output=True, text=True, timeout=60)
        drop_vhost(vhost)
        drop_database(database)
    assert done.returncode == 0, done.stderr[-3000:]
    assert again is not None and again.returncode == 1 and "a kept stack runs" in again.stderr, again
    assert f"other systems publish to: amqp://guest:guest@127.0.0.1:5672/{vhost}" in done.stderr
    assert listed is not None and listed.returncode == 0, listed.stderr if listed else ""
    assert len(json.loads(listed.stdout)) == 15
    assert stopped is not None and set(json.loads(stopped.stdout)["stopped"]) >= {"api", "executor", "telemetry"}
    outcome = json.loads(done.stdout)
    assert outcome["states"]["succeeded"] >= 10
    assert outcome["nodes_used"] == ["node-1", "node-2", "node-3"]
    by_name = {j["name"]: j for j in outcome["jobs_detail"]}
    assert by_name["broken-job"]["state"] == "failed" and by_name["broken-job"]["exit_code"] == 3
    assert by_name["too-big"]["state"] == "rejected"
    assert by_name["train-l4"]["node"] == "node-3"
    findings = {(a["job"], a["kind"]) for a in outcome["advice"]}
    assert {("idle-notebook", "idle"), ("oversized-train", "oversized")} <= findings

    assert report is not None and report.returncode == 0, report.stderr[-3000:] if report else ""
    review = json.loads(report.stdout)
    charts = review["charts"]
    assert review["series_source"].startswith("raw samples")  # a 30-second demo has no closed 5-minute bucket
    assert charts["utilisation.png"] > 3 and charts["allocation_vs_use.png"] >= 2 and charts["queue_wait.png"] >= 2
    for name in charts:
        assert (tmp_path / "report" / name).stat().st_size > 10_000
    kinds = {(c["kind"], c["subject"]) for c in review["conclusions"]}
    assert ("idle_gpus", "research") in kinds  # the idle notebook
    assert ("right_size", "oversized-train") in kinds
    assert ("short_of", "16 GPUs") in kinds  # too-big: the read model keeps a rejected job's spec
    assert any(kind == "autoscaler" for kind, _ in kinds)
    notebook = next(c for c in review["conclusions"] if c["subject"] == "research")
    assert "idle-notebook" in notebook["text"]
