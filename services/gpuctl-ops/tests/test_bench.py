"""`gpuctl bench` against the real servers, at toy sizes: the commands run end to end and report what they must.

No timing is asserted (speed lives in bench/ and docs/PERFORMANCE.md); these check counts and keys only.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from gpuorch_gpuctl_ops.bench_recovery import read_restart

E2E_KEYS = {"nodes", "offered_per_s", "jobs", "placed", "placements_per_s", "p50_ms", "p99_ms", "raw_p50_ms",
            "raw_p99_ms", "overhead_ratio_p50", "scheduler_cpu_s", "cpu_ms_per_message", "scheduler_rss_mib",
            "floor_placements_per_s", "floor_p50_ms", "floor_p99_ms", "floor_ratio", "floor_cpu_ms_per_message",
            "idle_cpu_ms_per_node_s", "relay_cpu_ms_per_message", "fleet_idle_cpu_pct", "fleet_cpu_pct",
            "machine_busy_pct", "idle_machine_busy_pct", "broker_cpu_pct", "database_cpu_pct", "bench_cpu_pct"}
REPO = Path(__file__).resolve().parents[3]


def _gpuctl(*args: str, timeout_s: float, env: dict[str, str] | None = None) -> dict[str, object]:
    done = subprocess.run([sys.executable, "-m", "gpuorch_gpuctl", *args, "--json"], capture_output=True, text=True,
                          timeout=timeout_s, env={**os.environ, **(env or {})})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.mark.integration
def test_e2e_places_every_submitted_job_and_reports_the_raw_baseline_and_the_floor() -> None:
    result = _gpuctl("bench", "e2e", "--nodes", "3", "--jobs", "20", "--rate", "50", "--heartbeat-s", "1",
                     "--idle-s", "0.5", "--timeout-s", "60", timeout_s=120)
    assert set(result) >= E2E_KEYS, E2E_KEYS - set(result)
    assert result["nodes"] == 3
    assert result["placed"] == result["jobs"] == 20
    assert result["duplicate_launches"] == 0
    assert result["raw_received"] == 20
    assert 0 < result["machine_busy_pct"] <= 100  # what shares the machine is reported beside the figures
    assert result["broker_cpu_pct"] > 0 and result["database_cpu_pct"] > 0  # both local here, and both worked
    assert result["floor_received"] == result["floor_messages"] == 20
    assert isinstance(result["floor_placements_per_s"], float) and result["floor_placements_per_s"] > 0
    assert result["floor_ratio"] == round(result["placements_per_s"] / result["floor_placements_per_s"], 2)


@pytest.mark.integration
def test_recovery_restarts_the_real_scheduler_with_and_without_a_snapshot() -> None:
    # 10 nodes, then jobs of 4 events each with at most 40 running: 10 + 4 x 40 + ... = 2,000 events, 2.5 s apart
    # up to now. The schedulers keep finished jobs for a day: with the default hour, the retention boundary falls
    # inside the history and moves with the wall clock between the two restarts (a job more or less forgotten)
    result = _gpuctl("bench", "recovery", "--events", "2000", "--nodes", "10", "--running", "40", "--repeats", "1",
                     timeout_s=150, env={"GPUORCH_RETENTION_S": "86400"})
    assert result["events"] == 2000
    assert result["state_nodes"] == 10
    # the service's own snapshot keeps what its replay built; a scheduler may forget finished jobs (retention),
    # never the 40 still running at the end of the history, and never holds a job the log does not have
    assert result["state_jobs"] == result["state_jobs_without_snapshot"]
    assert 40 <= result["state_jobs"] <= result["jobs_in_log"]
    assert result["jobs_in_log"] > 400
    assert result["position"] >= 2000  # the cold run replayed the whole log
    assert result["snapshot_mib_stored"] is not None and "snapshot_error" not in result
    assert result["restart_no_snapshot_s"] >= result["recover_no_snapshot_s"] > 0


def _log(path: Path, *records: dict[str, object]) -> Path:
    path.write_text("starting\n" + "".join(json.dumps(r) + "\n" for r in records))
    return path


def test_a_restart_is_timed_by_the_services_own_seconds_then_by_its_log_lines(tmp_path: Path) -> None:
    leader = {"event": "scheduler.leader", "timestamp": "2026-01-01T00:00:10.000000Z"}
    recovered = {"event": "scheduler.recovered", "timestamp": "2026-01-01T00:00:12.500000Z", "position": 7,
                 "replayed": 5, "jobs": 3, "nodes": 2, "from_snapshot": True}
    started = 1767225600.0 + 9.0  # 2026-01-01T00:00:09Z

    assert read_restart(_log(tmp_path / "a.log", leader), started) is None  # not recovered yet
    by_lines = read_restart(_log(tmp_path / "b.log", leader, recovered), started)
    assert by_lines is not None
    assert (by_lines.recover_s, by_lines.timed_by, by_lines.restart_s) == (2.5, "leader->recovered lines", 3.5)
    assert (by_lines.position, by_lines.replayed, by_lines.jobs, by_lines.nodes, by_lines.from_snapshot) == \
        (7, 5, 3, 2, True)
    own = read_restart(_log(tmp_path / "c.log", leader, {**recovered, "seconds": 1.25}), started)
    assert own is not None and (own.recover_s, own.timed_by) == (1.25, "seconds field")
    alone = read_restart(_log(tmp_path / "d.log", recovered), started)
    assert alone is not None and (alone.recover_s, alone.timed_by) == (3.5, "process start")


def test_gpuctl_imports_no_service_package() -> None:
    clients = ("gpuorch_gpuctl", "gpuorch_gpuctl_ops")
    services = {p.name for p in (REPO / "services").glob("*/src/gpuorch_*") if p.name not in clients}
    assert "gpuorch_scheduler" in services
    found = []
    sources = [*(REPO / "services/gpuctl/src").rglob("*.py"), *(REPO / "services/gpuctl-ops/src").rglob("*.py")]
    for source in sources:
        for node in ast.walk(ast.parse(source.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            found += [f"{source.name}: {n}" for n in names if n.split(".")[0] in services]
    assert found == []
