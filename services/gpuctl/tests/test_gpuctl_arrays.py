"""Sweeps and pipelines on a live stack (issue 26), through gpuctl and the API only: an array of 12 tasks runs each
task once, never more than 3 at once, each task told its index; a job depending on the array starts after its last
task ended; a job depending on a failing job is cancelled with the reason; arrays are one row in ``gpuctl jobs`` and
their tasks are listed with ``--array``; parallelism is changed and an array cancelled at run time."""

from __future__ import annotations

import subprocess
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from .conftest import TOKENS, Gpuctl, LiveApi

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TASK = "import os, time; time.sleep(0.4); print(os.environ['GPUORCH_ARRAY_TASK_ID'], os.environ['GPUORCH_ARRAY_TASK_COUNT'])"


def _at(value: str) -> datetime:
    return datetime.fromisoformat(value)


def most_at_once(tasks: list[dict[str, Any]]) -> int:
    """The largest number of tasks whose [started, ended] intervals overlap."""
    edges = sorted([(_at(t["started_at"]), 1) for t in tasks] + [(_at(t["ended_at"]), -1) for t in tasks],
                   key=lambda e: (e[0], e[1]))
    running = peak = 0
    for _, step in edges:
        running += step
        peak = max(peak, running)
    return peak


def test_a_sweep_then_an_evaluation_step_and_a_broken_pipeline(gpuctl: Gpuctl, live_api: LiveApi) -> None:
    gpuctl.ok("config", "set-context", "acme", "--server", live_api.url, "--token", TOKENS["acme-team"])
    sweep = gpuctl.ok("submit", "--array", "0-11%3", "--name", "sweep", "--", "python", "-c", TASK).stdout.strip()
    evaluate = gpuctl("submit", "--dependency", f"afterok:{sweep[:8]}", "--wait", "--timeout", "300",
                      "--", "python", "-c", "pass")
    assert evaluate.exit_code == 0, evaluate.output
    evaluated = gpuctl.json("describe", evaluate.stdout.strip())

    tasks = gpuctl.json("jobs", "--array", sweep, "--limit", "100")
    assert isinstance(tasks, list) and [t["array_index"] for t in tasks] == list(range(12))
    assert {t["state"] for t in tasks} == {"succeeded"}
    assert most_at_once(tasks) <= 3
    assert _at(evaluated["started_at"]) >= max(_at(t["ended_at"]) for t in tasks)  # type: ignore[index]
    assert gpuctl.ok("logs", tasks[7]["id"]).stdout == "7 12\n"

    rows = [j for j in gpuctl.json("jobs") if j["id"] == sweep]  # type: ignore[union-attr,index]
    assert len(rows) == 1 and rows[0]["array_counts"]["succeeded"] == 12 and rows[0]["state"] == "succeeded"
    assert all(j.get("array_id") is None for j in gpuctl.json("jobs"))  # type: ignore[union-attr]
    assert "ok 12" in gpuctl.ok("jobs").stdout

    failing = gpuctl.ok("submit", "--", "python", "-c", "raise SystemExit(3)").stdout.strip()
    doomed = gpuctl("submit", "--dependency", f"afterok:{failing}", "--wait", "--timeout", "300",
                    "--", "python", "-c", "pass")
    assert doomed.exit_code == 1
    assert f"cancelled: dependency afterok:{failing} can never be met: {failing} failed" in doomed.stderr

    assert gpuctl("submit", "--dependency", "afterok:ffffffff-0000-0000-0000-000000000000", "--wait",
                  "--", "python", "-c", "pass").exit_code == 1  # unknown: rejected with the reason
    assert gpuctl("submit", "--dependency", "after:abc", "--", "python", "-c", "pass").exit_code == 2


def test_an_arrays_parallelism_changes_and_it_is_cancelled_at_run_time(gpuctl: Gpuctl, live_api: LiveApi) -> None:
    gpuctl.ok("config", "set-context", "acme", "--server", live_api.url, "--token", TOKENS["acme-team"])
    long = gpuctl.ok("submit", "--array", "0-5%1", "--", "python", "-c", "import time; time.sleep(600)")
    array_id = long.stdout.strip()
    assert gpuctl.json("array", "set", array_id[:8], "--parallelism", "2")["parallelism"] == 2  # type: ignore[index]
    gpuctl.ok("config", "set-context", "research", "--server", live_api.url, "--token", TOKENS["research-team"])
    assert gpuctl("array", "set", array_id, "--parallelism", "5").exit_code == 1  # another team's array
    gpuctl.ok("config", "use-context", "acme")
    assert gpuctl("array", "cancel", array_id, "--tasks", "x").exit_code == 2
    gpuctl.ok("array", "cancel", array_id, "--tasks", "4-5")
    gpuctl.ok("cancel", array_id)
    finished = gpuctl("submit", "--dependency", f"afterany:{array_id}", "--wait", "--timeout", "300",
                      "--", "python", "-c", "pass")
    assert finished.exit_code == 0, finished.output
    row = gpuctl.json("describe", array_id)
    assert row["state"] == "cancelled" and row["array_counts"]["succeeded"] == 0  # type: ignore[index]
    assert row["array_counts"]["cancelled"] == 6  # type: ignore[index]


def test_the_sweep_example_runs_its_evaluation_after_the_sweep(live_api: LiveApi) -> None:
    example = Path(__file__).resolve().parents[3] / "examples" / "sweep_then_evaluate.py"
    run = subprocess.run([sys.executable, str(example), live_api.stack.amqp_url, "acme"], capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    assert lines[0].startswith("sweep ") and lines[1].startswith("evaluate ")
    assert any(line.startswith("job.queued waiting for ") for line in lines)
    assert lines[-1].startswith("job.finished")
