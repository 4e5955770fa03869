"""The live scheduler with identity on (``GPUORCH_IDENTITY=strict`` and an identity map): a submission for a
tenant its publisher may not use, or above its highest priority, is answered with a ``job.rejected`` routed to the
publisher's tenant; a forged job.failed and a forged node.registered from a submitter are dead-lettered with the
reason and change nothing; a cancel from another tenant changes nothing; the tenant of an accepted job is the one
its publisher's identity gives.

The forger has every broker right on the vhost: the scheduler's own checks are what refuses it.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aio_pika
import pytest
from gpuorch_contracts import (
    COMMANDS_EXCHANGE,
    EVENTS_EXCHANGE,
    CancelJob,
    GpuRequest,
    JobFailed,
    JobSpec,
    JobStarted,
    ProcessRun,
    SubmitJob,
    decode,
)
from gpuorch_gpuctl_ops.stack import LocalStack
from gpuorch_messaging import REASON_HEADER, Broker, QueueSpec
from gpuorch_scheduling.testing import registered_node

from tests.deploy.broker_users import RoleUsers
from tests.deploy.test_forged_messages import AllRights
from tests.e2e.harness import FakeNodes, wait_rows

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SUFFIX = uuid.uuid4().hex[:8]
NODE = f"n{SUFFIX}"


@pytest.fixture
def users(amqp_vhost: str) -> Iterator[RoleUsers]:
    created = RoleUsers(amqp_vhost, {"scheduler": AllRights, "team-a": AllRights, "team-b": AllRights})
    created.names["node-agent"] = f"node-agent-{NODE}"
    created.grants.append(AllRights(f"node-agent-{NODE}"))
    with created.created():
        yield created


@pytest.fixture
def stack(tmp_path: Path, amqp_url: str, pg_dsn: str, users: RoleUsers) -> Iterator[LocalStack]:
    identity = {"identities": {
        users.names["team-a"]: {"role": "submitter", "tenants": ["team-a"], "default_tenant": "team-a",
                                "max_priority": "normal"},
        users.names["team-b"]: {"role": "submitter", "tenants": ["team-b"], "default_tenant": "team-b",
                                "max_priority": "normal"},
        users.names["scheduler"]: {"role": "service"},
        users.names["node-agent"]: {"role": "service", "nodes": [NODE]},
    }}
    path = tmp_path / "identity.json"
    path.write_text(json.dumps(identity))
    local = LocalStack(root=tmp_path, amqp_url=amqp_url, database_url=pg_dsn, nodes=[],
                       extra_env={"GPUORCH_IDENTITY": "strict", "GPUORCH_IDENTITY_MAP": str(path)})
    try:
        yield local
    finally:
        local.stop_all()


async def next_of(queue: asyncio.Queue[Any]) -> Any:
    async with asyncio.timeout(60):
        return await queue.get()


async def test_tenants_and_facts_come_from_identity_not_from_bodies(
    stack: LocalStack, users: RoleUsers, amqp_url: str, pg_dsn: str
) -> None:
    stack.start_scheduler(GPUORCH_AMQP_URL=users.url("scheduler"))
    await stack.queues_declared(["scheduler", "scheduler.heartbeats"], timeout_s=60)
    agent = Broker(users.url("node-agent"), producer="node-agent", identity="strict")
    team_a = Broker(users.url("team-a"), producer="team-a", identity="strict")
    team_b = Broker(users.url("team-b"), producer="team-b", identity="strict")
    connection = await aio_pika.connect(amqp_url)
    nodes = FakeNodes(agent, [registered_node(NODE, gpus=2)])
    try:
        for broker in (agent, team_a, team_b):
            await broker.connect()
        await agent.declare_queue(QueueSpec(f"executor.{NODE}", [(COMMANDS_EXCHANGE, f"node.{NODE}.#")]))
        channel = await connection.channel()
        rejected: asyncio.Queue[Any] = asyncio.Queue()
        answers = await channel.declare_queue("", exclusive=True)
        await answers.bind(EVENTS_EXCHANGE, "job.rejected.#")

        async def on_answer(m: Any) -> None:
            rejected.put_nowait((m.routing_key, decode(m.body)))

        await answers.consume(on_answer, no_ack=True)
        dead: asyncio.Queue[Any] = asyncio.Queue()
        letters = await channel.declare_queue("scheduler.dlq", passive=True)

        async def on_letter(m: Any) -> None:
            dead.put_nowait(str((m.headers or {}).get(REASON_HEADER)))

        await letters.consume(on_letter, no_ack=True)
        await nodes.start(interval_s=0.5)
        await wait_rows(pg_dsn, "SELECT * FROM nodes", until=lambda rs: len(rs) == 1, what="node registered")

        run = ProcessRun(argv=["python", "-c", "pass"])
        mine = SubmitJob(spec=JobSpec(run=run, resources=GpuRequest(gpus=1)))  # no tenant: the publisher's
        await team_a.publish(mine)
        rows = await wait_rows(pg_dsn, "SELECT tenant, state FROM jobs WHERE job_id = $1", mine.job_id,
                               until=lambda rs: rs and rs[0]["state"] == "placed", what="team-a's job placed")
        assert rows[0]["tenant"] == "team-a"

        foreign = SubmitJob(spec=JobSpec(run=run, tenant="team-a", resources=GpuRequest(gpus=1)))
        await team_b.publish(foreign)
        routing_key, answer = await next_of(rejected)
        assert answer.job_id == foreign.job_id and routing_key == "job.rejected.team-b"
        assert "may not submit for tenant 'team-a'" in answer.reason

        urgent = SubmitJob(spec=JobSpec(run=run, priority_class="critical", resources=GpuRequest(gpus=1)))
        await team_a.publish(urgent)
        routing_key, answer = await next_of(rejected)
        assert answer.job_id == urgent.job_id and "at most priority 'normal'" in answer.reason

        held = (await wait_rows(pg_dsn, "SELECT placement_id FROM jobs WHERE job_id = $1", mine.job_id,
                                until=lambda rs: rs and rs[0]["placement_id"]))[0]["placement_id"]
        await team_b.publish(JobFailed(job_id=mine.job_id, placement_id=held, node_id=NODE, cause="nonzero_exit",
                                       reason="forged", tenant="team-a"))
        assert "job.failed from" in await next_of(dead)
        await team_b.publish(registered_node("ghost", gpus=8))
        assert "node.registered from" in await next_of(dead)
        await team_b.publish(JobStarted(job_id=mine.job_id, placement_id=held, node_id=NODE,
                                        log_path="/etc/shadow", tenant="team-a"))  # what gpuctl logs would print
        assert "job.started from" in await next_of(dead)
        await team_b.publish(CancelJob(job_id=mine.job_id, reason="not yours"))
        # a marker after the forgeries: once it is accepted, the forgeries before it have been handled
        marker = SubmitJob(spec=JobSpec(run=run, resources=GpuRequest(gpus=1)))
        await team_b.publish(marker)
        await wait_rows(pg_dsn, "SELECT state FROM jobs WHERE job_id = $1", marker.job_id,
                        until=lambda rs: rs and rs[0]["state"] in ("placed", "queued"), what="marker accepted")
        state = await wait_rows(pg_dsn, "SELECT state, placement_id, log_path FROM jobs WHERE job_id = $1",
                                mine.job_id, until=lambda rs: True)
        assert (state[0]["state"], state[0]["placement_id"], state[0]["log_path"]) == ("placed", held, None)
        known = await wait_rows(pg_dsn, "SELECT node_id FROM nodes", until=lambda rs: True)
        assert [r["node_id"] for r in known] == [NODE]
        accepted = await wait_rows(pg_dsn, "SELECT count(*) AS n FROM jobs WHERE state <> 'rejected'",
                                   until=lambda rs: True)
        assert accepted[0]["n"] == 2  # mine and the marker; foreign and urgent were rejected
    finally:
        await nodes.stop()
        for broker in (agent, team_a, team_b):
            await broker.close()
        await connection.close()
