"""The scheduler as a real process (LocalStack: RabbitMQ, PostgreSQL, executor): crashes, standby, preemption,
node liveness, pending reasons and rejections, seen through the event log and the read models."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from gpuorch_contracts import COMMANDS_EXCHANGE, CancelJob, GpuRequest, JobSpec, ProcessRun, SubmitJob
from gpuorch_gpuctl_ops.stack import LocalStack
from gpuorch_messaging import Broker, QueueSpec
from gpuorch_scheduling.testing import registered_node

from tests.e2e.harness import FakeNodes, publish_when_routable, wait_jobs_terminal, wait_rows

from .crash_drill import crash_drill

pytestmark = [pytest.mark.integration, pytest.mark.slow]


async def events_of(dsn: str) -> list[dict[str, Any]]:
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch("SELECT position, type, payload::text AS payload FROM events ORDER BY position")
    finally:
        await conn.close()
    return [{"position": r["position"], "type": r["type"], **json.loads(r["payload"])} for r in rows]


@pytest.mark.timeout(400)
async def test_sigkill_at_random_moments_places_every_job_exactly_once(
    stack: LocalStack, amqp_url: str, pg_dsn: str
) -> None:
    report = await crash_drill(stack, amqp_url, pg_dsn, jobs=150, kills=5, seed=20261130)
    assert report.unplaced == 0
    assert report.requeues == 0  # nothing is lost or requeued: every restart gives each lease a fresh grace
    assert report.placements == 150 and report.duplicates == 0
    assert report.capacity_violations == []
    assert len(report.recovery_s) == 5


@pytest.mark.timeout(300)
async def test_standby_takes_over_when_the_active_scheduler_is_killed(
    stack: LocalStack, amqp_url: str, pg_dsn: str
) -> None:
    report = await crash_drill(stack, amqp_url, pg_dsn, jobs=60, kills=2, seed=7, standby=True)
    assert report.leaders == ["scheduler-1", "scheduler-2", "scheduler-1"]  # each kill: the standby continued
    assert report.unplaced == 0 and report.placements == 60 and report.duplicates == 0
    assert report.capacity_violations == []


VICTIM = """
import os, pathlib, signal, sys, time
marker = pathlib.Path(sys.argv[1])
if marker.exists():
    sys.exit(0)  # resumed from its checkpoint: done
def checkpoint(*_):
    marker.write_text("step 42")
    pathlib.Path(os.environ["GPUORCH_CHECKPOINT_FILE"]).write_text("ok")
    sys.exit(0)
signal.signal(signal.SIGTERM, checkpoint)
pathlib.Path(sys.argv[2]).write_text("handler installed")
while True:
    time.sleep(0.05)
"""


async def wait_path(path: Path, what: str, timeout_s: float = 60.0) -> None:
    """Poll until ``path`` exists; raise after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.1)


@pytest.mark.timeout(200)
async def test_preemption_checkpoints_the_victim_then_requeues_it_and_holds_its_gpu_until_it_stopped(
    stack: LocalStack, amqp_url: str, pg_dsn: str, tmp_path: Path
) -> None:
    stack.start_scheduler()
    stack.start_executor()
    await stack.queues_declared(["scheduler", "scheduler.heartbeats", "executor.node-1"])
    broker = Broker(amqp_url, producer="test")
    await broker.connect()
    nodes = FakeNodes(broker, [registered_node("node-1", gpus=1)])
    try:
        await nodes.start()
        victim = SubmitJob(spec=JobSpec(
            name="victim", priority_class="low", preemptible=True, resources=GpuRequest(gpus=1),
            checkpoint={"signal": "SIGTERM", "grace_s": 20},  # type: ignore[arg-type]
            run=ProcessRun(argv=["python", "-c", VICTIM, str(tmp_path / "marker"), str(tmp_path / "ready")])))
        await publish_when_routable(broker, victim)
        await wait_rows(pg_dsn, "SELECT state FROM jobs WHERE job_id = $1", victim.job_id,
                        until=lambda rs: rs and rs[0]["state"] == "running", what="victim running")
        # "running" means spawned; a SIGTERM before the victim's handler is installed would kill it uncheckpointed
        await wait_path(tmp_path / "ready", what="victim's checkpoint handler installed")
        urgent = SubmitJob(spec=JobSpec(name="urgent", priority_class="critical", resources=GpuRequest(gpus=1),
                                        run=ProcessRun(argv=["python", "-c", "import time; time.sleep(0.5)"])))
        await broker.publish(urgent)
        rows = await wait_jobs_terminal(pg_dsn, [victim.job_id, urgent.job_id], timeout_s=120)
    finally:
        await nodes.stop()
        await broker.close()
    assert {r["state"] for r in rows.values()} == {"succeeded"}
    assert (tmp_path / "marker").read_text() == "step 42"
    events = await events_of(pg_dsn)
    about_victim = [e for e in events if e.get("job_id") == str(victim.job_id)]
    kinds = [e["type"] for e in about_victim]
    assert kinds[:8] == ["job.accepted", "job.placed", "job.started", "job.preempting", "job.checkpointed",
                         "job.failed", "job.requeued", "job.placed"], kinds
    requeued = next(e for e in about_victim if e["type"] == "job.requeued")
    assert requeued["preempted"] is True and requeued["requeues"] == 0
    stopped_at = next(e["position"] for e in about_victim if e["type"] == "job.failed")
    urgent_placed = [e["position"] for e in events if e["type"] == "job.placed" and e["job_id"] == str(urgent.job_id)]
    assert len(urgent_placed) == 1 and urgent_placed[0] > stopped_at  # the GPU was held until the victim stopped


