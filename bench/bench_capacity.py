"""Capacity planning over a simulated day: the autoscaled fleet against fixed fleets sized for the peak and the mean.

    uv run python bench/bench_capacity.py                 # seed 7, one day; see docs/capacity.md for the time
    uv run python bench/bench_capacity.py --json          # the figures as JSON on stdout
    uv run python bench/bench_capacity.py --seeds 1-5     # the table per seed and the mean

No services: the day is played through the scheduler the service runs, on the Harness (``gpuorch_scheduling``:
admission, tiers and priorities, fair order, placement, backfill, preemption, node liveness, with simulated
executors running each job for its runtime). Jobs arrive from a day-long demand curve (training on H100 nodes from
morning to evening, three inference bursts on L4 nodes, preemptible batch work at night) as ``SubmitJob``s; the
fleet is nodes of the simulated cloud (``gpuorch_capacity.providers.SimulatedCloud``: the simulated NVML's H100 and
L4 profiles, registering ``--boot-s`` after they were asked for). Three fleets run the same jobs:

- ``autoscaled``: ``gpuorch_capacity.decide`` every minute (mode auto), over the scheduler's read-model rows as
  telemetry reads them, grows the pools from the queue and drains idle nodes (a drained node leaves and goes
  silent); GPU-hours are paid from each node's request (booting included) to its release;
- ``peak``: a fixed fleet with enough nodes for the peak of the offered load (GPUs that would be busy if every job
  started on arrival, per pool);
- ``mean``: a fixed fleet sized for the mean of the offered load.

The simulation is ``gpuorch_capacity.simulation`` (``gpuctl bench capacity`` runs it too); this script adds the
files. Queue wait is start - arrival per job; GPU-hours paid are counted over the day (00:00-24:00). Writes
bench/results/capacity.md, bench/results/capacity.json and the plot docs/img/capacity.png (printed table too).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
from gpuorch_capacity.simulation import H100, L4, TIERS, RunResult, run_seed, table, verdict

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
PLOT = ROOT / "docs" / "img" / "capacity.png"


def plot(extra: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results: dict[str, RunResult] = extra["results"]
    load = extra["load"]
    fig = plt.figure(figsize=(10, 9))
    top = fig.add_subplot(3, 1, 1)
    middle = fig.add_subplot(3, 1, 2, sharex=top)
    bottom = fig.add_subplot(3, 1, 3)
    hours = np.arange(len(load["h100"])) / 60
    top.plot(hours, load["h100"], color="tab:blue", label="H100 GPUs asked (offered load)")
    top.plot(hours, load["l4"], color="tab:green", label="L4 GPUs asked (offered load)")
    auto = results["autoscaled"].timeline
    top.step([t / 3600 for t, *_ in auto], [h * H100.gpus for _, _, h, _, _ in auto], where="post",
             color="tab:blue", linestyle="--", label="H100 GPUs in the autoscaled fleet")
    top.step([t / 3600 for t, *_ in auto], [n * L4.gpus for _, _, _, n, _ in auto], where="post",
             color="tab:green", linestyle="--", label="L4 GPUs in the autoscaled fleet")
    for pool, colour in (("h100", "tab:blue"), ("l4", "tab:green")):
        per = H100.gpus if pool == "h100" else L4.gpus
        top.axhline(extra["peak_nodes"][pool] * per, color=colour, linestyle=":", linewidth=1)
        top.axhline(extra["mean_nodes"][pool] * per, color=colour, linestyle="-.", linewidth=1)
    top.set_ylabel("GPUs")
    top.set_title("Demand and fleet size (dotted: peak-sized fleet, dash-dot: mean-sized)")
    top.legend(fontsize="x-small", loc="upper left")
    for name, colour in (("peak", "tab:gray"), ("mean", "tab:red"), ("autoscaled", "tab:purple")):
        line = results[name].timeline
        middle.plot([t / 3600 for t, *_ in line], [q for _, q, *_ in line], label=name, color=colour)
    middle.set_ylabel("jobs queued")
    middle.set_yscale("symlog")
    middle.legend(fontsize="small")
    rows = {r["fleet"]: r for r in extra["rows"]}
    xs = np.arange(len(TIERS))
    for k, (name, colour) in enumerate((("peak", "tab:gray"), ("mean", "tab:red"), ("autoscaled", "tab:purple"))):
        bottom.bar(xs + (k - 1) * 0.27, [rows[name][f"{t}_mean_wait_s"] / 60 for t in TIERS], width=0.27,
                   color=colour, label=f"{name}: {rows[name]['gpu_hours']:.0f} GPU-h paid")
    bottom.set_xticks(xs, [f"{t} (mean wait)" for t in TIERS])
    bottom.set_ylabel("minutes")
    bottom.set_yscale("symlog")
    bottom.legend(fontsize="small")
    middle.set_xlabel("hour of the day")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def parse_seeds(text: str) -> list[int]:
    if "-" in text:
        lo, hi = text.split("-", 1)
        return list(range(int(lo), int(hi) + 1))
    return [int(s) for s in text.split(",")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--seeds", default="7", help="one seed, a list (1,2) or a range (1-5)")
    parser.add_argument("--boot-s", type=float, default=180.0, help="seconds a new node takes to become ready")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON on stdout")
    parser.add_argument("--no-write", action="store_true", help="write no results or plot files")
    args = parser.parse_args(argv)
    all_rows: list[dict[str, Any]] = []
    verdicts = []
    extra: dict[str, Any] = {}
    sizes = {}
    for seed in parse_seeds(args.seeds):
        rows, extra = run_seed(seed, args.boot_s, lambda line: print(f"  {line}", file=sys.stderr, flush=True))
        all_rows += rows
        verdicts.append({"seed": seed, **verdict(rows)})
        sizes[seed] = f"{extra['jobs']} jobs; peak-sized fleet {extra['peak_nodes']}, mean-sized {extra['mean_nodes']}"
    last_seed_rows = [r for r in all_rows if r["seed"] == verdicts[-1]["seed"]]
    payload = {"boot_s": args.boot_s, "jobs": extra["jobs"], "peak_nodes": extra["peak_nodes"],
               "mean_nodes": extra["mean_nodes"], "rows": all_rows, "verdicts": verdicts}
    text = [f"Capacity over one simulated day (boot {args.boot_s:.0f} s; GPU-hours and cost over 00:00-24:00; the "
            "plot shows the last seed)", ""]
    for seed in parse_seeds(args.seeds):
        text += [f"seed {seed} ({sizes[seed]} nodes)", "", table([r for r in all_rows if r["seed"] == seed]), ""]
    for v in verdicts:
        text.append(f"seed {v['seed']}: autoscaled mean wait {v['extra_wait_vs_peak_s']:+.1f} s against the peak "
                    f"fleet ({v['share_of_mean_fleet_gap'] * 100:.1f} % of the mean-sized fleet's extra wait; "
                    f"turnaround {v['turnaround_vs_peak']:.3f} x; within 10 % or 1 s of the peak fleet's wait: "
                    f"{'yes' if v['wait_within_10pct_or_1s_of_peak'] else 'NO'}), GPU-hours "
                    f"{v['gpu_hours_vs_peak']:.2f} x, cost {v['cost_vs_peak']:.2f} x")
    if not args.no_write:
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / "capacity.md").write_text("\n".join(text) + "\n")
        (RESULTS / "capacity.json").write_text(json.dumps(payload, indent=1) + "\n")
        extra["rows"] = last_seed_rows
        plot(extra, PLOT)
    print(json.dumps(payload, indent=1) if args.json else "\n".join(text))
    return 0


if __name__ == "__main__":
    sys.exit(main())
