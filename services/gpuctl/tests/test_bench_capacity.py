"""``gpuctl bench capacity``: the simulated day runs in process and its figures hang together (deterministic; the
figures themselves are in docs/capacity.md, not asserted here beyond their order)."""

from __future__ import annotations

import json

import pytest
import typer
from gpuorch_gpuctl.bench_capacity_cmd import capacity
from typer.testing import CliRunner


@pytest.mark.timeout(600)  # the day through the real scheduler: about 35 s of CPU for seed 3, minutes on a busy box
def test_bench_capacity_json_compares_three_fleets_on_one_day() -> None:
    # the command alone: the bench group's callback would point the process's logging at the runner's stderr,
    # which is closed after the call (later tests' log lines would fail on it)
    app = typer.Typer()
    app.command()(capacity)
    result = CliRunner().invoke(app, ["--seeds", "3", "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    rows = {r["fleet"]: r for r in payload["rows"]}
    assert set(rows) == {"peak", "mean", "autoscaled"}
    assert all(r["unfinished"] == 0 for r in rows.values())  # every job of the day started on every fleet
    assert rows["peak"]["gpu_hours"] == 24 * (rows["peak"]["nodes"]["h100"][0] * 8 + rows["peak"]["nodes"]["l4"][0] * 4)
    assert rows["mean"]["gpu_hours"] < rows["autoscaled"]["gpu_hours"] < rows["peak"]["gpu_hours"]
    assert rows["peak"]["mean_wait_s"] <= rows["autoscaled"]["mean_wait_s"] < rows["mean"]["mean_wait_s"]
    (verdict,) = payload["verdicts"]
    assert set(verdict) >= {"wait_within_10pct_of_peak", "gpu_hours_vs_peak", "cost_vs_peak", "turnaround_vs_peak"}
