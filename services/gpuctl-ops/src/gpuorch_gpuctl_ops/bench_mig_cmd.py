"""``gpuctl bench mig``: a simulated day on an H100 fleet, static MIG layouts against the MIG planner, in process.

The simulation is ``gpuorch_capacity.mig_simulation``: each layout's day is played through the scheduler the service
runs (``gpuorch_scheduling.Harness``, with its MIG loop and simulated node-agents); no services, deterministic per
seed, one to a few minutes per layout here. Progress goes to stderr; ``--json`` prints exactly one JSON object on
stdout. bench/bench_mig.py runs the same over several seeds and draws the plot in docs/mig.md.
"""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.console import Console


def mig(
    seed: Annotated[int, typer.Option(help="workload seed (same seed, same figures)")] = 1,
    nodes: Annotated[int, typer.Option(help="8-GPU H100 nodes in the fleet (the workload is sized for 4)")] = 4,
    hours: Annotated[float, typer.Option(help="play only the first hours of the day")] = 24.0,
    tick_s: Annotated[float, typer.Option("--tick-s", help="the scheduler's tick (GPUORCH_TICK_S)")] = 1.0,
    as_json: Annotated[bool, typer.Option("--json", help="print the figures as JSON")] = False,
    small_on_whole: Annotated[bool, typer.Option(
        "--small-on-whole/--mig-only", help="on the unpartitioned layout small jobs ask for one whole GPU, as on a "
        "fleet without MIG (the default); --mig-only: they ask for their MIG profiles there too")] = True,
) -> None:
    """Whole GPUs, all 1g.10gb, a fixed mix and the planner on one simulated day: completed jobs, GPU allocation,
    mean wait per tier, reconfigurations and how long one takes end to end (drain + apply)."""
    from gpuorch_capacity.mig_simulation import bench_json, run_mig_bench

    err = Console(stderr=True, emoji=False)
    day_s = hours * 3600
    err.print(f"seed {seed}: playing each layout's day through the scheduler (one to a few minutes each)")
    results = run_mig_bench(seed, nodes, small_on_whole, day_s=day_s, tick_s=tick_s,
                            on_layout=lambda name: err.print(f"seed {seed}: {name} played"))
    document = bench_json(results, seed, nodes, small_on_whole, day_s)
    if as_json:
        print(json.dumps(document, indent=1))
        return
    print(f"{document['fleet']}, seed {seed}: one simulated day ({hours:g} h)\n")
    print(f"{'layout':<24}{'completed':>10}{'GPU alloc %':>12}{'wait inference s':>18}{'wait training s':>17}"
          f"{'wait batch s':>14}{'reconfigs':>10}")
    for name, row in document["layouts"].items():  # type: ignore[attr-defined]
        wait = row["mean_wait_s"]
        print(f"{name:<24}{row['completed_jobs']:>10}{row['gpu_allocation_pct']:>12.1f}{wait['inference']:>18.0f}"
              f"{wait['training']:>17.0f}{wait['batch']:>14.0f}{row['reconfigurations']:>10}")
    r = document["reconfiguration_s"]
    print(f"\nplanner reconfiguration end to end (drain + apply): median {r['median']} s, "  # type: ignore[index]
          f"p95 {r['p95']} s, max {r['max']} s")  # type: ignore[index]
