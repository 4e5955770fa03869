"""How long ``gpuctl`` takes to start (issue 32): ``--version``, ``--help``, a command's ``--help`` and a client
command (its request refused at once), each run as a fresh process, and which heavy modules each one imports.

    uv run python bench/bench_gpuctl_startup.py                          # this checkout's environment, 21 runs
    uv run python bench/bench_gpuctl_startup.py --thin                   # and a fresh venv: the thin client alone
    uv run python bench/bench_gpuctl_startup.py before=/other/.venv/bin/python after=.venv/bin/python --runs 21

Each ``LABEL=PYTHON`` is an environment with gpuctl installed; runs alternate between them so that a busy machine
slows both alike. ``--thin`` first creates a fresh virtual environment (uv) holding only services/gpuctl and its
dependencies (typer, rich, httpx, pyyaml and theirs; no gpuorch-gpuctl-ops, no workspace library) and adds it as
``thin``: what a user who installs gpuctl alone runs; it also records that environment's size and packages. Reports the median, min and max wall time per command and environment, and the heavy modules
(numpy, asyncpg, matplotlib, OpenTelemetry, the broker client, the policy and scheduling libraries) found in
``python -X importtime``'s list for the command. Writes bench/results/gpuctl_startup.md (printed too). A benchmark,
not a test: the figures depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
NOWHERE = "http://127.0.0.1:9"
COMMANDS = {
    "--version": ["--version"],
    "--help": ["--help"],
    "jobs --help": ["jobs", "--help"],
    "jobs (refused)": ["--server", NOWHERE, "jobs"],
    "demo --help": ["demo", "--help"],
}
"""``demo --help`` in the thin environment is its "install gpuorch-gpuctl-ops" line (the entry points are read)."""
HEAVY = ("numpy", "asyncpg", "matplotlib", "opentelemetry", "aio_pika", "psutil", "pydantic", "gpuorch_policy",
         "gpuorch_scheduling", "gpuorch_report")


def script_of(python: str) -> str:
    """The ``gpuctl`` script installed next to ``python`` (what a user types)."""
    return str(Path(python).parent / "gpuctl")


def timed(python: str, args: list[str]) -> float:
    env = {**os.environ, "GPUCTL_CONFIG": "/nonexistent/gpuctl.yaml"}
    started = time.perf_counter()
    subprocess.run([script_of(python), *args], env=env, capture_output=True, check=False)
    return time.perf_counter() - started


def heavy_imports(python: str, args: list[str]) -> list[str]:
    """The heavy top-level packages the command imports (``-X importtime`` lists every module it loads)."""
    code = f"import sys; sys.argv = ['gpuctl', *{args!r}]; from gpuorch_gpuctl.__main__ import main; main()"
    env = {**os.environ, "GPUCTL_CONFIG": "/nonexistent/gpuctl.yaml"}
    done = subprocess.run([python, "-X", "importtime", "-c", code], env=env, capture_output=True, text=True,
                          check=False)
    loaded = {line.split("|")[-1].strip().split(".")[0] for line in done.stderr.splitlines()
              if line.startswith("import time:")}
    return [name for name in HEAVY if name in loaded]


def thin_environment(where: Path) -> tuple[str, str]:
    """A fresh venv at ``where`` with the thin client alone; its python, and a line on its size and packages."""
    import shutil

    shutil.rmtree(where, ignore_errors=True)
    subprocess.run(["uv", "venv", "-q", "-p", sys.executable, str(where)], check=True)
    python = str(where / "bin" / "python")
    subprocess.run(["uv", "pip", "install", "-q", "--python", python, str(ROOT / "services" / "gpuctl")], check=True)
    listed = subprocess.run(["uv", "pip", "freeze", "--python", python], capture_output=True, text=True, check=True)
    size = subprocess.run(["du", "-sm", str(where)], capture_output=True, text=True, check=False).stdout.split()[0]
    packages = sorted(line.split("==")[0].split(" @ ")[0] for line in listed.stdout.splitlines() if line)
    return python, f"thin environment: {size} MB, {len(packages)} packages: {', '.join(packages)}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("environments", nargs="*", help="LABEL=PYTHON (default: this=sys.executable)")
    parser.add_argument("--runs", type=int, default=21)
    parser.add_argument("--thin", action="store_true", help="also a fresh venv holding only the thin client")
    options = parser.parse_args()
    environments = dict(item.split("=", 1) for item in options.environments) or {"this": sys.executable}
    notes = []
    if options.thin:
        environments["thin"], note = thin_environment(Path("/tmp/gpuctl-thin-venv"))
        notes.append(note)
    times: dict[tuple[str, str], list[float]] = {(c, e): [] for c in COMMANDS for e in environments}
    for _ in range(options.runs):
        for command, args in COMMANDS.items():
            for label, python in environments.items():
                times[(command, label)].append(timed(python, args))
    lines = [f"gpuctl start-up, {options.runs} runs each, alternating; load average {os.getloadavg()[0]:.1f} "
             f"({os.cpu_count()} CPUs)", "",
             "| command | environment | median s | min s | max s | heavy modules imported |", "|---|---|---|---|---|---|"]
    for command, args in COMMANDS.items():
        for label, python in environments.items():
            runs = times[(command, label)]
            heavy = ", ".join(heavy_imports(python, args)) or "none"
            lines.append(f"| `gpuctl {command}` | {label} | {statistics.median(runs):.3f} | {min(runs):.3f} | "
                         f"{max(runs):.3f} | {heavy} |")
    text = "\n".join([*lines, "", *notes]) + "\n"
    print(text)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "gpuctl_startup.md").write_text(text)


if __name__ == "__main__":
    main()
