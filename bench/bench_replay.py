"""Every placement policy through the FGD paper's openb protocol, 10 seeds each, plus placement cost vs fleet size.

    uv run python bench/bench_replay.py                       # all policies, seeds 42-51 (a few minutes on 2 cores)
    uv run python bench/bench_replay.py --policies gpuorch,FGD --seeds 42-43 --no-scale
    uv run python bench/bench_replay.py --variants all --jobs 2  # FGD, BestFit, gpuorch on every workload variant

`--variants` (all, tuned, held-out or a comma list such as multi_gpu-40,gpu_share-60) replays the workload variants
of gpuorch_policy.variants (FGD paper families, generator seed --variant-seed) instead, and writes
bench/results/replay_variants.md and .json and the plot docs/img/replay_variants.png.

Writes bench/results/replay.md (printed too), bench/results/replay.json (all numbers, per seed) and the plot
docs/img/replay_allocation.png (allocated % against arrived %, mean of the seeds, every policy). The replays are
the same code as `gpuctl replay` (gpuorch_gpuctl_ops.replay_cmd.run_arrivals), timed per run with time.perf_counter.
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
from gpuorch_gpuctl_ops.replay_cmd import parse_seeds, run_arrivals
from gpuorch_policy import PUBLISHED, Cluster, Placement, TaskMix, build_policy, policy_names
from gpuorch_policy.index import PlacementIndex
from gpuorch_policy.model import NodeView
from gpuorch_policy.openb import parse_nodes, parse_tasks, protocol_workload
from gpuorch_policy.variants import DEFAULT_VARIANT_SEED, FAMILIES, HELD_OUT, TUNED, make_variant, variant_names
from gpuorch_scheduling.trace_replay import replay_protocol

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
PLOT = ROOT / "docs" / "img" / "replay_allocation.png"
VARIANT_PLOT = ROOT / "docs" / "img" / "replay_variants.png"
VARIANT_POLICIES = ("FGD", "BestFit", "gpuorch")


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
    """Microseconds per placement decision (the live fleet's engine: the placement index) over the first `count`
    tasks of seed 42, with the fleet replicated `factor` times and the workload scaled with it."""
    fleet = scale_nodes(nodes, factor)
    mix = TaskMix.from_requests(t.request for t in tasks)
    cluster = Cluster(fleet)
    workload = protocol_workload(tasks, cluster.gpu_capacity_milli, 1.3, 42)[: count * factor]
    placer = PlacementIndex(cluster, build_policy(policy_name, mix), rng=np.random.default_rng(0))
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


def _variant_run(job: tuple[str, str, str, list[int], float, int]) -> tuple[str, str, list[float], float]:
    """One (variant, policy) over the seeds: unallocated % at 130 % arrived per seed, and seconds."""
    source, variant, policy_name, seeds, tune, variant_seed = job
    directory = Path(source)
    nodes = parse_nodes((directory / "openb_node_list_gpu_node.csv").read_text().splitlines())
    tasks = parse_tasks((directory / "openb_pod_list_default.csv").read_text().splitlines())
    if variant != "default":
        tasks = make_variant(tasks, nodes, variant, variant_seed)
    mix = TaskMix.from_requests(t.request for t in tasks)
    started = time.perf_counter()
    values = [replay_protocol(nodes, tasks, policy_name, seed, ratio=tune, mix=mix).unallocated_pct_at_130
              for seed in seeds]
    return variant, policy_name, values, time.perf_counter() - started


def _geomean(values: list[float]) -> float:
    return float(np.exp(np.mean(np.log(values)))) if values else float("nan")


def run_variants(args: argparse.Namespace, source: Path) -> None:
    if args.variants in ("all", "tuned", "held-out"):
        levels = {"all": FAMILIES, "tuned": TUNED, "held-out": HELD_OUT}[args.variants]
        names = ["default", *variant_names(levels)]
    else:
        names = args.variants.split(",")
    seeds = parse_seeds(args.seeds)
    where = machine()
    jobs = [(str(source), v, p, seeds, args.tune, args.variant_seed) for v in names for p in VARIANT_POLICIES]
    results: dict[str, dict[str, list[float]]] = {v: {} for v in names}
    seconds: dict[str, dict[str, float]] = {v: {} for v in names}
    started = time.perf_counter()
    if args.jobs > 1:
        import multiprocessing

        with multiprocessing.get_context("spawn").Pool(args.jobs) as pool:
            outcomes = pool.imap_unordered(_variant_run, jobs)
            for variant, policy_name, values, secs in outcomes:
                results[variant][policy_name], seconds[variant][policy_name] = values, secs
                print(f"{variant:>14} {policy_name:>8}: {statistics.mean(values):.2f} ({secs:.0f} s)", file=sys.stderr)
    else:
        for job in jobs:
            variant, policy_name, values, secs = _variant_run(job)
            results[variant][policy_name], seconds[variant][policy_name] = values, secs
            print(f"{variant:>14} {policy_name:>8}: {statistics.mean(values):.2f} ({secs:.0f} s)", file=sys.stderr)
    wall = time.perf_counter() - started

    def mean(v: str, p: str) -> float:
        return statistics.mean(results[v][p])

    lines = [
        "# gpuorch, FGD and BestFit on workload variants of the openb trace",
        "",
        f"Command: `uv run python bench/bench_replay.py --variants {args.variants} --seeds {args.seeds} "
        f"--variant-seed {args.variant_seed} --jobs {args.jobs} --out-name {args.out_name}`  ",
        f"Machine: {where}; {wall:.0f} s wall in all  ",
        "Variants: gpuorch_policy.variants (FGD paper families); held-out levels were never used for tuning.",
        "Unallocated GPU % at 130 % arrived, mean over the seeds (lower is better); ratio = gpuorch / FGD.",
        "",
        "| variant | set | FGD | BestFit | gpuorch | gpuorch / FGD | gpuorch wins on seeds |",
        "|---|---|---|---|---|---|---|",
    ]
    for v in names:
        family = v.rpartition("-")[0]
        kind = "-" if v == "default" else ("tuned" if int(v.rpartition("-")[2]) in TUNED.get(family, ()) else "held-out")
        wins = sum(g <= f for g, f in zip(results[v]["gpuorch"], results[v]["FGD"], strict=True))
        lines.append(
            f"| {v} | {kind} | {mean(v, 'FGD'):.2f} | {mean(v, 'BestFit'):.2f} | **{mean(v, 'gpuorch'):.2f}** | "
            f"{mean(v, 'gpuorch') / mean(v, 'FGD'):.3f} | {wins}/{len(seeds)} |"
        )
    lines += ["", "Per family (geometric mean of gpuorch / FGD over the family's levels):", ""]
    lines += ["| family | tuned levels | held-out levels | all levels |", "|---|---|---|---|"]
    family_ratios = []
    for family in FAMILIES:
        row = []
        for levels in (TUNED[family], HELD_OUT[family], FAMILIES[family]):
            ratios = [mean(f"{family}-{x}", "gpuorch") / mean(f"{family}-{x}", "FGD") for x in levels
                      if f"{family}-{x}" in results]
            row.append(f"{_geomean(ratios):.3f}" if ratios else "-")
            if levels is FAMILIES[family] and ratios:
                family_ratios.append(_geomean(ratios))
        lines.append(f"| {family} | " + " | ".join(row) + " |")
    lines += ["", f"Geometric mean over the families: **{_geomean(family_ratios):.3f}**", ""]
    lines += ["Per seed (gpuorch / FGD / BestFit):", "", "| variant | " + " | ".join(map(str, seeds)) + " |"]
    lines.append("|---|" + "---|" * len(seeds))
    for v in names:
        cells = [
            f"{g:.2f} / {f:.2f} / {b:.2f}"
            for g, f, b in zip(results[v]["gpuorch"], results[v]["FGD"], results[v]["BestFit"], strict=True)
        ]
        lines.append(f"| {v} | " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.out_name}.md").write_text(text)
    (RESULTS / f"{args.out_name}.json").write_text(
        json.dumps({"machine": where, "seeds": seeds, "variant_seed": args.variant_seed, "unallocated_pct_at_130":
                    results, "seconds": seconds}, indent=1)
    )
    if not args.no_plot:
        plot_variants(names, results, ROOT / "docs" / "img" / f"{args.out_name}.png")
    print(text)


def plot_variants(names: list[str], results: dict[str, dict[str, list[float]]], path: Path = VARIANT_PLOT) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    families = [f for f in FAMILIES if any(v.startswith(f + "-") for v in names)]
    fig, axes = plt.subplots(1, max(len(families), 1), figsize=(4.2 * max(len(families), 1), 4), squeeze=False)
    for ax, family in zip(axes[0], families, strict=False):
        levels = [int(v.rpartition("-")[2]) for v in names if v.rpartition("-")[0] == family]
        for policy_name in VARIANT_POLICIES:
            ys = [statistics.mean(results[f"{family}-{x}"][policy_name]) for x in levels]
            ax.plot(levels, ys, marker="o", label=policy_name, linewidth=2.4 if policy_name == "gpuorch" else 1.2)
        for x in levels:
            if x in HELD_OUT[family]:
                ax.axvline(x, color="grey", linestyle=":", linewidth=0.8)
        ax.set_title(f"{family} (dotted: held-out)")
        ax.set_xlabel("level, %")
        ax.set_ylabel("unallocated GPU % @130 % arrived")
        ax.grid(alpha=0.3)
    axes[0][0].legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policies", default=",".join(policy_names()))
    parser.add_argument("--seeds", default="42-51")
    parser.add_argument("--tune", type=float, default=1.3)
    parser.add_argument("--no-scale", action="store_true", help="skip the placement-cost-vs-fleet-size table")
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--variants", default="", help="all, tuned, held-out or a comma list (FGD, BestFit, gpuorch)")
    parser.add_argument("--variant-seed", type=int, default=DEFAULT_VARIANT_SEED)
    parser.add_argument("--jobs", type=int, default=1, help="--variants: replays run in this many processes")
    parser.add_argument(
        "--out-name", default="replay_variants", help="--variants: bench/results/NAME.md/.json, docs/img/NAME.png"
    )
    args = parser.parse_args()
    source = trace_dir()
    if args.variants:
        run_variants(args, source)
        return
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
            "seed 42, the placement index, microseconds per decision):",
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
