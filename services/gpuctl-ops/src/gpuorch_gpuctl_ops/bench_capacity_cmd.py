"""``gpuctl bench capacity``: a simulated day on three fleets (autoscaled, peak-sized, mean-sized), in process.

The simulation is ``gpuorch_capacity.simulation``: the day played through the scheduler the service runs, on the
Harness (no services; the mean-sized fleet, deeply queued, costs most of the time). bench/bench_capacity.py runs the
same and also writes bench/results/capacity.md and the plot in docs/capacity.md.
"""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.console import Console

from gpuorch_gpuctl_ops.replay_cmd import parse_seeds


def capacity(
    seeds: Annotated[str, typer.Option(help="seeds: 7, 1,2 or 1-5")] = "1-3",
    boot_s: Annotated[float, typer.Option("--boot-s", help="seconds a new node takes to become ready")] = 180.0,
    as_json: Annotated[bool, typer.Option("--json", help="print the figures as JSON")] = False,
) -> None:
    """Autoscaled fleet vs fixed fleets sized for the peak and the mean: queue wait per tier and GPU-hours paid."""
    from gpuorch_capacity.simulation import run_seed, table, verdict

    err = Console(stderr=True, emoji=False)
    rows, verdicts = [], []
    for seed in parse_seeds(seeds):
        found, _ = run_seed(seed, boot_s, lambda line: err.print(line))
        rows += found
        verdicts.append({"seed": seed, **verdict(found)})
    if as_json:
        print(json.dumps({"boot_s": boot_s, "rows": rows, "verdicts": verdicts}, indent=1))
        return
    for seed in parse_seeds(seeds):
        print(f"seed {seed}\n\n{table([r for r in rows if r['seed'] == seed])}\n")
    for v in verdicts:
        print(f"seed {v['seed']}: autoscaled mean wait {v['extra_wait_vs_peak_s']:+.0f} s against the peak fleet, "
              f"within 10 %: {'yes' if v['wait_within_10pct_of_peak'] else 'NO'}; GPU-hours "
              f"{v['gpu_hours_vs_peak']:.2f} x, cost {v['cost_vs_peak']:.2f} x the peak fleet's")
