"""The scheduler at fleet scale through `gpuctl bench` (issue 10): e2e runs with medians, recovery, the cost curve.

    uv run python bench/bench_scale.py e2e --nodes 1000 --rate 500 --jobs 5000 --runs 5
    uv run python bench/bench_scale.py recovery --events 1000000 --repeats 3
    uv run python bench/bench_scale.py curve --nodes 100,1000,5000,10000 --rate 200 --jobs 2000
    uv run python bench/bench_scale.py core --nodes 1000,10000 --jobs 10000 --repeats 5

Each part runs `python -m gpuorch_gpuctl bench <part> ... --json` in a subprocess (the same code as the CLI),
prints a Markdown table (for e2e: every run, then the median of each column) and writes it with the raw JSON to
bench/results/scale-<part>-<label>.md / .json. The machine's load average is in every row: this machine is shared.
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
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"

E2E_COLUMNS = ["nodes", "offered_per_s", "jobs", "placed", "placements_per_s", "p50_ms", "p99_ms", "raw_p50_ms",
               "raw_p99_ms", "overhead_ratio_p50", "floor_placements_per_s", "floor_p50_ms", "floor_p99_ms",
               "floor_ratio", "cpu_ms_per_message", "cpu_ms_per_message_net", "floor_cpu_ms_per_message",
               "relay_cpu_ms_per_message", "scheduler_idle_cpu_pct", "idle_cpu_ms_per_node_s", "fleet_idle_cpu_pct",
               "fleet_cpu_pct", "scheduler_rss_mib", "registration_s", "load_avg_1m_start"]
CURVE_COLUMNS = ["nodes", "jobs", "placed", "offered_per_s", "placements_per_s", "cpu_ms_per_message",
                 "cpu_ms_per_message_net", "scheduler_idle_cpu_pct", "p50_ms", "p99_ms", "raw_p50_ms",
                 "scheduler_rss_mib", "load_avg_1m_start"]
CORE_COLUMNS = ["nodes", "gpus", "jobs", "placed", "placements_per_s", "engine_placements_per_s", "repeats"]
RECOVERY_COLUMNS = ["events", "nodes", "recover_no_snapshot_s", "recover_no_snapshot_runs_s", "recover_snapshot_s",
                    "recover_snapshot_runs_s", "restart_no_snapshot_s", "restart_snapshot_s", "recovery_timed_by",
                    "jobs_in_log", "state_jobs_without_snapshot", "state_jobs", "state_nodes", "snapshot_mib_stored",
                    "snapshot_error", "fill_s", "load_avg_1m_start"]


def gpuctl_bench(part: str, args: list[str], timeout_s: float) -> dict[str, Any]:
    command = [sys.executable, "-m", "gpuorch_gpuctl", "bench", part, *args, "--json"]
    print(f"  $ gpuctl bench {part} {' '.join(args)} --json", file=sys.stderr, flush=True)
    done = subprocess.run(command, stdout=subprocess.PIPE, text=True, timeout=timeout_s)
    if done.returncode != 0:
        return {"error": f"exit {done.returncode}"}
    return dict(json.loads(done.stdout))


def markdown(rows: list[dict[str, Any]], columns: list[str], first: str | None = None) -> str:
    head = ([first] if first else []) + columns
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        cells = ([str(row.get("_label", ""))] if first else []) + [_cell(row.get(c)) for c in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, list):
        return " ".join(str(v) for v in value)
    return str(value)


def medians(rows: list[dict[str, Any]], columns: list[str]) -> dict[str, Any]:
    result: dict[str, Any] = {"_label": f"median of {len(rows)}"}
    for column in columns:
        values = [r[column] for r in rows if isinstance(r.get(column), int | float) and not isinstance(r[column], bool)]
        result[column] = round(statistics.median(values), 2) if values else None
    return result


def header(command: str) -> str:
    return (f"Command: `{command}`  \nMachine: {platform.machine()}, {os.cpu_count()} cores, load avg "
            f"{os.getloadavg()[0]:.2f} at start, Python {platform.python_version()}, "
            f"{time.strftime('%Y-%m-%d %H:%M %Z')}\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parts = parser.add_subparsers(dest="part", required=True)
    e2e = parts.add_parser("e2e")
    e2e.add_argument("--nodes", type=int, default=1000)
    e2e.add_argument("--rate", type=float, default=500)
    e2e.add_argument("--jobs", type=int, default=5000)
    e2e.add_argument("--runs", type=int, default=5)
    e2e.add_argument("--timeout-s", type=float, default=300)
    recovery = parts.add_parser("recovery")
    recovery.add_argument("--events", type=int, default=1_000_000)
    recovery.add_argument("--repeats", type=int, default=3)
    curve = parts.add_parser("curve")
    curve.add_argument("--nodes", default="100,1000,5000,10000")
    curve.add_argument("--rate", type=float, default=200)
    curve.add_argument("--jobs", type=int, default=2000)
    curve.add_argument("--timeout-s", type=float, default=300)
    curve.add_argument("--png", default="docs/img/cost_curve.png")
    core = parts.add_parser("core")
    core.add_argument("--nodes", default="1000,10000")
    core.add_argument("--jobs", type=int, default=10_000)
    core.add_argument("--repeats", type=int, default=5)
    for sub in (e2e, recovery, curve, core):
        sub.add_argument("--label", default="", help="names the results file (e.g. before, after)")
    args = parser.parse_args()
    command = " ".join(["uv run python bench/bench_scale.py", *sys.argv[1:]])
    intro = header(command)

    if args.part == "e2e":
        title = f"# e2e: {args.nodes} nodes, {args.rate:g} SubmitJob/s offered, {args.jobs} one-GPU jobs\n"
        rows = []
        for run in range(args.runs):
            print(f"run {run + 1}/{args.runs}", file=sys.stderr, flush=True)
            row = gpuctl_bench("e2e", ["--nodes", str(args.nodes), "--rate", str(args.rate), "--jobs", str(args.jobs),
                                       "--timeout-s", str(args.timeout_s)], args.timeout_s * 3 + 600)
            row["_label"] = f"run {run + 1}"
            rows.append(row)
        good = [r for r in rows if "error" not in r]
        table = markdown([*rows, medians(good, E2E_COLUMNS)], E2E_COLUMNS, first="run")
        name = f"scale-e2e-{args.nodes}n-{args.rate:g}ps{'-' + args.label if args.label else ''}"
    elif args.part == "recovery":
        title = f"# recovery: {args.events:,} events\n"
        rows = [gpuctl_bench("recovery", ["--events", str(args.events), "--repeats", str(args.repeats)], 3600)]
        table = markdown(rows, RECOVERY_COLUMNS)
        name = f"scale-recovery{'-' + args.label if args.label else ''}"
    elif args.part == "core":
        title = f"# placement core in process: {args.jobs} one-GPU jobs, medians of {args.repeats}\n"
        result = gpuctl_bench("core", ["--nodes", args.nodes, "--jobs", str(args.jobs), "--repeats",
                                       str(args.repeats)], 3600)
        rows = result.get("fleets", [result])
        table = markdown(rows, CORE_COLUMNS)
        name = f"scale-core{'-' + args.label if args.label else ''}"
    else:
        title = f"# cost curve: {args.rate:g} SubmitJob/s, up to {args.jobs} jobs per fleet size\n"
        result = gpuctl_bench("curve", ["--nodes", args.nodes, "--rate", str(args.rate), "--jobs", str(args.jobs),
                                        "--timeout-s", str(args.timeout_s), "--png", args.png,
                                        "--label", args.label],
                              (args.timeout_s * 3 + 600) * len(args.nodes.split(",")))
        rows = result.get("points", [result])
        table = markdown(rows, CURVE_COLUMNS)
        name = f"scale-curve{'-' + args.label if args.label else ''}"
    text = f"{title}\n{intro}\n{table}\n"
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.md").write_text(text)
    (RESULTS / f"{name}.json").write_text(json.dumps(rows, indent=2) + "\n")
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
