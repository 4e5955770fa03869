"""MIG layouts over a simulated day: static layouts (whole GPUs, all 1g.10gb, a fixed mix) against the MIG planner.

    uv run python bench/bench_mig.py                 # seeds 1-3, 4 x 8 H100; a few minutes per seed and layout
    uv run python bench/bench_mig.py --seeds 1-9 --processes 2  # layouts and seeds in 2 processes
    uv run python bench/bench_mig.py --seeds 10-19 --no-write   # the held-out seeds
    uv run python bench/bench_mig.py --mig-only      # small jobs only on MIG instances (files *_mig_only)
    uv run python bench/bench_mig.py --json          # the figures as JSON on stdout
    uv run python bench/bench_mig.py --seeds 1-5 --training-scale 0.7

The simulation is ``gpuorch_capacity.mig_simulation``: every layout's day played through the scheduler the service
runs (``gpuorch_scheduling.Harness``), a scheduling step at every event and every tick (``--tick-s``, the service's
GPUORCH_TICK_S, 1 s). ``gpuctl bench mig`` runs one seed of it; this script adds several seeds and the files:
bench/results/mig.md, bench/results/mig.json and the plot docs/img/mig.png (the first seed over time).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
from gpuorch_capacity.mig_simulation import (
    DAY_S,
    PLANNER_VARIANTS,
    TIERS,
    LayoutResult,
    bench_json,
    mig_workload,
    simulate_layout,
)
from gpuorch_gpuctl_ops.replay_cmd import parse_seeds

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
PLOT = ROOT / "docs" / "img" / "mig.png"
LAYOUTS = ("whole", "all_1g.10gb", "fixed_mix", "planner", "planner_training_first")
COLOURS = {"whole": "tab:gray", "all_1g.10gb": "tab:orange", "fixed_mix": "tab:green", "planner": "tab:purple",
           "planner_training_first": "tab:pink"}


def plot(results: dict[str, LayoutResult], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(10, 10))
    top = fig.add_subplot(4, 1, 1)
    queued = fig.add_subplot(4, 1, 2, sharex=top)
    sliced = fig.add_subplot(4, 1, 3, sharex=top)
    bars = fig.add_subplot(4, 1, 4)
    for name in LAYOUTS:
        series = results[name].series
        hours = [s[0] for s in series]
        top.plot(hours, [s[1] for s in series], color=COLOURS[name], label=name)
        if name in ("whole", "fixed_mix", "planner", "planner_training_first"):
            queued.plot(hours, [s[3] for s in series], color=COLOURS[name], label=f"{name}: MIG jobs")
            queued.plot(hours, [s[4] for s in series], color=COLOURS[name], linestyle="--",
                        label=f"{name}: training jobs")
    for name in ("planner", "planner_training_first"):
        series = results[name].series
        sliced.step([s[0] for s in series], [s[2] for s in series], where="post", color=COLOURS[name],
                    label=f"{name}: GPUs in MIG mode")
    sliced.axhline(results["fixed_mix"].series[0][2], color=COLOURS["fixed_mix"], linestyle=":",
                   label="fixed mix: GPUs in MIG mode")
    top.set_ylabel("GPU allocation %")
    top.set_title(title)
    top.legend(fontsize="x-small", loc="lower right")
    queued.set_ylabel("jobs queued")
    queued.set_yscale("symlog")
    queued.set_ylim(bottom=0)
    queued.legend(fontsize="x-small", loc="upper left", ncol=3)
    sliced.set_ylabel("MIG GPUs")
    sliced.set_xlabel("hour of the day (samples every 15 min)")
    sliced.legend(fontsize="x-small", loc="upper left")
    xs = np.arange(len(TIERS))
    for k, name in enumerate(LAYOUTS):
        bars.bar(xs + (k - 2) * 0.16, [max(results[name].waits[t], 0.1) / 60 for t in TIERS], width=0.16,
                 color=COLOURS[name], label=f"{name}: {results[name].completed} jobs completed")
    bars.set_xticks(xs, [f"{t} (mean wait)" for t in TIERS])
    bars.set_ylabel("minutes")
    bars.set_yscale("log")
    bars.legend(fontsize="x-small")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)


def verdict(document: dict[str, Any], name: str = "planner") -> str:
    """The issue's three targets for one seed and the planner run ``name``: met or not, against which layout."""
    rows = document["layouts"]
    static = [n for n in rows if n not in PLANNER_VARIANTS]
    planner = rows[name]
    best_done = max(static, key=lambda n: rows[n]["completed_jobs"])
    best_inf = min(static, key=lambda n: rows[n]["mean_wait_s"]["inference"])
    checks = [
        ("completed jobs ahead of every static layout", planner["completed_jobs"] > rows[best_done]["completed_jobs"],
         f"{planner['completed_jobs']} vs {best_done} {rows[best_done]['completed_jobs']}"),
        ("inference wait at or below every static layout (to 0.1 s)",
         round(planner["mean_wait_s"]["inference"], 1) <= round(rows[best_inf]["mean_wait_s"]["inference"], 1),
         f"{planner['mean_wait_s']['inference']:.1f} s vs {best_inf} {rows[best_inf]['mean_wait_s']['inference']:.1f} s"),
        ("training wait no worse than whole GPUs",
         planner["mean_wait_s"]["training"] <= rows["whole"]["mean_wait_s"]["training"],
         f"{planner['mean_wait_s']['training']:.0f} s vs {rows['whole']['mean_wait_s']['training']:.0f} s"),
    ]
    return f"targets ({name}): " + "; ".join(f"{what}: {'met' if ok else 'NOT met'} ({figures})" for what, ok, figures in checks)


