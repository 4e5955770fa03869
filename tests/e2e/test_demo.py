"""`make demo` stays true: the demo command runs the whole stack and at least 10 jobs succeed on 3 nodes."""

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
    env = {**os.environ, "GPUORCH_DEMO_VHOST": vhost,
           "GPUORCH_DEMO_DATABASE_URL": f"postgresql://postgres@127.0.0.1:5432/{database}"}
    try:
        done = subprocess.run([sys.executable, "-m", "gpuorch_gpuctl", "demo", "--json", "--root", str(tmp_path)],
                              env=env, capture_output=True, text=True, timeout=180)
    finally:
        drop_vhost(vhost)
        drop_database(database)
    assert done.returncode == 0, done.stderr[-3000:]
    outcome = json.loads(done.stdout)
    assert outcome["states"]["succeeded"] >= 10
    assert outcome["nodes_used"] == ["node-1", "node-2", "node-3"]
    by_name = {j["name"]: j for j in outcome["jobs_detail"]}
    assert by_name["broken-job"]["state"] == "failed" and by_name["broken-job"]["exit_code"] == 3
    assert by_name["too-big"]["state"] == "rejected"
    assert by_name["train-l4"]["node"] == "node-3"
    findings = {(a["job"], a["kind"]) for a in outcome["advice"]}
    assert {("idle-notebook", "idle"), ("oversized-train", "oversized")} <= findings