@pytest.mark.timeout(200)
async def test_pending_reason_estimate_rejection_and_cancel_reach_gpuctl(
    stack: LocalStack, amqp_url: str, pg_dsn: str
) -> None:
    stack.start_scheduler()
    await stack.queues_declared(["scheduler", "scheduler.heartbeats"])
    broker = Broker(amqp_url, producer="test")
    await broker.connect()
    nodes = FakeNodes(broker, [registered_node("node-1", gpus=2, nvlink=[(0, 1)])])
    # a stand-in for node-1's executor queue: the blocker's launch is routable, so the scheduler does not declare
    # it lost (an undeliverable LaunchJob is parked and its job requeued) and free its GPU under the test
    await broker.declare_queue(QueueSpec("executor.node-1", [(COMMANDS_EXCHANGE, "node.node-1.#")]))
    try:
        await nodes.start()
        await wait_rows(pg_dsn, "SELECT * FROM nodes", until=lambda rs: len(rs) == 1, what="node registered")
        never = SubmitJob(spec=JobSpec(resources=GpuRequest(gpus=4), run=ProcessRun(argv=["true"])))
        blocker = SubmitJob(spec=JobSpec(resources=GpuRequest(gpus=1), max_runtime_s=3600, run=ProcessRun(argv=["x"])))
        waiting = SubmitJob(spec=JobSpec(resources=GpuRequest(gpus=2), run=ProcessRun(argv=["x"])))
        for message in (never, blocker, waiting):
            await publish_when_routable(broker, message)
        rows = await wait_rows(
            pg_dsn, "SELECT * FROM jobs WHERE job_id = ANY($1::uuid[])", [never.job_id, waiting.job_id],
            until=lambda rs: {r["state"] for r in rs} == {"rejected", "queued"} and all(
                r["pending_reason"] for r in rs if r["state"] == "queued"), what="rejection and pending reason")
        by_id = {r["job_id"]: r for r in rows}
        assert "can never fit" in by_id[never.job_id]["reason"] and "4 GPUs" in by_id[never.job_id]["reason"]
        pending = by_id[waiting.job_id]
        assert pending["pending_reason"] == "needs 2 GPUs on one node; largest free: 1"
        placed_at = (await wait_rows(pg_dsn, "SELECT placed_at FROM jobs WHERE job_id = $1", blocker.job_id,
                                     until=lambda rs: rs and rs[0]["placed_at"]))[0]["placed_at"]
        # the blocker has not started (no executor), so its max runtime counts from its placement
        assert abs(pending["estimated_start"].timestamp() - (placed_at.timestamp() + 3600)) < 5
        env = {**os.environ, "GPUORCH_DATABASE_URL": pg_dsn}
        # gpuctl runs in a thread: the fake node's heartbeats come from this event loop, and a loop blocked for the
        # CLI's run (long on a busy machine) would leave node-1 silent past the suspect deadline
        listed = json.loads((await asyncio.to_thread(
            subprocess.run, [sys.executable, "-m", "gpuorch_gpuctl", "jobs", "--json"], env=env,
            capture_output=True, text=True, check=True)).stdout)
        shown = {j["id"]: j for j in listed}
        assert shown[str(waiting.job_id)]["pending_reason"] == "needs 2 GPUs on one node; largest free: 1"
        described = json.loads((await asyncio.to_thread(
            subprocess.run, [sys.executable, "-m", "gpuorch_gpuctl", "describe", str(waiting.job_id), "--json"],
            env=env, capture_output=True, text=True, check=True)).stdout)
        assert described["estimated_start"] is not None
        await broker.publish(CancelJob(job_id=waiting.job_id, reason="no longer needed"))
        cancelled = await wait_jobs_terminal(pg_dsn, [waiting.job_id])
        assert cancelled[waiting.job_id]["state"] == "cancelled"
        assert cancelled[waiting.job_id]["pending_reason"] is None
    finally:
        await nodes.stop()
        await broker.close()


