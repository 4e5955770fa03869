"""`gpuctl replay`: replay a GPU-cluster trace (openb format) through the scheduler, offline.

Both modes run the scheduler the service runs, on its Harness (``gpuorch_scheduling.trace_replay``): admission, the
queue, the cycle, the plan applier and the live fleet's placement engine, with the placement policy pinned.
  arrivals (default): the FGD paper's protocol (shared/traces/openb/README.md): inflate the task list to `--tune` x
      the cluster's GPU capacity, shuffle per seed, submit one by one, nothing leaves. Reports allocated % at 100 %
      arrived, unallocated % at 130 % arrived, the fragmentation curve, failed tasks and seconds per run.
  jobs: tasks arrive at their creation time and run for their trace runtime (time-compressed) on simulated
      executors; the scheduler's queue (tiers, priorities, ageing, fair share, backfill). Reports queueing delay and
      completion time per tier.

`--json` prints exactly one JSON object on stdout; progress goes to stderr. `--placements FILE` writes one JSON line
per task in arrival order so the result can be checked independently (`--verify FILE` does that check).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Any

import typer
from gpuorch_gpuctl.errors import fail
from gpuorch_gpuctl.terminal_text import cell
from gpuorch_policy import DEFAULT_POLICY, PUBLISHED, TaskMix, build_policy, policy_names
from gpuorch_policy.jobs import jobs_from_tasks
from gpuorch_policy.openb import Task, inflate_seeded, parse_nodes, parse_tasks
from gpuorch_policy.replay import ReplayResult
from gpuorch_policy.variants import DEFAULT_VARIANT_SEED, make_variant, parse_variant, to_csv_lines
from gpuorch_policy.verify import check_placements
from gpuorch_scheduling.trace_replay import replay_jobs, replay_protocol
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

CURVE_POINTS = tuple(range(0, 131, 10))


def parse_seeds(text: str) -> list[int]:
    """'42-51' -> 42..51; '42,43' -> [42, 43]; both may be mixed ('1-3,7')."""
    seeds: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part[1:]:
            first, last = part.split("-", 1) if not part.startswith("-") else part[1:].split("-", 1)
            lo, hi = int(first), int(last)
            if hi < lo:
                raise typer.BadParameter(f"seed range {part!r} runs backwards", param_hint="--seeds")
            seeds.extend(range(lo, hi + 1))
        else:
            seeds.append(int(part))
    if not seeds:
        raise typer.BadParameter("no seeds given", param_hint="--seeds")
    return seeds


def _read_lines(path: Path, option: str) -> list[str]:
    """The lines of the file an option names; one that cannot be read is that option's usage error."""
    try:
        return path.read_text().splitlines()
    except OSError as exc:
        raise typer.BadParameter(f"cannot read {path}: {exc}", param_hint=option) from exc


def _seed_summary(result: ReplayResult, points: tuple[int, ...] = CURVE_POINTS) -> dict[str, Any]:
    return {
        "seed": result.seed,
        "allocated_pct_at_100": result.allocated_pct_at_100,
        "unallocated_pct_at_130": result.unallocated_pct_at_130,
        "failed": result.failed,
        "tasks": result.tasks,
        "seconds": round(result.seconds, 3),
        "allocated_curve": {str(k): v for k, v in result.curve(result.allocated_pct, points).items()},
        "frag_curve": {str(k): v for k, v in result.curve(result.frag_pct, points).items()},
    }


def _mean(values: list[float]) -> float:
    clean = [v for v in values if v == v]
    return round(sum(clean) / len(clean), 3) if clean else float("nan")


def _mean_summary(per_seed: list[dict[str, Any]]) -> dict[str, Any]:
    mean: dict[str, Any] = {
        key: _mean([s[key] for s in per_seed])
        for key in ("allocated_pct_at_100", "unallocated_pct_at_130", "failed", "tasks", "seconds")
    }
    mean["seconds_total"] = round(sum(s["seconds"] for s in per_seed), 3)
    for curve in ("allocated_curve", "frag_curve"):
        points = sorted({p for s in per_seed for p in s[curve]}, key=int)
        mean[curve] = {p: _mean([s[curve][p] for s in per_seed if p in s[curve]]) for p in points}
    return mean


_WORKER: dict[str, Any] = {}
"""In a ``--jobs`` worker process: the parsed trace and the policy, built once per process."""


