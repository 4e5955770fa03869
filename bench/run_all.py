"""`make bench`: run every benchmark one after another and collect their tables in bench/results/SUMMARY.md.

Each bench_*.py prints its own table and writes bench/results/<name>.md. Speed is only ever compared side by side
within one run of one script (medians and ratios); this machine is shared and noisy, so absolute seconds from
different runs are not comparable. Progress goes to stderr; a failing benchmark is reported and the others still run.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).parent
RESULTS = BENCH / "results"

# (script, arguments): sized so the whole run takes minutes on 2 cores, not hours
RUNS: list[tuple[str, list[str]]] = [
    ("bench_replay.py", []),
    ("bench_capacity.py", ["--seeds", "1-5"]),  # issue 18: a simulated day, three fleets, on the Harness (~430 s CPU)
    ("bench_scheduler.py", []),
    ("bench_arrays.py", ["--runs", "1"]),  # issue 26: a 10,000-task array vs 10,000 single jobs (about 1 min)
    ("bench_fleet.py", ["--nodes", "5000", "--duration-s", "60"]),
    ("bench_telemetry.py", ["--nodes", "5000", "--duration-s", "60"]),
    # issue 10, through `gpuctl bench` (docs/PERFORMANCE.md): one run each here; the doc's medians take --runs 5.
    # Each e2e gives up 60 s after its first submit, so a slow scheduler costs minutes, not hours.
    ("bench_scale.py", ["e2e", "--nodes", "1000", "--rate", "500", "--jobs", "5000", "--runs", "1", "--timeout-s", "60"]),
    ("bench_scale.py", ["e2e", "--nodes", "5000", "--rate", "500", "--jobs", "5000", "--runs", "1", "--timeout-s", "60"]),
    ("bench_scale.py", ["e2e", "--nodes", "1000", "--rate", "2000", "--jobs", "8000", "--runs", "1",
                        "--timeout-s", "60"]),
    ("bench_scale.py", ["e2e", "--nodes", "5000", "--rate", "2000", "--jobs", "10000", "--runs", "1",
                        "--timeout-s", "60"]),
    ("bench_scale.py", ["core", "--nodes", "1000,10000", "--jobs", "10000", "--repeats", "5"]),
    ("bench_scale.py", ["recovery", "--events", "1000000", "--repeats", "1"]),
    ("bench_scale.py", ["curve", "--nodes", "100,1000,5000,10000", "--rate", "200", "--jobs", "2000",
                        "--timeout-s", "45"]),
]


def main() -> int:
    RESULTS.mkdir(exist_ok=True)
    summary = ["# Benchmark results", "", f"Run at {time.strftime('%Y-%m-%d %H:%M:%S %Z')} on this machine.", ""]
    failures = 0
    for index, (script, args) in enumerate(RUNS, 1):
        path = BENCH / script
        if not path.exists():
            print(f"[{index}/{len(RUNS)}] {script}: missing, skipped", file=sys.stderr)
            continue
        print(f"[{index}/{len(RUNS)}] {script} {' '.join(args)} ...", file=sys.stderr, flush=True)
        started = time.monotonic()
        done = subprocess.run([sys.executable, str(path), *args], capture_output=True, text=True)
        seconds = time.monotonic() - started
        sys.stdout.write(done.stdout)
        if done.returncode != 0:
            failures += 1
            print(f"    failed (exit {done.returncode}):\n{done.stderr[-2000:]}", file=sys.stderr)
        summary += [f"## {script} ({seconds:.0f} s, exit {done.returncode})", "", done.stdout.strip(), ""]
    (RESULTS / "SUMMARY.md").write_text("\n".join(summary) + "\n")
    print(f"tables written to {RESULTS}/", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