def met(document: dict[str, Any], name: str = "planner") -> tuple[bool, bool, bool]:
    """The three targets of ``verdict`` as booleans."""
    text = verdict(document, name)
    return tuple("NOT met" not in part for part in text.split(": ", 1)[1].split("; "))  # type: ignore[return-value]


def summary(documents: list[dict[str, Any]]) -> str:
    """Means over the seeds per layout, and on how many seeds the planner met each target."""
    names = list(documents[0]["layouts"])
    lines = [f"mean over {len(documents)} seed(s) ({', '.join(str(d['seed']) for d in documents)}):", "",
             "| layout | completed jobs | GPU allocation % | mean wait inference s | training s | batch s | "
             "reconfigurations |", "|---|---|---|---|---|---|---|"]
    for name in names:
        rows = [d["layouts"][name] for d in documents]
        done, alloc, reconf = (float(np.mean([r[k] for r in rows]))
                               for k in ("completed_jobs", "gpu_allocation_pct", "reconfigurations"))
        inf, train, batch = (float(np.mean([r["mean_wait_s"][t] for r in rows]))
                             for t in ("inference", "training", "batch"))
        lines.append(f"| {name} | {done:.1f} | {alloc:.1f} | {inf:.1f} | {train:.0f} | {batch:.0f} | {reconf:.0f} |")
    lines.append("")
    for name in (n for n in PLANNER_VARIANTS if n in names):
        counts = np.sum([met(d, name) for d in documents], axis=0)
        lines.append(f"{name}: completed jobs ahead on {counts[0]}/{len(documents)} seeds, inference wait at or below "
                     f"on {counts[1]}/{len(documents)}, training wait no worse than whole GPUs on "
                     f"{counts[2]}/{len(documents)}")
    return "\n".join(lines)


