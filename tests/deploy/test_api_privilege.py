"""The API's broker user (make_definitions ``api``) against the real RabbitMQ: it publishes submissions and cancels
for any tenant's lane, opens live event streams (its own exclusive queues bound to job events of every tenant or
of one), and may neither publish events or commands nor bind anything else."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator

import aio_pika
import pytest
from gpuorch_api.auth import Caller
from gpuorch_api.live import EventStreams
from gpuorch_api.node_logs import NodeLogEndpoints
from gpuorch_contracts import CancelJob, JobPlaced, SubmitJob
from gpuorch_contracts.jobs import NodeAssignment
from gpuorch_identity import Identity
from gpuorch_messaging import Broker
from gpuorch_messaging.queues import Installation

from tests.deploy.broker_users import BrokerUsers, gen
from tests.deploy.test_least_privilege import SPEC, assert_refused, publish

pytestmark = pytest.mark.integration


@pytest.fixture
def users(amqp_vhost: str) -> Iterator[BrokerUsers]:
    suffix = uuid.uuid4().hex[:8]
    created = BrokerUsers(amqp_vhost, [gen.api(f"api-{suffix}"), gen.scheduler(f"scheduler-{suffix}")])
    created.create()
    try:
        yield created
    finally:
        created.delete()


async def test_the_api_user_submits_for_any_tenant_and_streams_events(users: BrokerUsers) -> None:
    api_user, scheduler_user = (g.user for g in users.grants)
    await users.install(Installation(tenants=["acme"]))
    scheduler = Broker(users.url(scheduler_user), producer="scheduler", publish_timeout_s=5, declare_topology=False)
    await scheduler.connect(timeout_s=5)
    api = Broker(users.url(api_user), producer="gpuorch-api", declare_topology=False, publish_timeout_s=5)
    streams = EventStreams(users.url(api_user))
    try:
        await api.connect(timeout_s=5)
        await api.publish(SubmitJob(spec=SPEC.model_copy(update={"tenant": "acme"}), on_behalf_of="acme-ci"))
        await api.publish(SubmitJob(spec=SPEC, on_behalf_of="acme-ci"))  # the shared lane
        await api.publish(CancelJob(job_id=uuid.uuid4(), tenant="acme", on_behalf_of="acme-ci"))

        await streams.connect()
        endpoints = NodeLogEndpoints("issuing-secret")
        await endpoints.watch(streams.connection)  # its heartbeat queue: bound with the api user's rights
        acme = Caller("acme-ci", Identity(role="submitter", tenants=["acme"], default_tenant="acme"))
        ops = Caller("ops", Identity(role="operator", tenants=["*"]))
        for caller in (acme, ops):
            chunks = streams.stream(caller)
            await anext(chunks)  # declared and bound with the api user's rights
            await scheduler.publish(JobPlaced(job_id=uuid.uuid4(), placement_id=uuid.uuid4(), tenant="acme",
                                              assignments=[NodeAssignment(node_id="n1")]))
            async with asyncio.timeout(10):
                assert (await anext(chunks)).startswith("event: job.placed")
            await chunks.aclose()
    finally:
        await streams.close()
        await api.close()
        await scheduler.close()

    url = users.url(api_user)
    await assert_refused(url, publish("gpuorch.events", "job.accepted.acme"))
    await assert_refused(url, publish("gpuorch.commands", "node.n1.launch_job"))
    await assert_refused(url, publish("gpuorch.submit", "node.n1.launch_job"))

    async def bind_heartbeats(channel: aio_pika.abc.AbstractChannel) -> None:
        queue = await channel.declare_queue(f"api.live.{uuid.uuid4().hex}", exclusive=True, auto_delete=True)
        await queue.bind("gpuorch.events", "gpu.usage_sampled")

    await assert_refused(url, bind_heartbeats)
    await assert_refused(url, lambda channel: channel.declare_queue("scheduler-own", durable=True))
