"""What the chaos scenarios share: jobs that record where they ran, a fleet without executors, waiting on states."""

from __future__ import annotations

import os
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aio_pika
import aio_pika.exceptions
import asyncpg
from gpuorch_contracts import COMMANDS_EXCHANGE, Checkpoint, GpuRequest, JobSpec, Message, ProcessRun, SubmitJob
from gpuorch_messaging import Broker, QueueSpec
from gpuorch_scheduling.testing import registered_node

from tests.chaos.invariants import RUN_RECORDER
from tests.e2e.harness import FakeNodes, publish_when_routable, wait_rows

PLACED_OR_LATER = ("placed", "running", "succeeded", "failed", "cancelled")


def recording_job(run_log: Path, seconds: float, *, gpus: int = 1, tenant: str = "default",
                  release: Path | None = None) -> SubmitJob:
    """A job that appends its start and end (job id, placement id, epoch) to ``run_log``; it runs ``seconds``, or
    with ``release`` until that file exists (at most ``seconds``): a scenario waits on states, not on a duration."""
    argv = ["python", "-c", RUN_RECORDER, str(run_log), str(seconds), *([str(release)] if release else [])]
    return SubmitJob(spec=JobSpec(resources=GpuRequest(gpus=gpus), run=ProcessRun(argv=argv), tenant=tenant,
                                  cpu_milli=100, memory_mib=128, max_requeues=10,
                                  checkpoint=Checkpoint(grace_s=1.0)))


def share_job(tenant: str = "default", milli: int = 100) -> SubmitJob:
    """A small GPU share that is never launched (scenarios without an executor stop at ``placed``)."""
    return SubmitJob(spec=JobSpec(resources=GpuRequest(gpu_milli=milli), tenant=tenant, cpu_milli=10, memory_mib=16,
                                  run=ProcessRun(argv=["python", "-c", "pass"])))


async def wait_states(dsn: str, job_ids: list[uuid.UUID], states: tuple[str, ...], *, timeout_s: float = 120.0,
                      what: str = "jobs") -> dict[uuid.UUID, str]:
    rows = await wait_rows(
        dsn, "SELECT job_id, state FROM jobs WHERE job_id = ANY($1::uuid[])", job_ids,
        until=lambda rs: len(rs) == len(job_ids) and all(r["state"] in states for r in rs),
        timeout_s=timeout_s, what=f"{len(job_ids)} {what} in {states}")
    return {r["job_id"]: r["state"] for r in rows}


async def wait_nodes(dsn: str, count: int, timeout_s: float = 60.0) -> None:
    await wait_rows(dsn, "SELECT count(*) AS n FROM nodes", until=lambda rs: rs[0]["n"] >= count,
                    timeout_s=timeout_s, what=f"{count} nodes registered")


async def query(dsn: str, sql: str, *args: object) -> list[dict[str, Any]]:
    conn = await asyncpg.connect(dsn)
    try:
        return [dict(r) for r in await conn.fetch(sql, *args)]
    finally:
        await conn.close()


async def dead_letter_count(amqp_url: str, queue: str) -> int:
    """Messages waiting in a dead-letter queue (0 if it does not exist)."""
    connection = await aio_pika.connect(amqp_url)
    try:
        channel = await connection.channel()
        try:
            return (await channel.declare_queue(queue, passive=True)).declaration_result.message_count or 0
        except aio_pika.exceptions.ChannelClosed:
            return 0
    finally:
        await connection.close()


def nodes_for(jobs: int, at_least: int = 1, gpus: int = 8, milli: int = 100) -> int:
    """Fake nodes enough to place ``jobs`` shares of ``milli`` (full-size runs scale the fleet with the jobs)."""
    return max(at_least, -(-jobs * milli // (gpus * 1000)))


@asynccontextmanager
async def fleet_without_executors(amqp_url: str, dsn: str, nodes: int, gpus: int = 8,
                                  commands: list[Message] | None = None) -> AsyncIterator[Broker]:
    """Registered, heartbeating fake nodes and a sink for their commands (so LaunchJobs are routable; appended to
    ``commands`` when given, in arrival order); yields the test's own broker connection (not faulted)."""
    broker = Broker(amqp_url, producer="chaos")
    await broker.connect()

    async def ignore(message: Message) -> None:
        if commands is not None:
            commands.append(message)

    await broker.consume(QueueSpec("chaos.commands", [(COMMANDS_EXCHANGE, "node.#")], prefetch=500), ignore)
    fleet = FakeNodes(broker, [registered_node(f"node-{i:03d}", gpus=gpus, cpu_milli=256000) for i in range(nodes)])
    try:
        await fleet.start(interval_s=1.0)
        await wait_nodes(dsn, nodes)
        yield broker
    finally:
        await fleet.stop()
        await broker.close()


def elapsed_since(started: float) -> float:
    return round(time.monotonic() - started, 1)


def report(name: str, line: str) -> None:
    """Print a scenario's figures (``-s`` shows them) and append them to ``$GPUORCH_CHAOS_REPORT`` when set (the
    figures of docs/RELIABILITY.md come from there)."""
    print(f"\nCHAOS {name}: {line}", file=sys.stderr)
    path = os.environ.get("GPUORCH_CHAOS_REPORT")
    if path:
        with open(path, "a", encoding="utf-8") as out:
            out.write(f"{name}: {line}\n")


@asynccontextmanager
async def submitter(amqp_url: str) -> AsyncIterator[Callable[[Message], Awaitable[None]]]:
    """The test's own confirmed publisher (retrying while no queue is bound yet)."""
    broker = Broker(amqp_url, producer="chaos")
    await broker.connect()

    async def submit(message: Message) -> None:
        await publish_when_routable(broker, message)

    try:
        yield submit
    finally:
        await broker.close()