def _load(nodes_lines: list[str], pods_lines: list[str], policy_name: str, variant: str | None,
          variant_seed: int) -> dict[str, Any]:
    nodes = parse_nodes(nodes_lines)
    tasks: list[Task] = parse_tasks(pods_lines)
    if variant:
        tasks = make_variant(tasks, nodes, variant, variant_seed)
    mix = TaskMix.from_requests(t.request for t in tasks)
    return {"nodes": nodes, "tasks": tasks, "mix": mix, "policy": build_policy(policy_name, mix).name}


def _worker_init(nodes_lines: list[str], pods_lines: list[str], policy_name: str, variant: str | None,
                 variant_seed: int) -> None:
    _WORKER.update(_load(nodes_lines, pods_lines, policy_name, variant, variant_seed))


def _replay_seed(loaded: dict[str, Any], seed: int, tune: float, record: bool,
                 on_progress: Any = None) -> ReplayResult:
    started = time.perf_counter()
    result = replay_protocol(loaded["nodes"], loaded["tasks"], loaded["policy"], seed, ratio=tune,
                             mix=loaded["mix"], record_outcomes=record, on_progress=on_progress)
    result.policy = loaded["policy"]
    result.seconds = time.perf_counter() - started
    return result


def _worker_seed(job: tuple[int, float, bool]) -> ReplayResult:
    return _replay_seed(_WORKER, *job)


def default_jobs(seeds: int) -> int:
    """Processes for ``seeds`` replays: one per CPU, at most one per seed."""
    return max(1, min(seeds, os.cpu_count() or 1))


def run_arrivals(
    nodes_lines: list[str],
    pods_lines: list[str],
    policy_name: str,
    seeds: list[int],
    tune: float,
    placements_out: Any | None = None,
    progress: Progress | None = None,
    log: Console | None = None,
    curve_points: tuple[int, ...] = CURVE_POINTS,
    variant: str | None = None,
    variant_seed: int = DEFAULT_VARIANT_SEED,
    jobs: int = 1,
) -> dict[str, Any]:
    """The arrivals protocol for every seed; returns the `--json` object. Usable from scripts (bench).
    `variant` ('multi_gpu-40', ...) replays that workload variant of the task list (gpuorch_policy.variants).
    `jobs` > 1 replays the seeds in that many processes (each seed's result is the same as in one process: a seed
    fixes its workload and its random stream); placements are written in seed order all the same."""
    loaded = _load(nodes_lines, pods_lines, policy_name, variant, variant_seed)
    policy: str = loaded["policy"]
    record = placements_out is not None
    results: dict[int, ReplayResult] = {}

    def finished(result: ReplayResult) -> None:
        results[result.seed] = result
        if log is not None:
            log.print(f"{policy} seed {result.seed}: unallocated {result.unallocated_pct_at_130:.2f} % at 130 % "
                      f"arrived, {result.seconds:.2f} s")

    if jobs > 1 and len(seeds) > 1:
        task_id = progress.add_task(f"{policy}: {len(seeds)} seeds in {jobs} processes", total=len(seeds)) \
            if progress is not None else None
        context = multiprocessing.get_context("spawn")
        with context.Pool(min(jobs, len(seeds)), initializer=_worker_init,
                          initargs=(nodes_lines, pods_lines, policy_name, variant, variant_seed)) as pool:
            for result in pool.imap_unordered(_worker_seed, [(seed, tune, record) for seed in seeds]):
                finished(result)
                if progress is not None and task_id is not None:
                    progress.advance(task_id)
    else:
        for seed in seeds:
            task_id = progress.add_task(f"{policy} seed {seed}", total=None) if progress is not None else None

            def on_progress(done: int, total: int, _task_id: Any = task_id) -> None:
                if progress is not None and _task_id is not None:
                    progress.update(_task_id, completed=done, total=total)

            finished(_replay_seed(loaded, seed, tune, record, on_progress))
    per_seed = []
    for seed in seeds:
        result = results[seed]
        if placements_out is not None:
            for outcome in result.outcomes:
                placements_out.write(json.dumps({"seed": seed, "task": outcome.task, "source": outcome.source,
                                                 "node": outcome.node, "gpus": [list(g) for g in outcome.gpus]})
                                     + "\n")
        per_seed.append(_seed_summary(result, curve_points))
    summary: dict[str, Any] = {"policy": policy, "tune": tune, "seeds": per_seed, "mean": _mean_summary(per_seed)}
    if variant:
        summary["variant"] = {"name": variant, "seed": variant_seed, "tasks": len(loaded["tasks"])}
    if policy in PUBLISHED and not variant:
        alloc, unalloc = PUBLISHED[policy]
        summary["published"] = {"allocated_pct_at_100": alloc, "unallocated_pct_at_130": unalloc}
    return summary


