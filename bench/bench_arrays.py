"""A 10,000-task array against 10,000 single jobs (issue 26): what submitting costs, what the scheduler holds, how
fast it places them. Everything runs the real Scheduler (fold, cycle, plan applier) in process, through the Harness.

    uv run python bench/bench_arrays.py                     # 10,000 tasks, 100 nodes x 8 GPUs, 3 runs each
    uv run python bench/bench_arrays.py --tasks 2000 --runs 1

Each measurement runs in a fresh subprocess (so RSS is its own):
The default admission limits (a burst of 5,000 submissions, 10,000 waiting jobs per tenant) are lifted for both, or
half of the single jobs would be rejected; one array of any size passes them.
- submit: the SubmitJob messages (bytes as JSON), the steps that admit them (wall seconds, 500 per batch as the
  service's Batcher), the events logged for them;
- memory: the scheduler's state right after admission, by tracemalloc (bytes allocated and still held) and the
  process RSS growth (VmRSS before and after, /proc);
- placement: the Harness plays the whole run (each task 1 GPU, 100 s simulated, no parallelism cap, a tick every
  10 simulated seconds) and reports placements per wall second over the run, and the simulated makespan.
Writes bench/results/arrays.md (printed too).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


def rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def measure(kind: str, tasks: int, nodes: int, gpus: int) -> dict[str, float]:
    from gpuorch_contracts import ArraySpec, GpuRequest, JobPlaced, JobSpec, ProcessRun, SubmitJob, encode
    from gpuorch_scheduling import QueuePolicy
    from gpuorch_scheduling.harness import Harness
    from gpuorch_scheduling.scheduler import Scheduler, SchedulerConfig
    from gpuorch_scheduling.step import Input
    from gpuorch_scheduling.testing import registered_node

    run = ProcessRun(argv=["python", "train.py"])
    base = JobSpec(run=run, resources=GpuRequest(gpus=1), runtime_estimate_s=100)
    if kind == "array":
        specs = [base.model_copy(update={"array": ArraySpec(indices=f"0-{tasks - 1}")})]
    else:
        specs = [base] * tasks
    submits = [SubmitJob(spec=s) for s in specs]
    wire = sum(len(encode(m)) for m in submits)

    # the default admission limits (5,000 submissions in a burst, 10,000 waiting per tenant) would reject half of
    # the single jobs: lifted here so that both place 10,000
    config = SchedulerConfig(queues=QueuePolicy(submission_burst=10 * tasks, max_queued_per_tenant=10 * tasks))
    scheduler = Scheduler(config)
    scheduler.step([Input(registered_node(f"n{k}", gpus=gpus)) for k in range(nodes)], 0.0)
    rss_before = rss_kib()
    tracemalloc.start()
    held_before = tracemalloc.get_traced_memory()[0]
    started = time.perf_counter()
    logged = 0
    for k in range(0, len(submits), 500):
        step = scheduler.step([Input(m) for m in submits[k:k + 500]], 1.0)
        logged += sum(1 for e, _ in step.events if not isinstance(e, JobPlaced))
    submit_s = time.perf_counter() - started
    held = tracemalloc.get_traced_memory()[0] - held_before
    tracemalloc.stop()
    rss_growth = rss_kib() - rss_before

    h = Harness(config, tick_s=10.0, heartbeat_s=10.0)
    for k in range(nodes):
        h.add_node(registered_node(f"n{k}", gpus=gpus).inventory, at=0)
    for spec in specs:
        h.submit(spec, at=1, runtime_s=100)
    placed = 0

    def count(step: object, _: object) -> None:
        nonlocal placed
        placed += step.placed  # type: ignore[attr-defined]

    h.observers.append(count)
    started = time.perf_counter()
    h.run()
    run_s = time.perf_counter() - started
    return {"wire_bytes": wire, "submit_s": submit_s, "logged": logged, "held_mib": held / 2**20,
            "rss_mib": rss_growth / 1024, "placed": placed, "run_s": run_s, "placements_per_s": placed / run_s,
            "makespan_s": h.now}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=10_000)
    parser.add_argument("--nodes", type=int, default=100)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--one", choices=["array", "singles"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.one, args.tasks, args.nodes, args.gpus)))
        return
    results: dict[str, list[dict[str, float]]] = {"array": [], "singles": []}
    for _ in range(args.runs):
        for kind in results:
            out = subprocess.run([sys.executable, __file__, "--one", kind, "--tasks", str(args.tasks), "--nodes",
                                  str(args.nodes), "--gpus", str(args.gpus)], check=True, capture_output=True,
                                 text=True).stdout
            results[kind].append(json.loads(out.strip().splitlines()[-1]))
    load = os.getloadavg()[0]
    rows = [
        ("submitted (JSON bytes)", "wire_bytes", "{:,.0f}"), ("admission steps (s)", "submit_s", "{:.3f}"),
        ("events logged at admission", "logged", "{:,.0f}"), ("state held after admission (MiB, tracemalloc)",
                                                                "held_mib", "{:.1f}"),
        ("RSS growth at admission (MiB)", "rss_mib", "{:.1f}"), ("placements", "placed", "{:,.0f}"),
        ("whole run, wall (s)", "run_s", "{:.2f}"), ("placements per wall second", "placements_per_s", "{:,.0f}"),
        ("simulated makespan (s)", "makespan_s", "{:,.0f}"),
    ]
    lines = [f"# {args.tasks:,}-task array vs {args.tasks:,} single jobs",
             "",
             f"`uv run python bench/bench_arrays.py --tasks {args.tasks} --nodes {args.nodes} --gpus {args.gpus} "
             f"--runs {args.runs}`: medians of {args.runs} runs, each in a fresh process; {args.nodes} nodes x "
             f"{args.gpus} GPUs, every task 1 GPU for 100 simulated seconds. {platform.machine()}, "
             f"{os.cpu_count()} cores, load {load:.2f} at the end, Python {platform.python_version()}.",
             "", "| | one array | single jobs |", "|---|---:|---:|"]
    for label, key, fmt in rows:
        values = [fmt.format(statistics.median(r[key] for r in results[kind])) for kind in ("array", "singles")]
        lines.append(f"| {label} | {values[0]} | {values[1]} |")
    text = "\n".join(lines) + "\n"
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "arrays.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
