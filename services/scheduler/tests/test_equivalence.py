"""One engine: a live scheduler's journal, played through a fresh ``gpuorch_scheduling.Scheduler`` (what the Harness
runs), decides the very events the live scheduler logged, in order, ids included.

The live run is the real thing: ``gpuorch-scheduler`` and ``gpuorch-executor`` processes (LocalStack), RabbitMQ,
PostgreSQL, real job processes; the workload has placements, a preemption with its checkpoint handshake, a failure,
a cancel, a rejection and a pending reason; a second run has an array, a parallelism change and dependencies.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from gpuorch_contracts import (
    MESSAGE_TYPES,
    CancelJob,
    GpuRequest,
    JobSpec,
    ProcessRun,
    SetArrayParallelism,
    SubmitJob,
)
from gpuorch_gpuctl_ops.stack import LocalStack
from gpuorch_messaging import Broker
from gpuorch_scheduler.settings import Settings
from gpuorch_scheduling.harness import Harness
from gpuorch_scheduling.testing import registered_node

from tests.e2e.harness import FakeNodes, publish_when_routable, wait_jobs_terminal, wait_rows

from .test_live import VICTIM, wait_path

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def spec(name: str, argv: list[str], **fields: object) -> JobSpec:
    return JobSpec(name=name, run=ProcessRun(argv=argv), **fields)  # type: ignore[arg-type]


@asynccontextmanager
async def journaled_run(stack: LocalStack, amqp_url: str, journal: Path) -> AsyncIterator[Broker]:
    """The scheduler (writing its journal) and an executor on one 2-GPU node; a broker to publish with. Everything
    is stopped on leaving, so that the journal holds every committed step."""
    stack.start_scheduler(GPUORCH_STEP_JOURNAL=str(journal))
    stack.start_executor()
    await stack.queues_declared(["scheduler", "scheduler.heartbeats", "executor.node-1"])
    broker = Broker(amqp_url, producer="test")
    await broker.connect()
    nodes = FakeNodes(broker, [registered_node("node-1", gpus=2)])
    try:
        await nodes.start()
        yield broker
    finally:
        await nodes.stop()
        await broker.close()
    stack.stop_all()


async def replayed_as_logged(stack: LocalStack, pg_dsn: str, journal: Path) -> tuple[list[dict[str, Any]],
                                                                                     list[tuple[str, str]]]:
    """Assert that the journal played through the Harness decides the live log's events and the outbox's commands,
    in order, ids included; returns them (the live events, the published (type, id))."""
    conn = await asyncpg.connect(pg_dsn)
    try:
        rows = await conn.fetch("SELECT payload::text AS payload FROM events WHERE stream = 'scheduler' "
                                "ORDER BY position")
        outbox = [json.loads(bytes(r["body"])) for r in await conn.fetch("SELECT body FROM outbox ORDER BY id")]
    finally:
        await conn.close()
    live = [json.loads(r["payload"]) for r in rows]
    entries = [json.loads(line) for line in journal.read_text().splitlines()]
    settings = Settings.load(env=stack.base_env())  # what the stack's scheduler ran with
    replayed = Harness(settings.scheduler_config).replay(entries)
    decided = [e.model_dump(mode="json") for e in replayed.logged]
    assert len(decided) == len(live)
    for position, (was, now) in enumerate(zip(live, decided, strict=True)):
        assert MESSAGE_TYPES[was["type"]].model_validate(was).model_dump(mode="json") == now, position
    published = [(m.type, str(m.message_id)) for m in replayed.published]
    assert [(m["type"], m["message_id"]) for m in outbox] == published
    return live, published


@pytest.mark.timeout(240)
async def test_a_live_run_replayed_through_the_harness_decides_the_same_events(
    stack: LocalStack, amqp_url: str, pg_dsn: str, tmp_path: Path
) -> None:
    journal = tmp_path / "journal.jsonl"
    async with journaled_run(stack, amqp_url, journal) as broker:
        victim = SubmitJob(spec=spec("victim", ["python", "-c", VICTIM, str(tmp_path / "marker"),
                                                str(tmp_path / "ready")],
                                     priority_class="low", preemptible=True, resources=GpuRequest(gpus=2),
                                     checkpoint={"signal": "SIGTERM", "grace_s": 20}))
        await publish_when_routable(broker, victim)
        await wait_path(tmp_path / "ready", what="victim's checkpoint handler installed")
        quick = "import time; time.sleep(0.3)"
        urgent = SubmitJob(spec=spec("urgent", ["python", "-c", quick], priority_class="critical",
                                     resources=GpuRequest(gpus=1)))
        failing = SubmitJob(spec=spec("failing", ["python", "-c", "import sys; sys.exit(3)"],
                                      resources=GpuRequest(gpu_milli=250), max_requeues=0))
        never = SubmitJob(spec=spec("never", ["python", "-c", quick], resources=GpuRequest(gpus=8)))
        doomed = SubmitJob(spec=spec("doomed", ["python", "-c", quick], resources=GpuRequest(gpus=2),
                                     priority_class="low"))
        for message in (urgent, failing, never, doomed):
            await broker.publish(message)
        await wait_rows(pg_dsn, "SELECT state FROM jobs WHERE job_id = $1", doomed.job_id,
                        until=lambda rs: rs and rs[0]["state"] == "queued", what="doomed waiting")
        await broker.publish(CancelJob(job_id=doomed.job_id, reason="changed my mind"))
        await wait_jobs_terminal(pg_dsn, [victim.job_id, urgent.job_id, failing.job_id, doomed.job_id],
                                 timeout_s=150)

    live, published = await replayed_as_logged(stack, pg_dsn, journal)
    kinds = {e["type"] for e in live}
    assert {"job.placed", "job.preempting", "job.checkpointed", "job.requeued", "job.rejected", "job.cancelled",
            "job.failed", "job.finished"} <= kinds, kinds  # the workload did what it was meant to
    assert any(kind == "stop_job" for kind, _ in published) and any(kind == "launch_job" for kind, _ in published)


@pytest.mark.timeout(240)
async def test_arrays_and_dependencies_replayed_through_the_harness_decide_the_same_events(
    stack: LocalStack, amqp_url: str, pg_dsn: str, tmp_path: Path
) -> None:
    journal = tmp_path / "journal.jsonl"
    quick = "import time; time.sleep(0.3)"
    async with journaled_run(stack, amqp_url, journal) as broker:
        sweep = SubmitJob(spec=spec("sweep", ["python", "-c", quick], resources=GpuRequest(gpu_milli=100),
                                    array={"indices": "0-7", "parallelism": 2}))
        await publish_when_routable(broker, sweep)
        await broker.publish(SetArrayParallelism(job_id=sweep.job_id, parallelism=3))
        evaluate = SubmitJob(spec=spec("evaluate", ["python", "-c", quick],
                                       depends_on=[{"condition": "afterok", "job_id": sweep.job_id}]))
        failing = SubmitJob(spec=spec("failing", ["python", "-c", "import sys; sys.exit(3)"], max_requeues=0))
        for message in (evaluate, failing):
            await broker.publish(message)
        doomed = SubmitJob(spec=spec("doomed", ["python", "-c", quick],
                                     depends_on=[{"condition": "afterok", "job_id": failing.job_id}]))
        await broker.publish(doomed)
        ended = await wait_jobs_terminal(pg_dsn, [sweep.job_id, evaluate.job_id, failing.job_id, doomed.job_id],
                                         timeout_s=150)

    assert [ended[j.job_id]["state"] for j in (sweep, evaluate, doomed)] == ["succeeded", "succeeded", "cancelled"]
    live, _ = await replayed_as_logged(stack, pg_dsn, journal)
    assert {"job.array_parallelism_changed", "job.cancelled"} <= {e["type"] for e in live}
