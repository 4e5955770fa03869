"""`gpuctl bench` against the real servers, at toy sizes: the commands run end to end and report what they must.

No timing is asserted (speed lives in bench/ and docs/PERFORMANCE.md); these check counts and keys only.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration

E2E_KEYS = {"nodes", "offered_per_s", "jobs", "placed", "placements_per_s", "p50_ms", "p99_ms", "raw_p50_ms",
            "raw_p99_ms", "overhead_ratio_p50", "scheduler_cpu_s", "cpu_ms_per_message", "scheduler_rss_mib"}


def _gpuctl(*args: str, timeout_s: float) -> dict[str, object]:
    done = subprocess.run([sys.executable, "-m", "gpuorch_gpuctl", *args, "--json"], capture_output=True, text=True,
                          timeout=timeout_s)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def test_e2e_places_every_submitted_job_and_reports_the_raw_baseline() -> None:
    result = _gpuctl("bench", "e2e", "--nodes", "3", "--jobs", "20", "--rate", "50", "--heartbeat-s", "1",
                     "--idle-s", "0.5", "--timeout-s", "60", timeout_s=90)
    assert set(result) >= E2E_KEYS, E2E_KEYS - set(result)
    assert result["nodes"] == 3
    assert result["placed"] == result["jobs"] == 20
    assert result["duplicate_launches"] == 0
    assert result["raw_received"] == 20


def test_recovery_rebuilds_the_synthetic_history_with_and_without_a_snapshot() -> None:
    # 10 nodes, then jobs of 4 events each with at most 40 running: 10 + 4 x 40 + ... = 2,000 events
    result = _gpuctl("bench", "recovery", "--events", "2000", "--nodes", "10", "--running", "40", "--repeats", "1",
                     timeout_s=90)
    assert result["events"] == 2000
    assert result["state_nodes"] == 10
    # the snapshot round trip keeps what the replay built; a scheduler may forget finished jobs (retention), never
    # the 40 still running at the end of the history, and never holds a job the log does not have
    assert result["state_jobs"] == result["state_jobs_without_snapshot"]
    assert 40 <= result["state_jobs"] <= result["jobs_in_log"]
    assert result["jobs_in_log"] > 400