@pytest.mark.timeout(200)
async def test_a_silent_node_is_suspect_then_lost_and_its_job_moves_but_mass_silence_only_alerts(
    stack: LocalStack, amqp_url: str, pg_dsn: str
) -> None:
    stack.start_scheduler(GPUORCH_SUSPECT_AFTER_S="1.5", GPUORCH_LOST_AFTER_S="4")
    await stack.queues_declared(["scheduler", "scheduler.heartbeats"])
    broker = Broker(amqp_url, producer="test")
    await broker.connect()
    healthy = FakeNodes(broker, [registered_node("node-b", gpus=1), registered_node("node-c", gpus=1)])
    doomed = FakeNodes(broker, [registered_node("node-a", gpus=1)])
    for name in ("node-a", "node-b", "node-c"):  # stand-ins for their executors' queues: launches are routable
        await broker.declare_queue(QueueSpec(f"executor.{name}", [(COMMANDS_EXCHANGE, f"node.{name}.#")]))
    try:
        await doomed.start(interval_s=0.3)
        await wait_rows(pg_dsn, "SELECT * FROM nodes", until=lambda rs: len(rs) == 1, what="node-a registered")
        job = SubmitJob(spec=JobSpec(resources=GpuRequest(gpus=1), run=ProcessRun(argv=["x"]), max_requeues=2))
        await publish_when_routable(broker, job)
        await wait_rows(pg_dsn, "SELECT node_ids FROM jobs WHERE job_id = $1", job.job_id,
                        until=lambda rs: rs and rs[0]["node_ids"] == ["node-a"], what="placed on node-a")
        await healthy.start(interval_s=0.3)
        await wait_rows(pg_dsn, "SELECT * FROM nodes", until=lambda rs: len(rs) == 3, what="3 nodes")
        await doomed.stop()  # node-a goes silent: suspect, then lost; its job is requeued and placed elsewhere
        rows = await wait_rows(pg_dsn, "SELECT node_ids, requeues, state FROM jobs WHERE job_id = $1", job.job_id,
                               until=lambda rs: rs and rs[0]["requeues"] == 1 and rs[0]["state"] == "placed",
                               what="job moved")
        assert rows[0]["node_ids"] in (["node-b"], ["node-c"])
        liveness = [(e["node_id"], e["liveness"]) for e in await events_of(pg_dsn)
                    if e["type"] == "node.liveness_changed"]
        assert liveness[:2] == [("node-a", "suspect"), ("node-a", "lost")]
        await healthy.stop()  # now every node is silent at once: an alert, and nothing is requeued
        await wait_rows(pg_dsn, "SELECT count(*) AS n FROM outbox WHERE type = 'alert.fleet'",
                        until=lambda rs: rs[0]["n"] >= 1, what="mass-silence alert")
        time.sleep(5)  # past the lost deadline: nothing may be requeued in that time  # noqa: ASYNC251
        after = await wait_rows(pg_dsn, "SELECT requeues, state FROM jobs WHERE job_id = $1", job.job_id,
                                until=lambda rs: True)
        assert after[0]["requeues"] == 1 and after[0]["state"] == "placed"
    finally:
        await healthy.stop()
        await doomed.stop()
        await broker.close()


