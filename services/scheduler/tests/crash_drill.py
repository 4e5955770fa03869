"""Crash drill: submit jobs while the active scheduler is SIGKILLed at random moments; check each is placed once.

Used by test_live.py (a small seeded run) and bench/bench_scheduler.py (1,000 jobs, 20 kills). No executor runs:
placement is the point. A fake fleet registers and heartbeats from here, and a sink queue takes the launch
commands (so the outbox relay has somewhere to route them).

Each kill hits the current leader with SIGKILL; with a standby running, the standby takes over and the killed one
is restarted as the new standby; alone, the killed scheduler is restarted. Recovery time is from the kill to the
``scheduler.recovered`` log line of the next leader (process start, leadership, snapshot + log replay).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import asyncpg
from gpuorch_contracts import COMMANDS_EXCHANGE, GpuRequest, JobSpec, Message, ProcessRun, SubmitJob
from gpuorch_gpuctl_ops.stack import LocalStack
from gpuorch_messaging import Broker, QueueSpec
from gpuorch_scheduler.handlers import SchedulerService
from gpuorch_scheduling.testing import registered_node

from tests.e2e.harness import FakeNodes, publish_when_routable, wait_rows

RUN = ProcessRun(argv=["python", "-c", "pass"])


@dataclass
class DrillReport:
    jobs: int
    kills: int
    placements: int = 0
    duplicates: int = 0
    unplaced: int = 0
    requeues: int = 0
    capacity_violations: list[str] = field(default_factory=list)
    recovery_s: list[float] = field(default_factory=list)
    total_s: float = 0.0
    leaders: list[str] = field(default_factory=list)


def drill_jobs(count: int, rng: random.Random) -> list[SubmitJob]:
    """A mix of shares (most), whole GPUs and MIG-free CPU-light jobs that all fit the drill fleet at once."""
    jobs = []
    for _ in range(count):
        whole = rng.random() < 0.1
        resources = GpuRequest(gpus=1) if whole else GpuRequest(gpu_milli=rng.choice([100, 200, 250]))
        jobs.append(SubmitJob(spec=JobSpec(run=RUN, resources=resources, cpu_milli=100, memory_mib=256,
                                           tenant=rng.choice(["a", "b", "c"]),
                                           priority_class=rng.choice(["normal", "high"]))))
    return jobs


def fleet_size(jobs: list[SubmitJob], gpus_per_node: int = 8) -> int:
    need = sum((j.spec.resources.gpus or (j.spec.resources.gpu_milli or 0) / 1000) for j in jobs)
    return max(2, int(need * 1.6 / gpus_per_node) + 1)


def _count(stack: LocalStack, name: str, text: str) -> int:
    process = stack.processes.get(name)
    if process is None or not process.log_path.exists():
        return 0
    return process.log_path.read_text(errors="replace").count(text)


async def _wait_log(stack: LocalStack, names: list[str], text: str, before: dict[str, int],
                    timeout_s: float = 120.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for name in names:
            if _count(stack, name, text) > before.get(name, 0):
                return name
        await asyncio.sleep(0.05)
    raise TimeoutError(f"no {text!r} from {names} within {timeout_s}s")


async def crash_drill(stack: LocalStack, amqp_url: str, dsn: str, *, jobs: int, kills: int, seed: int,
                      standby: bool = False, timeout_s: float = 300.0) -> DrillReport:
    rng = random.Random(seed)
    report = DrillReport(jobs=jobs, kills=kills)
    names = ["scheduler-1", "scheduler-2"] if standby else ["scheduler-1"]
    started = time.monotonic()
    stack.start_scheduler(names[0])
    leader = await _wait_log(stack, [names[0]], "scheduler.recovered", {})
    report.leaders.append(leader)
    if standby:
        stack.start_scheduler(names[1])
        await _wait_log(stack, [names[1]], "scheduler.waiting_for_leadership", {})
    await stack.queues_declared(["scheduler", "scheduler.heartbeats"])
    submits = drill_jobs(jobs, rng)
    broker = Broker(amqp_url, producer="crash-drill")
    await broker.connect()

    async def ignore(_: Message) -> None:
        return None

    await broker.consume(QueueSpec("drill.commands", [(COMMANDS_EXCHANGE, "node.#")], prefetch=500), ignore)
    nodes = FakeNodes(broker, [registered_node(f"node-{i:03d}", gpus=8, cpu_milli=256000)
                               for i in range(fleet_size(submits))])
    kill_at = sorted(rng.sample(range(1, jobs), kills)) if kills else []
    try:
        await nodes.start(interval_s=2.0)
        await wait_rows(dsn, "SELECT count(*) AS n FROM nodes", until=lambda rs: rs[0]["n"] == len(nodes.registrations),
                        what="fleet registered")
        for index, submit in enumerate(submits):
            await publish_when_routable(broker, submit)
            if rng.random() < 0.05:
                await asyncio.sleep(rng.random() * 0.2)
            while kill_at and kill_at[0] == index:
                kill_at.pop(0)
                await asyncio.sleep(rng.random() * 0.3)  # a random moment: mid-transaction, mid-relay, idle
                before = {n: _count(stack, n, "scheduler.recovered") for n in names}
                killed_at = time.monotonic()
                stack.kill(leader)
                if not standby:
                    stack.start_scheduler(leader)
                new_leader = await _wait_log(stack, names, "scheduler.recovered", before)
                report.recovery_s.append(time.monotonic() - killed_at)
                if standby:
                    stack.start_scheduler(leader)  # the killed one comes back as the standby
                leader = new_leader
                report.leaders.append(leader)
        ids = [s.job_id for s in submits]
        await wait_rows(dsn, "SELECT count(*) AS n FROM jobs WHERE job_id = ANY($1::uuid[]) AND state = 'placed'", ids,
                        until=lambda rs: rs[0]["n"] == len(ids), timeout_s=timeout_s, what=f"{jobs} jobs placed")
        report.total_s = time.monotonic() - started
    finally:
        await nodes.stop()
        await broker.close()
    await _check(report, dsn, [s.job_id for s in submits])
    return report


async def _check(report: DrillReport, dsn: str, ids: list[uuid.UUID]) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch("SELECT type, payload::text AS payload FROM events WHERE type IN "
                                "('job.placed', 'job.requeued')")
        placed: dict[str, int] = {}
        for row in rows:
            payload: dict[str, Any] = json.loads(row["payload"])
            if row["type"] == "job.placed":
                placed[payload["job_id"]] = placed.get(payload["job_id"], 0) + 1
            else:
                report.requeues += 1
        report.placements = sum(placed.values())
        report.duplicates = sum(c - 1 for c in placed.values() if c > 1) - report.requeues
        report.unplaced = sum(1 for j in ids if str(j) not in placed)
        rebuilt = SchedulerService(conn)
        await rebuilt.recover()
        report.capacity_violations = rebuilt.state.capacity_violations()
    finally:
        await conn.close()
