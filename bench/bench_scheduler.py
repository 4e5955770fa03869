"""Scheduler benchmarks: the crash drill against the real servers, and decision latency of the pure cycle.

    uv run python bench/bench_scheduler.py                 # both parts (crash drill: 1,000 jobs, 20 SIGKILLs)
    uv run python bench/bench_scheduler.py --part latency  # in process only: 100 / 1,000 / 5,000 nodes
    uv run python bench/bench_scheduler.py --part drill --jobs 1000 --kills 20 [--standby]

The drill needs RabbitMQ (with its management API) and PostgreSQL as the tests use them (see conftest.py); it makes
its own vhost and database and drops them afterwards.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "services" / "scheduler" / "tests")]

from gpuorch_contracts import GpuRequest, JobAccepted, JobSpec, ProcessRun  # noqa: E402
from gpuorch_scheduling import schedule  # noqa: E402
from gpuorch_scheduling.queueing import QueuePolicy, Quota  # noqa: E402
from gpuorch_scheduling.state import SchedulerState  # noqa: E402
from gpuorch_scheduling.testing import registered_node  # noqa: E402

RUN = ProcessRun(argv=["python", "-c", "pass"])
SHAPES = [GpuRequest(gpus=1), GpuRequest(gpus=2), GpuRequest(gpus=4), GpuRequest(gpus=8),
          GpuRequest(gpu_milli=250), GpuRequest(gpu_milli=500), GpuRequest(gpu_memory_mib=20000)]


def _accept(state: SchedulerState, rng: random.Random, now: float, count: int) -> None:
    for _ in range(count):
        spec = JobSpec(run=RUN, resources=rng.choice(SHAPES), cpu_milli=rng.choice([1000, 4000, 8000]),
                       memory_mib=rng.choice([4096, 16384]), tenant=f"t{rng.randrange(5)}",
                       tier=rng.choice(["training", "inference", "batch"]),
                       priority_class=rng.choice(["low", "normal", "normal", "high"]),
                       preemptible=rng.random() < 0.5,
                       runtime_estimate_s=rng.choice([None, 600.0, 3600.0, 36000.0]))
        stamp = datetime.fromtimestamp(now - rng.random() * 3600, UTC)
        state.apply(JobAccepted(job_id=uuid.uuid4(), spec=spec, occurred_at=stamp))


def _apply(state: SchedulerState, result: object) -> int:
    placed = 0
    for event in result.decision.logged:  # type: ignore[attr-defined]
        state.apply(event)
        placed += event.TYPE == "job.placed"
    return placed


def latency(node_counts: list[int], queued: int, repeats: int) -> None:
    policy = QueuePolicy({f"t{k}": Quota(gpus=10_000) for k in range(5)})
    print(f"\nDecision latency of one scheduling cycle (pure, in process; {queued} queued jobs, 8 GPUs per node)")
    print(f"{'nodes':>6} {'queued':>7} {'cold placed':>11} {'cold cycle s':>12} {'steady queue':>12} "
          f"{'steady cycle s (median)':>24} {'per queued job us':>18}")
    for nodes in node_counts:
        rng = random.Random(nodes)
        state = SchedulerState()
        for i in range(nodes):
            state.apply(registered_node(f"n{i:05d}", gpus=8, nvlink=[(k, k + 1) for k in range(7)],
                                        cpu_milli=128000, memory_mib=1024000))
        now = time.time()
        _accept(state, rng, now, queued)
        started = time.perf_counter()
        cold = schedule(state, now, policy)
        cold_s = time.perf_counter() - started
        placed = _apply(state, cold)
        _accept(state, rng, now, queued - len(state.queued_jobs()))
        _apply(state, schedule(state, now, policy))  # fill what the top-up can take
        _accept(state, rng, now, queued - len(state.queued_jobs()))
        steady = []
        for _ in range(repeats):
            started = time.perf_counter()
            result = schedule(state, now, policy)
            steady.append(time.perf_counter() - started)
        depth = len(state.queued_jobs())
        median = statistics.median(steady)
        assert state.capacity_violations() == []
        print(f"{nodes:>6} {queued:>7} {placed:>11} {cold_s:>12.2f} {depth:>12} {median:>24.3f} "
              f"{median / max(depth, 1) * 1e6:>18.1f}")
        del result


def drill(jobs: int, kills: int, seed: int, standby: bool) -> None:
    from crash_drill import crash_drill
    from gpuorch_gpuctl_ops.stack import LocalStack, SimNode

    import conftest  # the test fixtures' helpers: a fresh vhost and database

    vhost = conftest.make_vhost()
    database = conftest.make_database()
    amqp_url = f"amqp://guest:guest@{conftest.AMQP_HOST}:{conftest.AMQP_PORT}/{vhost}"
    dsn = f"{conftest.PG_ADMIN.rsplit('/', 1)[0]}/{database}"
    with tempfile.TemporaryDirectory() as root:
        stack = LocalStack(root=Path(root), amqp_url=amqp_url, database_url=dsn, nodes=[SimNode("n", "a100-80", 1)],
                           extra_env={"GPUORCH_TICK_S": "0.3", "GPUORCH_LOG_LEVEL": "INFO"})
        try:
            report = asyncio.run(crash_drill(stack, amqp_url, dsn, jobs=jobs, kills=kills, seed=seed,
                                             standby=standby, timeout_s=900))
        finally:
            stack.stop_all()
            conftest.drop_vhost(vhost)
            conftest.drop_database(database)
    rec = report.recovery_s or [0.0]
    print(f"\nCrash drill: SIGKILL of the active scheduler at random moments while jobs are submitted "
          f"({'standby takes over' if standby else 'restarted in place'}; seed {seed})")
    print(f"{'jobs':>5} {'kills':>5} {'placements':>10} {'duplicates':>10} {'unplaced':>8} {'requeues':>8} "
          f"{'capacity violations':>19} {'recovery median s':>17} {'recovery max s':>14} {'total s':>8}")
    print(f"{report.jobs:>5} {report.kills:>5} {report.placements:>10} {report.duplicates:>10} {report.unplaced:>8} "
          f"{report.requeues:>8} {len(report.capacity_violations):>19} {statistics.median(rec):>17.2f} "
          f"{max(rec):>14.2f} {report.total_s:>8.1f}")


def main() -> None:
    from gpuorch_observability import configure_logging

    configure_logging("bench-scheduler", "WARNING")  # the drill's in-process consumers log every message at info
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=["all", "drill", "latency"], default="all")
    parser.add_argument("--jobs", type=int, default=1000)
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--standby", action="store_true", help="run a standby scheduler; it takes over each kill")
    parser.add_argument("--nodes", default="100,1000,5000")
    parser.add_argument("--queued", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if args.part in ("all", "latency"):
        latency([int(n) for n in args.nodes.split(",")], args.queued, args.repeats)
    if args.part in ("all", "drill"):
        drill(args.jobs, args.kills, args.seed, args.standby)


if __name__ == "__main__":
    main()
