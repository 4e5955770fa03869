"""Forged commands against the live executor and node-agent with identity on (``GPUORCH_IDENTITY=strict``): a
LaunchJob or ApplyMigLayout from anyone but the scheduler is dead-lettered with the reason and changes nothing,
while the scheduler's own commands are carried out.

The forger has every broker right on the vhost (as if the broker's permissions were misconfigured, or a service
account leaked): this is the consumer's own check, the second line behind deploy/rabbitmq's permissions.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aio_pika
import pytest
from gpuorch_contracts import EVENTS_EXCHANGE, ApplyMigLayout, JobSpec, LaunchJob, MigGpuLayout, decode
from gpuorch_gpuctl_ops.stack import LocalStack, SimNode
from gpuorch_messaging import REASON_HEADER, Broker

from tests.deploy.broker_users import RoleUsers

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SUFFIX = uuid.uuid4().hex[:8]
NODE = f"n{SUFFIX}"
SPEC = JobSpec.model_validate({"run": {"runtime": "process", "argv": ["python", "-c", "print(1)"]}})


class AllRights:
    """A stand-in grant with every right on the vhost (the users differ only by name, hence by role)."""

    def __init__(self, user: str) -> None:
        self.user, self.configure, self.write, self.read = user, ".*", ".*", ".*"
        self.topics: dict[str, tuple[str, str]] = {}
        self.tags: tuple[str, ...] = ()


@pytest.fixture
def users(amqp_vhost: str) -> Iterator[RoleUsers]:
    created = RoleUsers(amqp_vhost, {"scheduler": AllRights, "gpuctl-operator": AllRights})
    created.names.update({"executor": f"executor-{NODE}", "node-agent": f"node-agent-{NODE}"})
    created.grants += [AllRights(f"executor-{NODE}"), AllRights(f"node-agent-{NODE}")]
    with created.created():
        yield created


@pytest.fixture
def stack(tmp_path: Path, amqp_url: str, users: RoleUsers) -> Iterator[LocalStack]:
    local = LocalStack(root=tmp_path, amqp_url=amqp_url, database_url="postgresql://unused",
                       nodes=[SimNode(NODE, "a100-80", 2)], extra_env={"GPUORCH_IDENTITY": "strict"})
    try:
        yield local
    finally:
        local.stop_all()


class Tap:
    def __init__(self) -> None:
        self.items: asyncio.Queue[aio_pika.abc.AbstractIncomingMessage] = asyncio.Queue()

    async def __call__(self, message: aio_pika.abc.AbstractIncomingMessage) -> None:
        await message.ack()
        await self.items.put(message)

    async def next(self) -> aio_pika.abc.AbstractIncomingMessage:
        async with asyncio.timeout(30):
            return await self.items.get()


async def tap(channel: Any, queue: str, bind: tuple[str, str] | None = None) -> Tap:
    if bind is None:
        declared = await channel.declare_queue(queue, passive=True)
    else:
        declared = await channel.declare_queue(queue, exclusive=True)
        await declared.bind(*bind)
    listener = Tap()
    await declared.consume(listener)
    return listener


async def test_forged_commands_are_refused_with_the_reason_and_change_nothing(
    stack: LocalStack, users: RoleUsers, amqp_url: str, tmp_path: Path
) -> None:
    stack.start_executor(GPUORCH_AMQP_URL=users.url("executor"))
    stack.start_node_agents(GPUORCH_AMQP_URL=users.url("node-agent"))
    node_agent_queue = "node-agent.fleet.local"
    await stack.queues_declared([f"executor.{NODE}", node_agent_queue], timeout_s=60)
    connection = await aio_pika.connect(amqp_url)
    forger = Broker(users.url("gpuctl-operator"), producer="gpuctl", identity="strict")
    scheduler = Broker(users.url("scheduler"), producer="scheduler/forged-test", identity="strict")
    try:
        channel = await connection.channel()
        events = await tap(channel, "t.events", (EVENTS_EXCHANGE, "job.#"))
        mig_answers = await tap(channel, "t.mig", (EVENTS_EXCHANGE, "node.mig_layout_applied"))
        executor_dead = await tap(channel, f"executor.{NODE}.dlq")
        agent_dead = await tap(channel, f"{node_agent_queue}.dlq")
        await forger.connect()
        await scheduler.connect()

        forged = LaunchJob(node_id=NODE, job_id=uuid.uuid4(), placement_id=uuid.uuid4(), spec=SPEC)
        await forger.publish(forged)
        await forger.publish(ApplyMigLayout(node_id=NODE, layouts=[MigGpuLayout(gpu_index=0)], reason="forged"))
        for dead, command in ((executor_dead, "launch_job"), (agent_dead, "apply_mig_layout")):
            letter = await dead.next()
            reason = str((letter.headers or {})[REASON_HEADER])
            assert f"{command} from {users.names['gpuctl-operator']} (role operator) refused" in reason
            assert "only scheduler may send it" in reason

        genuine = LaunchJob(node_id=NODE, job_id=uuid.uuid4(), placement_id=uuid.uuid4(), spec=SPEC)
        await scheduler.publish(genuine)
        genuine_layout = ApplyMigLayout(node_id=NODE, layouts=[MigGpuLayout(gpu_index=0)], reason="ok")
        await scheduler.publish(genuine_layout)
        seen = []
        while not seen or seen[-1][1] not in ("job.finished", "job.failed"):
            delivery = await events.next()
            event = decode(delivery.body)
            seen.append((event.job_id, event.TYPE, delivery.routing_key, delivery.user_id))  # type: ignore[attr-defined]
        assert {job for job, *_ in seen} == {genuine.job_id}  # the forged launch never ran
        assert seen[0][1:] == ("job.started", "job.started.default", users.names["executor"])
        answer = decode((await mig_answers.next()).body)
        assert answer.command_id == str(genuine_layout.message_id)  # type: ignore[attr-defined]  # the first one
        assert not (tmp_path / "executor" / NODE / "placements" / str(forged.placement_id)).exists()
        assert executor_dead.items.empty() and agent_dead.items.empty()
    finally:
        await forger.close()
        await scheduler.close()
        await connection.close()