def table(document: dict[str, Any]) -> str:
    lines = ["| layout | completed jobs | GPU allocation % | mean wait inference s | training s | batch s | "
             "never started (inf/train/batch) | reconfigurations |", "|---|---|---|---|---|---|---|---|"]
    for name, row in document["layouts"].items():
        wait, never = row["mean_wait_s"], row["unstarted_jobs"]
        lines.append(f"| {name} | {row['completed_jobs']} | {row['gpu_allocation_pct']:.1f} | "
                     f"{wait['inference']:.0f} | {wait['training']:.0f} | {wait['batch']:.0f} | "
                     f"{never['inference']}/{never['training']}/{never['batch']} | {row['reconfigurations']} |")
    r = document["reconfiguration_s"]
    lines.append("")
    lines += [verdict(document, name) for name in PLANNER_VARIANTS if name in document["layouts"]]
    lines.append(f"\nplanner reconfiguration end to end (drain + apply): {r['count']} times, median {r['median']} s, "
                 f"p95 {r['p95']} s, max {r['max']} s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--seeds", default="1-3", help="one seed, a list (1,2) or a range (1-5)")
    parser.add_argument("--nodes", type=int, default=4, help="8-GPU H100 nodes")
    parser.add_argument("--training-scale", type=float, default=1.0, help="training arrival rate x this")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON on stdout")
    parser.add_argument("--mig-only", action="store_true",
                        help="small jobs ask for MIG profiles on every layout (default: on the unpartitioned layout "
                             "they ask for one whole GPU, as on a fleet without MIG)")
    parser.add_argument("--no-write", action="store_true", help="write no results or plot files")
    parser.add_argument("--tick-s", type=float, default=1.0, help="the scheduler's tick (GPUORCH_TICK_S)")
    parser.add_argument("--hours", type=float, default=DAY_S / 3600, help="play only the first hours of the day")
    parser.add_argument("--processes", type=int, default=1, help="layouts and seeds played in this many processes")
    args = parser.parse_args(argv)
    documents, text = [], []
    small_on_whole = not args.mig_only
    suffix = "" if small_on_whole else "_mig_only"
    seeds = parse_seeds(args.seeds)
    work = [(seed, name, args) for seed in seeds for name in LAYOUTS]
    began = time.monotonic()
    with ProcessPoolExecutor(max(1, args.processes)) as pool:
        played = dict(zip([(seed, name) for seed, name, _ in work], pool.map(_play, work), strict=True))
    print(f"played {len(work)} layout days in {time.monotonic() - began:.0f} s", file=sys.stderr)
    for i, seed in enumerate(seeds):
        jobs = [j for j in mig_workload(seed, args.training_scale) if j.arrival < args.hours * 3600]
        results = {name: played[(seed, name)] for name in LAYOUTS}
        document = {**bench_json(results, seed, args.nodes, small_on_whole, args.hours * 3600),
                    "training_scale": args.training_scale, "tick_s": args.tick_s, "jobs": len(jobs)}
        documents.append(document)
        rule = (", small jobs ask for a whole GPU on the unpartitioned layout" if small_on_whole
                else ", small jobs ask for MIG profiles on every layout")
        text += [f"seed {seed}: {len(jobs)} jobs on {document['fleet']}, {args.hours:g} h (training scale "
                 f"{args.training_scale}{rule}; the service's scheduler on the Harness, tick {args.tick_s:g} s)", "",
                 table(document), ""]
        if i == 0 and not args.no_write:
            plot(results, PLOT.with_name(f"mig{suffix}.png"),
                 f"seed {seed}, {document['fleet']}, training scale {args.training_scale}{rule}")
    text += ["", summary(documents)]
    if not args.no_write:
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / f"mig{suffix}.md").write_text("\n".join(text) + "\n")
        (RESULTS / f"mig{suffix}.json").write_text(json.dumps(documents, indent=1) + "\n")
    print(json.dumps(documents, indent=1) if args.json else "\n".join(text))
    return 0


def _play(item: tuple[int, str, argparse.Namespace]) -> LayoutResult:
    """One layout's day (in a worker process)."""
    seed, name, args = item
    began = time.monotonic()
    result = simulate_layout(name, mig_workload(seed, args.training_scale), args.nodes,
                             small_on_whole=not args.mig_only, tick_s=args.tick_s, day_s=args.hours * 3600)
    print(f"seed {seed} {name}: {time.monotonic() - began:.0f} s", file=sys.stderr, flush=True)
    return result


if __name__ == "__main__":
    sys.exit(main())
