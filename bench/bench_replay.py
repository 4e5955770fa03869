"""Every placement policy through the FGD paper's openb protocol, 10 seeds each, plus placement cost vs fleet size.

    uv run python bench/bench_replay.py                       # all policies, seeds 42-51 (a few minutes on 2 cores)
    uv run python bench/bench_replay.py --policies gpuorch,FGD --seeds 42-43 --no-scale

Writes bench/results/replay.md (printed too), bench/results/replay.json (all numbers, per seed) and the plot
docs/img/replay_allocation.png (allocated % against arrived %, mean of the seeds, every policy). The replays are
the same code as `gpuctl replay` (gpuorch_gpuctl.replay_cmd.run_arrivals), timed per run with time.perf_counter.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from gpuorch_gpuctl.replay_cmd import parse_seeds, run_arrivals
from gpuorch_policy import PUBLISHED, Cluster, IncrementalPlacer, Placement, TaskMix, build_policy, policy_names
from gpuorch_policy.model import NodeView
from gpuorch_policy.openb import parse_nodes, parse_tasks, protocol_workload

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
PLOT = ROOT / "docs" / "img" / "replay_allocation.png"


def trace_dir() -> Path:
    for candidate in (
        Path(os.environ.get("GPUORCH_OPENB_DIR", "")),
        ROOT / "shared" / "traces" / "openb",
        ROOT.parent / "shared" / "traces" / "openb",
    ):
        if candidate.is_dir() and (candidate / "openb_node_list_gpu_node.csv").is_file():
            return candidate
    sys.exit("openb trace not found: set GPUORCH_OPENB_DIR")


def machine() -> str:
    cores = os.cpu_count()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return f"{platform.processor() or platform.machine()}, {cores} cores, load avg {load:.2f} at start, Python {platform.python_version()}"


def scale_nodes(nodes: list[NodeView], factor: int) -> list[NodeView]:
    out = []
    for k in range(factor):
        for n in nodes:
            out.append(NodeView(f"{n.node_id}-x{k}", n.cpu_milli_total, n.memory_mib_total, n.gpus))
    return out


def placement_cost(nodes: list[NodeView], tasks, policy_name: str, factor: int, count: int) -> float:
    """Microseconds per placement decision (IncrementalPlacer) over the first `count` tasks of seed 42, with the
    fleet replicated `factor` times and the workload scaled with it."""
    fleet = scale_nodes(nodes, factor)
    mix = TaskMix.from_requests(t.request for t in tasks)
    cluster = Cluster(fleet)
    workload = protocol_workload(tasks, cluster.gpu_capacity_milli, 1.3, 42)[: count * factor]
    placer = IncrementalPlacer(cluster, build_policy(policy_name, mix), rng=np.random.default_rng(0))
    started = time.perf_counter()
    for task in workload:
        decision = placer.place(task.request, explain=False)
        if isinstance(decision, Placement):
            cluster.assign(task.request, decision)
    return (time.perf_counter() - started) / len(workload) * 1e6


def plot(summaries: dict[str, dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, summary in summaries.items():
        curve = summary["mean"]["allocated_curve"]
        xs = [int(k) for k in curve]
        ys = [curve[k] for k in curve]
        style = {"linewidth": 2.4} if name == "gpuorch" else {"linewidth": 1.2}
        for ax in axes:
            ax.plot(xs, ys, label=name, **style)
    axes[0].plot([0, 100], [0, 100], color="grey", linestyle=":", linewidth=0.8)
    axes[0].set_title("GPU allocated % vs arrived % (openb default, mean of seeds)")
    axes[1].set_xlim(90, 130)
    axes[1].set_ylim(82, 97)
    axes[1].set_title("zoom: 90-130 % arrived")
    for ax in axes:
        ax.set_xlabel("arrived GPU request, % of capacity")
        ax.set_ylabel("allocated GPU, % of capacity")
        ax.grid(alpha=0.3)
    axes[1].legend(loc="lower right")
    fig.tight_layout()
    PLOT.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(PLOT, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policies", default=",".join(policy_names()))
    parser.add_argument("--seeds", default="42-51")
    parser.add_argument("--tune", type=float, default=1.3)
    parser.add_argument("--no-scale", action="store_true", help="skip the placement-cost-vs-fleet-size table")
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args()
    source = trace_dir()
    nodes_lines = (source / "openb_node_list_gpu_node.csv").read_text().splitlines()
    pods_lines = (source / "openb_pod_list_default.csv").read_text().splitlines()
    seeds = parse_seeds(args.seeds)
    where = machine()
    summaries: dict[str, dict] = {}
    for name in args.policies.split(","):
        started = time.perf_counter()
        summary = run_arrivals(nodes_lines, pods_lines, name, seeds, args.tune, curve_points=tuple(range(0, 131)))
        summary["wall_seconds"] = round(time.perf_counter() - started, 2)
        summaries[summary["policy"]] = summary
        print(
            f"{summary['policy']:>14}: unallocated @130 {summary['mean']['unallocated_pct_at_130']:.2f} %, "
            f"{summary['wall_seconds']:.1f} s",
            file=sys.stderr,
            flush=True,
        )

    lines = [
        "# Placement policies on the openb trace (FGD paper protocol)",
        "",
        f"Command: `uv run python bench/bench_replay.py --seeds {args.seeds} --tune {args.tune}`  ",
        f"Machine: {where}  ",
        f"Trace: {source}/openb_node_list_gpu_node.csv, openb_pod_list_default.csv",
        "",
        "| policy | allocated % @100 % arrived (mean ± sd) | unallocated % @130 % arrived (mean ± sd) | min-max "
        "| published (alloc / unalloc) | diff vs published (unalloc) | failed tasks (mean) | seconds, all seeds |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, s in summaries.items():
        allocs = [x["allocated_pct_at_100"] for x in s["seeds"]]
        unallocs = [x["unallocated_pct_at_130"] for x in s["seeds"]]
        sd_a = statistics.pstdev(allocs) if len(allocs) > 1 else 0.0
        sd_u = statistics.pstdev(unallocs) if len(unallocs) > 1 else 0.0
        pub = PUBLISHED.get(name)
        pub_text = f"{pub[0]:.2f} / {pub[1]:.2f}" if pub else "-"
        diff = f"{s['mean']['unallocated_pct_at_130'] - pub[1]:+.2f}" if pub else "-"
        lines.append(
            f"| {name} | {s['mean']['allocated_pct_at_100']:.2f} ± {sd_a:.2f} | "
            f"{s['mean']['unallocated_pct_at_130']:.2f} ± {sd_u:.2f} | {min(unallocs):.2f}-{max(unallocs):.2f} | "
            f"{pub_text} | {diff} | {s['mean']['failed']:.0f} | {s['mean']['seconds_total']:.1f} |"
        )
    lines += ["", "Unallocated GPU % at 130 % arrived, per seed:", ""]
    lines.append("| policy | " + " | ".join(str(s) for s in seeds) + " |")
    lines.append("|---|" + "---|" * len(seeds))
    for name, s in summaries.items():
        lines.append(f"| {name} | " + " | ".join(f"{x['unallocated_pct_at_130']:.2f}" for x in s["seeds"]) + " |")
    lines += ["", "Fragmented GPU % of capacity (FGD definition, against the task mix) by arrived %:", ""]
    points = [str(p) for p in range(10, 131, 10)]
    lines.append("| policy | " + " | ".join(points) + " |")
    lines.append("|---|" + "---|" * len(points))
    for name, s in summaries.items():
        frag = s["mean"]["frag_curve"]
        lines.append(f"| {name} | " + " | ".join(f"{frag.get(p, float('nan')):.2f}" for p in points) + " |")

    if not args.no_scale:
        nodes = parse_nodes(nodes_lines)
        tasks = parse_tasks(pods_lines)
        lines += [
            "",
            "Cost of one placement as the fleet grows (openb fleet replicated k times, first 3,000 x k tasks of "
            "seed 42, IncrementalPlacer, microseconds per decision):",
            "",
            "| policy | " + " | ".join(f"{1213 * k} nodes" for k in (1, 2, 4, 8)) + " |",
            "|---|---|---|---|---|",
        ]
        for name in ("gpuorch", "FGD"):
            costs = [placement_cost(nodes, tasks, name, k, 3000) for k in (1, 2, 4, 8)]
            lines.append(f"| {name} | " + " | ".join(f"{c:.0f}" for c in costs) + " |")

    text = "\n".join(lines) + "\n"
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "replay.md").write_text(text)
    (RESULTS / "replay.json").write_text(json.dumps({"machine": where, "policies": summaries}, indent=1))
    if not args.no_plot:
        plot(summaries)
    print(text)


if __name__ == "__main__":
    main()