def _print_arrivals(console: Console, summary: dict[str, Any]) -> None:
    table = Table(title=f"{summary['policy']}: arrivals replay, tune {summary['tune']}")
    for column in ("seed", "allocated % @100 % arrived", "unallocated % @130 % arrived", "failed", "tasks", "s"):
        table.add_column(column, justify="right")
    for s in summary["seeds"]:
        table.add_row(
            str(s["seed"]), f"{s['allocated_pct_at_100']:.2f}", f"{s['unallocated_pct_at_130']:.2f}",
            str(s["failed"]), str(s["tasks"]), f"{s['seconds']:.2f}",
        )
    m = summary["mean"]
    table.add_row(
        "mean", f"{m['allocated_pct_at_100']:.2f}", f"{m['unallocated_pct_at_130']:.2f}",
        f"{m['failed']:.1f}", f"{m['tasks']:.0f}", f"{m['seconds']:.2f} (total {m['seconds_total']:.1f})",
    )
    if "published" in summary:
        p = summary["published"]
        table.add_row("published", f"{p['allocated_pct_at_100']:.2f}", f"{p['unallocated_pct_at_130']:.2f}", "", "", "")
    console.print(table)
    curve = Table(title="mean curve: allocated % and fragmented % (FGD definition) by arrived %")
    curve.add_column("arrived %", justify="right")
    curve.add_column("allocated %", justify="right")
    curve.add_column("fragmented %", justify="right")
    for point, value in m["allocated_curve"].items():
        curve.add_row(str(point), f"{value:.2f}", f"{m['frag_curve'].get(point, float('nan')):.2f}")
    console.print(curve)


def run_jobs(
    nodes_lines: list[str],
    pods_lines: list[str],
    policy_name: str,
    compression: float,
    load: float,
    tune: float = 0.0,
    seed: int = 42,
) -> dict[str, Any]:
    """The job-level replay through the scheduler; `tune` > 0 first inflates the task list like the arrivals
    protocol (copies keep their source's times), so that demand can exceed the fleet."""
    nodes = parse_nodes(nodes_lines)
    tasks = parse_tasks(pods_lines)
    mix = TaskMix.from_requests(t.request for t in tasks)
    policy = build_policy(policy_name, mix).name
    if tune > 0:
        capacity = sum(len(n.gpus) for n in nodes) * 1000
        tasks = inflate_seeded(tasks, capacity, tune, seed)
    jobs = jobs_from_tasks(tasks, compression=compression, load=load)
    started = time.perf_counter()
    record = asdict(replay_jobs(nodes, jobs, policy, mix, seed))
    record["seconds"] = round(time.perf_counter() - started, 3)
    return {
        "mode": "jobs", "policy": policy, "compression": compression, "load": load, "tune": tune, "seed": seed,
        "jobs": len(jobs), "runs": [record],
    }


def _print_jobs(console: Console, summary: dict[str, Any]) -> None:
    table = Table(
        title=f"jobs replay ({summary['jobs']} jobs, tune {summary['tune']}, seed {summary['seed']}), placement "
        f"{summary['policy']}, compression {summary['compression']}, load {summary['load']}"
    )
    for column in ("tier", "jobs", "started", "wait mean", "wait p95", "completion mean", "completion p95"):
        table.add_column(column, justify="right")
    for run in summary["runs"]:
        for tier, s in run["tiers"].items():
            table.add_row(
                cell(tier), str(s["jobs"]), str(s["started"]), f"{s['queueing_mean']:.1f}",
                f"{s['queueing_p95']:.1f}", f"{s['completion_mean']:.1f}", f"{s['completion_p95']:.1f}",
            )
    console.print(table)


