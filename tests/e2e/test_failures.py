"""Failure paths end to end: the broker connection drops mid-flow; malformed submissions are dead-lettered."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aio_pika
import pytest
from gpuorch_contracts import SUBMIT_EXCHANGE, GpuRequest, JobSpec, ProcessRun, SubmitJob
from gpuorch_gpuctl_ops.stack import LocalStack
from gpuorch_messaging import REASON_HEADER, Broker
from gpuorch_messaging.testing import TcpProxy
from gpuorch_scheduling.testing import registered_node

from tests.e2e.harness import nodes_online, publish_when_routable, wait_jobs_terminal, wait_rows

pytestmark = [pytest.mark.integration, pytest.mark.slow]

RECORD_RUN = "import os, sys, time; open(sys.argv[1], 'a').write(os.environ['GPUORCH_JOB_ID'] + '\\n'); time.sleep(1.5)"


@pytest.mark.timeout(300)
async def test_connection_drops_mid_flow_and_every_job_completes_exactly_once(
    stack: LocalStack, amqp_url: str, amqp_vhost: str, pg_dsn: str, tmp_path: Path
) -> None:
    """A cut cancels the executor's delivery task mid-launch (aiormq cancels a closed channel's consumer tasks).
    Under load that used to leave a job `placed` for good: its handler stopped while waiting for the job to start,
    the job ran, and its JobStarted was never sent. The broker adapter now lets a handler finish, and the executor
    finishes an interrupted launch itself (watch loop, or the redelivery)."""
    proxy = TcpProxy("127.0.0.1", 5672)
    await proxy.start()
    stack.amqp_url = f"amqp://guest:guest@127.0.0.1:{proxy.port}/{amqp_vhost}"
    stack.start_scheduler()
    stack.start_executor()
    await stack.queues_declared(["scheduler", "scheduler.heartbeats", "executor.node-1"])
    runs = tmp_path / "runs.txt"
    try:  # the test itself talks to the broker directly, not through the proxy
        async with nodes_online(amqp_url, pg_dsn, [registered_node("node-1", gpus=4)]) as broker:
            submits = [SubmitJob(spec=JobSpec(resources=GpuRequest(gpus=1),
                                              run=ProcessRun(argv=["python", "-c", RECORD_RUN, str(runs)])))
                       for _ in range(8)]
            for i, submit in enumerate(submits):
                await publish_when_routable(broker, submit)
                if i in (2, 5):
                    await asyncio.sleep(0.8)
                    await proxy.cut()  # every service connection drops at once, mid-flow
            await asyncio.sleep(1.0)
            await proxy.cut()
            assert proxy.cuts == 3
            rows = await wait_jobs_terminal(pg_dsn, [s.job_id for s in submits], timeout_s=120)
            events = await wait_rows(pg_dsn, "SELECT type, payload::text AS payload FROM events", until=lambda rs: True)
    finally:
        await proxy.stop()
    assert {r["state"] for r in rows.values()} == {"succeeded"}
    assert stack.dead() == []  # no service died across the cuts (a crashed relay would stop the scheduler)
    ran = runs.read_text().split()
    assert sorted(ran) == sorted(str(s.job_id) for s in submits), "each job ran exactly once"
    for kind in ("job.placed", "job.started", "job.finished"):
        per_job = [json.loads(e["payload"])["job_id"] for e in events if e["type"] == kind]
        assert sorted(per_job) == sorted(str(s.job_id) for s in submits), kind


@pytest.mark.parametrize(
    "body",
    [b"{not json", b'{"type": "job.submit", "spec": {"run": {"argv": ["x"]}}, "extra": 1}',
     b'{"type": "job.submit", "spec": {"run": {"argv": "python"}}}',
     b'{"type": "job.submit", "spec": {"run": {"argv": ["x"]}, "name": "' + b"n" * 300_000 + b'"}}'],
    ids=["bad-json", "unknown-field", "wrong-type", "oversized"],
)
async def test_malformed_submission_is_dead_lettered_with_reason_while_valid_jobs_flow(
    stack: LocalStack, amqp_url: str, pg_dsn: str, body: bytes
) -> None:
    stack.start_scheduler()
    await stack.queues_declared(["scheduler", "scheduler.heartbeats"])
    connection = await aio_pika.connect(amqp_url)
    broker = Broker(amqp_url, producer="test")
    await broker.connect()
    try:
        channel = await connection.channel(publisher_confirms=True)
        exchange = await channel.get_exchange(SUBMIT_EXCHANGE)
        await exchange.publish(aio_pika.Message(body, message_id="bad"), routing_key="job.submit")
        valid = SubmitJob(spec=JobSpec(run=ProcessRun(argv=["python", "-c", "pass"])))
        await broker.publish(valid)
        await wait_rows(pg_dsn, "SELECT state FROM jobs WHERE job_id = $1", valid.job_id,
                        until=lambda rs: rs and rs[0]["state"] == "queued", what="valid job queued")
        dlq = await channel.declare_queue("scheduler.submit.dlq", passive=True)  # the shared lane
        dead = None
        for _ in range(40):
            dead = await dlq.get(no_ack=True, fail=False)
            if dead is not None:
                break
            await asyncio.sleep(0.25)
        assert dead is not None and dead.body == body
        assert dead.headers[REASON_HEADER].startswith("invalid message")
        assert stack.dead() == []  # the scheduler kept running
    finally:
        await broker.close()
        await connection.close()


async def test_broker_closing_a_running_services_connection_is_survived(
    stack: LocalStack, amqp_url: str, amqp_vhost: str, pg_dsn: str
) -> None:
    import httpx

    stack.start_scheduler()
    stack.start_executor()
    await stack.queues_declared(["scheduler", "scheduler.heartbeats", "executor.node-1"])
    async with nodes_online(amqp_url, pg_dsn, [registered_node("node-1", gpus=1)]) as broker:
        first = SubmitJob(spec=JobSpec(resources=GpuRequest(gpus=1), run=ProcessRun(argv=["python", "-c", "pass"])))
        await broker.publish(first)
        await wait_jobs_terminal(pg_dsn, [first.job_id])
        # the broker closes every connection of the services (as `rabbitmqctl close_connection` would)
        async with httpx.AsyncClient(base_url="http://127.0.0.1:15672", auth=("guest", "guest")) as api:
            services: list[dict] = []
            for _ in range(60):  # the management API lists connections only after its next stats round (~5 s)
                listed = (await api.get(f"/api/vhosts/{amqp_vhost}/connections")).json()
                services = [c for c in listed if str(c.get("client_properties", {}).get("connection_name", ""))
                            .startswith(("scheduler", "executor"))]
                if len(services) >= 2:
                    break
                await asyncio.sleep(0.5)
            assert len(services) >= 2, listed
            for c in services:
                await api.delete(f"/api/connections/{c['name']}", headers={"X-Reason": "test restart"})
        second = SubmitJob(spec=JobSpec(resources=GpuRequest(gpus=1), run=ProcessRun(argv=["python", "-c", "pass"])))
        await publish_when_routable(broker, second)
        rows = await wait_jobs_terminal(pg_dsn, [second.job_id], timeout_s=60)
    assert rows[second.job_id]["state"] == "succeeded"
    assert stack.dead() == []
