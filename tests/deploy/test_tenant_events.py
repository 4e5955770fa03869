"""Answers for submitters, against the real RabbitMQ with the generator's users: a submitter reads its own
tenant's job events through its own queue, and cannot read, bind or declare anything of another tenant's; no user
but the scheduler may publish commands; the operator may not publish events or commands.
"""

from __future__ import annotations

import asyncio
import re
import uuid
from collections.abc import Iterator
from typing import Any

import aio_pika
import pytest
from gpuorch_client import GpuorchClient
from gpuorch_contracts import JobAccepted, JobRejected, JobSpec, JobStarted, SubmitJob
from gpuorch_messaging import Broker

from tests.deploy.broker_users import RoleUsers, gen
from tests.deploy.test_least_privilege import assert_refused, publish

pytestmark = pytest.mark.integration

SPEC = JobSpec.model_validate({"name": "te", "run": {"runtime": "process", "argv": ["python", "-c", "1"]}})
NODE = "node-1"


def role_users(vhost: str) -> RoleUsers:
    return RoleUsers(vhost, {
        "scheduler": gen.scheduler, "telemetry": gen.telemetry,
        "acme-ci": lambda name: gen.submitter(name, ["acme"]), "beta-ci": lambda name: gen.submitter(name, ["beta"]),
        "gpuctl-operator": gen.operator, "executor": lambda name: gen.executor(name, [NODE]),
        "node-agent": lambda name: gen.node_agent(name, f"node-agent.{NODE}", [NODE]),
    })


@pytest.fixture
def users(amqp_vhost: str) -> Iterator[RoleUsers]:
    with role_users(amqp_vhost).created() as created:
        yield created


async def test_a_submitter_gets_its_own_tenants_events_and_cannot_read_anothers(users: RoleUsers) -> None:
    await users.install()  # the shared lane takes every submission
    scheduler = Broker(users.url("scheduler"), producer="scheduler/te", publish_timeout_s=5, declare_topology=False)
    executor = Broker(users.url("executor"), producer=f"executor/{NODE}", publish_timeout_s=5,
                      declare_topology=False)
    await scheduler.connect()
    await executor.connect()
    try:
        async with GpuorchClient(users.url("acme-ci"), "acme") as acme, \
                GpuorchClient(users.url("beta-ci"), "beta") as beta:
            acme_job, beta_job, placement = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
            acme.watch(beta_job)  # would keep beta's events if any reached acme's queue
            beta.watch(beta_job)
            acme.watch(acme_job)
            await acme.submit(SPEC.model_dump(mode="json", exclude={"tenant"}), job_id=acme_job)  # routed
            await scheduler.publish(JobRejected(job_id=beta_job, reason="no", tenant="beta"))
            await scheduler.publish(JobAccepted(job_id=acme_job, spec=SPEC.model_copy(update={"tenant": "acme"})))
            await executor.publish(JobStarted(job_id=acme_job, placement_id=placement, node_id=NODE, tenant="acme"))
            assert isinstance(await beta.wait(beta_job, timeout_s=10), JobRejected)
            answer = await acme.wait(acme_job, timeout_s=10)
            assert isinstance(answer, JobAccepted) and answer.spec.tenant == "acme"
            started = await anext(aiter(acme.follow(acme_job, timeout_s=10)))
            assert isinstance(started, JobStarted) and started.node_id == NODE
            assert acme.buffered(beta_job) == 0  # beta's rejection was routed before acme's events: not here
            assert (beta.queue_name or "").startswith("client.beta.")

            beta_queue = f"client.beta.{uuid.uuid4().hex}"  # a durable (not exclusive) queue of beta's
            connection = await aio_pika.connect(users.url("beta-ci"))
            try:
                channel = await connection.channel()
                declared = await channel.declare_queue(beta_queue, durable=True)
                await declared.bind("gpuorch.events", "job.*.beta")
            finally:
                await connection.close()

            url = users.url("acme-ci")

            async def bind_own_queue(key: str, exchange: str = "gpuorch.events") -> Any:
                async def run(channel: Any) -> Any:
                    queue = await channel.declare_queue(f"client.acme.{uuid.uuid4().hex}", exclusive=True)
                    return await queue.bind(exchange, key)
                return run

            for key in ("job.*.beta", "job.accepted.beta", "#", "job.#", "job.started.#", "job.*.*", "*.*.acme.#",
                        "node.heartbeat"):
                await assert_refused(url, await bind_own_queue(key))
            await assert_refused(url, await bind_own_queue("job.submit", "gpuorch.submit"))
            await assert_refused(url, await bind_own_queue("node.node-1.launch_job", "gpuorch.commands"))

            async def consume_betas(channel: Any) -> Any:
                queue = await channel.declare_queue(beta_queue, passive=True)
                return await queue.consume(_ignore)
            await assert_refused(url, consume_betas)
            await assert_refused(url, lambda channel: channel.declare_queue(f"client.beta.{uuid.uuid4().hex}",
                                                                             exclusive=True))
            await assert_refused(url, lambda channel: channel.declare_queue("scheduler", passive=False,
                                                                             durable=True))
            await assert_refused(url, publish("gpuorch.events", "job.accepted.acme"))
    finally:
        await scheduler.close()
        await executor.close()