def replay(
    nodes: Annotated[Path, typer.Option("--nodes", help="node list CSV (sn, cpu_milli, memory_mib, gpu, model)")],
    pods: Annotated[Path, typer.Option("--pods", help="task list CSV (name, cpu_milli, memory_mib, num_gpu, gpu_milli, ...)")],
    policy: Annotated[
        str, typer.Option("--policy", help=f"placement policy: {', '.join(policy_names())}")
    ] = DEFAULT_POLICY,
    seeds: Annotated[str, typer.Option("--seeds", help="seeds, e.g. 42-51 or 42,43")] = "42-51",
    tune: Annotated[float, typer.Option("--tune", help="inflate the task list to this x GPU capacity")] = 1.3,
    json_output: Annotated[bool, typer.Option("--json", help="print one JSON object on stdout")] = False,
    placements: Annotated[
        Path | None, typer.Option("--placements", help="write one JSON line per task (arrival order) to FILE")
    ] = None,
    mode: Annotated[str, typer.Option("--mode", help="arrivals (paper protocol) or jobs (the scheduler's queue, jobs "
                                                     "leave)")] = "arrivals",
    compression: Annotated[float, typer.Option("--compression", help="jobs mode: divide trace times by this")] = 1.0,
    load: Annotated[
        float, typer.Option("--load", help="jobs mode: pack arrivals this much closer (the openb trace needs ~1e4+)")
    ] = 1.0,
    verify: Annotated[
        Path | None, typer.Option("--verify", help="check a --placements FILE against capacities instead of replaying")
    ] = None,
    variant: Annotated[
        str | None,
        typer.Option(
            "--variant",
            help="replay a workload variant of --pods, e.g. multi_gpu-40, gpu_share-60, gpu_spec-25, cpu_only-200 "
            "(FGD paper families; with --verify, check placements of that variant)",
        ),
    ] = None,
    variant_seed: Annotated[
        int, typer.Option("--variant-seed", help="seed of the variant generator")
    ] = DEFAULT_VARIANT_SEED,
    write_variant: Annotated[
        Path | None, typer.Option("--write-variant", help="with --variant: write the variant's task list CSV and exit")
    ] = None,
    jobs: Annotated[
        int | None, typer.Option("--jobs", help="arrivals: replay the seeds in this many processes (default: one per "
                                               "CPU, at most one per seed; the results do not depend on it)", min=1)
    ] = None,
) -> None:
    """Replay a trace through the scheduler on its Harness (FGD paper protocol, or a job-level replay)."""
    console = Console(emoji=False)
    err = Console(stderr=True, emoji=False)
    nodes_lines, pods_lines = _read_lines(nodes, "--nodes"), _read_lines(pods, "--pods")
    if policy.lower() not in {p.lower() for p in policy_names()}:
        raise typer.BadParameter(f"unknown policy {policy!r}; known: {', '.join(policy_names())}",
                                 param_hint="--policy")
    if variant:
        try:
            parse_variant(variant)
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="--variant") from exc
        if write_variant is not None:
            lines = to_csv_lines(make_variant(parse_tasks(pods_lines), parse_nodes(nodes_lines), variant, variant_seed))
            write_variant.write_text("\n".join(lines) + "\n")
            err.print(f"{len(lines) - 1} tasks of {variant} (seed {variant_seed}) written to {write_variant}")
            return
    if verify is not None:
        records = [json.loads(line) for line in _read_lines(verify, "--verify") if line.strip()]
        tasks = parse_tasks(pods_lines)
        if variant:
            tasks = make_variant(tasks, parse_nodes(nodes_lines), variant, variant_seed)
        requests = {t.name: t.request for t in tasks}
        problems = check_placements(parse_nodes(nodes_lines), requests, records)
        report = {"records": len(records), "violations": len(problems), "first": problems[:20]}
        if json_output:
            print(json.dumps(report))
        else:
            console.print(f"{len(records)} placement records, {len(problems)} capacity violations")
            for line in problems[:20]:
                console.print(f"  {line}")
        if problems:
            fail(f"{len(problems)} capacity violations in {len(records)} placement records")
        return
    if mode == "jobs":
        with err.status("replaying jobs through the scheduler ..."):
            summary = run_jobs(nodes_lines, pods_lines, policy, compression, load, tune, parse_seeds(seeds)[0])
        if json_output:
            print(json.dumps(summary))
        else:
            _print_jobs(console, summary)
        return
    if mode != "arrivals":
        raise typer.BadParameter(f"unknown mode {mode!r}: arrivals or jobs", param_hint="--mode")
    seed_list = parse_seeds(seeds)
    out = placements.open("w") if placements is not None else None
    try:
        with Progress(
            TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            console=err, transient=True, disable=not err.is_terminal,
        ) as progress:
            summary = run_arrivals(
                nodes_lines, pods_lines, policy, seed_list, tune, out, progress,
                log=None if err.is_terminal else err, variant=variant, variant_seed=variant_seed,
                jobs=jobs if jobs is not None else default_jobs(len(seed_list)),
            )
    finally:
        if out is not None:
            out.close()
    if json_output:
        print(json.dumps(summary))
    else:
        _print_arrivals(console, summary)