@pytest.mark.timeout(200)
async def test_cancelling_a_running_job_holds_its_gpu_until_the_executor_stopped_it(
    stack: LocalStack, amqp_url: str, pg_dsn: str
) -> None:
    stack.start_scheduler()
    stack.start_executor()
    await stack.queues_declared(["scheduler", "scheduler.heartbeats", "executor.node-1"])
    broker = Broker(amqp_url, producer="test")
    await broker.connect()
    nodes = FakeNodes(broker, [registered_node("node-1", gpus=1)])
    slow_to_stop = "import signal, time; signal.signal(signal.SIGTERM, lambda *_: (time.sleep(1.5), exit(0))); " \
                   "time.sleep(600)"
    try:
        await nodes.start()
        first = SubmitJob(spec=JobSpec(resources=GpuRequest(gpus=1), checkpoint={"grace_s": 10},  # type: ignore[arg-type]
                                       run=ProcessRun(argv=["python", "-c", slow_to_stop])))
        await publish_when_routable(broker, first)
        await wait_rows(pg_dsn, "SELECT state FROM jobs WHERE job_id = $1", first.job_id,
                        until=lambda rs: rs and rs[0]["state"] == "running", what="first running")
        await broker.publish(CancelJob(job_id=first.job_id))
        second = SubmitJob(spec=JobSpec(resources=GpuRequest(gpus=1), run=ProcessRun(argv=["python", "-c", "pass"])))
        await broker.publish(second)
        rows = await wait_jobs_terminal(pg_dsn, [first.job_id, second.job_id], timeout_s=60)
    finally:
        await nodes.stop()
        await broker.close()
    assert (rows[first.job_id]["state"], rows[second.job_id]["state"]) == ("cancelled", "succeeded")
    events = await events_of(pg_dsn)
    stopped = next(e["position"] for e in events if e["type"] == "job.failed" and e["job_id"] == str(first.job_id))
    placed = next(e["position"] for e in events if e["type"] == "job.placed" and e["job_id"] == str(second.job_id))
    assert placed > stopped  # the second job got the GPU only once the cancelled one had really ended


@pytest.mark.timeout(200)
async def test_an_undeliverable_launch_is_parked_its_job_answered_and_later_work_flows(
    stack: LocalStack, amqp_url: str, pg_dsn: str
) -> None:
    """A node whose executor has no queue: its LaunchJob is refused, parked after a few tries, and the job is
    failed (requeue limit 0) with the reason, while a later job on a node with an executor queue is launched."""
    stack.start_scheduler()
    await stack.queues_declared(["scheduler", "scheduler.heartbeats"])
    broker = Broker(amqp_url, producer="test")
    await broker.connect()
    lonely = FakeNodes(broker, [registered_node("node-lonely", gpus=1)])
    try:
        await lonely.start(interval_s=0.3)
        await wait_rows(pg_dsn, "SELECT * FROM nodes", until=lambda rs: len(rs) == 1, what="node registered")
        doomed = SubmitJob(spec=JobSpec(resources=GpuRequest(gpus=1), run=ProcessRun(argv=["x"]), max_requeues=0))
        await publish_when_routable(broker, doomed)
        failed = await wait_rows(pg_dsn, "SELECT state, reason FROM jobs WHERE job_id = $1", doomed.job_id,
                                 until=lambda rs: rs and rs[0]["state"] == "failed", what="job failed")
        assert "could not be delivered to node-lonely" in failed[0]["reason"]
        await broker.declare_queue(QueueSpec("executor.node-ok", [(COMMANDS_EXCHANGE, "node.node-ok.#")]))
        ok = FakeNodes(broker, [registered_node("node-ok", gpus=1)])
        await ok.start(interval_s=0.3)
        try:
            later = SubmitJob(spec=JobSpec(resources=GpuRequest(gpus=1, gpu_models=[]), run=ProcessRun(argv=["x"]),
                                           max_requeues=0))
            await wait_rows(pg_dsn, "SELECT * FROM nodes", until=lambda rs: len(rs) == 2, what="2 nodes")
            await publish_when_routable(broker, later)
            placed = await wait_rows(pg_dsn, "SELECT node_ids, state FROM jobs WHERE job_id = $1", later.job_id,
                                     until=lambda rs: rs and rs[0]["state"] == "placed", what="later job placed")
            assert placed[0]["node_ids"] in (["node-ok"], ["node-lonely"])
            parked = await wait_rows(pg_dsn, "SELECT count(*) AS n FROM outbox WHERE parked_at IS NOT NULL",
                                     until=lambda rs: rs[0]["n"] >= 1, what="the refused launch parked")
            assert parked[0]["n"] >= 1
        finally:
            await ok.stop()
    finally:
        await lonely.stop()
        await broker.close()