ROLES = ("scheduler", "telemetry", "acme-ci", "gpuctl-operator", "executor", "node-agent")


@pytest.mark.parametrize("role", [r for r in ROLES if r != "scheduler"])
async def test_no_user_but_the_scheduler_may_publish_commands(role: str, users: RoleUsers) -> None:
    await users.install()  # the exchanges exist
    await assert_refused(users.url(role), publish("gpuorch.commands", f"node.{NODE}.launch_job"))
    await assert_refused(users.url(role), publish("gpuorch.commands", f"node.{NODE}.apply_mig_layout"))


async def test_the_scheduler_may_and_the_operator_may_not_publish_events(users: RoleUsers) -> None:
    await users.install()
    scheduler = Broker(users.url("scheduler"), producer="scheduler/te", publish_timeout_s=5, declare_topology=False)
    await scheduler.connect()
    try:  # an event nobody subscribes to goes to the alternate exchange: confirmed, so the right is there
        await scheduler.publish(JobRejected(job_id=uuid.uuid4(), reason="no", tenant="acme"))
    finally:
        await scheduler.close()
    for key in ("job.failed", "job.failed.acme", "node.registered"):
        await assert_refused(users.url("gpuctl-operator"), publish("gpuorch.events", key))
    operator = Broker(users.url("gpuctl-operator"), producer="gpuctl", publish_timeout_s=5, declare_topology=False)
    await operator.connect()
    try:  # the operator's own work: submit for any tenant (admission decides): confirmed by the shared lane
        await operator.publish(SubmitJob(spec=SPEC))
    finally:
        await operator.close()


def test_every_generated_grant_keeps_commands_to_the_scheduler() -> None:
    for grant in gen.grants():
        may_write_commands = re.search(grant.write, "gpuorch.commands") is not None
        assert may_write_commands == (grant.user in ("scheduler", "admin", "gpuorch-setup")), grant.user
        if may_write_commands and grant.user == "scheduler":
            write_keys, _ = grant.topics["gpuorch.commands"]
            assert re.search(write_keys, "node.n1.launch_job") and not re.search(write_keys, "node.n1.apply_x")


async def test_submit_only_gpuctl_can_submit_without_declaring_anything(users: RoleUsers) -> None:
    """``gpuctl submit`` as a submit-only user: ``Broker(declare_topology=False)`` looks exchanges up only."""
    await users.install()  # the shared lane takes every submission
    submit_only = Broker(users.url("acme-ci"), producer="gpuctl", publish_timeout_s=5, declare_topology=False)
    try:
        await submit_only.connect(timeout_s=5)
        await submit_only.publish(SubmitJob(spec=SPEC))
        connection = await aio_pika.connect(users.url("scheduler"))
        try:
            channel = await connection.channel()
            queue = await channel.declare_queue("scheduler.submit", passive=True)
            got = await asyncio.wait_for(_first(queue), 10)
            assert got.user_id == users.names["acme-ci"]
        finally:
            await connection.close()
    finally:
        await submit_only.close()


async def _ignore(message: Any) -> None:
    pass


async def _first(queue: Any) -> Any:
    async with queue.iterator() as messages:
        async for message in messages:
            await message.ack()
            return message
