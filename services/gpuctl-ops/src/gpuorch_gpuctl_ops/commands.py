"""The commands this package adds to gpuctl, each a ``LazyCommand`` named by an entry point of the group
``gpuctl.commands`` (pyproject.toml): ``gpuctl --help`` lists them from here, without importing their modules;
a command's module loads when it runs (gpuorch_gpuctl.lazy)."""

from __future__ import annotations

from typing import Any

from gpuorch_gpuctl.lazy import LazyCommand


def _bench_extras(_: Any) -> None:
    """``bench capacity`` and ``bench mig`` live in their own modules and join the bench group."""
    from gpuorch_gpuctl_ops.bench_capacity_cmd import capacity
    from gpuorch_gpuctl_ops.bench_cmd import bench_app
    from gpuorch_gpuctl_ops.bench_mig_cmd import mig

    if "capacity" not in {c.name for c in bench_app.registered_commands}:
        bench_app.command("capacity")(capacity)
        bench_app.command("mig")(mig)


OPS = "gpuorch_gpuctl_ops"
DEMO = LazyCommand(f"{OPS}.demo_cmd", "demo", "Run a simulated 3-node fleet with a mixed workload of real processes, "
                   "then stop everything (or --keep).")
DOWN = LazyCommand(f"{OPS}.demo_cmd", "down", "Stop the stack `gpuctl demo --keep` or `gpuctl up` left running (and "
                   "its jobs).")
UP = LazyCommand(f"{OPS}.up_cmd", "up", "Start every service on this host against its GPUs and leave them running "
                 "(gpuctl down --root ROOT stops).")
REPLAY = LazyCommand(f"{OPS}.replay_cmd", "replay", "Replay a trace through the scheduler on its Harness (FGD paper "
                     "protocol, or a job-level replay).")
REPORT = LazyCommand(f"{OPS}.report_cmd", "report", "The weekly review, from the gpuorch API of the current context: "
                     "per tenant and job, allocated vs used, idle GPU-hours, advice, queue wait by request shape, and "
                     "conclusions (idle GPUs, jobs to right-size, shortages, throttling, what the autoscaler would "
                     "do).")
SETUP = LazyCommand(f"{OPS}.setup_cmd", "setup_app", "Install-time setup: the broker topology, node log credentials.")
SCHEMA = LazyCommand(f"{OPS}.schema_cmd", "schema_app", "Export message schemas (JSON Schema, AsyncAPI).")
DB = LazyCommand(f"{OPS}.db_cmd", "db_app", "Database schema: apply migrations and show their status.")
BENCH = LazyCommand(f"{OPS}.bench_cmd", "bench_app", "Benchmarks of the scheduler: against the real broker and "
                    "database (e2e, curve, recovery) or in process on its Harness (core, capacity, mig); see "
                    "docs/PERFORMANCE.md.", _bench_extras)
MIG = LazyCommand(f"{OPS}.mig_cmd", "mig_app", "MIG layouts: what the planner would change (mode advise) and why.")
RESERVE = LazyCommand(f"{OPS}.reserve_cmd", "reserve_app", "Advance reservations: GPUs promised to a tenant for a "
                      "window (operators create).")
