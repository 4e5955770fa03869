"""The real services, each logged in as its own least-privilege user, run a job submitted by the ``submitter``.

This is what the compose file and the Kubernetes manifests do: the setup step declares the topology, the services
only look it up (``GPUORCH_BROKER_TOPOLOGY=passive``). If any service needed a right the generator does not grant
(a queue, an exchange, a routing key), the broker would close its channel with ACCESS_REFUSED and the job would
not finish, or the refusal would show in that service's log.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import aio_pika
import pytest
from gpuorch_contracts import JobSpec, ProcessRun, SubmitJob
from gpuorch_gpuctl_ops.stack import LocalStack, SimNode
from gpuorch_messaging.queues import Installation, install

from tests.deploy.broker_users import BrokerUsers, gen
from tests.e2e.harness import wait_jobs_terminal, wait_rows

pytestmark = [pytest.mark.integration, pytest.mark.slow]

NODE = "lp-node-1"


@pytest.fixture
def users(amqp_vhost: str) -> Iterator[dict[str, str]]:
    suffix = uuid.uuid4().hex[:8]
    names = {role: f"{role}-{suffix}" for role in ("scheduler", "telemetry", "executor", "node-agent", "submitter")}
    created = BrokerUsers(amqp_vhost, [
        gen.scheduler(names["scheduler"]), gen.telemetry(names["telemetry"]), gen.submitter(names["submitter"]),
        gen.executor(names["executor"], [NODE]),
        gen.node_agent(names["node-agent"], "node-agent.fleet.local", [NODE]),  # LocalStack's fleet name
    ]).create()
    try:
        yield {role: created.url(name) for role, name in names.items()} | {"admin": created.admin_url}
    finally:
        created.delete()


@pytest.fixture
def stack(tmp_path: Path, amqp_url: str, pg_dsn: str) -> Iterator[LocalStack]:
    local = LocalStack(root=tmp_path, amqp_url=amqp_url, database_url=pg_dsn,
                       nodes=[SimNode(NODE, "a100-80", 2)],
                       extra_env={"GPUORCH_HEARTBEAT_S": "1", "GPUORCH_TICK_S": "0.5",
                                  "GPUORCH_BROKER_TOPOLOGY": "passive"})
    try:
        yield local
    finally:
        local.stop_all()


async def test_services_run_a_job_with_least_privilege_users(
    stack: LocalStack, users: dict[str, str], pg_dsn: str
) -> None:
    await install(users["admin"], Installation(executor_nodes=[NODE], node_agents=[("node-agent.fleet.local", [NODE])]))
    stack.start_scheduler(GPUORCH_AMQP_URL=users["scheduler"])
    stack.start_executor(GPUORCH_AMQP_URL=users["executor"])
    await stack.queues_declared(["scheduler", "scheduler.heartbeats", f"executor.{NODE}"], timeout_s=60,
                                consumed=True)
    stack.start_telemetry(GPUORCH_AMQP_URL=users["telemetry"])
    await stack.queues_declared(["telemetry.samples"], timeout_s=60, consumed=True)
    stack.start_node_agents(GPUORCH_AMQP_URL=users["node-agent"])
    await wait_rows(pg_dsn, "SELECT * FROM nodes", until=lambda rows: len(rows) == 1, what="node registered")

    job = SubmitJob(spec=JobSpec(run=ProcessRun(argv=["python", "-c", "print('least privilege')"]),
                                 resources={"gpus": 1}), producer="other-system")  # type: ignore[arg-type]
    connection = await aio_pika.connect(users["submitter"])
    try:
        channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
        exchange = await channel.get_exchange("gpuorch.submit")
        await exchange.publish(aio_pika.Message(job.model_dump_json().encode(), content_type="application/json",
                                                message_id=str(job.message_id)), "job.submit", mandatory=True)
    finally:
        await connection.close()

    rows = await wait_jobs_terminal(pg_dsn, [job.job_id], timeout_s=60)
    logs = {name: stack.tail(name, 400) for name in stack.processes}
    assert rows[job.job_id]["state"] == "succeeded", logs
    assert stack.dead() == [], {name: stack.tail(name, 30) for name in stack.processes}
    for name, text in logs.items():
        assert "ACCESS_REFUSED" not in text, f"{name} was refused something:\n{text}"
