"""Escalation 2 (issue 29): a runtime broker user may not reconfigure shared topology.

As reported: with an executor's credentials ``gpuorch.commands`` was deleted, and binding the node's own queue to
``gpuorch.submit`` with ``#`` brought another tenant's submission, its environment secret included, into that
node's dead-letter queue. Here the generator's grants (deploy/rabbitmq/make_definitions.py) are loaded into a fresh
vhost, the setup step declares the topology, and each attempt is made with the runtime user's own credentials on the
real broker: every one must close the channel with ACCESS_REFUSED, the topology must be unchanged, and the
secret-bearing submission must reach the scheduler's lane and nothing of the node's.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import aio_pika
import pytest
from gpuorch_contracts import JobSpec, ProcessRun, SubmitJob

from tests.deploy.broker_users import RoleUsers, gen
from tests.deploy.test_least_privilege import assert_refused, publish

pytestmark = [pytest.mark.security, pytest.mark.integration]

NODE = "node-1"
RUNTIME_ROLES = {
    "executor": lambda name: gen.executor(name, [NODE]),
    "node-agent": lambda name: gen.node_agent(name, f"node-agent.{NODE}", [NODE]),
    "scheduler": gen.scheduler,
    "telemetry": gen.telemetry,
}
OWN_QUEUE = {"executor": f"executor.{NODE}", "node-agent": f"node-agent.{NODE}", "scheduler": "scheduler",
             "telemetry": "telemetry.samples"}
SHARED = ("gpuorch.commands", "gpuorch.submit", "gpuorch.events", "gpuorch.dlx", "gpuorch.unrouted",
          "gpuorch.submit.shared")


@pytest.fixture
def users(amqp_vhost: str) -> Iterator[RoleUsers]:
    factories: dict[str, Callable[[str], Any]] = {
        **RUNTIME_ROLES, "acme-ci": lambda name: gen.submitter(name, ["acme"])}
    with RoleUsers(amqp_vhost, factories).created() as created:
        yield created


async def installed(users: RoleUsers) -> None:
    from gpuorch_messaging.queues import Installation

    await users.install(Installation(tenants=["acme"], executor_nodes=[NODE],
                                     node_agents=[(f"node-agent.{NODE}", [NODE])]))


def bind(queue: str, exchange: str, key: str) -> Callable[[Any], Awaitable[Any]]:
    async def run(channel: Any) -> Any:
        target = await channel.declare_queue(queue, passive=True)
        return await target.bind(exchange, key)
    return run


def unbind(queue: str, exchange: str, key: str) -> Callable[[Any], Awaitable[Any]]:
    async def run(channel: Any) -> Any:
        target = await channel.declare_queue(queue, passive=True)
        return await target.unbind(exchange, key)
    return run


def delete_exchange(name: str) -> Callable[[Any], Awaitable[Any]]:
    async def run(channel: Any) -> Any:
        return await channel.exchange_delete(name)
    return run


def delete_queue(name: str) -> Callable[[Any], Awaitable[Any]]:
    async def run(channel: Any) -> Any:
        return await channel.queue_delete(name)
    return run


async def exists(url: str, kind: str, name: str) -> bool:
    connection = await aio_pika.connect(url)
    try:
        channel = await connection.channel()
        try:
            if kind == "exchange":
                await channel.get_exchange(name, ensure=True)
            else:
                await channel.declare_queue(name, passive=True)
            return True
        except aio_pika.exceptions.ChannelNotFoundEntity:
            return False
    finally:
        await connection.close()


async def test_an_executor_can_neither_delete_commands_nor_bind_its_queue_to_submissions(users: RoleUsers) -> None:
    await installed(users)
    executor = users.url("executor")
    await assert_refused(executor, delete_exchange("gpuorch.commands"))
    await assert_refused(executor, bind(f"executor.{NODE}", "gpuorch.submit", "#"))
    await assert_refused(executor, bind(f"executor.{NODE}.dlq", "gpuorch.submit", "#"))
    await assert_refused(executor, bind(f"executor.{NODE}", "gpuorch.submit.shared", ""))
    await assert_refused(executor, bind(f"executor.{NODE}", "gpuorch.events", "#"))
    assert await exists(users.admin_url, "exchange", "gpuorch.commands")

    secret = SubmitJob(spec=JobSpec(run=ProcessRun(argv=["python", "-c", "pass"], env={"API_KEY": "s3cr3t"}),
                                    tenant="acme"))
    connection = await aio_pika.connect(users.url("acme-ci"))
    try:
        channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
        exchange = await channel.get_exchange("gpuorch.submit")
        await exchange.publish(aio_pika.Message(secret.model_dump_json().encode(), user_id=users.names["acme-ci"]),
                               "job.submit.acme", mandatory=True)
    finally:
        await connection.close()
    names = ["scheduler.submit.acme", f"executor.{NODE}", f"executor.{NODE}.dlq", "scheduler.submit"]
    deadline = time.monotonic() + 10
    while (depths := await queue_depths(users.admin_url, names))["scheduler.submit.acme"] < 1:
        assert time.monotonic() < deadline, depths
        await asyncio.sleep(0.1)
    assert depths == {"scheduler.submit.acme": 1, f"executor.{NODE}": 0, f"executor.{NODE}.dlq": 0,
                      "scheduler.submit": 0}


@pytest.mark.parametrize("role", sorted(RUNTIME_ROLES))
async def test_no_runtime_user_configures_anything_shared(role: str, users: RoleUsers) -> None:
    await installed(users)
    url, own = users.url(role), OWN_QUEUE[role]
    for name in SHARED:
        await assert_refused(url, delete_exchange(name))
    await assert_refused(url, delete_queue(own))  # its own queue is declared at install, not by it
    await assert_refused(url, delete_queue(f"{own}.dlq"))
    await assert_refused(url, lambda channel: channel.declare_exchange("gpuorch.events", "topic", durable=True))
    await assert_refused(url, lambda channel: channel.declare_queue(f"{own}.extra", durable=True))
    await assert_refused(url, lambda channel: channel.declare_queue("", exclusive=True))  # not even a private one
    await assert_refused(url, bind(own, "gpuorch.submit", "#"))
    await assert_refused(url, bind(own, "gpuorch.commands", "#"))
    await assert_refused(url, bind(own, "gpuorch.events", "job.#"))
    await assert_refused(url, unbind(own, *spec_binding(own)))
    await assert_refused(url, publish("gpuorch.submit", "job.submit.acme"))
    await assert_refused(url, publish("gpuorch.dlx", "scheduler.submit.acme" if role != "scheduler" else "x"))
    for name in SHARED:
        assert await exists(users.admin_url, "exchange", name), name
    assert await exists(users.admin_url, "queue", own)


def spec_binding(queue: str) -> tuple[str, str]:
    """One binding the setup step made for ``queue`` (what removing it would cut)."""
    from gpuorch_messaging.queues import Installation

    install = Installation(tenants=["acme"], executor_nodes=[NODE], node_agents=[(f"node-agent.{NODE}", [NODE])])
    spec = next(s for s in install.queues() if s.name == queue)
    return spec.bindings[0]


async def queue_depths(url: str, names: list[str]) -> dict[str, int]:
    """Message counts of the named queues."""
    connection = await aio_pika.connect(url)
    try:
        channel = await connection.channel()
        depths = {}
        for name in names:
            queue = await channel.declare_queue(name, passive=True)
            depths[name] = queue.declaration_result.message_count or 0
        return depths
    finally:
        await connection.close()


def test_the_generated_runtime_grants_hold_no_configure_right_and_pin_every_topic_exchange() -> None:
    runtime = [gen.scheduler(), gen.telemetry(), gen.executor("executor-x", ["x"]),
               gen.node_agent("node-agent-x", "node-agent.x", ["x"])]
    for grant in runtime:
        assert grant.configure == "^$", grant.user
        assert set(grant.topics) == {"gpuorch.submit", "gpuorch.events", "gpuorch.commands", "gpuorch.dlx"}
        assert all(read == "^$" for _, read in grant.topics.values()), grant.user  # binds nothing anywhere
        assert all(w.startswith("^") and w.endswith("$") for w, _ in grant.topics.values()), grant.user
